"""The HTTP routes, thin: each generation endpoint hands its validated body to its serving module
(``serving_completion``, ``serving_chat``, ``serving_tokenization``); health, metrics, the model
list and vLLM's ``/version`` and ``/ping`` are answered here.

The ``responses=`` of the generation routes document their bodies in ``/openapi.json``: the JSON
response, and for ``"stream": true`` the ``text/event-stream`` whose ``data:`` events are the
``*StreamResponse`` chunks (registered in the schema's components by ``gateway.app``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError

import sluice
from gateway import errors, serving
from gateway.broker import LoadedCard
from gateway.metrics import METRICS, render
from gateway.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelInfo,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from gateway.request_body import BoundedBodyRoute
from gateway.serving import redis_down, to_json
from gateway.serving_chat import create_chat_completion
from gateway.serving_completion import create_completion
from gateway.serving_tokenization import create_detokenize, create_tokenize
from sluice.wire.card import CardError

router = APIRouter(route_class=BoundedBodyRoute)  # JSON bodies bounded, large ones parsed off the loop

# Models whose schemas /openapi.json carries beyond those FastAPI finds (the stream chunks).
STREAM_CHUNK_MODELS = (CompletionStreamResponse, ChatCompletionStreamResponse)

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in ((400, "invalid request"), (401, "missing or wrong API key"), (404, "unknown model"),
                         (413, "body too large"), (429, "queue full (Retry-After)"),
                         (503, "no live engine or Redis unavailable"), (504, "deadline exceeded"))
}


def _generation_responses(model: type, chunk: type) -> dict[int | str, dict[str, Any]]:
    return {
        200: {
            "model": model,
            "description": f"the {model.__name__}; with `\"stream\": true` an SSE stream of "
                           f"{chunk.__name__} `data:` events ending with `data: [DONE]`",
            "content": {"text/event-stream": {"schema": {"$ref": f"#/components/schemas/{chunk.__name__}"}}},
        },
        **_ERRORS,
    }


# --- health, metrics, models -------------------------------------------------------------------


@router.get("/health")
async def health(request: Request) -> Response:
    broker = serving.broker_of(request)
    if not await broker.ping():
        return errors.redis_down().response()
    try:
        live = await broker.live_engines(fresh=True)
    except (RedisError, OSError) as exc:
        return redis_down(exc).response()
    if not any(live.values()):
        return errors.no_engine().response()
    return JSONResponse({"status": "ok", "engines": live})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    broker = serving.broker_of(request)
    try:
        async with asyncio.timeout(1.0):
            METRICS.queue_depth.set_all({model: await broker.queue_depth(model) for model in await broker.model_names()})
    except (RedisError, OSError, TimeoutError):
        pass  # Redis away: the depths of the last scrape
    body, content_type = render()
    return Response(body, media_type=content_type)


def _model_info(card: LoadedCard | None, name: str) -> ModelInfo:
    info = ModelInfo(id=name, object="model", created=card.created if card else 0, owned_by="sluice",
                     root=name, parent=None)
    if card is not None:
        info.max_model_len = card.max_model_len
    return info


@router.get("/v1/models", responses={200: {"model": ModelList}})
async def list_models(request: Request) -> Response:
    broker = serving.broker_of(request)
    try:
        live = await broker.live_engines()
        data = []
        for name in await broker.model_names():
            if live.get(name):
                try:
                    card = await broker.card(name)
                except CardError:  # another contract version or malformed: listed without its card
                    card = None
                data.append(_model_info(card, name))
    except (RedisError, OSError) as exc:
        raise redis_down(exc) from exc
    return JSONResponse(to_json(ModelList(object="list", data=data)))


@router.get("/v1/models/{model_id:path}", responses={200: {"model": ModelInfo}, 404: _ERRORS[404]})
async def get_model(model_id: str, request: Request) -> Response:
    broker = serving.broker_of(request)
    try:
        live = await broker.live_engines()
        card = await broker.card(model_id) if live.get(model_id) else None
    except (RedisError, OSError) as exc:
        raise redis_down(exc) from exc
    except CardError as exc:
        raise errors.from_card_error(model_id, exc) from exc
    if card is None:
        raise errors.model_not_found(model_id)
    return JSONResponse(to_json(_model_info(card, model_id)))


# --- generation --------------------------------------------------------------------------------


@router.post("/v1/completions", responses=_generation_responses(CompletionResponse, CompletionStreamResponse))
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await create_completion(body, request)


@router.post("/v1/chat/completions",
             responses=_generation_responses(ChatCompletionResponse, ChatCompletionStreamResponse))
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await create_chat_completion(body, request)


# --- vLLM's utility endpoints ------------------------------------------------------------------


@router.post("/tokenize", responses={200: {"model": TokenizeResponse}, **{k: _ERRORS[k] for k in (400, 404, 503)}})
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    return JSONResponse(to_json(await create_tokenize(body, request)))


@router.post("/detokenize",
             responses={200: {"model": DetokenizeResponse}, **{k: _ERRORS[k] for k in (400, 404, 503)}})
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    return JSONResponse(to_json(await create_detokenize(body, request)))


@router.get("/version", responses={200: {"model": VersionResponse}})
async def version() -> Response:
    return JSONResponse(to_json(VersionResponse(version=sluice.__version__)))


@router.get("/ping", responses={503: _ERRORS[503]})
@router.post("/ping", responses={503: _ERRORS[503]})
async def ping(request: Request) -> Response:
    """vLLM's (and SageMaker's) probe: 200 with no body when /health would answer 200, else its 503."""
    answer = await health(request)
    return Response(status_code=200) if answer.status_code == 200 else answer
