"""Fixtures for the gateway tests: a fake engine that follows the Redis contract, and a gateway
served by uvicorn in a thread. (No tests here; the test modules import these fixtures.)

The fake engine publishes the model card (the real SmolLM2 tokenizer files of ``model_dir``),
heartbeats (the model's served key too), reads the request stream with XREADGROUP, takes what it reads
as the engine does (``contract.TAKE_SCRIPT``: a cancelled request is dropped, the owner marker names it,
so cancels come to its own channel) and answers with ``Event``s: each completion
index spells ``REPLY`` (rotated by the index) token by token (with logprobs, and the prompt's with the
first event, when asked), then finishes with "length" at ``max_tokens`` or "stop" at the end of the
reply. It records the requests it read and the cancels
it received. Like the real engine it rides out a Redis restart: its loops retry, and each heartbeat
puts back the card, the models set and the consumer group when Redis lost them.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import threading
import time
from pathlib import Path

import pytest
import redis
import uvicorn

from sluice.wire import codec, contract, event_log
from sluice.wire.card import ModelCard
from sluice.wire.connection import connect, read_shard_message_async
from sluice.wire.messages_pb2 import Cancel, Event, GenerateRequest, PositionLogprobs, TokenLogprob
from sluice.wire.registry import EngineEntry

MODEL = "smollm2-test"
REPLY = "Hello world! 你好, 🙂 emoji and ünïcödé. The end"
MAX_MODEL_LEN = 256


def card_fields(model_dir: Path, max_model_len: int = MAX_MODEL_LEN) -> dict:
    """The card a real engine would publish for ``model_dir`` (sluice.wire.card's encoder)."""
    return ModelCard.from_model_dir(model_dir, name=MODEL, max_model_len=max_model_len, vocab_size=49152,
                                    eos_token_ids=[2]).encode()


@functools.lru_cache(maxsize=2)
def _tokenizer(model_dir: Path):
    from sluice.text.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir)


class FakeEngine:
    def __init__(self, redis_url: str, model_dir: Path, *, token_delay: float = 0.005) -> None:
        self.redis_url = redis_url
        self.model_dir = model_dir
        self.tokenizer = _tokenizer(model_dir)
        self.reply_ids = self.tokenizer.encode(REPLY, add_special_tokens=False)
        self.token_delay = token_delay
        self.engine_id = "fake-0"
        self.model_grace_s = float(contract.DEFAULT_MODEL_GRACE_S)  # the served key's TTL (--model-grace-s)
        self.requests: list[GenerateRequest] = []
        self.stream_of: dict[str, str] = {}  # request id -> the queue shard's stream it came from
        self.cancels: list[str] = []
        self.finished: set[str] = set()
        self.hang = False  # read requests but never answer
        self.paused = False  # do not read the stream
        self.error: tuple[str, str] | None = None  # answer every request with this error
        self.heartbeat = True
        self.max_running: int | None = None  # read only while fewer requests than this are running
        self.cached_tokens = 0  # what the first token event says the prefix cache served
        self.running = 0
        self._loop = asyncio.new_event_loop()
        self._beat_lock = asyncio.Lock()  # a heartbeat and kill() never interleave
        self._read_idle = asyncio.Event()  # set while paused with no XREADGROUP in flight
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._tasks: list = []
        # Why a flag beside cancelling the loops: redis-py can turn the CancelledError of a
        # command in flight into a ConnectionError, which the loops catch and go on after; the
        # flag ends them at their next turn, so stop() does not sit out _close's bound.
        self._stopping = False

    # -- control from the test thread --
    def start(self) -> FakeEngine:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._setup(), self._loop).result(10)
        for coro in (self._heartbeat(), self._read(), self._listen_cancels()):
            self._tasks.append(asyncio.run_coroutine_threadsafe(coro, self._loop))
        return self

    def stop(self) -> None:
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        # _close bounds each of its waits, so this returns; the margin is for a loaded machine.
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def kill(self) -> None:
        """Stop heartbeating and drop the liveness key (the engine is dead). On return the key is
        gone for good: a heartbeat in flight has finished first (it would have set the key again)."""
        self.heartbeat = False
        asyncio.run_coroutine_threadsafe(self._kill(), self._loop).result(10)

    def pause(self) -> None:
        """Stop reading the stream; on return no read is in flight (a blocked XREADGROUP would still
        take what the test queues next)."""
        self.paused = True
        asyncio.run_coroutine_threadsafe(self._read_idle.wait(), self._loop).result(10)

    def wait_cancel(self, request_id_prefix: str, timeout: float = 5.0) -> bool:
        end = time.time() + timeout
        while time.time() < end:
            if any(c.startswith(request_id_prefix) for c in self.cancels):
                return True
            time.sleep(0.02)
        return False

    # -- engine side --
    async def _setup(self) -> None:
        self.r = connect(self.redis_url, asyncio=True)
        self._take = self.r.register_script(contract.TAKE_SCRIPT)
        await self._publish_card()
        await self._beat()

    async def _publish_card(self) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(contract.model_card_key(MODEL), mapping=card_fields(self.model_dir))
        pipe.sadd(contract.MODELS_KEY, MODEL)
        pipe.set(contract.served_key(MODEL), self.engine_id, px=int(self.model_grace_s * 1000))
        await pipe.execute()
        for stream in contract.request_streams(MODEL, contract.DEFAULT_QUEUE_SHARDS):
            try:
                await self.r.xgroup_create(stream, contract.CONSUMER_GROUP, id="0", mkstream=True)
            except redis.ResponseError:
                pass

    async def _close(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        # A task cancelled inside a Redis call may wait on its socket's close (redis-py's disconnect
        # waits up to the connect timeout per connection); a stuck one must not fail the test's
        # teardown, which once took more than 5 s on a loaded CI machine.
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        try:
            await asyncio.wait_for(self.r.aclose(), 10)
        except (TimeoutError, redis.RedisError, OSError):
            pass

    async def _beat(self) -> None:
        await self.r.hset(contract.ENGINES_KEY, self.engine_id,
                          EngineEntry(engine_id=self.engine_id, model=MODEL, heartbeat=time.time()).encode())
        await self.r.set(contract.engine_key(self.engine_id), b"1", ex=int(contract.HEARTBEAT_TTL_S))
        await self.r.set(contract.served_key(MODEL), self.engine_id, px=int(self.model_grace_s * 1000))

    async def _heartbeat(self) -> None:
        while not self._stopping:
            try:
                async with self._beat_lock:
                    if self.heartbeat:
                        if not await self.r.exists(contract.model_card_key(MODEL)):
                            await self._publish_card()  # Redis restarted without its data
                        await self._beat()
            except (redis.RedisError, OSError):
                pass
            await asyncio.sleep(contract.HEARTBEAT_INTERVAL_S)

    async def _kill(self) -> None:
        async with self._beat_lock:
            await self.r.delete(contract.engine_key(self.engine_id))

    async def _listen_cancels(self) -> None:
        ps = self.r.pubsub()
        await ps.ssubscribe(contract.cancel_channel(self.engine_id))  # as the engine: its own requests' cancels
        while not self._stopping:
            try:
                msg = await read_shard_message_async(ps, 1.0)
            except (redis.RedisError, OSError):
                await asyncio.sleep(0.1)
                continue
            if msg and msg["type"] == "smessage":
                self.cancels.extend(Cancel.FromString(msg["data"]).request_ids)

    async def _read(self) -> None:
        # Every shard of the queue (the card's count) and every tenant's lane in it, as a real
        # engine alone serves them: non-blocking reads, a short pause when all are empty.
        shards = range(contract.DEFAULT_QUEUE_SHARDS)
        while not self._stopping:
            streams = [contract.request_stream(MODEL, shard) for shard in shards]
            try:
                for shard in shards:
                    tenants = await self.r.smembers(contract.lanes_key(MODEL, shard))
                    streams += [contract.lane_stream(MODEL, shard, t.decode()) for t in sorted(tenants)]
            except (redis.RedisError, OSError):
                await asyncio.sleep(0.1)
                continue
            free = 16 if self.max_running is None else min(16, self.max_running - self.running)
            if self.paused or free <= 0:
                if self.paused:
                    self._read_idle.set()
                await asyncio.sleep(0.05)
                continue
            self._read_idle.clear()
            got = 0
            try:
                for stream in streams:  # one by one, so that the credit is never exceeded
                    if free <= 0:
                        break
                    resp = await self.r.xreadgroup(contract.CONSUMER_GROUP, self.engine_id, {stream: ">"},
                                                   count=free)
                    for _, entries in resp or []:
                        for entry_id, fields in entries:
                            req = GenerateRequest.FromString(fields[contract.REQUEST_FIELD])
                            self.requests.append(req)
                            self.stream_of[req.request_id] = stream
                            self.running += 1
                            free -= 1
                            got += 1
                            self._loop.create_task(self._serve(stream, entry_id, req))
            except redis.ResponseError:  # NOGROUP: Redis restarted without its data
                await asyncio.sleep(0.1)
                continue
            except (redis.RedisError, OSError):
                await asyncio.sleep(0.1)
                continue
            if not got:
                await asyncio.sleep(0.01)

    def _cancelled(self, rid: str) -> bool:
        return rid in self.cancels

    async def _serve(self, stream: str, entry_id, req: GenerateRequest) -> None:
        channel = contract.events_channel(req.reply_to)
        try:
            # as the engine: take it (cancelled while queued? else the owner marker names this engine)
            rid, reply_to = req.request_id, req.reply_to
            cancelled, _ = await self._take(keys=[contract.cancelled_key(reply_to, rid), contract.emitted_key(reply_to, rid),
                                                  contract.owner_key(reply_to, rid)], args=[self.engine_id, 600])
            if cancelled:
                return
            while self.hang and not self._cancelled(rid) and not self._stopping:  # holds it, says nothing
                await asyncio.sleep(0.02)
            if self.hang:
                return
            if self.error is not None:
                ev = codec.error_event(req.request_id, self.error[0], self.error[1], self.engine_id)
                await self.r.spublish(channel, codec.encode_events([ev], self.engine_id))
                return
            n = req.params.n or 1
            max_tokens = req.params.max_tokens if req.params.HasField("max_tokens") else 64
            want_lp = req.params.HasField("logprobs")
            streams = [self.reply_ids[i:] + self.reply_ids[:i] for i in range(n)]
            for step in range(max_tokens):
                if self._cancelled(req.request_id):
                    if req.log_events:  # as the engine: an abort for each completion, logged too
                        for i in range(n):
                            ev = codec.finished_event(req.request_id, i, "abort", engine_id=self.engine_id)
                            await self.r.spublish(channel, codec.encode_events([ev], self.engine_id))
                            await self.r.rpush(contract.log_key(req.request_id), event_log.encode_entry([ev]))
                    return
                for i in range(n):
                    ids = streams[i]
                    if step > len(ids):
                        continue
                    ev = Event(request_id=req.request_id, index=i, engine_id=self.engine_id)
                    if step < len(ids):
                        ev.token_ids.append(ids[step])
                        if step == 0 and i == 0 and self.cached_tokens:
                            ev.cached_tokens = self.cached_tokens
                        if step == 0 and req.params.HasField("prompt_logprobs"):  # as the engine: with the first
                            for pos, tid in enumerate(req.prompt_token_ids):  # the first position has none
                                entry = ev.prompt_logprobs.add()
                                if pos:
                                    entry.entries.append(TokenLogprob(token_id=tid, logprob=-0.5, rank=2))
                                    for k in range(req.params.prompt_logprobs):
                                        entry.entries.append(TokenLogprob(token_id=200 + k, logprob=-0.1 - k,
                                                                          rank=k + 1))
                        if want_lp:
                            pos = PositionLogprobs()
                            pos.entries.append(TokenLogprob(token_id=ids[step], logprob=-0.25, rank=1))
                            for k in range(req.params.logprobs):
                                pos.entries.append(TokenLogprob(token_id=100 + k, logprob=-1.0 - k, rank=k + 2))
                            ev.logprobs.append(pos)
                    done_len = step + 1 == max_tokens and step < len(ids)
                    if step == len(ids) or done_len:
                        ev.finished.finish_reason = codec.finish_reason("length" if done_len else "stop")
                        if not done_len:
                            ev.finished.stop_token_id = 2
                        ev.finished.usage.prompt_tokens = len(req.prompt_token_ids)
                        ev.finished.usage.completion_tokens = min(step + 1, len(ids))
                    await self.r.spublish(channel, codec.encode_events([ev], self.engine_id))
                    if req.log_events:  # the engine's event log (sluice.wire.event_log), one element a step
                        await self.r.rpush(contract.log_key(req.request_id), event_log.encode_entry([ev]))
                if step >= max(len(s) for s in streams):
                    break
                await asyncio.sleep(self.token_delay)
            self.finished.add(req.request_id)
        except (redis.RedisError, OSError):
            pass  # Redis went away mid-request: like an engine whose publishes were dropped
        finally:
            self.running -= 1
            try:
                await self.r.delete(contract.owner_key(req.reply_to, req.request_id))
                await self.r.xack(stream, contract.CONSUMER_GROUP, entry_id)
            except (redis.RedisError, OSError):
                pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GatewayServer:
    """The real app under uvicorn in a thread, on a free 127.0.0.1 port."""

    def __init__(self, **config) -> None:
        from gateway.app import create_app
        from gateway.config import GatewayConfig
        from gateway.main import GRACEFUL_SHUTDOWN_S  # the deployed gateway's drain on SIGTERM

        self.config = GatewayConfig(**config)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(self.config)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> GatewayServer:
        self.thread.start()
        end = time.time() + 15
        while not self.server.started:
            if time.time() > end or not self.thread.is_alive():
                raise RuntimeError("gateway did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def fake_engine(redis_client, clean_redis, model_dir):
    engine = FakeEngine(clean_redis, Path(model_dir)).start()
    yield engine
    engine.stop()


@pytest.fixture
def make_fake_engine(model_dir):
    """Fake engines on any Redis (``make_fake_engine(url)``), stopped at the end of the test."""
    engines: list[FakeEngine] = []

    def make(redis_url: str, **attrs) -> FakeEngine:
        engine = FakeEngine(redis_url, Path(model_dir))
        for k, v in attrs.items():
            setattr(engine, k, v)
        engines.append(engine.start())
        return engine

    yield make
    for e in engines:
        e.stop()


@pytest.fixture
def make_gateway(clean_redis):
    servers: list[GatewayServer] = []

    def make(**config) -> GatewayServer:
        config.setdefault("redis_url", clean_redis)
        server = GatewayServer(**config).start()
        servers.append(server)
        return server

    yield make
    for s in servers:
        s.stop()


@pytest.fixture
def gateway(make_gateway, fake_engine) -> GatewayServer:
    return make_gateway()
