"""Redis I/O beside the step loop: four small threads, queues in between.

``RedisIO`` (this module) holds what the threads share, starts and stops them, and keeps the credit
the worker grants; each thread's code is a mixin in a module of its own:

- ``queue_reader.QueueReader``: the reader and the canceller (what reaches the worker's inbox);
- ``event_publisher.EventPublisher``: the publisher (``send`` and the outbox);
- ``housekeeping.Housekeeping``: the housekeeper (and ``trim_stream``);
- ``io_types``: the values they pass around (``Entry``, ``Batch``, ``CancelNote``, ``ShardView``...).

Each mixin's class annotations name the attributes of ``RedisIO`` it uses. What the threads do:

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

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import ExponentialBackoff

from engine_service.core.fair_share import EMPTY_VIEW, FairView
from engine_service.service.event_publisher import EventPublisher
from engine_service.service.housekeeping import Housekeeping
from engine_service.service.io_types import Batch, LogSpec, ShardView
from engine_service.service.metrics import NULL_METRICS, NullMetrics
from engine_service.service.queue_reader import QueueReader
from sluice.wire import contract, shards
from sluice.wire.connection import TRANSIENT_ERRORS as _REDIS_ERRORS
from sluice.wire.connection import connect, is_cluster

log = logging.getLogger("sluice.engine.io")

STOP_READING_WAIT_S = 2.0  # how long stop_reading waits for a read in flight (Redis not answering)


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


class RedisIO(QueueReader, EventPublisher, Housekeeping):
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
