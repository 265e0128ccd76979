"""Redis I/O beside the step loop: four small threads, queues in between.

- reader: XREADGROUP on the model's queue shards, only as many entries as the worker granted
  (credit): first the shards this engine owns (rendezvous hashing over the live engines,
  ``sluice.wire.shards``), in one pipelined non-blocking read, then, when room is left, the
  oldest entries of other shards that waited ``steal_after_ms`` (or whose owner is gone or
  saturated). A shard with tenants' lanes (``contract.lane_stream``) is read in fair-share order
  (``engine_service.core.fair_share``, the worker's ``FairView`` of each step): the credit goes
  first to the lanes of the tenants with the least virtual time (one absent from the engine counts
  as the least), so a tenant's backlog does not stand in front of another tenant's request; and,
  beyond its credit, one entry of each tenant with nothing waiting in the engine whose next
  request could take a slot of the tenant furthest over its share (``FairView.may_take_slot``; at
  most ``FairView.slots_to_give`` such entries on their way), which the scheduler then gives it:
  on one Redis server it BLOCKs on those tenants' lanes for up to ``steal_probe_ms`` (their
  request is read as it lands), on a cluster it looks every ``steal_probe_ms``.
  The lanes are looked up (SMEMBERS of each shard's lanes set) at most every ``LANE_REFRESH_S``. After an empty read it BLOCKs on its shards in one XREADGROUP on one Redis server;
  on a cluster, where one XREADGROUP cannot name streams of several slots, it pauses instead,
  doubling the pause up to ``read_idle_ms``.
  It takes what it read with ``contract.TAKE_SCRIPT`` (the cancel and emitted markers, and the owner
  marker naming this engine) in one pipelined round trip and delivers to the worker's inbox.
- canceller: SSUBSCRIBE to this engine's cancel channel (``contract.cancel_channel``: gateways send a
  cancel to the engine whose owner marker names it, set when the reader took the entry); delivers
  Cancel ids to the inbox.
- publisher: takes the worker's per-step ``Batch`` from the outbox and sends it in ONE pipelined
  round trip (emitted markers, then one SPUBLISH per reply_to of an ``EventFrame`` carrying all its
  events of the step, each request's encoded once and appended as the same bytes to its log when it
  is logged, the owner markers of the requests let go, then the XACKs), retrying while Redis is away. Hand-backs go with their XACKs in one MULTI (both
  in the queue's slot), so a hand-back can never leave the entry twice in the queue.

Redis may be one server or a Redis Cluster (``sluice.wire.connection``): every multi-key step above
stays inside one hash slot family of ``sluice.wire.contract``; the publisher's pipeline spans
families but is not a transaction (redis-py sends each node its part, in order, so an emitted
marker still lands before the event it guards: both are in the reply_to's slot).
- housekeeper: heartbeat (liveness key + registry hash + the model's served key), model card (again
  after each reconnect),
  the shard view (who owns which shard, how many shards exist, each shard's depth), reclaim of
  pending entries whose consumer's liveness key is gone (shard by shard, lane by lane), removal of
  dead engines' registry entries, the streams' trim (acknowledged entries only, see
  ``trim_stream``) and the removal of tenants' lanes that stayed empty and idle
  (``contract.LANE_REMOVE_SCRIPT``).

At start the housekeeper first reclaims this consumer's own pending entries (a restarted engine
with a fixed ``--engine-id`` owns those of its previous life); the reader waits for that, so the
reclaim can never take (and deliver a second time) an entry the reader has just read.

Every thread has its own connection(s) from one pool and reconnects with backoff on its own, so a
slow or broken round trip in one never stalls another, nor the step loop.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import redis
from redis.backoff import ExponentialBackoff

from engine_service.core.fair_share import EMPTY_VIEW, FairView
from engine_service.service.metrics import NULL_METRICS, NullMetrics
from sluice.wire import codec, contract, event_log, policy, registry, shards, tenants, usage
from sluice.wire.connection import TRANSIENT_ERRORS, connect, is_cluster, read_shard_message, refresh_topology
from sluice.wire.messages_pb2 import Cancel, Event, GenerateRequest

log = logging.getLogger("sluice.engine.io")

_REDIS_ERRORS = TRANSIENT_ERRORS
# How often the reader looks up the shards' lanes (a tenant's first entry in a new lane waits this
# long at most, beyond the read); the housekeeper also does at each heartbeat.
LANE_REFRESH_S = 0.1
STOP_READING_WAIT_S = 2.0  # how long stop_reading waits for a read in flight (Redis not answering)
# How many heartbeats an engine takes the entries of a shard it stopped owning without waiting for
# the steal bound: peers refresh their views a beat apart, and the shard must not wait in between.
SHARD_HANDOVER_BEATS = 2
# Errors of a read naming a lane that was just removed (it holds nothing): look the lanes up again.
_GONE_LANE = ("NOGROUP", "UNBLOCKED")


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


def next_id(entry_id: str) -> str:
    """The smallest stream id greater than ``entry_id`` ("ms-seq")."""
    ms, _, seq = entry_id.partition("-")
    return f"{ms}-{int(seq or 0) + 1}"


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def trim_stream(client: redis.Redis, stream: str) -> tuple[str | None, int]:
    """Drop the stream's acknowledged entries and only those: ``XTRIM MINID`` at the oldest entry
    some group still needs — its oldest pending entry, or the first it has not read yet.

    Order makes it safe without a lock: the groups' read positions are taken first (they only move
    forward, so anything read later lies above them), their pending lists after (an entry only
    becomes pending by being read, i.e. above the position already taken, or by a claim of an
    entry that was pending already). A stream without a group is left alone (nobody has read it).
    Returns (the MINID used or None, entries removed).
    """
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:  # no such stream
        return None, 0
    if not groups:
        return None, 0
    floor: str | None = None
    for group in groups:
        bound = next_id(_str(group["last-delivered-id"]))
        if int(group.get("pending", 0) or 0):
            summary = client.xpending(stream, _str(group["name"]))
            if summary.get("pending") and summary.get("min"):
                oldest = _str(summary["min"])
                bound = min(bound, oldest, key=_id_key)
        floor = bound if floor is None else min(floor, bound, key=_id_key)
    if floor is None:
        return None, 0
    removed = client.xtrim(stream, minid=floor, approximate=False)
    return floor, int(removed or 0)


def owner_ttl_s(deadline: float, now: float | None = None) -> int:
    """The owner marker's TTL: past the request's deadline by the in-flight margin (a dead engine's
    markers expire on their own); an hour without a deadline."""
    if not deadline:
        return contract.EMITTED_TTL_S
    now = time.time() if now is None else now
    return max(1, int(deadline - now) + contract.INFLIGHT_MARGIN_S)


class _LoopBackoff:
    """A thread loop's pause between failed rounds (redis-py's ExponentialBackoff computes it; the
    client's own Retry already retried each command), and the reconnect hook for the metrics."""

    def __init__(self, on_recover: Callable[[], None] | None = None) -> None:
        self._backoff = ExponentialBackoff(cap=0.5, base=0.05)
        self.failures = 0
        self.on_recover = on_recover  # called by the first ok() after a failure (a reconnect)

    def fail(self, stop: threading.Event) -> None:
        self.failures += 1
        stop.wait(self._backoff.compute(self.failures))

    def ok(self) -> None:
        if self.failures and self.on_recover is not None:
            self.on_recover()
        self.failures = 0


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


class RedisIO:
    def __init__(
        self,
        settings: Any,
        model: str,
        inbox: queue.SimpleQueue,  # worker.new_inbox()
        card: dict[str, str],
        load: Callable[[], dict[str, Any]],
    ) -> None:
        self.settings = settings
        self.model = model
        self.consumer = settings.engine_id
        # The queue's shards: until the housekeeper has read the registry, this engine is alone.
        own = max(1, min(int(settings.queue_shards), contract.MAX_QUEUE_SHARDS))
        self.view = ShardView(own, tuple(range(own)), (self.consumer,) * own)
        self.streams = contract.request_streams(model, own)  # each shard's stream: the default tenant's lane
        # the tenants' lanes: shard -> tenant ids (valid ones only; refresh_lanes), and where each
        # stream of a shard (default lane included) belongs
        self.lanes: dict[int, tuple[str, ...]] = {}
        self._shard_of = {stream: i for i, stream in enumerate(self.streams)}
        self._tenant_of: dict[str, str] = {}  # lane stream -> tenant (absent: the default tenant)
        self._lanes_due = 0.0
        self._lane_remove = None  # contract.LANE_REMOVE_SCRIPT, registered at first use
        self._grouped: set[str] = set()  # streams whose consumer group exists (reader thread)
        self._rotation = 0  # which owned shard a short credit starts with, so none starves
        self._next_probe = 0.0
        self._room_shown: bool | None = None  # what contract.room_key last said (reader thread)
        self.shard_depth: dict[int, int] = {}  # undelivered entries per shard (housekeeper, metrics)
        # The prompt tokens this engine took from each shard lately (reader adds, heartbeat publishes),
        # and the shards it owned until the last view, read on for a hand-over grace (housekeeper).
        self._shard_load = shards.ShardLoad(settings.shard_load_half_life_s)
        self._shard_load_lock = threading.Lock()
        self._handed_over: dict[int, float] = {}
        self._viewed = False  # a view was computed from the registry
        self._claimed: tuple[int, ...] = ()  # the shards the last view gave this engine (published)
        self.inbox = inbox
        self.card = card
        self.load = load  # the worker's latest load snapshot, for the heartbeat
        self.redis = connect(settings.redis_url, socket_timeout=max(5.0, settings.read_block_ms / 1000 + 2.0))
        self._take_sha = self.redis.register_script(contract.TAKE_SCRIPT).sha
        # One server: an idle reader BLOCKs on its shards in one XREADGROUP. A cluster cannot
        # (CROSSSLOT: the shards' streams are in different slots), so its reader polls.
        self._can_block = not is_cluster(self.redis)
        # request id -> reply_to of the requests delivered to the worker and not acknowledged yet:
        # where their events go (the worker's events name the request only).
        self._reply_to: dict[str, str] = {}
        # request id -> event-log flags of those of them that log or are detached (same lifetime);
        # and the logged ones whose log has had its first write (and TTL) already.
        self._logs: dict[str, LogSpec] = {}
        self._log_started: set[str] = set()
        self.outbox: queue.Queue[Batch | None] = queue.Queue()
        self._stop = threading.Event()
        self._carry_acks: list[bytes] = []  # XACKs of batches dropped after a long outage
        self._never = threading.Event()  # publish retries wait on this: a stop still flushes
        self._threads: list[threading.Thread] = []
        # Credit: the worker reports (headroom, entries it has consumed); the reader may have
        # ``headroom - (delivered - consumed)`` entries in flight towards it.
        self._credit_lock = threading.Condition()
        self._read_lock = threading.Lock()  # held by the reader while it reads and delivers (stop_reading)
        self._headroom = 0
        self._consumed = 0
        self._delivered = 0
        # The worker's fair share after its last step, and the tenants of the entries delivered and
        # not consumed yet (oldest first): the reader's order among lanes and its read-ahead.
        self._fair: FairView = EMPTY_VIEW
        self._inflight_tenants: deque[str] = deque()
        self._next_read_ahead = 0.0
        # Entries handed to the worker and not acknowledged yet (their XACK not sent), with their
        # request and gateway ids: our own pending entries that are NOT here are orphans (see
        # ``reclaim_orphans``), and the gateways named here are watched (``check_gateways``).
        self._held: dict[bytes, tuple[str, str]] = {}
        self._held_lock = threading.Lock()
        # Gateway liveness (housekeeper thread only): since when each watched gateway's key has been
        # found missing, check after check; and the gateways found lost (monotonic time), whose
        # entries are dropped on delivery.
        self._gateway_missing: dict[str, float] = {}
        self._gateways_lost: dict[str, float] = {}
        self._gateways_lock = threading.Lock()  # _gateways_lost is read by the reader thread
        self.reading = True  # False while draining
        self.connected = threading.Event()
        self.own_reclaimed = threading.Event()  # the start's reclaim of our own entries is done
        self.stats = {
            "published_batches": 0, "publish_retries": 0, "dropped_batches": 0, "reclaimed": 0,
            "trimmed": 0, "pruned_engines": 0, "orphans": 0, "gateways_lost": 0, "stolen": 0,
            "ownership_changes": 0,
        }
        self.metrics: NullMetrics = NULL_METRICS  # reconnects, reclaims, events answered here

    def _backoff(self, connection: str) -> _LoopBackoff:
        return _LoopBackoff(on_recover=lambda: self.metrics.redis_reconnected(connection))

    # --- lifecycle ---
    def start(self) -> None:
        for name, target in (
            ("reader", self._reader_loop),
            ("canceller", self._cancel_loop),
            ("publisher", self._publisher_loop),
            ("housekeeper", self._housekeeper_loop),
        ):
            thread = threading.Thread(target=target, name=f"sluice-io-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, flush_timeout: float = 10.0, deregister: bool = True) -> None:
        """Flush the outbox (up to ``flush_timeout``), deregister, stop the threads."""
        self.stop_reading()
        self.outbox.put(None)
        publisher = next((t for t in self._threads if t.name.endswith("publisher")), None)
        if publisher is not None:
            publisher.join(flush_timeout)
        self._stop.set()
        self.own_reclaimed.set()
        with self._credit_lock:
            self._credit_lock.notify_all()
        if deregister:
            try:
                pipe = self.redis.pipeline(transaction=False)
                pipe.delete(contract.engine_key(self.consumer))
                pipe.delete(contract.room_key(self.consumer))
                pipe.hdel(contract.ENGINES_KEY, self.consumer)
                pipe.execute()
            except _REDIS_ERRORS + (redis.RedisError,) as exc:
                log.warning("could not deregister: %s", exc)
        end = time.monotonic() + 1.0  # daemon threads: wait a little, never long
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))
        self.redis.close()

    def stop_reading(self) -> None:
        """No entry is taken after this returns: a read already in flight (a BLOCK of up to
        ``read_block_ms``) is waited for, and what it took is delivered before (bounded by
        ``STOP_READING_WAIT_S`` while Redis does not answer)."""
        with self._credit_lock:
            self.reading = False
            self._credit_lock.notify_all()
        if threading.current_thread().name != "sluice-io-reader" and self._read_lock.acquire(timeout=STOP_READING_WAIT_S):
            self._read_lock.release()

    # --- credit (called by the worker) ---
    def report_headroom(self, headroom: int, consumed: int, fair: FairView | None = None) -> None:
        """The worker's room for new entries, the entries it has taken so far, and (after a step)
        its fair share between tenants."""
        with self._credit_lock:
            inflight = self._inflight_tenants
            for _ in range(min(len(inflight), consumed - self._consumed)):
                inflight.popleft()
            self._headroom, self._consumed = headroom, consumed
            if fair is not None:
                self._fair = fair
            if self._credit() > 0 or self._read_ahead() > 0:
                self._credit_lock.notify_all()

    def _credit(self) -> int:
        if not self.reading:
            return 0
        return self._headroom - (self._delivered - self._consumed)

    def _read_ahead(self) -> int:
        """Entries the reader may take beyond its credit (one per tenant that could take a slot):
        the fair share's slots to give, less the entries on their way to the worker, which the
        view does not count yet (call with ``_credit_lock`` held)."""
        fair = self._fair
        if not self.reading or fair.slots_to_give <= 0 or not self.lanes:
            return 0
        return max(0, fair.slots_to_give - len(self._inflight_tenants))

    def send(self, batch: Batch) -> None:
        if batch:
            self.outbox.put(batch)

    # --- reader ---
    def _ensure_groups(self, streams: list[str]) -> None:
        for stream in streams:
            if stream in self._grouped:
                continue
            try:
                self.redis.xgroup_create(stream, contract.CONSUMER_GROUP, id="0", mkstream=True)
                log.debug("created consumer group %s on %s", contract.CONSUMER_GROUP, stream)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
            self._grouped.add(stream)

    def _set_view(self, view: ShardView) -> None:
        """Adopt a new view (housekeeper): more shards than before extend the streams served."""
        if view.count > len(self.streams):
            log.info("serving %d queue shards (an engine of the model published that many)", view.count)
            self.streams = contract.request_streams(self.model, view.count)
            self._set_lanes(self.lanes)
        self.view = view

    # --- lanes ---
    def shard_lanes(self, shard: int) -> list[tuple[str, str]]:
        """(tenant, stream) of each lane of a shard: the default tenant's (the shard's stream) first."""
        lanes = [("", self.streams[shard])]
        lanes += [(t, contract.lane_stream(self.model, shard, t)) for t in self.lanes.get(shard, ())]
        return lanes

    def all_streams(self) -> list[str]:
        """Every lane's stream of every shard served."""
        return [stream for shard in range(len(self.streams)) for _, stream in self.shard_lanes(shard)]

    def refresh_lanes(self) -> dict[int, tuple[str, ...]]:
        """Look up each shard's lanes set (one pipelined round trip). A member that is not a valid
        tenant id is ignored: the engine trusts nothing it reads."""
        count = len(self.streams)
        pipe = self.redis.pipeline(transaction=False)
        for shard in range(count):
            pipe.smembers(contract.lanes_key(self.model, shard))
        lanes: dict[int, tuple[str, ...]] = {}
        for shard, members in enumerate(pipe.execute(raise_on_error=False)):
            if isinstance(members, Exception):  # that node is away: keep what we knew
                if shard in self.lanes:
                    lanes[shard] = self.lanes[shard]
                continue
            names = sorted({t for t in map(_str, members) if t and tenants.check_tenant_id(t) is None})
            if names:
                lanes[shard] = tuple(names)
        if lanes != self.lanes:
            self._set_lanes(lanes)
        return lanes

    def _set_lanes(self, lanes: dict[int, tuple[str, ...]]) -> None:
        shard_of = {stream: i for i, stream in enumerate(self.streams)}
        tenant_of = {}
        for shard, names in lanes.items():
            for name in names:
                stream = contract.lane_stream(self.model, shard, name)
                shard_of[stream], tenant_of[stream] = shard, name
        # each attribute swapped whole: the other threads read one or the other, never a half
        self._shard_of, self._tenant_of, self.lanes = shard_of, tenant_of, lanes

    def _reader_loop(self) -> None:
        backoff = self._backoff("reader")
        idle_s = 0.001
        while not self._stop.is_set():
            if not self.own_reclaimed.is_set():
                self.own_reclaimed.wait(0.1)
                continue
            with self._credit_lock:
                credit = self._credit()
                ahead = self._read_ahead()
            if (credit > 0) != self._room_shown:
                self._show_room(credit > 0)
            if credit <= 0 and ahead <= 0:
                with self._credit_lock:
                    if self._credit() <= 0 and self._read_ahead() <= 0:
                        self._credit_lock.wait(0.1)
                continue
            if credit <= 0 and not self._can_block:  # a cluster: look for takers every steal_probe_ms
                wait = self._next_read_ahead - time.monotonic()
                if wait > 0:
                    self._stop.wait(wait)
                    continue
                self._next_read_ahead = time.monotonic() + self.settings.steal_probe_ms / 1000
            self._read_lock.acquire()
            try:
                if not self.reading:  # stopped since the credit was read
                    continue
                if credit <= 0:  # one Redis server: wait on the takers' lanes for steal_probe_ms
                    entries = self._wait_for_takers(ahead)
                else:
                    entries = self.read(min(credit, self.settings.max_read_batch), ahead)
                if not entries and credit > 0 and self._can_block:
                    entries = self._wait_for_entries()
                backoff.ok()
                self.connected.set()
                if entries:
                    self._deliver(entries)
            except _REDIS_ERRORS as exc:
                log.warning("reader: Redis unavailable (%s); retrying", exc)
                self._grouped.clear()
                backoff.fail(self._stop)
                continue
            except redis.ResponseError as exc:
                self._grouped.clear()
                if any(word in str(exc) for word in _GONE_LANE):
                    # Redis lost a stream (restart without persistence), or a lane read was removed
                    self._lanes_due = 0.0
                    continue
                log.error("XREADGROUP failed: %s", exc)
                backoff.fail(self._stop)
                continue
            finally:
                self._read_lock.release()
            if entries:
                idle_s = 0.001
            elif not self._can_block:  # an idle queue on a cluster: pause a little, longer each time
                self._stop.wait(idle_s)
                idle_s = min(idle_s * 2, self.settings.read_idle_ms / 1000)

    def _wait_for_entries(self) -> list[Entry]:
        """One Redis server: after an empty read, BLOCK on the owned shards' streams in ONE
        XREADGROUP (COUNT 1 each) until an entry comes, or until the next look at other shards is
        due (``steal_probe_ms``; ``read_block_ms`` when there are none). An idle engine so costs
        nothing and a new entry is read at once. Only an entry that lands between the empty read
        and this one can make the read return more than one (one per shard at most)."""
        view = self.view
        owned = [stream for i in view.owned if i < len(self.streams) for _, stream in self.shard_lanes(i)]
        others = view.count > len([i for i in view.owned if i < len(self.streams)])
        if not owned:
            self._stop.wait(self.settings.steal_probe_ms / 1000)
            return []
        reply = self.redis.xreadgroup(contract.CONSUMER_GROUP, self.consumer, {s: ">" for s in owned}, count=1,
                                      block=self.settings.steal_probe_ms if others else self.settings.read_block_ms)
        entries = []
        for name, messages in reply or []:
            stream = _str(name)
            for eid, fields in messages:
                entry = parse_entry(EntryRef(stream, eid), fields)
                entry.shard = self._shard_of.get(stream, 0)
                entries.append(entry)
        return entries

    def _wait_for_takers(self, ahead: int) -> list[Entry]:
        """One Redis server, no credit, a read-ahead allowed: BLOCK (up to ``steal_probe_ms``, so
        that credit coming back waits no longer) on the lanes of the owned shards of up to ``ahead``
        tenants that could take a slot (``FairView.may_take_slot``) and have nothing on their way
        (least virtual time first, equal ones in turn), COUNT 1 each: such a tenant's request is read
        the moment it lands instead of at the next look. On a cluster the reader looks every
        ``steal_probe_ms`` instead (``read``)."""
        self._refresh_lanes_when_due()
        with self._credit_lock:
            fair, on_the_way = self._fair, set(self._inflight_tenants)
        owned = [shard for shard in self.view.owned if shard < len(self.streams)]
        lanes = [(shard, tenant, stream) for shard in owned for tenant, stream in self.shard_lanes(shard)
                 if tenant not in on_the_way and fair.may_take_slot(tenant)]
        names = sorted({tenant for _, tenant, _ in lanes})
        if names:
            k = self._rotation % len(names)
            self._rotation += 1
            chosen = set(sorted(names[k:] + names[:k], key=fair.priority)[:ahead])
            lanes = [lane for lane in lanes if lane[1] in chosen]
        streams = {stream: shard for shard, _, stream in lanes}
        if not streams:
            with self._credit_lock:
                self._credit_lock.wait(self.settings.steal_probe_ms / 1000)
            return []
        reply = self.redis.xreadgroup(contract.CONSUMER_GROUP, self.consumer, dict.fromkeys(streams, ">"), count=1,
                                      block=self.settings.steal_probe_ms)
        entries = []
        for name, messages in reply or []:
            stream = _str(name)
            for eid, fields in messages:
                entry = parse_entry(EntryRef(stream, eid), fields)
                entry.shard = streams.get(stream, 0)
                entries.append(entry)
        return entries

    def _refresh_lanes_when_due(self) -> None:
        now = time.monotonic()
        if now >= self._lanes_due:
            self._lanes_due = now + LANE_REFRESH_S
            self.refresh_lanes()

    def _show_room(self, room: bool) -> None:
        """Tell peers at once whether this engine can take more (``contract.room_key``): while it
        cannot, they take its shards' entries without waiting for the steal bound."""
        try:
            self.redis.set(contract.room_key(self.consumer), b"1" if room else b"0",
                           px=int(self.settings.heartbeat_ttl_s * 1000))
            self._room_shown = room
        except _REDIS_ERRORS + (redis.RedisError,) as exc:
            log.debug("reader: could not publish room (%s)", exc)

    def read(self, count: int, ahead: int = 0) -> list[Entry]:
        """At most ``count`` new entries: own shards first, then what may be stolen; and with
        tenants' lanes, up to ``ahead`` more, one per tenant absent from the engine."""
        view = self.view
        streams = self.streams
        self._ensure_groups(streams)
        self._refresh_lanes_when_due()
        now = time.monotonic()
        owned = [i for i in view.owned if i < len(streams)]
        if self.lanes:
            entries = self._read_fair(owned, count, ahead)
        else:  # one lane a shard (no tenants): the shards' credit split
            entries = self._read_shards(owned, count) if owned else []
        room = count - len(entries)
        if room > 0 and now >= self._next_probe:
            self._next_probe = now + self.settings.steal_probe_ms / 1000
            stolen = self._read_stolen(self.steal_candidates(view, streams), room)
            if stolen:
                self.stats["stolen"] += len(stolen)
                log.debug("took %d entries of shards this engine does not own", len(stolen))
            entries += stolen
        return entries

    def _read_shards(self, shard_ids: list[int], count: int) -> list[Entry]:
        """The own shards' default lanes, the credit split so that the total never exceeds
        ``count``: a credit shorter than the shards goes to those with unread entries, a rotating
        subset when they are still more."""
        if not shard_ids or count <= 0:
            return []
        if count < len(shard_ids):
            # Less credit than shards: look first which hold unread entries (one more pipelined
            # round trip), so that the credit goes to those rather than to empty ones.
            positions = self._positions([self.streams[i] for i in shard_ids])
            shard_ids = [i for i, (last, lag) in zip(shard_ids, positions, strict=True) if last is None or lag != 0]
            if not shard_ids:
                return []
        k = self._rotation % len(shard_ids)
        shard_ids = shard_ids[k:] + shard_ids[:k]
        self._rotation += 1
        shard_ids = shard_ids[:count]
        base, extra = divmod(count, len(shard_ids))
        return self._xread([(shard, self.streams[shard], base + (1 if i < extra else 0))
                            for i, shard in enumerate(shard_ids)])

    def _read_stolen(self, targets: list[tuple[int, str]], count: int) -> list[Entry]:
        """Other shards' lanes, in the order given (``steal_candidates``), the credit split."""
        targets = targets[:count]
        if not targets or count <= 0:
            return []
        base, extra = divmod(count, len(targets))
        return self._xread([(shard, stream, base + (1 if i < extra else 0))
                            for i, (shard, stream) in enumerate(targets)], stolen=True)

    def _read_fair(self, shard_ids: list[int], count: int, ahead: int) -> list[Entry]:
        """The own shards' lanes in fair-share order: the lanes' unread entries first (one
        pipelined round trip), then ``count`` entries dealt one at a time to the tenants in order
        of least virtual time (``FairView.priority``; an absent tenant's is the least), round after
        round while they have entries; then ``ahead`` more, one per tenant that could take a slot
        (``FairView.may_take_slot``) and has nothing on its way. A tenant's entries come from its
        lanes in rotating order."""
        if not shard_ids or count + ahead <= 0:
            return []
        with self._credit_lock:
            fair, on_the_way = self._fair, set(self._inflight_tenants)
        lanes = [(shard, tenant, stream) for shard in shard_ids for tenant, stream in self.shard_lanes(shard)]
        if count <= 0:  # a look for takers only (every steal_probe_ms while saturated): their lanes alone
            lanes = [lane for lane in lanes if lane[1] not in on_the_way and fair.may_take_slot(lane[1])]
            if not lanes:
                return []
        positions = self._positions([stream for _, _, stream in lanes])
        by_tenant: dict[str, list[list]] = {}  # tenant -> [[shard, stream, unread], ...]
        for (shard, tenant, stream), (last, lag) in zip(lanes, positions, strict=True):
            if tenant and last is None:
                continue  # a lane without its group: removed meanwhile
            if lag is None:
                lag = count + ahead  # unknown (no group yet on a default lane, or Redis cannot tell)
            if lag > 0:
                by_tenant.setdefault(tenant, []).append([shard, stream, lag])
        if not by_tenant:
            return []
        names = sorted(by_tenant)
        k = self._rotation % len(names)
        self._rotation += 1
        order = sorted(names[k:] + names[:k], key=fair.priority)  # stable: equal priorities rotate
        unread = {t: sum(lane[2] for lane in by_tenant[t]) for t in order}
        dealt = dict.fromkeys(order, 0)
        left = count
        while left > 0 and any(dealt[t] < unread[t] for t in order):
            for t in order:
                if left > 0 and dealt[t] < unread[t]:
                    dealt[t] += 1
                    left -= 1
        for t in order:
            if ahead <= 0:
                break
            if not dealt[t] and t not in on_the_way and fair.may_take_slot(t):
                dealt[t] = 1
                ahead -= 1
        alloc: list[tuple[int, str, int]] = []
        for t in order:
            tenant_lanes = by_tenant[t]
            j = self._rotation % len(tenant_lanes)
            tenant_lanes = tenant_lanes[j:] + tenant_lanes[:j]
            n = dealt[t]
            while n > 0:
                for lane in tenant_lanes:
                    if n > 0 and lane[2] > 0:
                        take = 1 if len(tenant_lanes) > 1 else min(n, lane[2])
                        lane[2] -= take
                        n -= take
                        alloc.append((lane[0], lane[1], take))
        merged: dict[tuple[int, str], int] = {}
        for shard, stream, n in alloc:
            merged[(shard, stream)] = merged.get((shard, stream), 0) + n
        return self._xread([(shard, stream, n) for (shard, stream), n in merged.items()])

    def _xread(self, alloc: list[tuple[int, str, int]], stolen: bool = False) -> list[Entry]:
        """One pipelined, non-blocking XREADGROUP per (shard, stream, count) (a cluster pipeline
        sends each node its part)."""
        if not alloc:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for _, stream, n in alloc:
            pipe.xreadgroup(contract.CONSUMER_GROUP, self.consumer, {stream: ">"}, count=n)
        # A failing node (a cluster failover) must not hide what the others delivered: those
        # entries are ours now, pending; dropping them would leave them to the orphan check.
        replies = pipe.execute(raise_on_error=False)
        entries = []
        failed: list[Exception] = []
        for (shard, stream, _), reply in zip(alloc, replies, strict=True):
            if isinstance(reply, Exception):
                failed.append(reply)
                self._grouped.discard(stream)
                continue
            for _, messages in reply or []:
                for eid, fields in messages:
                    entry = parse_entry(EntryRef(stream, eid), fields)
                    entry.shard, entry.stolen = shard, stolen
                    entries.append(entry)
        if failed and not entries:
            raise failed[0]
        if failed:
            log.warning("reader: %d of %d lane reads failed (%s)", len(failed), len(alloc), failed[0])
        return entries

    def steal_candidates(self, view: ShardView, streams: list[str]) -> list[tuple[int, str]]:
        """The other shards' lanes whose oldest undelivered entry may be taken now, as (shard,
        stream): it waited ``steal_after_ms``, or its shard has no live owner, or the owner is
        saturated; oldest first, and with tenants' lanes in fair-share order first. Two pipelined
        round trips: each group's read position (and lag), then the first entry after it (its id
        is its enqueue time)."""
        owned = set(view.owned)
        others = [(i, tenant, stream) for i in range(len(streams)) if i not in owned
                  for tenant, stream in self.shard_lanes(i)]
        if not others:
            return []
        positions = self._positions([stream for _, _, stream in others])
        looked = [(i, tenant, stream, last) for (i, tenant, stream), (last, lag) in zip(others, positions, strict=True)
                  if last is not None and lag != 0]
        if not looked:
            return []
        owners = sorted({o for i, *_ in looked if (o := view.owners[i] if i < len(view.owners) else None)})
        pipe = self.redis.pipeline(transaction=False)
        for _, _, stream, last in looked:
            pipe.xrange(stream, min="(" + last, count=1)
        for o in owners:
            pipe.get(contract.room_key(o))
        replies = pipe.execute(raise_on_error=False)
        firsts, rooms = replies[:len(looked)], dict(zip(owners, replies[len(looked):], strict=True))
        # no room: its reader's credit is spent (or it has not said so: hung, dying)
        full = {o for o, room in rooms.items() if room in (b"0", "0", None)} | set(view.saturated)
        now_ms = self._redis_ms()
        fair = self._fair
        ready: list[tuple[tuple[float, float], int, int, str]] = []
        for (i, tenant, stream, _), first in zip(looked, firsts, strict=True):
            if isinstance(first, Exception) or not first:
                continue
            age = now_ms - shards.entry_ms(first[0][0])
            owner = view.owners[i] if i < len(view.owners) else None
            if age >= self.settings.steal_after_ms or owner is None or owner in full or i in view.handed_over:
                ready.append((fair.priority(tenant) if self.lanes else (0.0, 0.0), -age, i, stream))
        return [(i, stream) for _, _, i, stream in sorted(ready)]

    def _positions(self, streams: list[str]) -> list[tuple[str | None, int | None]]:
        """Per stream: the group's last-delivered id and lag (None where unknown); (None, None)
        for a stream without the group."""
        pipe = self.redis.pipeline(transaction=False)
        for stream in streams:
            pipe.xinfo_groups(stream)
        out: list[tuple[str | None, int | None]] = []
        for groups in pipe.execute(raise_on_error=False):
            found: tuple[str | None, int | None] = (None, None)
            if not isinstance(groups, Exception):
                for g in groups:
                    if _str(g.get("name", b"")) == contract.CONSUMER_GROUP:
                        lag = g.get("lag")
                        found = (_str(g.get("last-delivered-id", b"0-0")), None if lag is None else int(lag))
            out.append(found)
        return out

    def _redis_ms(self) -> int:
        """Now, by this host's clock, in ms (entry ids carry Redis's clock; the two agree on one
        host, and across hosts within NTP's error, small beside ``steal_after_ms``)."""
        return int(time.time() * 1000)

    def _deliver(self, entries: list[Entry]) -> None:
        """Check markers in one round trip, then hand the entries to the worker."""
        known = [e for e in entries if e.request is not None]
        if known:
            try:
                for e, (cancelled, emitted) in zip(known, self._take(known), strict=True):
                    e.cancelled = bool(cancelled)
                    e.emitted = bool(emitted) and (e.reclaimed or e.request.attempt > 0)
            except _REDIS_ERRORS + (redis.RedisError,) as exc:
                # The entries are ours now (pending), but no owner marker names us: a cancel of one
                # of them only leaves its marker, which a reclaim or hand-back would see.
                log.warning("could not check markers: %s", exc)
        entries = self._answer_lost(entries)
        with self._gateways_lock:
            if self._gateways_lost:
                for e in entries:
                    if e.request is not None and e.request.gateway_id in self._gateways_lost and not e.request.detached:
                        e.gateway_lost = True
        with self._held_lock:
            for e in entries:
                rid, gid = (e.request.request_id, e.request.gateway_id) if e.request is not None else ("", "")
                self._held[e.entry_id] = (rid, gid)
                if e.request is not None:
                    self._reply_to[rid] = e.request.reply_to
                    if (spec := LogSpec.of(e.request)) is not None:
                        self._logs[rid] = spec
        now = time.monotonic()
        with self._shard_load_lock:
            for e in entries:
                if e.request is not None and not e.reclaimed:
                    self._shard_load.add(e.shard, len(e.request.prompt_token_ids), now)
        with self._credit_lock:
            self._delivered += len(entries)
            self._inflight_tenants.extend(e.request.tenant if e.request is not None else "" for e in entries)
        for e in entries:
            self.inbox.put(e)

    def _take(self, entries: list[Entry]) -> list[Any]:
        """``contract.TAKE_SCRIPT`` for each entry, pipelined (one round trip; a cluster pipeline
        sends each node its part): its (cancelled, emitted) flags, and the owner marker naming this
        engine, so that cancels of these requests come here. EVALSHA; a Redis that lost the script
        (a restart, a failover to a node that never saw it) gets it loaded, and the round trip is
        made again (the script is idempotent)."""
        for attempt in (0, 1):
            pipe = self.redis.pipeline(transaction=False)
            for e in entries:
                rid, reply_to = e.request.request_id, e.request.reply_to
                pipe.evalsha(self._take_sha, 3, contract.cancelled_key(reply_to, rid),
                             contract.emitted_key(reply_to, rid), contract.owner_key(reply_to, rid),
                             self.consumer, owner_ttl_s(e.request.deadline))
            replies = pipe.execute(raise_on_error=False)
            if attempt == 0 and any(isinstance(r, redis.exceptions.NoScriptError) for r in replies):
                self.redis.script_load(contract.TAKE_SCRIPT)
                continue
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
            return replies
        raise AssertionError("unreachable")

    def _answer_lost(self, entries: list[Entry]) -> list[Entry]:
        """Reclaimed entries whose request already emitted tokens (or that were delivered too
        often) need no model: answer them here, at once (error event + XACK in one round trip),
        instead of waiting for the step loop's next iteration."""
        reasons = {
            id(e): reason
            for e in entries
            if e.request is not None and e.reclaimed and not e.cancelled
            and (reason := policy.lost_on_delivery(emitted=e.emitted, deliveries=e.deliveries,
                                                   attempt=e.request.attempt)) is not None
        }
        lost = [e for e in entries if id(e) in reasons]
        if not lost:
            return entries
        batch = Batch()
        for e in lost:
            reason = reasons[id(e)]
            batch.events.append(codec.error_event(e.request.request_id, contract.ERR_ENGINE_LOST, reason, self.consumer))
            batch.reply_to[e.request.request_id] = e.request.reply_to
            batch.released[e.request.request_id] = e.request.reply_to
            if (spec := LogSpec.of(e.request)) is not None:
                batch.logs[e.request.request_id] = spec
            batch.acks.append(e.entry_id)
            log.warning("reclaimed %s: %s", e.request.request_id, reason)
        self.metrics.events(batch.events)
        self.outbox.put(batch)  # the publisher sends it now (it is idle between steps' batches)
        lost_ids = {id(e) for e in lost}
        return [e for e in entries if id(e) not in lost_ids]

    # --- canceller ---
    def _cancel_loop(self) -> None:
        backoff = self._backoff("canceller")
        while not self._stop.is_set():
            pubsub = self.redis.pubsub()
            try:
                pubsub.ssubscribe(contract.cancel_channel(self.consumer))  # the cancels of our requests
                backoff.ok()
                while not self._stop.is_set():
                    message = read_shard_message(pubsub, 0.2)
                    if not message or message.get("type") not in (b"smessage", "smessage"):
                        continue
                    cancel = Cancel()
                    try:
                        cancel.ParseFromString(message["data"])
                    except Exception as exc:
                        log.warning("ignoring an undecodable Cancel: %s", exc)
                        continue
                    if cancel.request_ids:
                        self.inbox.put(CancelNote(list(cancel.request_ids)))
            except _REDIS_ERRORS + (redis.RedisError,) as exc:
                log.warning("canceller: Redis unavailable (%s); resubscribing", exc)
                backoff.fail(self._stop)
                try:  # a cluster's channel may now be served by a promoted replica
                    refresh_topology(self.redis)
                except _REDIS_ERRORS + (redis.RedisError,):
                    pass
            finally:
                try:
                    pubsub.close()
                except Exception:
                    pass

    # --- publisher ---
    def _publisher_loop(self) -> None:
        while True:
            batch = self.outbox.get()
            if batch is None:
                return
            # Coalesce whatever else is waiting: still one round trip, fewer of them.
            stop_after = False
            while True:
                try:
                    more = self.outbox.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop_after = True
                    break
                batch.extend(more)
            self._publish(batch)
            if stop_after:
                return

    def _publish(self, batch: Batch) -> None:
        if self._carry_acks:
            batch.acks = self._carry_acks + batch.acks
            self._carry_acks = []
        backoff = self._backoff("publisher")
        give_up = time.monotonic() + self.settings.publish_retry_s
        while True:
            try:
                results = self._send(batch)
                for result in results:
                    if isinstance(result, Exception):
                        log.warning("publish: a command failed: %s", result)
                self.stats["published_batches"] += 1
                if batch.acks:
                    with self._held_lock:
                        for entry_id in batch.acks:
                            rid, _ = self._held.pop(entry_id, ("", ""))
                            self._reply_to.pop(rid, None)
                            self._logs.pop(rid, None)
                            self._log_started.discard(rid)
                        for rid in batch.logs:
                            self._log_started.discard(rid)
                backoff.ok()
                return
            except _REDIS_ERRORS as exc:
                if time.monotonic() >= give_up:
                    # The events are stale (their subscribers lost the subscription with Redis);
                    # the acknowledgements are not: they ride with the next batch.
                    self.stats["dropped_batches"] += 1
                    self._carry_acks += batch.acks
                    log.error("publish: dropping %d events after %ss without Redis: %s", len(batch.events), self.settings.publish_retry_s, exc)
                    return
                self.stats["publish_retries"] += 1
                log.warning("publish: Redis unavailable (%s); retrying", exc)
                backoff.fail(self._never)
            except redis.RedisError as exc:
                log.error("publish: dropping a batch after error %s", exc)
                self.stats["dropped_batches"] += 1
                return

    def _send(self, batch: Batch) -> list[Any]:
        """One step's writes: emitted markers, then each reply_to's events as ONE message on its
        channel, then the XACKs (one pipeline, not a transaction: it spans slot families). With
        hand-backs, their XADDs and the XACKs go in one MULTI of the queue's slot instead."""
        by_request: dict[str, list[Event]] = {}  # each request's events of the batch, in order
        reply_of: dict[str, str] = {}
        with self._held_lock:
            for event in batch.events:
                rid = event.request_id
                reply_to = batch.reply_to.get(rid) or self._reply_to.get(rid)
                if reply_to is None:  # cannot happen for a delivered entry; never guess a channel
                    log.error("publish: no reply_to known for request %s; event dropped", rid)
                    continue
                by_request.setdefault(rid, []).append(event)
                reply_of[rid] = reply_to
            logged = {rid for rid in by_request
                      if (spec := batch.logs.get(rid) or self._logs.get(rid)) and spec.logged}
            replies = {rid: self._reply_to.get(rid) for rid in batch.emitted}
            acks, requeues = self._queue_writes(batch)
            let_go = {rid: self._reply_to.get(rid) for a in batch.acks if (rid := self._held.get(a, ("", ""))[0])}
            let_go.update(batch.released)
            requeued = {request.request_id for request in batch.requeue}  # handed back: not ended
            ended = {self._held[a][0] for a in batch.acks if a in self._held} - requeued
            ended |= set(batch.logs)
            log_specs = {rid: batch.logs.get(rid) or self._logs.get(rid) for rid in logged | ended}
            first_writes = {rid for rid in logged if rid not in self._log_started}
        # Each request's events encoded ONCE: the same bytes go in its part of the reply channel's
        # frame and, when it is logged, in its log.
        encoded = {rid: event_log.encode_entry(events) for rid, events in by_request.items()}
        by_reply: dict[str, list[tuple[str, bytes]]] = {}
        for rid, data in encoded.items():
            by_reply.setdefault(reply_of[rid], []).append((rid, data))
        pipe = self.redis.pipeline(transaction=False)
        for rid, reply_to in replies.items():
            if reply_to:
                pipe.set(contract.emitted_key(reply_to, rid), self.consumer, ex=contract.EMITTED_TTL_S)
        for reply_to, parts in by_reply.items():
            pipe.spublish(contract.events_channel(reply_to), codec.encode_frame(self.consumer, parts))
        self._append_logs(pipe, {rid: encoded[rid] for rid in logged}, log_specs, first_writes, ended)
        for rid, reply_to in let_go.items():  # acknowledged (ended or handed back): no longer ours
            if reply_to:
                pipe.delete(contract.owner_key(reply_to, rid))
        usage.record(pipe, batch.usage)
        for stream, ids in acks.items():
            if stream not in requeues:
                pipe.xack(stream, contract.CONSUMER_GROUP, *ids)
        results = pipe.execute(raise_on_error=False) if len(pipe) else []
        for stream, requests in requeues.items():  # one MULTI per shard: both in its slot
            multi = self.redis.pipeline(transaction=True)
            for request in requests:
                multi.xadd(stream, codec.encode_request(request))
            if acks.get(stream):
                multi.xack(stream, contract.CONSUMER_GROUP, *acks[stream])
            results += multi.execute(raise_on_error=False)
        return results

    def _queue_writes(self, batch: Batch) -> tuple[dict[str, list[bytes]], dict[str, list[GenerateRequest]]]:
        """The batch's XACKs by shard stream, and its hand-backs by the shard they came from (a
        hand-back goes back to ITS shard, with its XACK; call with ``_held_lock`` held)."""
        acks: dict[str, list[bytes]] = {}
        shard_of_request: dict[str, str] = {}
        for ref in batch.acks:
            stream, entry_id = (ref.stream, ref.id) if isinstance(ref, EntryRef) else (self.streams[0], ref)
            acks.setdefault(stream, []).append(entry_id)
            rid = self._held.get(ref, ("", ""))[0]
            if rid:
                shard_of_request[rid] = stream
        requeues: dict[str, list[GenerateRequest]] = {}
        for request in batch.requeue:
            stream = shard_of_request.get(request.request_id, self.streams[0])
            requeues.setdefault(stream, []).append(request)
        return acks, requeues

    def _append_logs(self, pipe: Any, by_log: dict[str, bytes], specs: dict[str, LogSpec | None],
                     first_writes: set[str], ended: set[str]) -> None:
        """The event-log part of a step's pipeline (``sluice.wire.event_log``): one RPUSH per logged
        request with events in this step (the bytes of its part of the frame); an EXPIRE to
        (deadline + window) with its first write, and to the window alone for log and record when
        the request ends here. No extra round trip."""
        for rid, element in by_log.items():
            pipe.rpush(contract.log_key(rid), element)
            spec = specs[rid]
            if rid in first_writes and rid not in ended and spec is not None:
                pipe.expire(contract.log_key(rid), event_log.ttl_until_end(spec.deadline, spec.ttl_s))
        for rid in ended:
            spec = specs.get(rid)
            if spec is not None and spec.logged:
                pipe.expire(contract.log_key(rid), spec.ttl_s)
                pipe.expire(contract.record_key(rid), spec.ttl_s)
        self._log_started.update(first_writes - ended)

    # --- housekeeper: heartbeat, model card, reclaim ---
    def publish_card(self) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(contract.model_card_key(self.model), mapping=self.card)
        pipe.sadd(contract.MODELS_KEY, self.model)
        pipe.sadd(contract.queue_shards_key(self.model), self.settings.queue_shards)
        pipe.set(contract.served_key(self.model), self.consumer, px=int(self.settings.model_grace_s * 1000))
        pipe.execute()

    def heartbeat(self) -> None:
        # The card first: if Redis lost its data (a restart without persistence; the healing client
        # may have hidden the outage from us), the card is back before the liveness key says
        # "this engine serves", so a gateway that sees the engine also finds its card.
        if not self.redis.exists(contract.model_card_key(self.model)):
            self.publish_card()
        load = dict(self.load())
        with self._credit_lock:
            load["free_slots"] = max(0, self._credit())  # 0 while draining: its shards are others' now
        with self._shard_load_lock:
            load["shard_load"] = {s: round(v, 1) for s, v in self._shard_load.snapshot(time.monotonic()).items()}
        load["owned_shards"] = list(self._claimed) if self.reading else []
        entry = registry.EngineEntry.from_load(self.consumer, self.model, time.time(), load)
        pipe = self.redis.pipeline(transaction=True)  # both in the registry's slot
        pipe.set(contract.engine_key(self.consumer), json.dumps({"model": self.model}), px=int(self.settings.heartbeat_ttl_s * 1000))
        pipe.set(contract.room_key(self.consumer), b"1" if load["free_slots"] > 0 else b"0",
                 px=int(self.settings.heartbeat_ttl_s * 1000))
        pipe.hset(contract.ENGINES_KEY, self.consumer, entry.encode())
        # the model is served: its keys stay (a draining engine still serves what it holds)
        pipe.set(contract.served_key(self.model), self.consumer, px=int(self.settings.model_grace_s * 1000))
        pipe.execute()
        # What the room key says now: the reader compares its credit with this, so a "0" written
        # here at an instant without credit is put right as soon as credit is back (not a beat later).
        self._room_shown = load["free_slots"] > 0

    def _housekeeper_loop(self) -> None:
        backoff = self._backoff("housekeeper")
        need_card = True
        next_beat = next_reclaim = 0.0
        next_prune = time.monotonic() + 30.0
        next_tidy = time.monotonic() + self.settings.trim_interval_s
        next_orphans = time.monotonic() + self.settings.orphan_check_s
        next_gateways = time.monotonic() + self.settings.gateway_check_s
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if need_card:
                    self.publish_card()
                    need_card = False
                if now >= next_beat:
                    self.heartbeat()
                    self.refresh_view()
                    next_beat = now + self.settings.heartbeat_interval_s
                if not self.own_reclaimed.is_set():
                    # Before the reader's first read: our own entries of a previous life only.
                    if self.reading:
                        self.reclaim(include_self=True)
                    self.own_reclaimed.set()
                    next_reclaim = now + self.settings.reclaim_interval_s
                if now >= next_reclaim and self.reading:
                    self.reclaim()
                    next_reclaim = now + self.settings.reclaim_interval_s
                if now >= next_orphans and self.reading:
                    self.reclaim_orphans()
                    next_orphans = now + self.settings.orphan_check_s
                if now >= next_gateways:
                    self.check_gateways()
                    next_gateways = now + self.settings.gateway_check_s
                if now >= next_tidy:
                    self.tidy()
                    next_tidy = now + self.settings.trim_interval_s
                if now >= next_prune:
                    self.prune_consumers()
                    next_prune = now + 30.0
                backoff.ok()
                self.connected.set()
            except _REDIS_ERRORS as exc:
                log.warning("housekeeper: Redis unavailable (%s); retrying", exc)
                need_card = True  # Redis may come back empty
                next_beat = 0.0
                backoff.fail(self._stop)
                continue
            except redis.RedisError as exc:
                log.error("housekeeper: %s", exc)
                backoff.fail(self._stop)
                continue
            except Exception:  # a bug in one chore must not stop the heartbeat (and so the engine)
                log.exception("housekeeper: unexpected error")
                backoff.fail(self._stop)
                continue
            self._stop.wait(min(next_beat, next_reclaim, next_gateways) - time.monotonic() if self.reading else 0.2)

    def refresh_view(self) -> ShardView:
        """Read the registry: the live engines of this model (liveness key present, not draining;
        this engine while it reads), the shard counts published, the shard loads and KV capacity
        the live engines published; compute every shard's owner by bounded-load rendezvous hashing
        (``shards.balanced_owners``), and each shard's depth (for the metrics). A shard this
        engine owned until now is taken without waiting for the steal bound for
        ``SHARD_HANDOVER_BEATS`` heartbeats (``_handover``): engines adopt a moved owner a beat
        apart, and an entry landing between must not wait for the bound."""
        pipe = self.redis.pipeline(transaction=False)  # both in the registry's slot
        pipe.hgetall(contract.ENGINES_KEY)
        pipe.smembers(contract.queue_shards_key(self.model))
        raw, counts = pipe.execute()
        peers = {}
        mine = None
        for value in raw.values():
            entry = registry.decode(value)
            if entry is None or entry.model != self.model or entry.draining:
                continue
            if entry.engine_id == self.consumer:
                mine = entry
            else:
                peers[entry.engine_id] = entry
        ids = list(peers)
        if ids:
            pipe = self.redis.pipeline(transaction=False)
            for engine_id in ids:
                pipe.exists(contract.engine_key(engine_id))
            alive = pipe.execute()
            peers = {e: peers[e] for e, ok in zip(ids, alive, strict=True) if ok}
        live = set(peers) | ({self.consumer} if self.reading else set())
        count = max(shards.shard_count(counts, self.settings.queue_shards), len(self.streams))
        published = {**peers, **({self.consumer: mine} if mine is not None and self.reading else {})}
        loads: dict[int, float] = {}
        for entry in published.values():
            for shard, value in entry.shard_load.items():
                loads[shard] = loads.get(shard, 0.0) + value
        capacity = {e: float(published[e].total_blocks) if e in published else 0.0 for e in live}
        current = shards.current_owners({e: entry.owned_shards for e, entry in published.items()}, count)
        owners = tuple(shards.balanced_owners(count, capacity, loads, self.settings.shard_load_slack, current))
        # One shard is one shared queue, as before sharding: every engine reads it as its own.
        owned = tuple(range(count)) if count == 1 and self.reading else \
            tuple(i for i, o in enumerate(owners) if o == self.consumer)
        self._claimed = owned if count > 1 else ()
        view = ShardView(count, owned, owners, frozenset(e for e, entry in peers.items() if entry.saturated),
                         self._handover(owned, count))
        if view.owned != self.view.owned:
            self.stats["ownership_changes"] += 1
            log.info("owning queue shards %s of %d (%d live engines)", list(view.owned), count, len(live))
        self._set_view(view)
        self.refresh_lanes()
        streams = self.all_streams()
        depth: dict[int, int] = {}
        for stream, (_, lag) in zip(streams, self._positions(streams), strict=True):
            if lag is not None:
                shard = self._shard_of.get(stream, 0)
                depth[shard] = depth.get(shard, 0) + lag
        self.shard_depth.update(depth)
        return view

    def _handover(self, owned: tuple[int, ...], count: int) -> frozenset[int]:
        """The shards this engine owned and lost less than ``SHARD_HANDOVER_BEATS`` heartbeats ago
        (none while draining): peers adopt a moved owner a beat apart, so until the new owner
        reads the shard, this engine takes its entries without waiting for the steal bound."""
        now = time.monotonic()
        if not self.reading or not self._viewed:  # the start's view (alone, owning all) hands nothing over
            self._viewed = self.reading
            self._handed_over.clear()
            return frozenset()
        for shard in set(self.view.owned) - set(owned):
            self._handed_over.setdefault(shard, now + SHARD_HANDOVER_BEATS * self.settings.heartbeat_interval_s)
        self._handed_over = {s: t for s, t in self._handed_over.items() if t > now and s not in owned and s < count}
        return frozenset(self._handed_over)

    def check_gateways(self, now: float | None = None) -> list[str]:
        """Abort the requests of gateways that are gone; return the ids of those found lost now.

        A gateway's key must be found missing at every check for ``gateway_lost_after_s``: Redis
        restarted without its data loses every live gateway's key as well, and those gateways put it
        back within a heartbeat of reconnecting. A check that fails (Redis away) resets the count.
        Requests of a lost gateway still held at a later check (delivered while it was being
        declared lost) are aborted then; a second abort of the same request does nothing.
        """
        if self.settings.gateway_lost_after_s <= 0:
            return []
        with self._held_lock:
            by_gateway: dict[str, list[str]] = {}
            for rid, gid in self._held.values():
                spec = self._logs.get(rid)
                if gid and rid and not (spec is not None and spec.detached):  # detached: never for gateway loss
                    by_gateway.setdefault(gid, []).append(rid)
        now = time.monotonic() if now is None else now
        with self._gateways_lock:
            for gid, since in list(self._gateways_lost.items()):
                if now - since > contract.CANCEL_MARKER_TTL_S and gid not in by_gateway:
                    del self._gateways_lost[gid]  # nothing of it can be queued any more
            known_lost = set(self._gateways_lost)
        for gid in list(self._gateway_missing):
            if gid not in by_gateway:
                del self._gateway_missing[gid]
        watched = [gid for gid in by_gateway if gid not in known_lost]
        lost: list[str] = []
        if watched:
            pipe = self.redis.pipeline(transaction=False)
            for gid in watched:
                pipe.exists(contract.gateway_key(gid))
            try:
                present = pipe.execute()
            except _REDIS_ERRORS:
                self._gateway_missing.clear()  # Redis may come back empty: every key counts afresh
                raise
            for gid, alive in zip(watched, present, strict=True):
                if alive:
                    self._gateway_missing.pop(gid, None)
                elif now - self._gateway_missing.setdefault(gid, now) >= self.settings.gateway_lost_after_s:
                    lost.append(gid)
        for gid in lost:
            del self._gateway_missing[gid]
            with self._gateways_lock:
                self._gateways_lost[gid] = now
            self.stats["gateways_lost"] += 1
            log.warning("gateway %s is gone (no liveness key for %.1fs): aborting its %d request(s)",
                        gid, self.settings.gateway_lost_after_s, len(by_gateway[gid]))
        orphaned = self._unleased([rid for gid in [*lost, *known_lost] for rid in by_gateway.get(gid, ())])
        if orphaned:
            self.inbox.put(CancelNote(orphaned, cause="gateway_lost"))
        return lost

    def _unleased(self, request_ids: list[str]) -> list[str]:
        """Those of a lost gateway's requests that nobody follows: a logged request whose lease
        (``contract.lease_key``) a resuming gateway holds is spared, while the lease lasts (checked
        again at every check; one pipelined EXISTS per logged request of a lost gateway)."""
        with self._held_lock:
            logged = [rid for rid in request_ids if (spec := self._logs.get(rid)) is not None and spec.logged]
        if not logged:
            return request_ids
        pipe = self.redis.pipeline(transaction=False)
        for rid in logged:
            pipe.exists(contract.lease_key(rid))
        leased = {rid for rid, held in zip(logged, pipe.execute(), strict=True) if held}
        return [rid for rid in request_ids if rid not in leased]

    def reclaim_orphans(self) -> int:
        """Take back our own pending entries that the worker does not hold: their XACK was lost
        (Redis crashed within its last fsync second, after our acknowledgement) or they belong to
        a previous life of this engine id. Left alone they would stay pending forever (no peer
        reclaims a live consumer's entries) and stop the stream's trim. They go through the
        reclaim path: errored (emitted, cancelled, expired) or restarted, and acknowledged."""
        return sum(self._reclaim_orphans(stream) for stream in self.all_streams())

    def _reclaim_orphans(self, stream: str) -> int:
        try:
            pending = self.redis.xpending_range(
                stream, contract.CONSUMER_GROUP, min="-", max="+", count=1000,
                consumername=self.consumer, idle=self.settings.orphan_idle_ms,
            )
        except redis.ResponseError:
            return 0
        with self._held_lock:
            orphans = [p for p in pending if EntryRef(stream, p["message_id"]) not in self._held]
        if not orphans:
            return 0
        ids = [p["message_id"] for p in orphans]
        deliveries = {p["message_id"]: int(p["times_delivered"]) for p in orphans}
        messages = self.redis.xclaim(
            stream, contract.CONSUMER_GROUP, self.consumer, self.settings.orphan_idle_ms, ids
        )
        entries = []
        for entry_id, fields in messages:
            with self._held_lock:
                if EntryRef(stream, entry_id) in self._held:  # delivered meanwhile: ours after all
                    continue
            entry = parse_entry(EntryRef(stream, entry_id), fields)
            entry.shard = self._shard_of.get(stream, 0)
            entry.reclaimed = True
            entry.deliveries = deliveries.get(entry_id, 1)
            entries.append(entry)
        claimed = {e for e, _ in messages}
        gone = [i for i in ids if i not in claimed]  # deleted entries: nothing to run, just forget them
        if gone:
            self.redis.xack(stream, contract.CONSUMER_GROUP, *gone)
        if entries:
            log.warning("took back %d orphaned pending entries of our own (lost acknowledgements?)", len(entries))
            self.stats["orphans"] += len(entries)
            self._deliver(entries)
        return len(entries) + len(gone)

    def tidy(self) -> None:
        """Trim the streams' acknowledged entries, remove the tenants' lanes that stayed empty and
        idle, and forget dead engines' registry entries."""
        for stream in self.all_streams():
            _, removed = trim_stream(self.redis, stream)
            self.stats["trimmed"] += removed
        self.remove_idle_lanes()
        self.stats["pruned_engines"] += self.prune_registry()

    def remove_idle_lanes(self, now_ms: int | None = None) -> int:
        """Remove each tenant's lane that holds nothing and took no entry for
        ``contract.LANE_IDLE_S`` (``contract.LANE_REMOVE_SCRIPT``: the stream and its name in the
        lanes set, in one step); returns how many went."""
        if not self.lanes:
            return 0
        if self._lane_remove is None:
            self._lane_remove = self.redis.register_script(contract.LANE_REMOVE_SCRIPT)
        now_ms = self._redis_ms() if now_ms is None else now_ms
        removed = 0
        for shard, names in list(self.lanes.items()):
            for name in names:
                removed += int(self._lane_remove(
                    keys=[contract.lane_stream(self.model, shard, name), contract.lanes_key(self.model, shard)],
                    args=[name, now_ms, contract.LANE_IDLE_S * 1000]) or 0)
        if removed:
            log.info("removed %d idle tenant lanes", removed)
            self.refresh_lanes()
        return removed

    def prune_registry(self) -> int:
        """Remove registry entries (``sluice:engines``) of engines whose liveness key is gone and
        whose last heartbeat is older than the TTL: a kill -9'd engine never deregisters itself.
        A live engine removed by a race puts itself back with its next heartbeat."""
        entries = self.redis.hgetall(contract.ENGINES_KEY)
        others = [(_str(k), v) for k, v in entries.items() if _str(k) != self.consumer]
        if not others:
            return 0
        pipe = self.redis.pipeline(transaction=False)
        for engine_id, _ in others:
            pipe.exists(contract.engine_key(engine_id))
        alive = pipe.execute()
        now = time.time()
        dead = []
        for (engine_id, raw), ok in zip(others, alive, strict=True):
            if ok:
                continue
            entry = registry.decode(raw)
            beat = entry.heartbeat if entry is not None else 0.0
            if now - beat > self.settings.heartbeat_ttl_s:
                dead.append(engine_id)
        if dead:
            self.redis.hdel(contract.ENGINES_KEY, *dead)
            log.info("removed registry entries of gone engines: %s", ", ".join(dead))
        return len(dead)

    def prune_consumers(self) -> None:
        """Forget consumers (dead engines) that own nothing and whose liveness key is gone, so the
        group does not grow with every engine restart. A live one removed by a race is recreated
        by its next XREADGROUP."""
        for stream in self.all_streams():
            self._prune_consumers(stream)

    def _prune_consumers(self, stream: str) -> None:
        try:
            consumers = self.redis.xinfo_consumers(stream, contract.CONSUMER_GROUP)
        except redis.ResponseError:
            return
        ttl_ms = self.settings.heartbeat_ttl_s * 1000
        for c in consumers:
            name = c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
            if name == self.consumer or c.get("pending", 0) or c.get("idle", 0) < 2 * ttl_ms:
                continue
            if not self.redis.exists(contract.engine_key(name)):
                self.redis.xgroup_delconsumer(stream, contract.CONSUMER_GROUP, name)
                log.info("removed consumer %s of a gone engine", name)

    def reclaim(self, include_self: bool = False) -> int:
        """XCLAIM the pending entries of consumers whose liveness key is gone (and, once at start,
        our own: a restarted engine with a fixed id owns entries of its previous life), shard by
        shard: whoever finds a dead consumer's entries first takes them (XCLAIM's min-idle keeps
        two reclaimers from both winning one), whichever shards they are on."""
        streams = self.all_streams()
        pipe = self.redis.pipeline(transaction=False)
        for stream in streams:
            pipe.xpending(stream, contract.CONSUMER_GROUP)
        summaries = []
        for stream, summary in zip(streams, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(summary, redis.ResponseError):
                if "NOGROUP" in str(summary) or "no such key" in str(summary).lower():
                    continue
                raise summary
            if isinstance(summary, Exception):
                raise summary
            names = [_str(c["name"]) for c in summary.get("consumers") or []]
            if names:
                summaries.append((stream, names))
        others = sorted({c for _, names in summaries for c in names if c != self.consumer})
        alive: dict[str, bool] = {}
        if others:
            pipe = self.redis.pipeline(transaction=False)
            for c in others:
                pipe.exists(contract.engine_key(c))
            alive = dict(zip(others, pipe.execute(), strict=True))
        claimed = 0
        for stream, names in summaries:
            dead = [c for c in names if c != self.consumer and not alive.get(c, True)]
            if include_self and self.consumer in names:
                dead.append(self.consumer)
            for consumer in dead:
                claimed += self._claim(stream, consumer)
        return claimed

    def _claim(self, stream: str, consumer: str) -> int:
        pending = self.redis.xpending_range(
            stream, contract.CONSUMER_GROUP, min="-", max="+", count=1000, consumername=consumer
        )
        ids = [p["message_id"] for p in pending]
        if not ids:
            return 0
        deliveries = {p["message_id"]: int(p["times_delivered"]) for p in pending}
        min_idle = 0 if consumer == self.consumer else self.settings.reclaim_min_idle_ms
        messages = self.redis.xclaim(stream, contract.CONSUMER_GROUP, self.consumer, min_idle, ids)
        entries = []
        for entry_id, fields in messages:
            entry = parse_entry(EntryRef(stream, entry_id), fields)
            entry.reclaimed = True
            entry.deliveries = deliveries.get(entry_id, 1) + 1
            entry.shard = self._shard_of.get(stream, 0)
            entries.append(entry)
        if entries:
            log.warning("reclaimed %d pending entries of dead engine %s on %s", len(entries), consumer, stream)
            self.stats["reclaimed"] += len(entries)
            self.metrics.reclaimed(len(entries))
            self._deliver(entries)
        return len(entries)
