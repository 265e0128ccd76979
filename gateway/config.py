"""Gateway settings: one dataclass, filled from the command line or from the environment.

Uvicorn's multi-process mode imports the app through a factory in each worker, so the CLI hands
its settings to the workers through ``SLUICE_GATEWAY_CONFIG`` (JSON).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

ENV_VAR = "SLUICE_GATEWAY_CONFIG"


@dataclass
class GatewayConfig:
    redis_url: str = "redis://localhost:6379/0"
    api_keys: list[str] = field(default_factory=list)
    max_queue_len: int | None = None  # 429 when the model's queue holds this many or more
    request_timeout_s: float = 600.0  # a request's deadline, from arrival
    max_body_bytes: int = 4 * 1024 * 1024
    retry_after_s: int = 1  # the Retry-After of a 429
    card_ttl_s: float = 2.0  # how long a model card (and engine liveness) is trusted before a check
    # The request limits (n, logprobs, prompts per request, ...) are not settings: sluice.wire.limits.
    # a request's own `chat_template` is rendered (vLLM's flag of the same name); else it is a 400.
    # Off by default: a template is a program, and one from a client runs on the gateway's CPU.
    trust_request_chat_template: bool = False
    # Streamed chat/completions requests are logged by the engine (sluice.wire.event_log), so their
    # SSE events carry `id:` and a client may resume on any gateway with Last-Event-ID; a client that
    # goes away then keeps its request running for contract.RESUME_WINDOW_S, waiting for a resume.
    resumable_streams: bool = True
    event_log_ttl_s: int = 600  # how long a log (and its record) is kept after its request ends
    # How long a stored Responses API response (its object, input items and conversation) stays in
    # Redis after it ended; a response still running is kept request_timeout_s (plus a minute).
    responses_ttl_s: float = 24 * 3600.0
    # Large requests are prepared (JSON parsed, chat template, tokenizing) by this many worker
    # processes, off the event loop (gateway.prepare_pool, docs/gateway-load.md); 0: on the loop.
    prepare_pool_workers: int = 2
    prepare_pool_queue: int = 8  # large requests waiting for a busy pool; one more is a 429 gateway_busy
    prepare_pool_threshold_bytes: int = 64 * 1024  # a body (or stored history) this large is a large request

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> GatewayConfig:
        data = json.loads(text)
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    @classmethod
    def from_env(cls) -> GatewayConfig:
        text = os.environ.get(ENV_VAR)
        if text:
            return cls.from_json(text)
        cfg = cls()
        if os.environ.get("SLUICE_REDIS_URL"):
            cfg.redis_url = os.environ["SLUICE_REDIS_URL"]
        return cfg
