"""The gateway's side of the Redis contract (``sluice.wire.contract``).

One :class:`Broker` per worker process holds

- a command connection pool (model cards, registry, XADD, PUBLISH);
- ONE pub/sub connection for every request this process serves: a reader task demultiplexes the
  messages of ``sluice:out:{request_id}`` channels into per-request asyncio queues. A connection per
  request would cost a TCP connection and a Redis client per in-flight request;
- caches of model cards (refreshed when their fingerprint changes) and of engine liveness.

``subscribe()`` returns only once Redis has confirmed the SUBSCRIBE, so the XADD that follows can
never race the engine's first PUBLISH (pub/sub keeps nothing for late subscribers).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from sluice.wire import contract
from sluice.wire.messages_pb2 import Cancel, GenerateRequest

log = logging.getLogger("sluice.gateway.broker")


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def load_tokenizer(tokenizer_json: str, tokenizer_config: str):
    """Build the shared tokenizer from the card's strings (``sluice.text.tokenizer``)."""
    from sluice.text.tokenizer import Tokenizer

    return Tokenizer.from_strings(tokenizer_json, tokenizer_config)


@dataclass
class ModelCard:
    name: str
    max_model_len: int
    eos_token_ids: list[int]
    vocab_size: int | None
    tokenizer: Any
    fingerprint: tuple
    created: int = field(default_factory=lambda: int(time.time()))


class Broker:
    def __init__(self, redis_url: str, *, card_ttl_s: float = 2.0, tokenizer_loader=load_tokenizer) -> None:
        self.redis_url = redis_url
        self.card_ttl_s = card_ttl_s
        self._load_tokenizer = tokenizer_loader
        self.redis: aioredis.Redis = aioredis.Redis.from_url(redis_url)
        self._pubsub = None
        self._reader: asyncio.Task | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._confirm: dict[str, asyncio.Future] = {}
        self._cards: dict[str, tuple[float, ModelCard]] = {}
        self._card_locks: dict[str, asyncio.Lock] = {}
        self._live: tuple[float, dict[str, int]] | None = None
        self._background: set[asyncio.Task] = set()
        self._home = f"{contract.PREFIX}:gateway:{uuid.uuid4().hex}"  # keeps the pub/sub connection subscribed
        self._sub_lock = asyncio.Lock()
        self.ready = asyncio.Event()

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self, wait_s: float = 5.0) -> None:
        """Open the shared pub/sub connection; Redis may still be down (requests then get 503)."""
        self.ready = asyncio.Event()
        self._pubsub = self.redis.pubsub()
        self._reader = asyncio.create_task(self._read_loop(), name="sluice-pubsub-reader")
        try:
            await asyncio.wait_for(self.ready.wait(), wait_s)
        except TimeoutError:
            log.warning("Redis at %s is not answering yet; will keep trying", self.redis_url)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        for task in list(self._background):
            try:
                await asyncio.wait_for(task, 1.0)
            except (TimeoutError, asyncio.CancelledError, Exception):  # noqa: BLE001
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
                msg = await self._pubsub.get_message(ignore_subscribe_messages=False, timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a lost connection: redis-py resubscribes on reconnect
                log.warning("pub/sub read failed (%s); retrying", exc)
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
                if channel == self._home:
                    self.ready.set()
                fut = self._confirm.pop(channel, None)
                if fut is not None and not fut.done():
                    fut.set_result(True)

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

    async def enqueue(self, req: GenerateRequest) -> None:
        await self.redis.xadd(contract.request_stream(req.model), {contract.REQUEST_FIELD: req.SerializeToString()})

    async def cancel(self, request_ids: list[str]) -> None:
        """Publish a Cancel and leave a marker for requests still in the queue (idempotent)."""
        if not request_ids:
            return
        pipe = self.redis.pipeline(transaction=False)
        for rid in request_ids:
            pipe.set(contract.cancelled_key(rid), b"1", ex=contract.CANCEL_MARKER_TTL_S)
        pipe.publish(contract.CANCEL_CHANNEL, Cancel(request_ids=request_ids).SerializeToString())
        await pipe.execute()

    def cancel_nowait(self, request_ids: list[str]) -> None:
        """Cancel from a context that must not await (a cancelled task's cleanup)."""
        if request_ids:
            self._spawn(self._cancel_quietly(list(request_ids)))

    async def _cancel_quietly(self, request_ids: list[str]) -> None:
        try:
            await self.cancel(request_ids)
        except Exception as exc:  # noqa: BLE001
            log.warning("cancel of %s failed: %s", request_ids, exc)

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

    async def card(self, model: str) -> ModelCard | None:
        """The model's card, from the cache unless older than ``card_ttl_s`` and changed in Redis."""
        now = time.monotonic()
        cached = self._cards.get(model)
        if cached is not None and now - cached[0] < self.card_ttl_s:
            return cached[1]
        lock = self._card_locks.setdefault(model, asyncio.Lock())
        async with lock:
            cached = self._cards.get(model)
            if cached is not None and time.monotonic() - cached[0] < self.card_ttl_s:
                return cached[1]
            key = contract.model_card_key(model)
            pipe = self.redis.pipeline(transaction=False)
            pipe.hmget(
                key,
                [contract.CARD_MAX_MODEL_LEN, contract.CARD_EOS_TOKEN_IDS, contract.CARD_VOCAB_SIZE,
                 contract.CARD_CONTRACT_VERSION],
            )
            pipe.hstrlen(key, contract.CARD_TOKENIZER_JSON)
            pipe.hstrlen(key, contract.CARD_TOKENIZER_CONFIG)
            small, tok_len, cfg_len = await pipe.execute()
            if small[0] is None:
                self._cards.pop(model, None)
                return None
            fingerprint = (*(_s(x) if x is not None else None for x in small), tok_len, cfg_len)
            if cached is not None and cached[1].fingerprint == fingerprint:
                self._cards[model] = (time.monotonic(), cached[1])
                return cached[1]
            tok_json, tok_cfg = await self.redis.hmget(
                key, [contract.CARD_TOKENIZER_JSON, contract.CARD_TOKENIZER_CONFIG]
            )
            tokenizer = await asyncio.to_thread(
                self._load_tokenizer, _s(tok_json or b""), _s(tok_cfg or b"{}")
            )
            card = ModelCard(
                name=model,
                max_model_len=int(_s(small[0])),
                eos_token_ids=[int(x) for x in json.loads(_s(small[1]))] if small[1] else [],
                vocab_size=int(_s(small[2])) if small[2] else None,
                tokenizer=tokenizer,
                fingerprint=fingerprint,
            )
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
