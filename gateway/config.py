"""The gateway's knobs: one dataclass, each field made with ``knob(...)`` a flag and a ``--config``
key of ``sluice gateway`` (and of ``sluice serve``, which forwards it); the plain fields are
internal tunables, not the command line.

Uvicorn's multi-process mode imports the app through a factory in each worker, so the CLI hands
the resolved configuration to the workers through ``SLUICE_GATEWAY_CONFIG`` (JSON, in the
workers' environment: secrets included, never on a command line).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from sluice.config import knob, resolve, shared
from sluice.config.knobs import KnobSet

ENV_VAR = "SLUICE_GATEWAY_CONFIG"
API_KEY_ENV = "SLUICE_API_KEY"


@dataclass
class GatewayConfig:
    knob_title = "gateway"  # its --help group and docs section (a class attribute, not a knob)

    redis_url: str = shared.redis_url()
    host: str = knob("0.0.0.0", "address to bind")
    port: int = knob(8000, "port of the HTTP API", bounds=(0, 65535))
    workers: int = knob(1, "uvicorn worker processes", bounds=(1, 1024))
    api_keys: list[str] = knob([], "require `Authorization: Bearer KEY` on /v1 (repeatable): each key a tenant of its "
                               "own (docs/tenants.md)", flag="api-key", env=API_KEY_ENV, secret=True, metavar="KEY")
    keys_file: str | None = knob(None, "tenants with their keys, weights and limits, in YAML (docs/tenants.md); "
                                       "refused at start naming the line when it cannot be used", metavar="FILE")
    redis_keys: bool = knob(False, "also accept the keys `sluice keys create` keeps in Redis (a revoked key is "
                                   "refused on every gateway within about a second)")
    max_queue_len: int | None = knob(None, "answer 429 when a model's queue holds this many requests (default: "
                                           "no limit)", bounds=(1, None))
    request_timeout_s: float = knob(600.0, "a request's deadline from its arrival; 504 past it", bounds=(0, None))
    max_body_bytes: int = knob(4 * 1024 * 1024, "413 for larger request bodies", bounds=(1, None))
    retry_after_s: int = knob(1, "Retry-After of a 429", bounds=(0, None))
    # The request limits (n, logprobs, prompts per request, ...) are not settings: sluice.wire.limits.
    # Off by default: a template is a program, and one from a client runs on the gateway's CPU.
    trust_request_chat_template: bool = knob(
        False, "render a `chat_template` sent with a chat request (vLLM's flag; default: refuse it with a 400, "
        "the model's template is used when none is sent)")
    # Streamed chat/completions requests are logged by the engine (sluice.wire.event_log), so their
    # SSE events carry `id:` and a client may resume on any gateway with Last-Event-ID; a client that
    # goes away then keeps its request running for contract.RESUME_WINDOW_S, waiting for a resume.
    resumable_streams: bool = knob(
        True, "log streamed chat/completions requests in Redis so that their SSE events carry `id:` and a client "
        "resumes on any gateway with Last-Event-ID")
    event_log_ttl_s: int = knob(600, "how long a request's event log is kept after the request ends, for resumes",
                                bounds=(1, None))
    # a response still running is kept request_timeout_s (plus a minute)
    responses_ttl_s: float = knob(24 * 3600.0, "how long Redis keeps a stored /v1/responses response after it "
                                               "ended", bounds=(1, None))
    # Large requests are prepared (JSON parsed, chat template, tokenizing) by worker processes, off
    # the event loop (gateway.prepare_pool, docs/gateway-load.md).
    prepare_pool_workers: int = knob(2, "processes that prepare large requests (parse, chat template, tokenize) "
                                        "off the event loop; 0: everything on the loop", bounds=(0, 64))
    prepare_pool_queue: int = knob(8, "large requests that wait for a busy prepare pool; one more is a 429 "
                                      "gateway_busy", bounds=(0, None))
    prepare_pool_threshold_bytes: int = knob(64 * 1024, "a body (or stored history) this large is prepared in the "
                                                        "pool", bounds=(0, None))
    log_level: str = shared.log_level()

    # --- internal tunables (not knobs) ---
    card_ttl_s: float = 2.0  # how long a model card (and engine liveness) is trusted before a check

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> GatewayConfig:
        data = json.loads(text)
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    @classmethod
    def from_env(cls) -> GatewayConfig:
        """What ``sluice gateway`` handed its workers (``SLUICE_GATEWAY_CONFIG``); else the defaults
        with the knobs' environment variables applied (``SLUICE_REDIS_URL``, ``SLUICE_API_KEY``)."""
        text = os.environ.get(ENV_VAR)
        if text:
            return cls.from_json(text)
        settings = resolve(KnobSet("gateway", [cls]), flags={}, flag_files={}, config=None)
        return cls(**{name: s.value for name, s in settings.items()})
