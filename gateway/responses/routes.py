"""The Responses API's routes (thin: the work is in ``gateway.responses.service``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from gateway.protocol import ErrorResponse
from gateway.request_body import BoundedBodyRoute
from gateway.responses import service
from gateway.responses.models import (
    STREAM_EVENT_MODELS,
    CreateResponseRequest,
    DeletedResponse,
    InputItemList,
    ResponseObject,
)

router = APIRouter(tags=["responses"], route_class=BoundedBodyRoute)  # gateway.request_body

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in ((400, "invalid request"), (401, "missing or wrong API key"),
                         (404, "unknown, expired or deleted response (or unknown model)"),
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
