"""The Conversations API (``/v1/conversations``): a conversation is an ordered list of items (a
response's input and output items, in the same shapes) with metadata, in Redis
(``gateway.responses.conversation_store``), served by any gateway and its tenant's alone. A response
created with ``conversation`` continues its items and appends its own turn (input, then output)
when it ends (``gateway.responses.history``, ``background.store_final``).
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from gateway import errors, serving
from gateway.errors import OpenAIError
from gateway.responses import convert
from gateway.responses.conversation_store import ItemExists, NoSuchItem, StoredConversation, conversations_of
from gateway.responses.history import conversation_not_found
from gateway.responses.models import (
    AddItemsRequest,
    ConversationItemList,
    ConversationObject,
    CreateConversationRequest,
    DeletedConversation,
    UpdateConversationRequest,
)
from sluice.wire import limits
from sluice.wire.error_codes import Code


def new_conversation_id() -> str:
    return f"conv_{secrets.token_hex(24)}"


def _object(conversation: StoredConversation) -> JSONResponse:
    return JSONResponse(ConversationObject(id=conversation.id, created_at=conversation.created_at,
                                           metadata=conversation.metadata).model_dump(mode="json"))


def _list(items: list[dict[str, Any]], has_more: bool) -> JSONResponse:
    return JSONResponse(ConversationItemList(data=items, first_id=items[0]["id"] if items else None,
                                             last_id=items[-1]["id"] if items else None,
                                             has_more=has_more).model_dump(mode="json"))


def _no_include(include: list[str] | None) -> None:
    """The items are stored as they were said: nothing more to include."""
    if include:
        raise errors.invalid(f"'include' is not supported on conversation items (got {include[0]!r}): an item "
                             "is returned as it was stored.", param="include")


def _new_items(items: list[Any]) -> list[dict[str, Any]]:
    """The items as stored (each with an id); a 400 for an id given twice."""
    out = convert.item_dicts(items)
    seen: set[str] = set()
    for i, item in enumerate(out):
        if item["id"] in seen:
            raise errors.invalid(f"items[{i}] has the id '{item['id']}' of an earlier item.", param=f"items[{i}].id")
        seen.add(item["id"])
    return out


def _item_not_found(conversation_id: str, item_id: str) -> OpenAIError:
    return errors.error(Code.NOT_FOUND, f"No item with id '{item_id}' in conversation '{conversation_id}'.",
                        param="item_id")


async def create(body: CreateConversationRequest, request: Request) -> Response:
    items = _new_items(body.items or [])
    conversation = StoredConversation(new_conversation_id(), int(time.time()), body.metadata or {})
    await conversations_of(request).create(conversation.id, conversation.created_at, conversation.metadata, items)
    return _object(conversation)


async def retrieve(request: Request, conversation_id: str) -> Response:
    conversation = await conversations_of(request).get(conversation_id)
    if conversation is None:
        raise conversation_not_found(conversation_id)
    return _object(conversation)


async def update(body: UpdateConversationRequest, request: Request, conversation_id: str) -> Response:
    conversation = await conversations_of(request).update(conversation_id, body.metadata)
    if conversation is None:
        raise conversation_not_found(conversation_id)
    return _object(conversation)


async def delete(request: Request, conversation_id: str) -> Response:
    if not await conversations_of(request).delete(conversation_id):
        raise conversation_not_found(conversation_id)
    return JSONResponse(DeletedConversation(id=conversation_id).model_dump(mode="json"))


async def list_items(request: Request, conversation_id: str, *, after: str | None, limit: int, order: str,
                     include: list[str] | None) -> Response:
    """A page of the items, newest first unless ``order`` is ``asc``."""
    serving.check(limits.INPUT_ITEMS_PAGE.check(limit))
    if order not in ("asc", "desc"):
        raise errors.invalid(f"'order' must be 'asc' or 'desc', got {order!r}.", param="order")
    _no_include(include)
    try:
        page = await conversations_of(request).page(conversation_id, order=order, after=after, limit=limit)
    except NoSuchItem:
        raise errors.invalid(f"No item with id '{after}' in conversation '{conversation_id}'.",
                             param="after") from None
    if page is None:
        raise conversation_not_found(conversation_id)
    return _list(page.items, page.has_more)


async def add_items(body: AddItemsRequest, request: Request, conversation_id: str,
                    include: list[str] | None) -> Response:
    _no_include(include)
    items = _new_items(body.items)
    try:
        added = await conversations_of(request).add(conversation_id, items, strict=True)
    except ItemExists as exc:
        i = next(i for i, item in enumerate(items) if item["id"] == exc.item_id)
        raise errors.invalid(f"items[{i}] has the id '{exc.item_id}' of an item already in the conversation.",
                             param=f"items[{i}].id") from None
    if added is None:
        raise conversation_not_found(conversation_id)
    return _list(items, False)


async def retrieve_item(request: Request, conversation_id: str, item_id: str, include: list[str] | None) -> Response:
    _no_include(include)
    try:
        item = await conversations_of(request).item(conversation_id, item_id)
    except NoSuchItem:
        raise _item_not_found(conversation_id, item_id) from None
    if item is None:
        raise conversation_not_found(conversation_id)
    return JSONResponse(item)


async def delete_item(request: Request, conversation_id: str, item_id: str) -> Response:
    try:
        conversation = await conversations_of(request).delete_item(conversation_id, item_id)
    except NoSuchItem:
        raise _item_not_found(conversation_id, item_id) from None
    if conversation is None:
        raise conversation_not_found(conversation_id)
    return _object(conversation)
