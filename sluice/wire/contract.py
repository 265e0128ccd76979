"""The Redis contract between gateways and engines, written down once.

Every key and channel name either side uses comes from here. Payloads are the protobuf messages
of ``sluice.wire.messages_pb2`` (source: proto/sluice/wire/messages.proto).

| key / channel                    | type                  | writer  | purpose                                   |
|----------------------------------|-----------------------|---------|-------------------------------------------|
| sluice:{model}:requests          | stream, group engines | gateway | the request queue (field "r": GenerateRequest) |
| sluice:out:{request_id}          | pub/sub channel       | engine  | Event messages for one request            |
| sluice:cancel                    | pub/sub channel       | gateway | Cancel messages; every engine listens     |
| sluice:cancelled:{request_id}    | string with TTL       | gateway | a cancel remembered for a still-queued request |
| sluice:engines                   | hash id -> JSON       | engine  | the registry: model, load, last heartbeat |
| sluice:engine:{engine_id}        | string with TTL       | engine  | liveness: gone when the heartbeat lapses  |
| sluice:model:{model}             | hash                  | engine  | model card: tokenizer, chat template, limits |
| sluice:models                    | set                   | engine  | names of models that have a card          |
| sluice:emitted:{request_id}      | string with TTL       | engine  | set with a request's first token: a reclaimed request that has it is errored, not restarted |
| sluice:inflight:{request_id}     | string with TTL       | gateway | set in one MULTI with the request's XADD, deleted when the gateway is done with it: gone while the gateway still waits = Redis lost its queue entry |
| sluice:gateway:{gateway_id}      | string with TTL       | gateway | liveness of the gateway process named in GenerateRequest.gateway_id: gone for GATEWAY_LOST_AFTER_S = its requests are aborted |
"""

from __future__ import annotations

from sluice.wire.messages_pb2 import ErrorCode

# Raised whenever the payloads or the rules change; a gateway and an engine of different versions
# refuse each other (card.check_version, the engine's check of GenerateRequest.version).
# 2: error codes and finish reasons as enums, terminal event as a oneof, the typed ModelCard.
# (GenerateRequest.gateway_id was added within 2: an engine that does not know it ignores it, and an
# engine that does treats an entry without it as one no gateway waits for.)
CONTRACT_VERSION = 2
PREFIX = "sluice"

CONSUMER_GROUP = "engines"
REQUEST_FIELD = b"r"  # the stream entry's field holding the GenerateRequest bytes
CANCEL_CHANNEL = f"{PREFIX}:cancel"
ENGINES_KEY = f"{PREFIX}:engines"
MODELS_KEY = f"{PREFIX}:models"

# Liveness: an engine refreshes its key every HEARTBEAT_INTERVAL_S; the key expires after
# HEARTBEAT_TTL_S, after which other engines may reclaim its pending entries.
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TTL_S = 5.0
CANCEL_MARKER_TTL_S = 600

# Gateway liveness: a gateway refreshes its key every GATEWAY_HEARTBEAT_INTERVAL_S from its start; the
# key expires GATEWAY_HEARTBEAT_TTL_S after the last refresh. An engine aborts the
# requests of a gateway whose key it has found missing, check after check, for GATEWAY_LOST_AFTER_S:
# a single miss is not enough, because a Redis restart without its data removes every live
# gateway's key too, and a live gateway puts it back within a heartbeat of reconnecting.
GATEWAY_HEARTBEAT_INTERVAL_S = 1.0
GATEWAY_HEARTBEAT_TTL_S = 5.0
GATEWAY_LOST_AFTER_S = 5.0

# The model card's hash fields are defined with the card: sluice.wire.card.


def request_stream(model: str) -> str:
    return f"{PREFIX}:{model}:requests"


def output_channel(request_id: str) -> str:
    return f"{PREFIX}:out:{request_id}"


def cancelled_key(request_id: str) -> str:
    return f"{PREFIX}:cancelled:{request_id}"


def engine_key(engine_id: str) -> str:
    return f"{PREFIX}:engine:{engine_id}"


def gateway_key(gateway_id: str) -> str:
    return f"{PREFIX}:gateway:{gateway_id}"


def model_card_key(model: str) -> str:
    return f"{PREFIX}:model:{model}"


def emitted_key(request_id: str) -> str:
    return f"{PREFIX}:emitted:{request_id}"


def inflight_key(request_id: str) -> str:
    return f"{PREFIX}:inflight:{request_id}"


# The in-flight marker outlives the request's deadline by this much (a crashed gateway's markers
# expire on their own). Engines never touch it.
INFLIGHT_MARGIN_S = 60


# The emitted marker outlives any request the engine would still run.
EMITTED_TTL_S = 3600
# A request delivered (read, reclaimed or handed back) more often than this is errored, not retried:
# a poison request must not take down every engine in turn.
MAX_ATTEMPTS = 3

# Error codes carried by Event.error.code: the proto enum's values (codec.error_code_name gives
# the short name, e.g. "deadline_exceeded").
ERR_INVALID_REQUEST = ErrorCode.ERROR_CODE_INVALID_REQUEST
ERR_CONTEXT_LENGTH = ErrorCode.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED
ERR_KV_CACHE_TOO_SMALL = ErrorCode.ERROR_CODE_KV_CACHE_TOO_SMALL
ERR_DEADLINE = ErrorCode.ERROR_CODE_DEADLINE_EXCEEDED
ERR_ENGINE_LOST = ErrorCode.ERROR_CODE_ENGINE_LOST
ERR_DRAINING = ErrorCode.ERROR_CODE_DRAINING
ERR_INTERNAL = ErrorCode.ERROR_CODE_INTERNAL
ERR_CONTRACT_MISMATCH = ErrorCode.ERROR_CODE_CONTRACT_MISMATCH
