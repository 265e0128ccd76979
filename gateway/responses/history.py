"""What a new response continues: the turns of a ``previous_response_id`` chain (walked back along
its links, ``ResponseStore.chain``) or the items of a ``conversation`` (its newest,
``ConversationStore.tail``), bounded by the model's context: a prompt renders every item (a
reasoning item aside) as a token at least, so no more items than the context has tokens are read.
A history that reaches that bound cannot fit: a 400 ``context_length_exceeded``, unless the request
asks ``truncation: "auto"``, which keeps the newest items that fit (``gateway.responses.service``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from gateway import errors
from gateway.errors import OpenAIError
from gateway.responses import background
from gateway.responses.conversation_store import conversations_of
from gateway.responses.models import CreateResponseRequest
from gateway.responses.store import MissingLink, store_of
from sluice.wire import stored_response as sr
from sluice.wire.error_codes import Code


@dataclass
class History:
    """The items before a response's input, oldest first; ``cut``: older ones were left out at
    the bound. ``ancestors``: the new response's (its ``previous_response_id`` first)."""

    items: list[dict[str, Any]] = field(default_factory=list)
    cut: bool = False
    ancestors: list[str] = field(default_factory=list)


def not_found(response_id: str, param: str | None = None) -> OpenAIError:
    return errors.error(Code.NOT_FOUND, f"Response with id '{response_id}' not found.", param=param)


def conversation_not_found(conversation_id: str, param: str | None = None) -> OpenAIError:
    return errors.error(Code.NOT_FOUND, f"Conversation with id '{conversation_id}' not found.", param=param)


def too_long(max_model_len: int, what: str) -> OpenAIError:
    return errors.error(
        Code.CONTEXT_LENGTH_EXCEEDED,
        f"This model's maximum context length is {max_model_len} tokens. However, the {what} holds more than "
        f"{max_model_len} items, which cannot fit. Continue from a later point, or set 'truncation' to 'auto' "
        "to drop its oldest items.", param="input")


async def history_of(body: CreateResponseRequest, request: Request, conversation_id: str | None,
                     max_model_len: int) -> History:
    """The history ``body`` continues (none without ``previous_response_id`` or a conversation):
    404 for an unknown (expired, deleted, another tenant's) response, chain link or conversation;
    400 for a previous response still running (one whose run has ended at the engine, its
    creating gateway gone, is caught up from its log first)."""
    ttl_s = request.app.state.config.responses_ttl_s
    if conversation_id is not None:
        tail = await conversations_of(request).tail(conversation_id, max_model_len)
        if tail is None:
            raise conversation_not_found(conversation_id, "conversation")
        return History(*tail)
    previous_id = body.previous_response_id
    if previous_id is None:
        return History()
    store = store_of(request)
    stored = await store.load(previous_id)
    if stored is not None and stored.running:
        await background.catch_up(request, stored, previous_id)
        stored = await store.load(previous_id)
    if stored is None:
        raise not_found(previous_id, "previous_response_id")
    if stored.running:
        raise errors.invalid(f"Previous response with id '{previous_id}' is still {stored.status}; wait for it to "
                             "finish before continuing it.", param="previous_response_id")
    try:
        chain = await store.chain(previous_id, stored, ttl_s, max_model_len)
    except MissingLink as exc:
        raise errors.error(Code.NOT_FOUND, f"Previous response with id '{previous_id}' continues response "
                           f"'{exc.response_id}', which no longer exists (deleted or expired).",
                           param="previous_response_id") from None
    return History(chain.items, chain.cut, [previous_id, *stored.ancestors[:sr.ANCESTOR_WINDOW - 1]])
