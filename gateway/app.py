"""The FastAPI application: ``create_app(config)``, and ``app_factory()`` for uvicorn's workers."""

from __future__ import annotations

import hmac
import json
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway import errors
from gateway.body_checks import check_body, check_content_type
from gateway.broker import Broker
from gateway.config import GatewayConfig
from gateway.metrics import METRICS
from gateway.preparation import offloaded
from gateway.prepare_pool import PreparePool
from gateway.responses.models import STREAM_EVENT_MODELS
from gateway.responses.routes import router as responses_router
from gateway.routes import STREAM_CHUNK_MODELS, router
from sluice.heap import freeze_startup_heap

log = logging.getLogger("sluice.gateway")

_KNOWN_ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                    "/tokenize", "/detokenize", "/version", "/ping"}


# Open without the API key: probes and scrapes (a kubelet or Prometheus sends no key), the version,
# and the API's own documentation (the schema and the two pages that render it). Everything else,
# /tokenize and /detokenize included (they spend the gateway's CPU on a client's text), needs it.
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/docs", "/docs/oauth2-redirect", "/redoc",
                        "/openapi.json"})


def _endpoint_label(path: str) -> str:
    if path in _KNOWN_ENDPOINTS:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    if path == "/v1/responses":
        return path
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{id}"
    return "other"


async def _send_json(send, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
    raw = json.dumps(body).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": raw})


class GatewayMiddleware:
    """Pure ASGI: counts responses by status, checks API keys (every path but ``OPEN_PATHS``),
    enforces the body size limit, and
    refuses bodies that are not declared JSON or are not valid Unicode (``body_checks``).

    The body is read here (up to the limit) and replayed to the app, so a chunked upload without
    Content-Length is held to the same limit; afterwards ``receive`` is the server's again, so the
    app still sees the client's disconnect.
    """

    def __init__(self, app, config: GatewayConfig) -> None:
        self.app = app
        self.config = config
        self.keys = [k.encode() for k in config.api_keys]

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                token = token.strip()
                return scheme.lower() == b"bearer" and any(hmac.compare_digest(token, k) for k in self.keys)
        return False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        label = _endpoint_label(scope["path"])

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                METRICS.requests.labels(endpoint=label, status=str(message["status"])).inc()
            await send(message)

        if self.keys and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            err = errors.unauthorized()
            await _send_json(counting_send, err.status, err.body(), {"WWW-Authenticate": "Bearer"})
            return
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            limit = self.config.max_body_bytes
            too_large = errors.body_too_large(limit)
            for name, value in scope.get("headers", []):
                if name == b"content-length":
                    try:
                        declared = int(value)
                    except ValueError:
                        declared = 0
                    if declared > limit:
                        await _send_json(counting_send, 413, too_large.body())
                        return
            body = bytearray()
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body += message.get("body", b"")
                if len(body) > limit:
                    await _send_json(counting_send, 413, too_large.body())
                    return
                more = message.get("more_body", False)
            if body:
                # a body for the prepare pool gets check_body there, off the event loop
                refusal = check_content_type(scope.get("headers", [])) or (
                    None if offloaded(self.config, len(body)) else check_body(bytes(body)))
                if refusal is not None:
                    await _send_json(counting_send, refusal.status, refusal.body())
                    return
            replayed = False

            async def replay() -> dict:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": bytes(body), "more_body": False}
                return await receive()

            await self.app(scope, replay, counting_send)
            return
        await self.app(scope, receive, counting_send)


def _openapi_with_stream_chunks(app: FastAPI) -> dict:
    """FastAPI's schema plus the stream-chunk models the routes reference for ``text/event-stream``."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = FastAPI.openapi(app)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in (*STREAM_CHUNK_MODELS, *STREAM_EVENT_MODELS):
        js = model.model_json_schema(mode="serialization", ref_template="#/components/schemas/{model}")
        for name, definition in js.pop("$defs", {}).items():
            components.setdefault(name, definition)
        components.setdefault(model.__name__, js)
    # FastAPI documents a 422 for every route with a body; the gateway never sends one (a
    # validation error is OpenAI's 400, see errors.py), so the schema must not promise it.
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            if isinstance(operation, dict):
                operation.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):  # in this order: the first refers to the second
        definition = components.pop(name, None)
        if definition is not None and f'"#/components/schemas/{name}"' in json.dumps(schema):
            components[name] = definition  # still referenced somewhere: keep it
    app.openapi_schema = schema
    return schema


def create_app(config: GatewayConfig | None = None, *, broker: Broker | None = None) -> FastAPI:
    config = config or GatewayConfig.from_env()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        b = broker or Broker(config.redis_url, card_ttl_s=config.card_ttl_s, retry_after_s=config.retry_after_s)
        app.state.broker = b
        pool = None
        if config.prepare_pool_workers > 0:
            pool = PreparePool(config.prepare_pool_workers, config.prepare_pool_queue, config.retry_after_s)
            pool.start()
        app.state.prepare_pool = pool
        await b.start()
        try:
            yield
        finally:
            await b.close()
            if pool is not None:
                pool.close()

    app = FastAPI(
        title="Sluice gateway",
        version="0.1.0",
        description="OpenAI-compatible completions and chat completions served by Sluice engines via Redis.",
        lifespan=lifespan,
    )
    app.state.config = config
    app.openapi = lambda: _openapi_with_stream_chunks(app)  # type: ignore[method-assign]
    errors.install_handlers(app)
    app.include_router(router)
    app.include_router(responses_router)
    app.add_middleware(GatewayMiddleware, config=config)
    return app


def app_factory() -> FastAPI:
    """For ``uvicorn --factory gateway.app:app_factory`` (the settings come from the environment): the
    app of one gateway process, its start-up heap then frozen (``sluice.heap``)."""
    app = create_app(GatewayConfig.from_env())
    log.info("%d start-up objects frozen out of the garbage collector's walks", freeze_startup_heap())
    return app
