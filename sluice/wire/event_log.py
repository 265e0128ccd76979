"""The per-request event log's codecs (the ``{r:<rid>}`` family of ``sluice.wire.contract``).

- The log (``contract.log_key``): a Redis list the engine RPUSHes to, one element per publish (one
  engine step, or the few steps its publisher coalesced) with the request's events of it (an
  ``EventBatch`` without the ids the key already names), in the order the engine published them.
  Replaying it gives a renderer the same events in the same order as the live subscriber got, so
  the rendered chunks are the same. A list, not a stream: Redis (7.0) gives every stream key a
  preallocated 4 KB listpack, so a short request's log would cost some 4.7 KB instead of some
  0.6 KB (scripts/bench_event_log.py); a follower polls it (LRANGE from its index; resumes are rare).
- The record (``contract.record_key``): what a gateway that did not start the request needs to
  render the log: the ids, the creation time, the prompt, the endpoint's own rendering parameters
  (opaque here: ``render``), and ``reply_to`` (a cancel is keyed by it). JSON, versioned.
- Event ids (SSE ``id:``): ``<record id>:<sequence number>``; the record id alone finds the record.

TTL rule (``ttl_until_end``): while a request runs its log and record must not expire, so their first
TTL runs to the request's deadline plus the log window; at the end both get the window alone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from sluice.wire import contract
from sluice.wire.messages_pb2 import Event, EventBatch

RECORD_VERSION = 1
# A request without a deadline (WireClient, offline tools) keeps its log this long before its end.
NO_DEADLINE_RUN_S = 3600


@dataclass
class StreamRecord:
    """A logged request as a renderer needs it. ``id`` is the id the client sees (the record's key);
    ``request_ids`` the engine requests whose logs make up its events (one, today)."""

    id: str
    endpoint: str  # "chat" | "completions" | "responses": which renderer
    model: str
    created: int
    reply_to: str  # the cancel's key (contract.cancelled_key) and the channel the events went to
    request_ids: list[str]
    # Per engine request: its prompt's last tokens (the detokenizer's left context) or, where the
    # renderer shows the prompt (an echo), all of them; and its length (usage.prompt_tokens).
    prompt_ids: list[list[int]]
    prompt_tokens: list[int] = field(default_factory=list)
    deadline: float = 0.0  # unix seconds; 0: none
    detached: bool = False
    render: dict[str, Any] = field(default_factory=dict)  # the endpoint's rendering parameters (JSON)
    tenant: str = ""  # whose request (sluice.wire.tenants): another tenant is told it does not exist
    version: int = RECORD_VERSION

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> StreamRecord:
        """Raises ValueError for a record this code cannot read."""
        try:
            data = json.loads(raw)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"undecodable stream record: {exc}") from None
        if not isinstance(data, dict) or data.get("version") != RECORD_VERSION:
            raise ValueError("stream record of an unknown version")
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        try:
            return cls(**known)
        except TypeError as exc:
            raise ValueError(f"stream record lacks a field: {exc}") from None


def ttl_until_end(deadline: float, log_ttl_s: int, now: float | None = None) -> int:
    """The TTL (s) of a log or record written while its request may still run."""
    now = time.time() if now is None else now
    run = max(deadline - now, 0.0) if deadline else NO_DEADLINE_RUN_S
    return max(1, int(run) + 1 + (log_ttl_s or contract.DEFAULT_LOG_TTL_S))


def encode_entry(events: Iterable[Event]) -> bytes:
    """A log element (RPUSH): the request's events of one publish, without their request and
    engine ids (the key names the request; a decode puts its id back): a decode step's element is a
    few bytes instead of some 70, which is most of a log's memory."""
    batch = EventBatch()
    for event in events:
        copy = batch.events.add()
        copy.CopyFrom(event)
        copy.ClearField("request_id")
        copy.ClearField("engine_id")
    return batch.SerializeToString()


def decode_entry(raw: bytes, request_id: str) -> list[Event]:
    """The events of one element of ``request_id``'s log (raises
    ``google.protobuf.message.DecodeError``)."""
    events = list(EventBatch.FromString(raw).events) if raw else []
    for event in events:
        event.request_id = request_id
    return events


# --- event ids ----------------------------------------------------------------------------------

SEPARATOR = ":"


def event_id(record_id: str, seq: int) -> str:
    """The SSE ``id:`` of a stream's ``seq``-th chunk (1-based)."""
    return f"{record_id}{SEPARATOR}{seq}"


def parse_event_id(value: str) -> tuple[str, int]:
    """(record id, sequence number) of a ``Last-Event-ID``; ValueError when malformed."""
    record_id, sep, seq = value.strip().rpartition(SEPARATOR)
    if not sep or not record_id or not seq.isdigit() or len(seq) > 12 or len(record_id) > 200:
        raise ValueError(f"expected '<id>{SEPARATOR}<sequence number>', got {value[:80]!r}")
    if any(c in record_id for c in "{}\r\n ") or not record_id.isascii():
        raise ValueError(f"not an id this server gives: {record_id[:80]!r}")
    return record_id, int(seq)
