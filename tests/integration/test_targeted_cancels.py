"""A cancel reaches the engine that holds the request, and only it (contract 6): three engines with
the real ``RedisIO`` and ``Worker`` around a model-free engine, on both Redis topologies (the take
and the cancel are scripts of the reply_to's slot, the cancel channel is each engine's own).

What it pins down: every cancelled request ends with ``abort``, each engine's step loop hears the
cancels of its own requests and of nobody else's, a cancel of a queued request publishes nothing
(the marker alone stops it at the take), and no owner marker outlives its request. A reclaimed
request's owner marker moves with the reclaim: a reclaim delivers through the same take.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import pytest

from engine_service.service.io_types import CancelNote
from engine_service.service.redis_io import RedisIO
from engine_service.service.settings import ServiceSettings
from engine_service.service.worker import Worker
from sluice.wire import codec, contract
from sluice.wire.client import WireClient
from tests.integration.test_engine_service_worker import FakeEngine
from tests.waiting import wait_until

pytestmark = [pytest.mark.redis]

MODEL = "cancel-model"


class _HeardInbox(queue.Queue):
    """A step loop's inbox that remembers the ids of the clients' cancels put in it."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled: list[str] = []

    def put(self, item, block=True, timeout=None):
        if isinstance(item, CancelNote) and item.cause == "cancel":
            self.cancelled += item.request_ids
        super().put(item, block, timeout)


class _Engine:
    def __init__(self, url: str, engine_id: str) -> None:
        self.engine_id = engine_id
        self.settings = ServiceSettings(redis_url=url, engine_id=engine_id, queue_shards=4)
        self.inbox = _HeardInbox()
        self.io = RedisIO(self.settings, MODEL, self.inbox, {"name": MODEL}, lambda: {})
        self.engine = FakeEngine(slow=0.02)  # a token every 20 ms; 4 slots
        self.worker = Worker(self.engine, self.io, self.settings, MODEL)
        self.thread = threading.Thread(target=self.worker.run, daemon=True)

    def start(self) -> _Engine:
        self.io.start()
        self.thread.start()
        return self

    def stop(self) -> None:
        self.worker.request_stop()
        self.thread.join(10)
        self.io.stop(flush_timeout=5.0)


@pytest.fixture
def engines(clean_redis) -> Iterator[list[_Engine]]:
    started = [_Engine(clean_redis, f"eng-{i}").start() for i in range(3)]
    for e in started:
        assert e.io.connected.wait(10)
    try:
        yield started
    finally:
        for e in started:
            e.stop()


@pytest.fixture
def client(clean_redis) -> Iterator[WireClient]:
    c = WireClient.from_url(clean_redis)
    try:
        yield c
    finally:
        c.close()


def _first_event(handle):
    for event in handle.events(timeout=30):
        if event.token_ids:
            return event
    raise AssertionError("no token before the cancel")


@pytest.mark.both_topologies
def test_each_engine_hears_only_the_cancels_of_its_own_requests(engines, client):
    # 9 long requests spread over the shards (4 slots each engine: all run at once)
    handles = [client.submit(MODEL, [i, i + 1, i + 2], {"temperature": 0.0, "max_tokens": 100_000}, shard=i % 4)
               for i in range(9)]
    holder = {h.request_id: _first_event(h).engine_id for h in handles}
    assert set(holder.values()) <= {e.engine_id for e in engines}
    # the owner marker names the engine whose events come: that is where the cancel goes
    for h in handles:
        owner = client.redis.get(contract.owner_key(h.reply_to, h.request_id))
        assert owner.decode() == holder[h.request_id]
    for h in handles:
        sent = codec.cancel(client.redis, h.reply_to, [h.request_id])
        assert list(sent) == [contract.cancel_channel(holder[h.request_id])]
    for h in handles:
        result = h.collect(timeout=30)
        assert not result.timed_out and result.finish_reason == "abort", h.request_id
    for e in engines:
        own = sorted(rid for rid, eid in holder.items() if eid == e.engine_id)
        assert sorted(e.inbox.cancelled) == own, e.engine_id
    # nothing names a request that is over
    wait_until(lambda: not any(client.redis.exists(contract.owner_key(h.reply_to, h.request_id)) for h in handles),
               10, "owner markers left behind")


@pytest.mark.both_topologies
def test_a_queued_request_is_cancelled_by_its_marker_alone(engines, client, clean_redis):
    for e in engines:  # nobody reads: the request stays queued
        e.io.stop_reading()
    handle = client.submit(MODEL, [7, 8, 9], {"temperature": 0.0, "max_tokens": 5}, shard=1)
    sent = codec.cancel(client.redis, handle.reply_to, [handle.request_id])
    assert sent == {}  # nobody holds it: no engine hears anything
    # an engine that takes it later drops it (the take sees the marker) and sets no owner
    probe = _Engine(clean_redis, "eng-late").start()
    try:
        result = handle.collect(timeout=30)
        assert result.finish_reason == "abort" and result.token_ids == []
        assert not client.redis.exists(contract.owner_key(handle.reply_to, handle.request_id))
        assert probe.inbox.cancelled == [] and all(e.inbox.cancelled == [] for e in engines)
    finally:
        probe.stop()


def test_cancel_after_the_end_sends_nothing(engines, client):
    handle = client.submit(MODEL, [4, 5, 6], {"temperature": 0.0, "max_tokens": 3})
    result = handle.collect(timeout=30)
    assert result.finish_reason == "length" and len(result.token_ids) == 3
    wait_until(lambda: not client.redis.exists(contract.owner_key(handle.reply_to, handle.request_id)), 5, "owner gone")
    assert codec.cancel(client.redis, handle.reply_to, [handle.request_id]) == {}
    time.sleep(0.3)
    assert all(e.inbox.cancelled == [] for e in engines)
