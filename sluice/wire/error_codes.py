"""Every error code a client or a peer can receive, and what each means at the HTTP edge, written once.

:class:`Code` is one enum: the codes an engine sends in an ``Error`` event (the proto's
``ErrorCode``, :attr:`Code.wire` gives its value) and the codes only a gateway gives (an unknown
model, a full queue, Redis unavailable, a lost request, the HTTP validation codes). :data:`TABLE`
maps each to its HTTP status, OpenAI ``type``, whether the client should retry (then the answer
carries ``Retry-After``) and a default message. ``gateway/errors.py`` builds every error response
from it; the engine's refusals (the scheduler's door, the worker) and the broker's ``Lost`` carry
a ``Code``. ``docs/api.md``'s error table is checked against :data:`TABLE` by a test.

``Code`` is a ``StrEnum``: its value is the OpenAI ``code`` string (``"deadline_exceeded"``), so it
compares equal to the name a client reads.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from sluice.wire.messages_pb2 import ErrorCode


class Code(enum.StrEnum):
    # sent by engines (the proto's ErrorCode), and by gateways too
    INVALID_REQUEST = "invalid_request"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    KV_CACHE_TOO_SMALL = "kv_cache_too_small"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    ENGINE_LOST = "engine_lost"
    DRAINING = "draining"
    INTERNAL = "internal"
    CONTRACT_MISMATCH = "contract_mismatch"
    # gateway only
    INVALID_VALUE = "invalid_value"
    INVALID_TYPE = "invalid_type"
    MISSING_REQUIRED_PARAMETER = "missing_required_parameter"
    UNKNOWN_PARAMETER = "unknown_parameter"
    UNSUPPORTED_PARAMETER = "unsupported_parameter"
    INVALID_JSON = "invalid_json"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    INVALID_API_KEY = "invalid_api_key"
    MODEL_NOT_FOUND = "model_not_found"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    REQUEST_TOO_LARGE = "request_too_large"
    QUEUE_FULL = "queue_full"
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
    GATEWAY_BUSY = "gateway_busy"
    NO_ENGINE = "no_engine"
    REDIS_UNAVAILABLE = "redis_unavailable"
    REQUEST_LOST = "request_lost"
    BAD_MODEL_CARD = "bad_model_card"

    @property
    def wire(self) -> int | None:
        """The proto ``ErrorCode`` value, None for a gateway-only code."""
        return _WIRE.get(self)

    @classmethod
    def from_wire(cls, value: int) -> Code:
        """The code of an ``Error`` event's ``code`` (``INTERNAL`` for a value this side does not know)."""
        return _FROM_WIRE.get(int(value), cls.INTERNAL)


_WIRE: dict[Code, int] = {
    code: ErrorCode.Value("ERROR_CODE_" + code.name) for code in Code
    if "ERROR_CODE_" + code.name in ErrorCode.keys()
}
_FROM_WIRE: dict[int, Code] = {v: k for k, v in _WIRE.items()}


@dataclass(frozen=True)
class Spec:
    status: int
    type: str  # OpenAI's error type
    retryable: bool  # the answer carries Retry-After
    message: str  # when nothing more specific is known


_BAD = "invalid_request_error"
_UNAVAILABLE = "service_unavailable_error"

TABLE: dict[Code, Spec] = {
    Code.INVALID_REQUEST: Spec(400, _BAD, False, "The request is invalid."),
    Code.CONTEXT_LENGTH_EXCEEDED: Spec(400, _BAD, False, "The prompt plus max_tokens exceeds the model's context."),
    Code.KV_CACHE_TOO_SMALL: Spec(400, _BAD, False, "The request needs more KV cache than the engine has."),
    Code.DEADLINE_EXCEEDED: Spec(504, "timeout_error", False, "The request did not complete before its deadline."),
    Code.ENGINE_LOST: Spec(503, _UNAVAILABLE, True, "The engine serving the request was lost."),
    Code.DRAINING: Spec(503, _UNAVAILABLE, True, "The engine shut down before the request finished."),
    Code.INTERNAL: Spec(500, "internal_error", False, "Internal error."),
    Code.CONTRACT_MISMATCH: Spec(503, _UNAVAILABLE, True,
                                 "The gateway and the engine speak different contract versions."),
    Code.INVALID_VALUE: Spec(400, _BAD, False, "Invalid value."),
    Code.INVALID_TYPE: Spec(400, _BAD, False, "Invalid type."),
    Code.MISSING_REQUIRED_PARAMETER: Spec(400, _BAD, False, "Missing required parameter."),
    Code.UNKNOWN_PARAMETER: Spec(400, _BAD, False, "Unknown parameter."),
    Code.UNSUPPORTED_PARAMETER: Spec(400, _BAD, False, "Unsupported parameter."),
    Code.INVALID_JSON: Spec(400, _BAD, False, "We could not parse the JSON body of your request."),
    Code.UNSUPPORTED_MEDIA_TYPE: Spec(400, _BAD, False, "Only 'application/json' is allowed."),
    Code.INVALID_API_KEY: Spec(401, _BAD, False,
                               "Incorrect API key provided. Pass it as `Authorization: Bearer <key>`."),
    Code.MODEL_NOT_FOUND: Spec(404, _BAD, False, "The model does not exist or you do not have access to it."),
    Code.NOT_FOUND: Spec(404, _BAD, False, "Not Found"),
    Code.METHOD_NOT_ALLOWED: Spec(405, _BAD, False, "Method Not Allowed"),
    Code.REQUEST_TOO_LARGE: Spec(413, _BAD, False, "The request body is too large."),
    Code.QUEUE_FULL: Spec(429, "rate_limit_error", True, "The model's queue is full."),
    # OpenAI's own code; its type names the limit ("requests" or "tokens"), set by gateway/admission.py
    Code.RATE_LIMIT_EXCEEDED: Spec(429, "requests", True, "Rate limit reached for the tenant."),
    Code.GATEWAY_BUSY: Spec(429, "rate_limit_error", True,
                            "The gateway is preparing as many large requests as it takes at once."),
    Code.NO_ENGINE: Spec(503, _UNAVAILABLE, True, "No engine serving the model is alive."),
    Code.REDIS_UNAVAILABLE: Spec(503, _UNAVAILABLE, True, "The queue (Redis) is unavailable."),
    Code.REQUEST_LOST: Spec(503, _UNAVAILABLE, True, "The request was lost with Redis."),
    Code.BAD_MODEL_CARD: Spec(503, _UNAVAILABLE, True, "The model card in Redis cannot be read."),
}
