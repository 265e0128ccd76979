"""The Responses and Conversations APIs' routes (thin: the work is in ``gateway.responses.service``
and ``gateway.responses.conversations``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from gateway.protocol import ErrorResponse
from gateway.request_body import BoundedBodyRoute
from gateway.responses import conversations, service
from gateway.responses.models import (
    STREAM_EVENT_MODELS,
    AddItemsRequest,
    ConversationItemList,
    ConversationObject,
    CreateConversationRequest,
    CreateResponseRequest,
    DeletedConversation,
    DeletedResponse,
    InputItemList,
    ResponseObject,
    UpdateConversationRequest,
)

router = APIRouter(tags=["responses"], route_class=BoundedBodyRoute)  # gateway.request_body

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in ((400, "invalid request"), (401, "missing or wrong API key"),
                         (404, "unknown, expired or deleted response or conversation (or unknown model)"),
                         (429, "queue full (Retry-After)"), (503, "no live engine or Redis unavailable"),
                         (504, "deadline exceeded"))
}

_EVENTS = {"oneOf": [{"$ref": f"#/components/schemas/{m.__name__}"} for m in STREAM_EVENT_MODELS]}


@router.post("/v1/responses", responses={
    200: {"model": ResponseObject,
          "description": "the Response; with `\"stream\": true` an SSE stream of typed events (`event:` the "
                         "type, `id:` the sequence number, `data:` the event)",
          "content": {"text/event-stream": {"schema": _EVENTS}}},
    **_ERRORS})
async def create_response(body: CreateResponseRequest, request: Request) -> Response:
    return await service.create_response(body, request)


@router.get("/v1/responses/{response_id}", responses={
    200: {"model": ResponseObject,
          "description": "the Response; with `stream=true` (a background response) an SSE stream of its events "
                         "after `starting_after` (a sequence number), replayed from its event log, then live",
          "content": {"text/event-stream": {"schema": _EVENTS}}},
    **_ERRORS})
async def retrieve_response(response_id: str, request: Request, stream: bool = Query(False),
                            starting_after: int | None = Query(None, ge=-1)) -> Response:
    return await service.retrieve(request, response_id, stream=stream, starting_after=starting_after)


@router.delete("/v1/responses/{response_id}", responses={200: {"model": DeletedResponse}, **_ERRORS})
async def delete_response(response_id: str, request: Request) -> Response:
    return await service.delete(request, response_id)


@router.post("/v1/responses/{response_id}/cancel", responses={200: {"model": ResponseObject}, **_ERRORS})
async def cancel_response(response_id: str, request: Request) -> Response:
    return await service.cancel(request, response_id)


@router.get("/v1/responses/{response_id}/input_items", responses={200: {"model": InputItemList}, **_ERRORS})
async def list_input_items(response_id: str, request: Request, after: str | None = None,
                           limit: int = Query(20), order: str = Query("desc")) -> Response:
    return await service.list_input_items(request, response_id, after=after, limit=limit, order=order)


# --- conversations -------------------------------------------------------------------------------

_CONV = {"tags": ["conversations"]}
_INCLUDE = Query(None, description="not supported: an item is returned as it was stored (a 400 when given)")


@router.post("/v1/conversations", responses={200: {"model": ConversationObject}, **_ERRORS}, **_CONV)
async def create_conversation(body: CreateConversationRequest, request: Request) -> Response:
    return await conversations.create(body, request)


@router.get("/v1/conversations/{conversation_id}", responses={200: {"model": ConversationObject}, **_ERRORS},
            **_CONV)
async def retrieve_conversation(conversation_id: str, request: Request) -> Response:
    return await conversations.retrieve(request, conversation_id)


@router.post("/v1/conversations/{conversation_id}", responses={200: {"model": ConversationObject}, **_ERRORS},
             **_CONV)
async def update_conversation(conversation_id: str, body: UpdateConversationRequest, request: Request) -> Response:
    return await conversations.update(body, request, conversation_id)


@router.delete("/v1/conversations/{conversation_id}", responses={200: {"model": DeletedConversation}, **_ERRORS},
               **_CONV)
async def delete_conversation(conversation_id: str, request: Request) -> Response:
    return await conversations.delete(request, conversation_id)


@router.get("/v1/conversations/{conversation_id}/items",
            responses={200: {"model": ConversationItemList}, **_ERRORS}, **_CONV)
async def list_conversation_items(conversation_id: str, request: Request, after: str | None = None,
                                  limit: int = Query(20), order: str = Query("desc"),
                                  include: list[str] | None = _INCLUDE) -> Response:
    return await conversations.list_items(request, conversation_id, after=after, limit=limit, order=order,
                                          include=include)


@router.post("/v1/conversations/{conversation_id}/items",
             responses={200: {"model": ConversationItemList}, **_ERRORS}, **_CONV)
async def add_conversation_items(conversation_id: str, body: AddItemsRequest, request: Request,
                                 include: list[str] | None = _INCLUDE) -> Response:
    return await conversations.add_items(body, request, conversation_id, include)


@router.get("/v1/conversations/{conversation_id}/items/{item_id}", responses=_ERRORS, **_CONV)
async def retrieve_conversation_item(conversation_id: str, item_id: str, request: Request,
                                     include: list[str] | None = _INCLUDE) -> Response:
    return await conversations.retrieve_item(request, conversation_id, item_id, include)


@router.delete("/v1/conversations/{conversation_id}/items/{item_id}",
               responses={200: {"model": ConversationObject}, **_ERRORS}, **_CONV)
async def delete_conversation_item(conversation_id: str, item_id: str, request: Request) -> Response:
    return await conversations.delete_item(request, conversation_id, item_id)
