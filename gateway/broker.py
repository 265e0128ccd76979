"""The gateway's side of the Redis contract (``sluice.wire.contract``).

One :class:`Broker` per worker process holds

- a command connection pool (model cards, registry, XADD, PUBLISH);
- ONE pub/sub connection for every request this process serves: a reader task demultiplexes the
  messages of ``sluice:out:{request_id}`` channels into per-request asyncio queues. A connection per
  request would cost a TCP connection and a Redis client per in-flight request;
- caches of model cards (refreshed when their fingerprint changes) and of engine liveness;
- the requests it has enqueued and still waits for (``_tracked``).

``subscribe()`` returns only once Redis has confirmed the SUBSCRIBE, so the XADD that follows can
never race the engine's first PUBLISH (pub/sub keeps nothing for late subscribers).

Surviving Redis restarts (issue 12):

- Every connection heals (``sluice.wire.connection``: retry with backoff, health checks), so no
  command fails once Redis is back; the pub/sub connection reconnects and resubscribes.
- What was published while the pub/sub connection was away is gone. After a reconnect the broker
  AUDITS its in-flight requests: one whose queue entry an engine had already taken may have lost
  events, and one whose entry is gone (Redis restarted without persistence) will never be
  answered; both are ended with a retryable 503 (``Retry-After``) at once. A request still waiting,
  untouched, in the queue keeps waiting.
- The XADD goes with an in-flight marker (``contract.inflight_key``) in one MULTI. Every
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
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from gateway.metrics import METRICS
from sluice.wire import card as wire_card
from sluice.wire import codec, contract
from sluice.wire.card import ModelCard
from sluice.wire.connection import async_redis
from sluice.wire.error_codes import Code
from sluice.wire.messages_pb2 import GenerateRequest

log = logging.getLogger("sluice.gateway.broker")

# How often the in-flight markers of waiting requests are checked.
ENTRY_CHECK_S = 2.0
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


def _entry_id(raw: Any) -> tuple[int, int]:
    ms, _, seq = _s(raw).partition("-")
    return int(ms), int(seq or 0)


class Broker:
    def __init__(self, redis_url: str, *, card_ttl_s: float = 2.0,
                 retry_after_s: int = 1) -> None:
        self.redis_url = redis_url
        self.card_ttl_s = card_ttl_s
        self.retry_after_s = retry_after_s
        self.redis: aioredis.Redis = async_redis(redis_url)
        self._pubsub = None
        self._reader: asyncio.Task | None = None
        self._housekeeper: asyncio.Task | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._confirm: dict[str, asyncio.Future] = {}
        self._cards: dict[str, tuple[float, LoadedCard]] = {}
        self._card_locks = _KeyedLocks()
        self._live: tuple[float, dict[str, int]] | None = None
        self._background: set[asyncio.Task] = set()
        # Names this process in every request it enqueues; its liveness key tells engines it lives.
        self.gateway_id = uuid.uuid4().hex
        self._gateway_key = contract.gateway_key(self.gateway_id)
        self._home = f"{contract.PREFIX}:home:{self.gateway_id}"  # keeps the pub/sub connection subscribed
        self._sub_lock = asyncio.Lock()
        self.ready = asyncio.Event()
        self._tracked: dict[str, _Tracked] = {}
        self._forget: list[str] = []  # in-flight markers to delete (requests this gateway is done with)
        self._pending_cancels: dict[str, float] = {}  # request id -> give up at (unix seconds)
        self._hooked: Any = None  # the pub/sub connection our connect callback is registered on
        self._resubscribing = False  # reconnected; the audit runs once Redis confirms the resubscribe
        self._down_since: float | None = None  # monotonic time the pub/sub connection was found failing
        self.stats = {"reconnects": 0, "audits": 0, "lost": 0}

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self, wait_s: float = 5.0) -> None:
        """Open the shared pub/sub connection; Redis may still be down (requests then get 503)."""
        self.ready = asyncio.Event()
        self._pubsub = self.redis.pubsub()
        self._reader = asyncio.create_task(self._read_loop(), name="sluice-pubsub-reader")
        self._housekeeper = asyncio.create_task(self._housekeeping(), name="sluice-broker-housekeeper")
        try:
            await asyncio.wait_for(self.ready.wait(), wait_s)
        except TimeoutError:
            log.warning("Redis at %s is not answering yet; will keep trying", self.redis_url)

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
        assert self._pubsub is not None
        while True:
            try:
                if not self._pubsub.subscribed:
                    await self._pubsub.subscribe(self._home)
                self._hook_connection()
                msg = await self._pubsub.get_message(ignore_subscribe_messages=False, timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis away beyond the retries: keep trying
                if self._down_since is None:
                    self._down_since = time.monotonic()
                    log.warning("pub/sub connection lost (%s); reconnecting", exc)
                await asyncio.sleep(0.2)
                continue
            if msg is None:
                continue
            kind = _s(msg.get("type"))
            channel = _s(msg.get("channel"))
            if kind == "message":
                q = self._queues.get(channel)
                if q is not None:
                    q.put_nowait(msg["data"])
            elif kind == "subscribe":
                if self._resubscribing:
                    # The resubscribe (one SUBSCRIBE of every channel, sent on connect) is done:
                    # from here on nothing published is missed, so the audit can tell what was.
                    self._resubscribing = False
                    self._down_since = None
                    self._spawn(self._audit())
                if channel == self._home:
                    self.ready.set()
                fut = self._confirm.pop(channel, None)
                if fut is not None and not fut.done():
                    fut.set_result(True)

    def _hook_connection(self) -> None:
        conn = getattr(self._pubsub, "connection", None)
        if conn is not None and conn is not self._hooked:
            conn.register_connect_callback(self._on_pubsub_connect)
            self._hooked = conn

    def _on_pubsub_connect(self, _conn) -> None:
        """Called by redis-py after it reconnected the pub/sub connection (and re-sent SUBSCRIBE)."""
        self.stats["reconnects"] += 1
        METRICS.redis_reconnects.inc()
        self._resubscribing = True
        log.warning("pub/sub connection re-established; auditing %d in-flight requests", len(self._tracked))

    # --- per-request channels ----------------------------------------------------------------

    async def subscribe(self, channels: list[str], queue: asyncio.Queue, timeout: float = 10.0) -> None:
        """Route every message of ``channels`` to ``queue``; return once Redis confirmed them."""
        assert self._pubsub is not None, "Broker.start() was not awaited"
        if not self.ready.is_set():
            await asyncio.wait_for(self.ready.wait(), timeout)
        loop = asyncio.get_running_loop()
        futs = []
        for ch in channels:
            self._queues[ch] = queue
            fut = loop.create_future()
            self._confirm[ch] = fut
            futs.append(fut)
        async with self._sub_lock:
            await self._pubsub.subscribe(*channels)
        await asyncio.wait_for(asyncio.gather(*futs), timeout)

    def unsubscribe(self, channels: list[str]) -> None:
        for ch in channels:
            self._queues.pop(ch, None)
            self._confirm.pop(ch, None)
        self._spawn(self._unsubscribe(channels))

    async def _unsubscribe(self, channels: list[str]) -> None:
        try:
            async with self._sub_lock:
                await self._pubsub.unsubscribe(*channels)
        except Exception as exc:  # noqa: BLE001
            log.debug("unsubscribe failed: %s", exc)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- requests and cancels ----------------------------------------------------------------

    async def enqueue(self, req: GenerateRequest) -> bytes:
        """XADD the request with its in-flight marker (one MULTI); track it until ``release``.

        The request is stamped with this gateway's id: engines abort it if this process dies (its
        liveness key, kept by the housekeeper, stays gone).

        Call after ``subscribe`` of its output channel (whose queue receives a :class:`Lost` if
        the request cannot complete). Returns the stream entry id.
        """
        rid = req.request_id
        req.gateway_id = self.gateway_id
        queue = self._queues.get(contract.output_channel(rid))
        tracked = None
        if queue is not None:
            tracked = _Tracked(rid, req.model, queue, req.deadline)
            self._tracked[rid] = tracked
        ttl = (max(req.deadline - time.time(), 0.0) if req.deadline else 3600.0) + contract.INFLIGHT_MARGIN_S
        pipe = self.redis.pipeline(transaction=True)
        pipe.xadd(contract.request_stream(req.model), {contract.REQUEST_FIELD: req.SerializeToString()})
        pipe.set(contract.inflight_key(rid), b"1", ex=max(1, int(ttl)))
        entry_id, _ = await pipe.execute()
        if tracked is not None and self._tracked.get(rid) is tracked:
            tracked.entry_id = entry_id
            if tracked.audit_pending:
                tracked.audit_pending = False
                self._spawn(self._audit([tracked]))
        return entry_id

    def release(self, request_ids: list[str]) -> None:
        """This gateway is done waiting for these requests: stop tracking, drop their markers."""
        for rid in request_ids:
            if self._tracked.pop(rid, None) is not None:
                self._forget.append(rid)

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

    async def cancel(self, request_ids: list[str]) -> None:
        """Publish a Cancel and leave a marker for requests still in the queue (idempotent)."""
        if not request_ids:
            return
        await codec.cancel(self.redis.pipeline(transaction=False), request_ids).execute()

    def cancel_nowait(self, request_ids: list[str], give_up_at: float | None = None) -> None:
        """Cancel from a context that must not await (a cancelled task's cleanup). A cancel that
        fails (Redis away) is retried by the housekeeper until it lands or ``give_up_at``."""
        if request_ids:
            until = give_up_at if give_up_at else time.time() + contract.CANCEL_MARKER_TTL_S
            self._spawn(self._cancel_quietly(list(request_ids), until))

    async def _cancel_quietly(self, request_ids: list[str], until: float) -> None:
        try:
            await self.cancel(request_ids)
        except Exception as exc:  # noqa: BLE001
            log.warning("cancel of %s failed (%s); will retry", request_ids, exc)
            for rid in request_ids:
                self._pending_cancels[rid] = until

    # --- housekeeping: markers, the watchdog, cancels, the audit -------------------------------

    async def _housekeeping(self) -> None:
        next_check = time.monotonic() + ENTRY_CHECK_S
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
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                log.debug("housekeeping: Redis unavailable (%s)", exc)
            except Exception:  # noqa: BLE001 - the housekeeper must not die
                log.exception("housekeeping failed")

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
            ids = [rid for rid, until in self._pending_cancels.items() if until > now]
            self._pending_cancels.clear()
            if ids:
                await self._cancel_quietly(ids, now + contract.CANCEL_MARKER_TTL_S)
        if check and self._down_since is None:
            await self._check_markers([t for t in self._tracked.values() if t.entry_id is not None])

    async def _flush_forget(self) -> None:
        if not self._forget:
            return
        batch, self._forget = self._forget, []
        try:
            await self.redis.unlink(*(contract.inflight_key(rid) for rid in batch))
        except BaseException:
            self._forget.extend(batch)
            raise

    async def _check_markers(self, tracked: list[_Tracked]) -> list[_Tracked]:
        """End the requests whose in-flight marker is gone; return those that still have one."""
        if not tracked:
            return []
        values = await self.redis.mget([contract.inflight_key(t.request_id) for t in tracked])
        alive = []
        for t, v in zip(tracked, values, strict=True):
            if v is None:
                self._lose(t, Code.REQUEST_LOST,
                           "The request's queue entry was lost (Redis restarted without its data); retry it.")
            else:
                alive.append(t)
        return alive

    async def _audit(self, only: list[_Tracked] | None = None) -> None:
        """After a pub/sub reconnect: end the requests that may have lost events or whose entry is
        gone; keep those still waiting, untouched, in the queue (nothing was published for them)."""
        self.stats["audits"] += 1
        METRICS.inflight_audits.inc()
        give_up = time.monotonic() + REDIS_DOWN_FAIL_S
        while True:
            targets = list(only) if only is not None else list(self._tracked.values())
            for t in targets:
                if t.entry_id is None:
                    t.audit_pending = True  # audited when its XADD returns
            targets = [t for t in targets if t.entry_id is not None and self._tracked.get(t.request_id) is t]
            try:
                delivered = await self._last_delivered({t.model for t in targets})
                alive = await self._check_markers(targets)
            except (RedisError, OSError) as exc:
                if time.monotonic() < give_up:
                    await asyncio.sleep(HOUSEKEEP_S)
                    continue
                for t in targets:
                    self._lose(t, Code.REDIS_UNAVAILABLE, f"The queue (Redis) is unavailable: {type(exc).__name__}")
                return
            for t in alive:
                last = delivered.get(t.model)
                if last is not None and _entry_id(t.entry_id) <= last:
                    self._lose(t, Code.REQUEST_LOST,
                               "The connection to the queue (Redis) was lost while an engine ran the request, "
                               "so part of its output may be missing; retry it.")
            return

    async def _last_delivered(self, models: set[str]) -> dict[str, tuple[int, int]]:
        """Per model, the id of the last entry the engines' group has read (absent: none read)."""
        out: dict[str, tuple[int, int]] = {}
        for model in models:
            try:
                groups = await self.redis.xinfo_groups(contract.request_stream(model))
            except ResponseError:  # the stream is gone
                continue
            for g in groups:
                if _s(g.get("name", b"")) == contract.CONSUMER_GROUP:
                    out[model] = _entry_id(g.get("last-delivered-id", b"0-0"))
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
        registry = await self.redis.hgetall(contract.ENGINES_KEY)
        ids = [_s(k) for k in registry]
        alive: list[int] = []
        if ids:
            pipe = self.redis.pipeline(transaction=False)
            for eid in ids:
                pipe.exists(contract.engine_key(eid))
            alive = await pipe.execute()
        counts: dict[str, int] = {}
        for (raw_id, raw), ok in zip(registry.items(), alive, strict=True):
            if not ok:
                continue
            for model in _engine_models(raw):
                counts[model] = counts.get(model, 0) + 1
            del raw_id
        self._live = (now, counts)
        return counts

    async def model_names(self) -> list[str]:
        return sorted(_s(m) for m in await self.redis.smembers(contract.MODELS_KEY))

    async def queue_depth(self, model: str) -> int:
        """Requests not yet delivered to any engine: the group's lag, else the stream's length."""
        stream = contract.request_stream(model)
        try:
            groups = await self.redis.xinfo_groups(stream)
        except ResponseError:  # no stream yet
            return 0
        for g in groups:
            if _s(g.get("name", b"")) == contract.CONSUMER_GROUP:
                lag = g.get("lag")
                if lag is not None:
                    return int(lag)
        return int(await self.redis.xlen(stream))

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
            card = LoadedCard(card=decoded, tokenizer=tokenizer, fingerprint=_s(fingerprint))
            self._cards[model] = (time.monotonic(), card)
            return card


def _engine_models(raw: Any) -> list[str]:
    """The models an engine's registry entry says it serves (JSON with "model" or "models")."""
    try:
        info = json.loads(_s(raw))
    except (ValueError, TypeError):
        return []
    if not isinstance(info, dict):
        return []
    models = info.get("models")
    if isinstance(models, list):
        return [str(m) for m in models]
    model = info.get("model")
    return [str(model)] if model else []
