"""Redis I/O beside the step loop: four small threads, queues in between.

- reader: XREADGROUP on the model's stream, only as many entries as the worker granted (credit);
  checks the cancel marker (and, for reclaimed entries, the emitted marker) in the same round trip;
  delivers to the worker's inbox.
- canceller: SSUBSCRIBE to the cancel channel; delivers Cancel ids to the inbox.
- publisher: takes the worker's per-step ``Batch`` from the outbox and sends it in ONE pipelined
  round trip (emitted markers, then one SPUBLISH per reply_to carrying all its events of the step,
  the event-log appends of logged requests, then the XACKs), retrying while Redis is away. Hand-backs go with their XACKs in one MULTI (both
  in the queue's slot), so a hand-back can never leave the entry twice in the queue.

Redis may be one server or a Redis Cluster (``sluice.wire.connection``): every multi-key step above
stays inside one hash slot family of ``sluice.wire.contract``; the publisher's pipeline spans
families but is not a transaction (redis-py sends each node its part, in order, so an emitted
marker still lands before the event it guards: both are in the reply_to's slot).
- housekeeper: heartbeat (liveness key + registry hash), model card (again after each reconnect),
  reclaim of pending entries whose consumer's liveness key is gone, removal of dead engines'
  registry entries, and the stream's trim (acknowledged entries only, see ``trim_stream``).

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import ExponentialBackoff

from engine_service.service.metrics import NULL_METRICS, NullMetrics
from sluice.wire import codec, contract, event_log, policy, registry
from sluice.wire.connection import TRANSIENT_ERRORS, connect, read_shard_message, refresh_topology
from sluice.wire.messages_pb2 import Cancel, Event, GenerateRequest

log = logging.getLogger("sluice.engine.io")

_REDIS_ERRORS = TRANSIENT_ERRORS


@dataclass
class Entry:
    """One stream entry handed to the worker."""

    entry_id: bytes
    request: GenerateRequest | None  # None: unparseable (see ``problem``)
    problem: str | None = None
    cancelled: bool = False  # the queued-request cancel marker was set
    emitted: bool = False  # a previous attempt already emitted tokens (reclaimed entries only)
    reclaimed: bool = False
    deliveries: int = 1
    gateway_lost: bool = False  # the gateway that waits for it is gone (``RedisIO.check_gateways``)


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
    acks: list[bytes] = field(default_factory=list)
    # request id -> reply_to for events of entries the worker never held (answered by the I/O thread)
    reply_to: dict[str, str] = field(default_factory=dict)
    logs: dict[str, LogSpec] = field(default_factory=dict)  # the same, for their event-log flags

    def __bool__(self) -> bool:
        return bool(self.events or self.emitted or self.requeue or self.acks)

    def extend(self, other: Batch) -> None:
        self.events += other.events
        self.emitted += other.emitted
        self.requeue += other.requeue
        self.acks += other.acks
        self.reply_to.update(other.reply_to)
        self.logs.update(other.logs)


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


def parse_entry(entry_id: bytes, fields: dict | None) -> Entry:
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
        inbox: queue.Queue,
        card: dict[str, str],
        load: Callable[[], dict[str, Any]],
    ) -> None:
        self.settings = settings
        self.model = model
        self.stream = contract.request_stream(model)
        self.consumer = settings.engine_id
        self.inbox = inbox
        self.card = card
        self.load = load  # the worker's latest load snapshot, for the heartbeat
        self.redis = connect(settings.redis_url, socket_timeout=max(5.0, settings.read_block_ms / 1000 + 2.0))
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
        self._headroom = 0
        self._consumed = 0
        self._delivered = 0
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
            "trimmed": 0, "pruned_engines": 0, "orphans": 0, "gateways_lost": 0,
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
                pipe.hdel(contract.ENGINES_KEY, self.consumer)
                pipe.execute()
            except _REDIS_ERRORS + (redis.RedisError,) as exc:
                log.warning("could not deregister: %s", exc)
        end = time.monotonic() + 1.0  # daemon threads: wait a little, never long
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))
        self.redis.close()

    def stop_reading(self) -> None:
        with self._credit_lock:
            self.reading = False
            self._credit_lock.notify_all()

    # --- credit (called by the worker) ---
    def report_headroom(self, headroom: int, consumed: int) -> None:
        with self._credit_lock:
            self._headroom, self._consumed = headroom, consumed
            if self._credit() > 0:
                self._credit_lock.notify_all()

    def _credit(self) -> int:
        if not self.reading:
            return 0
        return self._headroom - (self._delivered - self._consumed)

    def send(self, batch: Batch) -> None:
        if batch:
            self.outbox.put(batch)

    # --- reader ---
    def _ensure_group(self) -> None:
        try:
            self.redis.xgroup_create(self.stream, contract.CONSUMER_GROUP, id="0", mkstream=True)
            log.info("created consumer group %s on %s", contract.CONSUMER_GROUP, self.stream)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def _reader_loop(self) -> None:
        backoff = self._backoff("reader")
        need_group = True
        while not self._stop.is_set():
            if not self.own_reclaimed.is_set():
                self.own_reclaimed.wait(0.1)
                continue
            with self._credit_lock:
                credit = self._credit()
                if credit <= 0:
                    self._credit_lock.wait(0.1)
                    continue
            try:
                if need_group:
                    self._ensure_group()
                    need_group = False
                reply = self.redis.xreadgroup(
                    contract.CONSUMER_GROUP,
                    self.consumer,
                    {self.stream: ">"},
                    count=min(credit, self.settings.max_read_batch),
                    block=self.settings.read_block_ms,
                )
                backoff.ok()
                self.connected.set()
            except _REDIS_ERRORS as exc:
                log.warning("reader: Redis unavailable (%s); retrying", exc)
                need_group = True
                backoff.fail(self._stop)
                continue
            except redis.ResponseError as exc:
                if "NOGROUP" in str(exc):  # Redis lost the stream (restart without persistence)
                    need_group = True
                    continue
                log.error("XREADGROUP failed: %s", exc)
                backoff.fail(self._stop)
                continue
            entries = [parse_entry(eid, fields) for _, messages in (reply or []) for eid, fields in messages]
            if entries:
                self._deliver(entries)

    def _deliver(self, entries: list[Entry]) -> None:
        """Check markers in one round trip, then hand the entries to the worker."""
        known = [e for e in entries if e.request is not None]
        if known:
            try:
                pipe = self.redis.pipeline(transaction=False)
                for e in known:
                    pipe.exists(contract.cancelled_key(e.request.reply_to, e.request.request_id))
                    pipe.exists(contract.emitted_key(e.request.reply_to, e.request.request_id))
                flags = pipe.execute()
                for i, e in enumerate(known):
                    e.cancelled = bool(flags[2 * i])
                    e.emitted = bool(flags[2 * i + 1]) and (e.reclaimed or e.request.attempt > 0)
            except _REDIS_ERRORS + (redis.RedisError,) as exc:
                # The entries are ours now (pending); the pub/sub cancel still reaches us.
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
        with self._credit_lock:
            self._delivered += len(entries)
        for e in entries:
            self.inbox.put(e)

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
                pubsub.ssubscribe(contract.CANCEL_CHANNEL)
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
        by_reply: dict[str, list[Event]] = {}
        by_log: dict[str, list[Event]] = {}
        with self._held_lock:
            for event in batch.events:
                reply_to = batch.reply_to.get(event.request_id) or self._reply_to.get(event.request_id)
                if reply_to is None:  # cannot happen for a delivered entry; never guess a channel
                    log.error("publish: no reply_to known for request %s; event dropped", event.request_id)
                    continue
                by_reply.setdefault(reply_to, []).append(event)
                if (spec := batch.logs.get(event.request_id) or self._logs.get(event.request_id)) and spec.logged:
                    by_log.setdefault(event.request_id, []).append(event)
            replies = {rid: self._reply_to.get(rid) for rid in batch.emitted}
            ended = {self._held[a][0] for a in batch.acks if a in self._held} if not batch.requeue else set()
            ended |= set(batch.logs)
            log_specs = {rid: batch.logs.get(rid) or self._logs.get(rid) for rid in by_log.keys() | ended}
            first_writes = {rid for rid in by_log if rid not in self._log_started}
        pipe = self.redis.pipeline(transaction=False)
        for rid, reply_to in replies.items():
            if reply_to:
                pipe.set(contract.emitted_key(reply_to, rid), self.consumer, ex=contract.EMITTED_TTL_S)
        for reply_to, events in by_reply.items():
            pipe.spublish(contract.events_channel(reply_to), codec.encode_events(events))
        self._append_logs(pipe, by_log, log_specs, first_writes, ended)
        if batch.acks and not batch.requeue:
            pipe.xack(self.stream, contract.CONSUMER_GROUP, *batch.acks)
        results = pipe.execute(raise_on_error=False) if len(pipe) else []
        if batch.requeue:
            multi = self.redis.pipeline(transaction=True)
            for request in batch.requeue:
                multi.xadd(self.stream, codec.encode_request(request))
            if batch.acks:
                multi.xack(self.stream, contract.CONSUMER_GROUP, *batch.acks)
            results += multi.execute(raise_on_error=False)
        return results

    def _append_logs(self, pipe: Any, by_log: dict[str, list[Event]], specs: dict[str, LogSpec | None],
                     first_writes: set[str], ended: set[str]) -> None:
        """The event-log part of a step's pipeline (``sluice.wire.event_log``): one RPUSH per logged
        request with events in this step; an EXPIRE to (deadline + window) with its first write, and
        to the window alone for log and record when the request ends here. No extra round trip."""
        for rid, events in by_log.items():
            pipe.rpush(contract.log_key(rid), event_log.encode_entry(events))
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
        pipe.execute()

    def heartbeat(self) -> None:
        # The card first: if Redis lost its data (a restart without persistence; the healing client
        # may have hidden the outage from us), the card is back before the liveness key says
        # "this engine serves", so a gateway that sees the engine also finds its card.
        if not self.redis.exists(contract.model_card_key(self.model)):
            self.publish_card()
        entry = registry.EngineEntry.from_load(self.consumer, self.model, time.time(), self.load())
        pipe = self.redis.pipeline(transaction=True)  # both in the registry's slot
        pipe.set(contract.engine_key(self.consumer), json.dumps({"model": self.model}), px=int(self.settings.heartbeat_ttl_s * 1000))
        pipe.hset(contract.ENGINES_KEY, self.consumer, entry.encode())
        pipe.execute()

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
        try:
            pending = self.redis.xpending_range(
                self.stream, contract.CONSUMER_GROUP, min="-", max="+", count=1000,
                consumername=self.consumer, idle=self.settings.orphan_idle_ms,
            )
        except redis.ResponseError:
            return 0
        with self._held_lock:
            orphans = [p for p in pending if p["message_id"] not in self._held]
        if not orphans:
            return 0
        ids = [p["message_id"] for p in orphans]
        deliveries = {p["message_id"]: int(p["times_delivered"]) for p in orphans}
        messages = self.redis.xclaim(
            self.stream, contract.CONSUMER_GROUP, self.consumer, self.settings.orphan_idle_ms, ids
        )
        entries = []
        for entry_id, fields in messages:
            with self._held_lock:
                if entry_id in self._held:  # delivered meanwhile: ours after all
                    continue
            entry = parse_entry(entry_id, fields)
            entry.reclaimed = True
            entry.deliveries = deliveries.get(entry_id, 1)
            entries.append(entry)
        claimed = {e for e, _ in messages}
        gone = [i for i in ids if i not in claimed]  # deleted entries: nothing to run, just forget them
        if gone:
            self.redis.xack(self.stream, contract.CONSUMER_GROUP, *gone)
        if entries:
            log.warning("took back %d orphaned pending entries of our own (lost acknowledgements?)", len(entries))
            self.stats["orphans"] += len(entries)
            self._deliver(entries)
        return len(entries) + len(gone)

    def tidy(self) -> None:
        """Trim the stream's acknowledged entries and forget dead engines' registry entries."""
        _, removed = trim_stream(self.redis, self.stream)
        self.stats["trimmed"] += removed
        self.stats["pruned_engines"] += self.prune_registry()

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
        try:
            consumers = self.redis.xinfo_consumers(self.stream, contract.CONSUMER_GROUP)
        except redis.ResponseError:
            return
        ttl_ms = self.settings.heartbeat_ttl_s * 1000
        for c in consumers:
            name = c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
            if name == self.consumer or c.get("pending", 0) or c.get("idle", 0) < 2 * ttl_ms:
                continue
            if not self.redis.exists(contract.engine_key(name)):
                self.redis.xgroup_delconsumer(self.stream, contract.CONSUMER_GROUP, name)
                log.info("removed consumer %s of a gone engine", name)

    def reclaim(self, include_self: bool = False) -> int:
        """XCLAIM the pending entries of consumers whose liveness key is gone (and, once at start,
        our own: a restarted engine with a fixed id owns entries of its previous life)."""
        try:
            summary = self.redis.xpending(self.stream, contract.CONSUMER_GROUP)
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc) or "no such key" in str(exc).lower():
                return 0
            raise
        consumers = [c["name"].decode() if isinstance(c["name"], bytes) else c["name"] for c in summary.get("consumers") or []]
        others = [c for c in consumers if c != self.consumer]
        pipe = self.redis.pipeline(transaction=False)
        for c in others:
            pipe.exists(contract.engine_key(c))
        alive = dict(zip(others, pipe.execute(), strict=True)) if others else {}
        dead = [c for c in others if not alive[c]]
        if include_self and self.consumer in consumers:
            dead.append(self.consumer)
        claimed = 0
        for consumer in dead:
            pending = self.redis.xpending_range(
                self.stream, contract.CONSUMER_GROUP, min="-", max="+", count=1000, consumername=consumer
            )
            ids = [p["message_id"] for p in pending]
            if not ids:
                continue
            deliveries = {p["message_id"]: int(p["times_delivered"]) for p in pending}
            min_idle = 0 if consumer == self.consumer else self.settings.reclaim_min_idle_ms
            messages = self.redis.xclaim(self.stream, contract.CONSUMER_GROUP, self.consumer, min_idle, ids)
            entries = []
            for entry_id, fields in messages:
                entry = parse_entry(entry_id, fields)
                entry.reclaimed = True
                entry.deliveries = deliveries.get(entry_id, 1) + 1
                entries.append(entry)
            if entries:
                log.warning("reclaimed %d pending entries of dead engine %s", len(entries), consumer)
                self.stats["reclaimed"] += len(entries)
                self.metrics.reclaimed(len(entries))
                claimed += len(entries)
                self._deliver(entries)
        return claimed
