"""The gateway's side of the Redis contract (``sluice.wire.contract``).

One :class:`Broker` per worker process holds

- a command client (model cards, registry, XADD, cancels) from ``sluice.wire.connection``: one
  Redis server or a Redis Cluster, the same code;
- ONE sharded subscription for every request this process serves: its requests carry
  ``reply_to = gateway_id``, engines SPUBLISH each step's events for them as one ``EventFrame`` on
  ``contract.events_channel(gateway_id)``, and a reader task demultiplexes the events into
  per-request asyncio queues by request id. Nothing is subscribed or unsubscribed per request
  (no round trip before the XADD), and on a cluster each gateway's events stay on the node that
  owns its channel's slot;
- caches of model cards (refreshed when their fingerprint changes) and of engine liveness;
- the requests it has enqueued and still waits for (``_tracked``).

``start()`` returns once Redis has confirmed the SSUBSCRIBE, so no request can be enqueued before
its answers can be heard (pub/sub keeps nothing for late subscribers).

Surviving Redis restarts (issue 12):

- Every connection heals (``sluice.wire.connection``: retry with backoff, health checks), so no
  command fails once Redis is back. A pub/sub read that fails makes the broker drop its pub/sub
  connection, refresh a cluster's slot map (the channel's slot may now belong to a promoted
  replica) and subscribe again.
- What was published while the subscription was away is gone. Every SSUBSCRIBE confirmation after
  the first one is a resubscription, and the broker then AUDITS the requests in flight at that
  confirmation (one enqueued after it can have missed nothing): one whose queue entry an engine
  had already taken may have lost events, and one whose entry is gone (Redis restarted without
  persistence) will never be answered; both are ended with a retryable 503 (``Retry-After``) at
  once. A request still waiting, untouched, in the queue keeps waiting.
- The request goes to one shard of the model's queue, chosen from its prompt's first blocks
  (``sluice.wire.shards.choose_shard``, with the shard count, block size and prefix blocks of the
  model card), so requests that share a prefix meet on the engine that owns the shard; and in that
  shard to its tenant's lane (``contract.lane_stream``: the shard's stream for the default tenant),
  which the enqueue script creates when it is new. The queue depth and the audit count every lane.
- The XADD goes with an in-flight marker (``contract.inflight_key``) in one script. Every
  ``ENTRY_CHECK_S`` the broker checks the markers of the requests it waits for: a marker gone while
  the gateway still waits means Redis lost the entry (restart without persistence, FLUSHALL, an
  eviction), and the client learns it within seconds instead of at its deadline.
- While Redis stays unreachable for ``REDIS_DOWN_FAIL_S`` after the pub/sub connection failed, the
  requests in flight are ended with a retryable 503 rather than left waiting.
- Cancels that fail while Redis is away are retried until they land (or the request's deadline).

Gateway liveness: every request carries this process's ``gateway_id``, and the broker keeps
``contract.gateway_key(gateway_id)`` alive (every ``contract.GATEWAY_HEARTBEAT_INTERVAL_S``,
from the housekeeper; an engine waits ``GATEWAY_LOST_AFTER_S`` of missing key before it gives up,
so a request enqueued before the first beat is safe). When the process dies, its clients' connections go with
it and nobody will ever cancel their requests; the engines see the key stay gone and abort them.

The event log (``sluice.wire.event_log``, issue 22): a logged request's record is written before its
XADD; any gateway reads the record and the log (``read_log``: LRANGE from an index; a follower polls
it, resumes being rare) and holds the request's lease while it follows it for a client, so that the
engines' lost-gateway rule spares the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from gateway import unserved
from gateway.metrics import METRICS
from sluice.wire import card as wire_card
from sluice.wire import codec, contract, event_log, registry, shards, tenants
from sluice.wire.card import ModelCard
from sluice.wire.connection import (
    TRANSIENT_ERRORS,
    check_topology_async,
    connect,
    read_shard_message_async,
    redact,
    refresh_topology,
    shard_subscribers_async,
)
from sluice.wire.error_codes import Code
from sluice.wire.event_log import StreamRecord
from sluice.wire.messages_pb2 import Event, GenerateRequest

log = logging.getLogger("sluice.gateway.broker")

# How often the in-flight markers of waiting requests are checked.
ENTRY_CHECK_S = 2.0
# How often the models nobody serves any more are looked for, and removed (gateway/unserved.py).
UNSERVED_CHECK_S = 10.0
# The housekeeper's tick: deleting markers of finished requests, retrying cancels, the watchdog.
HOUSEKEEP_S = 0.5
# The pub/sub connection has failed and Redis has not come back for this long: end every request
# in flight with a retryable 503 (their events, if any come, would arrive with gaps).
REDIS_DOWN_FAIL_S = 3.0


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@dataclass
class LoadedCard:
    """A model card read from Redis (``sluice.wire.card.ModelCard``, decoded there) with its
    tokenizer built once, cached by the card's fingerprint."""

    card: ModelCard
    tokenizer: Any
    fingerprint: str
    created: int = field(default_factory=lambda: int(time.time()))
    header_tokens: int = 0  # tokens every chat prompt starts with (the template's header): no shard key

    def shard_of(self, prompt_token_ids: Sequence[int], request_id: str) -> int:
        """The queue shard of a request (``sluice.wire.shards``, with this card's settings)."""
        c = self.card
        return shards.choose_shard(prompt_token_ids, shards=c.queue_shards, block_size=c.block_size,
                                   prefix_blocks=c.shard_prefix_blocks, request_id=request_id,
                                   header_tokens=self.header_tokens)

    @property
    def name(self) -> str:
        return self.card.name

    @property
    def max_model_len(self) -> int:
        return self.card.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.card.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        return self.card.eos_token_ids

    @property
    def max_chars_per_token(self) -> int | None:
        """The tokenizer's proven characters-per-token bound (``sluice.text.chars_per_token``)."""
        return self.tokenizer.max_chars_per_token


@dataclass
class Lost:
    """Put on a request's queue instead of an event: the request cannot complete (retryable 503)."""

    code: Code  # REQUEST_LOST | REDIS_UNAVAILABLE
    message: str


@dataclass
class _Tracked:
    """A request this gateway enqueued and still waits for."""

    request_id: str
    model: str
    queue: asyncio.Queue
    deadline: float  # unix seconds
    shard: int = 0  # the queue shard it went to
    tenant: str = ""  # whose lane of the shard (the default tenant's: the shard's stream)
    entry_id: bytes | None = None  # known once the XADD returned
    audit_pending: bool = False  # a reconnect happened before the entry id was known
    lost: bool = False  # a Lost was sent


class _KeyedLocks:
    """One asyncio.Lock per key, held only while someone holds or waits for it.

    A plain ``dict.setdefault(key, Lock())`` keeps one lock per key ever seen: with model names
    chosen by clients (every unknown name a 404) that grows without bound (issue 12, item 6).
    """

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def __len__(self) -> int:
        return len(self._locks)

    @asynccontextmanager
    async def hold(self, key: str):
        lock, users = self._locks.get(key, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users <= 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


def template_header_tokens(tokenizer: Any) -> int:
    """Tokens every chat prompt of this tokenizer's template starts with: the common prefix of two
    unrelated one-message conversations (0 without a chat template)."""
    try:
        a = tokenizer.apply_chat_template([{"role": "user", "content": "Zebra quartz 17"}], tokenize=True)
        b = tokenizer.apply_chat_template([{"role": "user", "content": "Mellow river 42"}], tokenize=True)
    except Exception:  # noqa: BLE001 - no template, or one that needs more: no header to skip
        return 0
    return shards.common_prefix_len(a, b)


def _entry_id(raw: Any) -> tuple[int, int]:
    ms, _, seq = _s(raw).partition("-")
    return int(ms), int(seq or 0)


class Broker:
    def __init__(self, redis_url: str, *, card_ttl_s: float = 2.0,
                 retry_after_s: int = 1) -> None:
        self.redis_url = redis_url
        self.card_ttl_s = card_ttl_s
        self.retry_after_s = retry_after_s
        self.redis: aioredis.Redis = connect(redis_url, asyncio=True)
        self._enqueue_script = self.redis.register_script(contract.ENQUEUE_SCRIPT)
        self._cancel_script = self.redis.register_script(contract.CANCEL_SCRIPT)
        self._pubsub = None
        self._reader: asyncio.Task | None = None
        self._housekeeper: asyncio.Task | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._cards: dict[str, tuple[float, LoadedCard]] = {}
        self._card_locks = _KeyedLocks()
        self._live: tuple[float, dict[str, int]] | None = None
        self._background: set[asyncio.Task] = set()
        # Names this process in every request it enqueues; its liveness key tells engines it lives.
        self.gateway_id = uuid.uuid4().hex
        self._gateway_key = contract.gateway_key(self.gateway_id)
        self._channel = contract.events_channel(self.gateway_id)  # every event of our requests
        self._confirmations = 0  # SSUBSCRIBE confirmations of our channel: each after the first is a resubscribe
        self._lost_subscription = False  # set by the housekeeper's check: the read loop subscribes anew
        # Bumped each time the read loop (re)sends its SSUBSCRIBE; ``_confirmed``: the latest was
        # confirmed. The housekeeper's check trusts a count of 0 only if neither changed meanwhile.
        self._sub_epoch = 0
        self._confirmed = False
        self.ready = asyncio.Event()
        self._tracked: dict[str, _Tracked] = {}
        self._forget: list[tuple[str, int, str]] = []  # (model, shard, request id): in-flight markers to delete
        self._pending_cancels: dict[str, tuple[float, str]] = {}  # request id -> (give up at (unix s), reply_to)
        self._down_since: float | None = None  # monotonic time the pub/sub connection was found failing
        self.stats = {"reconnects": 0, "audits": 0, "lost": 0}

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self, wait_s: float = 5.0) -> None:
        """Check the URL's topology and subscribe to this gateway's channel; Redis may still be
        down (requests then get 503). A URL of the wrong topology raises ``RedisURLError``."""
        try:
            await asyncio.wait_for(check_topology_async(self.redis, self.redis_url), wait_s)
            # The liveness key before the first request, not at the housekeeper's first tick: an
            # engine holding a request of a gateway without a key counts it as missing from then.
            await asyncio.wait_for(self.heartbeat(), wait_s)
        except (TimeoutError, *TRANSIENT_ERRORS):
            log.warning("Redis at %s does not answer yet; will keep trying", redact(self.redis_url))
        self.ready = asyncio.Event()
        self._pubsub = self.redis.pubsub()
        self._reader = asyncio.create_task(self._read_loop(), name="sluice-pubsub-reader")
        self._housekeeper = asyncio.create_task(self._housekeeping(), name="sluice-broker-housekeeper")
        try:
            await asyncio.wait_for(self.ready.wait(), wait_s)
        except TimeoutError:
            log.warning("Redis at %s is not answering yet; will keep trying", redact(self.redis_url))

    async def close(self) -> None:
        for task in (self._reader, self._housekeeper):
            if task is not None:
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):  # noqa: BLE001
                    pass
        for task in list(self._background):
            try:
                await asyncio.wait_for(task, 1.0)
            except (TimeoutError, asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        try:
            await asyncio.wait_for(self._flush_forget(), 1.0)
        except (TimeoutError, RedisError, OSError):
            pass
        try:
            # Nothing will read what is still running for us: let the engines stop it.
            await asyncio.wait_for(self.redis.unlink(self._gateway_key), 1.0)
        except (TimeoutError, RedisError, OSError):
            pass
        if self._pubsub is not None:
            try:
                await self._pubsub.aclose()
            except Exception:  # noqa: BLE001
                pass
        await self.redis.aclose()

    async def _read_loop(self) -> None:
        subscribed = False
        while True:
            if self._lost_subscription:
                # The housekeeper found nobody subscribed to our channel (a failover the client
                # library did not follow: no error on our side, no message either).
                self._lost_subscription = False
                subscribed = False
                await self._reopen_pubsub()
            try:
                if not subscribed:
                    self._sub_epoch += 1
                    self._confirmed = False
                    await self._pubsub.ssubscribe(self._channel)
                    subscribed = True
                msg = await read_shard_message_async(self._pubsub, 1.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis away beyond the retries: keep trying
                if self._down_since is None:
                    self._down_since = time.monotonic()
                    log.warning("pub/sub connection lost (%s); reconnecting", exc)
                subscribed = False
                # This reopen answers a lost subscription the housekeeper may have flagged at the
                # same time (Redis restarted: nobody subscribed, and our read failed): a second one
                # would open a second window in which published events are missed.
                self._lost_subscription = False
                await self._reopen_pubsub()
                await asyncio.sleep(0.2)
                continue
            if msg is None:
                continue
            kind = _s(msg.get("type"))
            if kind == "smessage":
                self._dispatch(msg["data"])
            elif kind == "ssubscribe" and _s(msg.get("channel")) == self._channel:
                self._confirmations += 1
                self._confirmed = True
                self._down_since = None
                if self._confirmations > 1:
                    self._resubscribed()
                self.ready.set()

    def _resubscribed(self) -> asyncio.Task:
        """A resubscription (after a reconnect or a failover) is confirmed: from here on nothing
        published is missed, so audit the requests tracked NOW. One enqueued later cannot have
        missed anything, and auditing it would end it wrongly as soon as an engine took it."""
        self.stats["reconnects"] += 1
        METRICS.redis_reconnects.inc()
        in_flight = list(self._tracked.values())
        log.warning("subscription re-established; auditing %d in-flight requests", len(in_flight))
        return self._spawn(self._audit(in_flight))

    def _dispatch(self, data: bytes) -> None:
        """One frame: each part whose request this process waits for is decoded and queued (the
        others, requests given up on, are not even decoded)."""
        try:
            frame = codec.decode_frame(data)
            for part in frame.requests:
                q = self._queues.get(part.request_id)
                if q is not None:
                    for event in codec.decode_part(part):
                        q.put_nowait(event)
        except Exception as exc:  # noqa: BLE001 - a foreign or corrupt message must not kill the reader
            log.warning("ignoring an undecodable event frame (%d bytes): %s", len(data), exc)

    async def _reopen_pubsub(self) -> None:
        """A fresh pub/sub connection, after the slot map of a cluster is refreshed (a failed
        master's slots now belong to a promoted replica); its SSUBSCRIBE goes to the current owner."""
        old, self._pubsub = self._pubsub, self.redis.pubsub()
        try:
            await asyncio.wait_for(old.aclose(), 1.0)
        except Exception:  # noqa: BLE001 - the old connection is broken anyway
            pass
        try:
            await asyncio.wait_for(refresh_topology(self.redis), 2.0)
        except Exception as exc:  # noqa: BLE001 - no node answers yet; the next round tries again
            log.debug("topology refresh failed: %s", exc)

    # --- per-request queues --------------------------------------------------------------------

    def register(self, request_ids: list[str], queue: asyncio.Queue) -> None:
        """Route the events of ``request_ids`` to ``queue`` (no Redis round trip: the channel is
        this gateway's, subscribed once at start)."""
        for rid in request_ids:
            self._queues[rid] = queue

    def unregister(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._queues.pop(rid, None)

    def spawn(self, coro) -> None:
        """Run ``coro`` as a task the broker keeps (and awaits a moment at close)."""
        self._spawn(coro)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # --- requests and cancels ----------------------------------------------------------------

    async def enqueue(self, req: GenerateRequest, record: StreamRecord | None = None) -> bytes:
        """XADD the request with its in-flight marker (one MULTI); track it until ``release``.

        The request is stamped with this gateway's id: engines abort it if this process dies (its
        liveness key, kept by the housekeeper, stays gone).

        Call after ``register`` of its id (whose queue receives a :class:`Lost` if the request
        cannot complete). A logged request's ``record`` is written first (its ``reply_to`` set
        here). Returns the stream entry id.
        """
        if not self.ready.is_set():  # the answer could not be heard yet
            await asyncio.wait_for(self.ready.wait(), REDIS_DOWN_FAIL_S)
        rid = req.request_id
        req.gateway_id = req.reply_to = self.gateway_id
        card = await self.card(req.model)  # cached: the caller has just read it
        shard = card.shard_of(req.prompt_token_ids, rid) if card is not None else 0
        if record is not None:  # before the XADD: whoever reads the log finds its record
            record.reply_to = self.gateway_id
            await self.redis.set(contract.record_key(record.id), record.encode(),
                                 ex=event_log.ttl_until_end(req.deadline, req.log_ttl_s))
        queue = self._queues.get(rid)
        tracked = None
        if queue is not None:
            tracked = _Tracked(rid, req.model, queue, req.deadline, shard, req.tenant)
            self._tracked[rid] = tracked
        ttl = (max(req.deadline - time.time(), 0.0) if req.deadline else 3600.0) + contract.INFLIGHT_MARGIN_S
        entry_id = await self._enqueue_script(  # marker + (new lane) + XADD, atomic: all in the shard's slot
            keys=[contract.lane_stream(req.model, shard, req.tenant), contract.inflight_key(req.model, shard, rid),
                  contract.lanes_key(req.model, shard)],
            args=[req.SerializeToString(), max(1, int(ttl)), contract.REQUEST_FIELD, req.tenant,
                  contract.CONSUMER_GROUP])
        if tracked is not None and self._tracked.get(rid) is tracked:
            tracked.entry_id = entry_id
            if tracked.audit_pending:
                tracked.audit_pending = False
                self._spawn(self._audit([tracked]))
        return entry_id

    def release(self, request_ids: list[str]) -> None:
        """This gateway is done waiting for these requests: stop tracking, drop their markers."""
        for rid in request_ids:
            tracked = self._tracked.pop(rid, None)
            if tracked is not None:
                self._forget.append((tracked.model, tracked.shard, rid))

    def settled(self, request_id: str) -> None:
        """The engine ended this request (terminal events received): nothing more can be lost."""
        self.release([request_id])

    def _lose(self, t: _Tracked, code: Code, message: str) -> None:
        if t.lost or self._tracked.get(t.request_id) is not t:
            return
        t.lost = True
        self.stats["lost"] += 1
        METRICS.requests_lost.labels(code=code.value).inc()
        log.warning("request %s: %s", t.request_id, message)
        t.queue.put_nowait(Lost(code, message))

    async def cancel(self, request_ids: list[str], reply_to: str | None = None) -> None:
        """Leave a marker for requests still in the queue and send a Cancel to the engine that holds
        each of the others (``codec.cancel_async``; idempotent).
        ``reply_to``: whose requests (another gateway's, for a resumed or background request)."""
        if not request_ids:
            return
        await codec.cancel_async(self.redis, reply_to or self.gateway_id, request_ids, self._cancel_script)

    def cancel_nowait(self, request_ids: list[str], give_up_at: float | None = None,
                      reply_to: str | None = None) -> None:
        """Cancel from a context that must not await (a cancelled task's cleanup). A cancel that
        fails (Redis away) is retried by the housekeeper until it lands or ``give_up_at``."""
        if request_ids:
            until = give_up_at if give_up_at else time.time() + contract.CANCEL_MARKER_TTL_S
            self._spawn(self._cancel_quietly(list(request_ids), until, reply_to or self.gateway_id))

    async def _cancel_quietly(self, request_ids: list[str], until: float, reply_to: str | None = None) -> None:
        reply_to = reply_to or self.gateway_id
        try:
            await self.cancel(request_ids, reply_to)
        except Exception as exc:  # noqa: BLE001
            log.warning("cancel of %s failed (%s); will retry", request_ids, exc)
            for rid in request_ids:
                self._pending_cancels[rid] = (until, reply_to)

    # --- the event log: records, logs, leases (sluice.wire.event_log) ----------------------------

    async def load_record(self, record_id: str) -> StreamRecord | None:
        """A logged request's record; None when unknown or expired (or unreadable)."""
        raw = await self.redis.get(contract.record_key(record_id))
        if raw is None:
            return None
        try:
            return StreamRecord.decode(raw)
        except ValueError as exc:
            log.warning("record %s: %s", record_id, exc)
            return None

    async def read_log(self, request_id: str, start: int = 0, count: int = 512) -> list[list[Event]]:
        """Up to ``count`` elements of the log from index ``start``, each as its events."""
        raw = await self.redis.lrange(contract.log_key(request_id), start, start + count - 1)
        return [event_log.decode_entry(element, request_id) for element in raw]

    async def take_lease(self, request_ids: list[str], token: str) -> None:
        """Hold (or refresh) the leases of requests this gateway follows for a client."""
        pipe = self.redis.pipeline(transaction=False)
        for rid in request_ids:
            pipe.set(contract.lease_key(rid), token.encode(), px=int(contract.LEASE_TTL_S * 1000))
        await pipe.execute()

    async def drop_lease(self, request_ids: list[str]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for rid in request_ids:
            pipe.delete(contract.lease_key(rid))
        await pipe.execute()

    async def leased(self, request_ids: list[str]) -> bool:
        """Whether a gateway holds the lease of any of these requests (a client resumed it)."""
        pipe = self.redis.pipeline(transaction=False)
        for rid in request_ids:
            pipe.exists(contract.lease_key(rid))
        return any(await pipe.execute())

    # --- housekeeping: markers, the watchdog, cancels, the audit -------------------------------

    async def _housekeeping(self) -> None:
        next_check = time.monotonic() + ENTRY_CHECK_S
        next_unserved = time.monotonic() + UNSERVED_CHECK_S
        next_beat = 0.0
        while True:
            await asyncio.sleep(HOUSEKEEP_S)
            now = time.monotonic()
            check = now >= next_check
            if check:
                next_check = now + ENTRY_CHECK_S
            if now >= next_beat:
                try:
                    await self.heartbeat()
                    next_beat = now + contract.GATEWAY_HEARTBEAT_INTERVAL_S
                except (RedisError, OSError) as exc:  # again at the next tick
                    log.debug("heartbeat: Redis unavailable (%s)", exc)
            try:
                await self._housekeep_once(check)
                if now >= next_unserved and self._down_since is None:
                    next_unserved = now + UNSERVED_CHECK_S
                    await self.forget_unserved()
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                log.debug("housekeeping: Redis unavailable (%s)", exc)
            except Exception:  # noqa: BLE001 - the housekeeper must not die
                log.exception("housekeeping failed")

    async def forget_unserved(self) -> list[str]:
        """Remove the keys of the models nobody has served for their grace period
        (``gateway.unserved``); returns the models removed."""
        gone = []
        for model in await unserved.unserved_models(self.redis):
            if await unserved.forget_model(self.redis, model):
                self._cards.pop(model, None)
                gone.append(model)
        return gone

    async def withdraw(self, request_ids: list[str]) -> bool:
        """For requests whose model has no live engine: True when no engine holds any of them (no
        owner marker: still queued, or handed back), and then their queue entries are deleted, so
        that nothing is left behind for an engine that comes later; False (nothing deleted) when
        some engine took one (it died with it)."""
        tracked = [t for rid in request_ids if (t := self._tracked.get(rid)) is not None]
        pipe = self.redis.pipeline(transaction=False)
        for rid in request_ids:
            pipe.exists(contract.owner_key(self.gateway_id, rid))
        if any(await pipe.execute()):
            return False
        pipe = self.redis.pipeline(transaction=False)
        for t in tracked:
            if t.entry_id is not None:
                pipe.xdel(contract.lane_stream(t.model, t.shard, t.tenant), t.entry_id)
        if len(pipe):
            await pipe.execute()
        return True

    async def heartbeat(self) -> None:
        """Refresh this gateway's liveness key (engines abort the requests of a gateway without one)."""
        await self.redis.set(self._gateway_key, b"1", px=int(contract.GATEWAY_HEARTBEAT_TTL_S * 1000))

    async def _housekeep_once(self, check: bool) -> None:
        if self._down_since is not None and time.monotonic() - self._down_since >= REDIS_DOWN_FAIL_S:
            for t in list(self._tracked.values()):
                self._lose(t, Code.REDIS_UNAVAILABLE,
                           "The connection to the queue (Redis) was lost while the request was in flight; "
                           "retry it.")
        await self._flush_forget()
        if self._pending_cancels:
            now = time.time()
            by_reply: dict[str, list[str]] = {}
            for rid, (until, reply_to) in self._pending_cancels.items():
                if until > now:
                    by_reply.setdefault(reply_to, []).append(rid)
            self._pending_cancels.clear()
            for reply_to, ids in by_reply.items():
                await self._cancel_quietly(ids, now + contract.CANCEL_MARKER_TTL_S, reply_to)
        if check and self._down_since is None:
            await self._check_subscription()
            await self._check_markers([t for t in self._tracked.values() if t.entry_id is not None])

    async def _check_subscription(self) -> None:
        """Ask Redis whether anyone is subscribed to this gateway's channel. After a cluster
        failover redis-py's cluster pub/sub may drop the subscription without raising (its own
        migration of the channel to the promoted node can fail and is not retried), and the
        requests would then wait for their deadline; a count of 0 makes the read loop subscribe
        again, and that resubscription runs the audit like any other."""
        if not self.ready.is_set() or self._lost_subscription or not self._confirmed:
            return  # a (re)subscription is under way: its own confirmation settles it
        epoch = self._sub_epoch
        count = await shard_subscribers_async(self.redis, self._channel)
        if count == 0 and self._confirmed and self._sub_epoch == epoch:
            log.warning("nobody is subscribed to %s any more; subscribing again", self._channel)
            self._lost_subscription = True

    async def _flush_forget(self) -> None:
        if not self._forget:
            return
        batch, self._forget = self._forget, []
        try:
            # single-key commands, pipelined: a cluster pipeline routes each to its slot's node
            pipe = self.redis.pipeline(transaction=False)
            for model, shard, rid in batch:
                pipe.delete(contract.inflight_key(model, shard, rid))
            await pipe.execute()
        except BaseException:
            self._forget.extend(batch)
            raise

    async def _check_markers(self, tracked: list[_Tracked]) -> list[_Tracked]:
        """End the requests whose in-flight marker is gone; return those that still have one."""
        if not tracked:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for t in tracked:  # single-key GETs: a cluster pipeline routes each to its slot's node
            pipe.get(contract.inflight_key(t.model, t.shard, t.request_id))
        values = await pipe.execute()
        alive = []
        for t, v in zip(tracked, values, strict=True):
            if v is None:
                self._lose(t, Code.REQUEST_LOST,
                           "The request's queue entry was lost (Redis restarted without its data); retry it.")
            else:
                alive.append(t)
        return alive

    async def _audit(self, in_flight: list[_Tracked]) -> None:
        """After a pub/sub reconnect: of ``in_flight`` (tracked when the resubscription was
        confirmed), end the requests that may have lost events or whose entry is gone; keep those
        still waiting, untouched, in the queue (nothing was published for them)."""
        self.stats["audits"] += 1
        METRICS.inflight_audits.inc()
        give_up = time.monotonic() + REDIS_DOWN_FAIL_S
        while True:
            targets = list(in_flight)
            for t in targets:
                if t.entry_id is None:
                    t.audit_pending = True  # audited when its XADD returns
            targets = [t for t in targets if t.entry_id is not None and self._tracked.get(t.request_id) is t]
            try:
                delivered = await self._last_delivered({(t.model, t.shard, t.tenant) for t in targets})
                alive = await self._check_markers(targets)
            except (RedisError, OSError) as exc:
                if time.monotonic() < give_up:
                    await asyncio.sleep(HOUSEKEEP_S)
                    continue
                for t in targets:
                    self._lose(t, Code.REDIS_UNAVAILABLE, f"The queue (Redis) is unavailable: {type(exc).__name__}")
                return
            for t in alive:
                last = delivered.get((t.model, t.shard, t.tenant))
                if last is not None and _entry_id(t.entry_id) <= last:
                    self._lose(t, Code.REQUEST_LOST,
                               "The connection to the queue (Redis) was lost while an engine ran the request, "
                               "so part of its output may be missing; retry it.")
            return

    async def _last_delivered(self, lanes: set[tuple[str, int, str]]) -> dict[tuple[str, int, str], tuple[int, int]]:
        """Per (model, shard, tenant) lane, the id of the last entry the engines' group has read
        (absent: none read, or the lane is gone)."""
        out: dict[tuple[str, int, str], tuple[int, int]] = {}
        for model, shard, tenant in lanes:
            try:
                groups = await self.redis.xinfo_groups(contract.lane_stream(model, shard, tenant))
            except ResponseError:  # the stream is gone
                continue
            for g in groups:
                if _s(g.get("name", b"")) == contract.CONSUMER_GROUP:
                    out[(model, shard, tenant)] = _entry_id(g.get("last-delivered-id", b"0-0"))
        return out

    def tracked_ids(self) -> Iterator[str]:
        return iter(self._tracked)

    # --- registry ------------------------------------------------------------------------------

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except (RedisError, OSError):
            return False

    async def live_engines(self, *, fresh: bool = False) -> dict[str, int]:
        """Model name -> number of engines whose heartbeat key still exists."""
        now = time.monotonic()
        if not fresh and self._live is not None and now - self._live[0] < min(self.card_ttl_s, 1.0):
            return self._live[1]
        raw = await self.redis.hgetall(contract.ENGINES_KEY)
        ids = [_s(k) for k in raw]
        alive: list[int] = []
        if ids:
            pipe = self.redis.pipeline(transaction=False)
            for eid in ids:
                pipe.exists(contract.engine_key(eid))
            alive = await pipe.execute()
        counts: dict[str, int] = {}
        for value, ok in zip(raw.values(), alive, strict=True):
            entry = registry.decode(value)
            if ok and entry is not None:
                counts[entry.model] = counts.get(entry.model, 0) + 1
        self._live = (now, counts)
        return counts

    async def model_names(self) -> list[str]:
        return sorted(_s(m) for m in await self.redis.smembers(contract.MODELS_KEY))

    async def queue_depth(self, model: str) -> int:
        """Requests not yet delivered to any engine, over the shards of the model's card and their
        tenants' lanes: each lane's group lag, else its stream's length (one pipelined round trip
        for the shards' streams and lanes sets, one more for the lanes when there are any, one for
        lengths)."""
        card = self._cards.get(model)
        count = card[1].card.queue_shards if card is not None else 1
        streams = contract.request_streams(model, count)
        pipe = self.redis.pipeline(transaction=False)
        for stream in streams:
            pipe.xinfo_groups(stream)
        for shard in range(count):
            pipe.smembers(contract.lanes_key(model, shard))
        replies = await pipe.execute(raise_on_error=False)
        infos = list(replies[:count])
        lanes = [contract.lane_stream(model, shard, _s(t)) for shard, members in enumerate(replies[count:])
                 if not isinstance(members, Exception) for t in members
                 if _s(t) and tenants.check_tenant_id(_s(t)) is None]
        if lanes:
            pipe = self.redis.pipeline(transaction=False)
            for stream in lanes:
                pipe.xinfo_groups(stream)
            streams += lanes
            infos += await pipe.execute(raise_on_error=False)
        depth = 0
        unknown = []
        for stream, groups in zip(streams, infos, strict=True):
            if isinstance(groups, ResponseError):  # no stream yet
                continue
            if isinstance(groups, Exception):
                raise groups
            lag = next((g.get("lag") for g in groups if _s(g.get("name", b"")) == contract.CONSUMER_GROUP), None)
            if lag is not None:
                depth += int(lag)
            else:
                unknown.append(stream)
        if unknown:
            pipe = self.redis.pipeline(transaction=False)
            for stream in unknown:
                pipe.xlen(stream)
            depth += sum(int(n) for n in await pipe.execute())
        return depth

    async def card(self, model: str) -> LoadedCard | None:
        """The model's card, from the cache unless older than ``card_ttl_s`` and changed in Redis."""
        now = time.monotonic()
        cached = self._cards.get(model)
        if cached is not None and now - cached[0] < self.card_ttl_s:
            return cached[1]
        async with self._card_locks.hold(model):
            cached = self._cards.get(model)
            if cached is not None and time.monotonic() - cached[0] < self.card_ttl_s:
                return cached[1]
            key = contract.model_card_key(model)
            fingerprint, version = await self.redis.hmget(key, [wire_card.F_FINGERPRINT, wire_card.F_CONTRACT_VERSION])
            if fingerprint is None and version is None:
                self._cards.pop(model, None)
                return None
            wire_card.check_version(version, model)  # ContractMismatch: a clear 503, never a misread
            if cached is not None and cached[1].fingerprint == _s(fingerprint):
                self._cards[model] = (time.monotonic(), cached[1])
                return cached[1]
            decoded = ModelCard.decode(await self.redis.hgetall(key))
            tokenizer = await asyncio.to_thread(decoded.tokenizer)
            header = await asyncio.to_thread(template_header_tokens, tokenizer)
            card = LoadedCard(card=decoded, tokenizer=tokenizer, fingerprint=_s(fingerprint), header_tokens=header)
            self._cards[model] = (time.monotonic(), card)
            return card
