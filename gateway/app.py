"""The FastAPI application: ``create_app(config)``, and ``app_factory()`` for uvicorn's workers."""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway import errors
from gateway.admission import peek_headers
from gateway.body_checks import check_body, check_content_type
from gateway.broker import Broker
from gateway.config import GatewayConfig
from gateway.keyring import ANONYMOUS, Keyring, flag_records
from gateway.keys_file import load_keys_file
from gateway.metrics import METRICS
from gateway.preparation import offloaded
from gateway.prepare_pool import PreparePool
from gateway.responses.models import STREAM_EVENT_MODELS
from gateway.responses.routes import router as responses_router
from gateway.routes import STREAM_CHUNK_MODELS, router
from gateway.usage_api import router as usage_router
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
    if path == "/v1/conversations":
        return path
    if path.startswith("/v1/conversations/"):
        return "/v1/conversations/{id}"
    return "other"


async def _send_json(send, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
    raw = json.dumps(body).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": raw})


def _bearer(scope) -> bytes | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            token = token.strip()
            return token if scheme.lower() == b"bearer" and token else None
    return None


class GatewayMiddleware:
    """Pure ASGI: finds who calls (the API key's tenant, ``gateway.keyring``; every path but
    ``OPEN_PATHS``), counts responses by status and tenant, adds the tenant's ``x-ratelimit-*``
    headers, enforces the body size limit, and refuses bodies that are not declared JSON or are not
    valid Unicode (``body_checks``).

    A key is checked before the body is read: an unknown or revoked key is a 401 at once.
    The body is read here (up to the limit) and replayed to the app, so a chunked upload without
    Content-Length is held to the same limit; afterwards ``receive`` is the server's again, so the
    app still sees the client's disconnect.
    """

    def __init__(self, app, config: GatewayConfig, keyring: Keyring) -> None:
        self.app = app
        self.config = config
        self.keyring = keyring

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        label = _endpoint_label(path)
        state = scope.setdefault("state", {})
        principal = ANONYMOUS

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                status = str(message["status"])
                METRICS.requests.labels(endpoint=label, status=status).inc()
                if state.get("principal") is not None:  # a known key: its tenant (a 401 has none)
                    METRICS.tenant_requests.labels(tenant=METRICS.tenant_label(principal.tenant), endpoint=label,
                                                   status=status).inc()
                extra = state.get("ratelimit_headers")
                if extra is None and principal.limits.any and path.startswith("/v1/"):
                    extra = await peek_headers(scope["app"].state.broker, principal)
                if extra:
                    message = {**message, "headers": [*message.get("headers", []),
                                                      *((k.encode(), v.encode()) for k, v in extra.items())]}
            await send(message)

        if self.keyring.enabled and path not in OPEN_PATHS:
            token = _bearer(scope)
            found = self.keyring.lookup(token) if token is not None else None
            if found is None:
                if token is not None and not self.keyring.loaded:  # the key table is in Redis, not read yet
                    err = errors.redis_down()
                    await _send_json(counting_send, err.status, err.body(), err.headers)
                    return
                err = errors.unauthorized()
                await _send_json(counting_send, err.status, err.body(), {"WWW-Authenticate": "Bearer"})
                return
            principal = state["principal"] = found
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


def build_keyring(config: GatewayConfig) -> Keyring:
    """The key table of ``config``: ``--api-key`` keys, the keys file, and the Redis table with
    ``--redis-keys``. Raises ``KeysFileError`` (``FILE:LINE: why``) for a keys file it cannot use."""
    records = flag_records(config.api_keys)
    if config.keys_file:
        flagged = {r.key_hash for r in records}
        for record in load_keys_file(config.keys_file):
            if record.key_hash in flagged:
                raise ValueError(f"{config.keys_file}: a key of tenant {record.tenant!r} is also given with --api-key")
            records.append(record)
    return Keyring(records, redis_keys=config.redis_keys)


def ready_line(config: GatewayConfig) -> str:
    """What a gateway process serves and where: its one line at start."""
    import os

    from sluice.wire.connection import redact

    host = f"[{config.host}]" if ":" in config.host else config.host
    line = f"gateway ready: OpenAI API at http://{host}:{config.port}/v1; models from {redact(config.redis_url)}"
    if config.api_keys or config.keys_file or config.redis_keys:
        line += "; API keys required (" + ", ".join(
            name for name, on in (("--api-key", config.api_keys), ("--keys-file", config.keys_file),
                                  ("--redis-keys", config.redis_keys)) if on) + ")"
    if config.workers > 1:
        line += f" (worker pid {os.getpid()} of {config.workers})"
    return line


def create_app(config: GatewayConfig | None = None, *, broker: Broker | None = None,
               announce: bool = False) -> FastAPI:
    """The gateway app; ``announce``: log ``ready_line`` once it started (a served process)."""
    config = config or GatewayConfig.from_env()
    keyring = build_keyring(config)

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
        follower = asyncio.create_task(keyring.follow(b.redis), name="sluice-keys") if keyring.redis_keys else None
        if announce:
            log.info("%s", ready_line(config))
        try:
            yield
        finally:
            if follower is not None:
                follower.cancel()
                await asyncio.gather(follower, return_exceptions=True)
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
    app.state.keyring = keyring
    app.openapi = lambda: _openapi_with_stream_chunks(app)  # type: ignore[method-assign]
    errors.install_handlers(app)
    app.include_router(router)
    app.include_router(responses_router)
    app.include_router(usage_router)
    app.add_middleware(GatewayMiddleware, config=config, keyring=keyring)
    return app


def app_factory() -> FastAPI:
    """For ``uvicorn --factory gateway.app:app_factory`` (the settings come from the environment): the
    app of one gateway process, its start-up heap then frozen (``sluice.heap``)."""
    app = create_app(GatewayConfig.from_env(), announce=True)
    log.debug("%d start-up objects frozen out of the garbage collector's walks", freeze_startup_heap())
    return app
