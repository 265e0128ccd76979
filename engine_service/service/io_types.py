"""The values the engine's Redis I/O passes around: queue entries (``EntryRef``, ``Entry``,
``parse_entry``), the shard view the housekeeper hands the reader, and what the step loop and the I/O
threads exchange (``Batch``, ``CancelNote``, ``LogSpec``). Apart from the threads, so that the worker
and the tests use them without the Redis machinery."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from sluice.wire import contract, usage
from sluice.wire.messages_pb2 import Event, GenerateRequest


class EntryRef(NamedTuple):
    """A queue entry: its shard's stream and its id there (ids of two shards may be equal)."""

    stream: str
    id: bytes

    def __str__(self) -> str:
        return f"{self.stream}/{self.id.decode(errors='replace')}"


@dataclass(frozen=True)
class ShardView:
    """What the housekeeper learnt from the registry, read by the reader: the shards served (the
    largest count published), this engine's own ones, each shard's owner, and the owners whose
    registry entry says they are saturated (the reader also reads their room keys, fresher)."""

    count: int
    owned: tuple[int, ...]
    owners: tuple[str | None, ...]
    saturated: frozenset[str] = frozenset()
    # shards this engine owned until lately: taken without waiting for the steal bound for a while
    handed_over: frozenset[int] = frozenset()


@dataclass
class Entry:
    """One stream entry handed to the worker."""

    entry_id: EntryRef | bytes
    request: GenerateRequest | None  # None: unparseable (see ``problem``)
    problem: str | None = None
    cancelled: bool = False  # the queued-request cancel marker was set
    emitted: bool = False  # a previous attempt already emitted tokens (reclaimed entries only)
    reclaimed: bool = False
    deliveries: int = 1
    gateway_lost: bool = False  # the gateway that waits for it is gone (``RedisIO.check_gateways``)
    shard: int = 0
    stolen: bool = False  # read from a shard this engine does not own


@dataclass(frozen=True)
class LogSpec:
    """What the publisher and the lost-gateway check need of a request's event-log flags."""

    logged: bool
    detached: bool
    ttl_s: int
    deadline: float

    @classmethod
    def of(cls, request: GenerateRequest) -> LogSpec | None:
        if not (request.log_events or request.detached):
            return None
        return cls(request.log_events, request.detached, request.log_ttl_s or contract.DEFAULT_LOG_TTL_S,
                   request.deadline)


@dataclass
class CancelNote:
    request_ids: list[str]
    cause: str = "cancel"  # "cancel": a client's; "gateway_lost": the gateway that waited is gone


@dataclass
class Batch:
    """What one step sends: applied in order, in one round trip."""

    events: list[Event] = field(default_factory=list)
    emitted: list[str] = field(default_factory=list)  # request ids whose first token is in this batch
    requeue: list[GenerateRequest] = field(default_factory=list)  # handed back (attempt already raised)
    acks: list[EntryRef] = field(default_factory=list)
    # request id -> reply_to for events of entries the worker never held (answered by the I/O thread)
    reply_to: dict[str, str] = field(default_factory=dict)
    logs: dict[str, LogSpec] = field(default_factory=dict)  # the same, for their event-log flags
    usage: list[usage.Usage] = field(default_factory=list)  # what the requests that ended used (their tenants')
    # request id -> reply_to of entries the worker never held that this batch lets go (their owner markers)
    released: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.events or self.emitted or self.requeue or self.acks or self.usage)

    def extend(self, other: Batch) -> None:
        self.events += other.events
        self.emitted += other.emitted
        self.requeue += other.requeue
        self.acks += other.acks
        self.usage += other.usage
        self.reply_to.update(other.reply_to)
        self.logs.update(other.logs)
        self.released.update(other.released)


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_entry(entry_id: EntryRef | bytes, fields: dict | None) -> Entry:
    if not fields:
        return Entry(entry_id, None, problem="entry has no fields (deleted?)")
    raw = fields.get(contract.REQUEST_FIELD)
    if raw is None:
        return Entry(entry_id, None, problem=f"entry lacks field {contract.REQUEST_FIELD!r}")
    request = GenerateRequest()
    try:
        request.ParseFromString(raw)
    except Exception as exc:  # DecodeError and friends
        return Entry(entry_id, None, problem=f"undecodable GenerateRequest: {exc}")
    if not request.request_id:
        return Entry(entry_id, None, problem="GenerateRequest without request_id")
    if not request.reply_to:  # nowhere to answer (a contract-2 entry, or a hand-made one)
        return Entry(entry_id, None, problem=f"GenerateRequest {request.request_id} without reply_to")
    return Entry(entry_id, request)
