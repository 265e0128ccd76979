"""Tenants' lanes of the queue shards against a real Redis: the enqueue script creates a lane (group
from id 0, name in the shard's lanes set) atomically; the engines remove a lane once empty and idle,
and an enqueue creates it again; the engine's reader takes a light tenant's request out of Redis
ahead of a flood's backlog (and, when the flood holds every slot, ahead of its credit); reclaim,
trim, hand-back and the gateway's queue depth and audit work lane by lane; a lanes-set member that
is not a tenant id is never read. The scripts' tests run on one Redis and on a Redis Cluster.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest

from engine_service.service.redis_io import RedisIO
from engine_service.service.settings import ServiceSettings
from engine_service.service.worker import Worker, new_inbox
from gateway.broker import Broker
from sluice.wire import codec, contract
from sluice.wire.client import WireClient
from sluice.wire.connection import read_shard_message
from sluice_bench.prefix_affinity import SimEngine
from tests.integration.test_engine_reliability import MODEL, FakeService, fake_card
from tests.integration.test_engine_service_worker import FakeEngine
from tests.queue_helpers import engines_group
from tests.waiting import wait_until

pytestmark = [pytest.mark.docker, pytest.mark.redis]

PARAMS = {"temperature": 0.0, "max_tokens": 3}


def lane_members(r, shard: int = 0) -> set[str]:
    return {m.decode() if isinstance(m, bytes) else m for m in r.smembers(contract.lanes_key(MODEL, shard))}


def enqueue(r, tenant: str, shard: int = 0, rid: str | None = None, ttl: int = 60) -> bytes:
    """What a gateway's broker runs (contract.ENQUEUE_SCRIPT), marker included."""
    rid = rid or f"req-{uuid.uuid4().hex[:8]}"
    req = codec.make_request(rid, MODEL, [1, 2, 3], PARAMS, reply_to="g", tenant=tenant)
    script = r.register_script(contract.ENQUEUE_SCRIPT)
    return script(keys=[contract.lane_stream(MODEL, shard, tenant), contract.inflight_key(MODEL, shard, rid),
                        contract.lanes_key(MODEL, shard)],
                  args=[req.SerializeToString(), ttl, contract.REQUEST_FIELD, tenant, contract.CONSUMER_GROUP])


def remove_lane(r, tenant: str, now_ms: int, shard: int = 0) -> int:
    script = r.register_script(contract.LANE_REMOVE_SCRIPT)
    return int(script(keys=[contract.lane_stream(MODEL, shard, tenant), contract.lanes_key(MODEL, shard)],
                      args=[tenant, now_ms, contract.LANE_IDLE_S * 1000]))


# --------------------------------------------------------------------------- the scripts


@pytest.mark.both_topologies
def test_enqueue_creates_a_tenants_lane_with_its_group_in_one_step(redis_client):
    r = redis_client
    enqueue(r, "", rid="d1")
    assert r.xlen(contract.request_stream(MODEL, 0)) == 1 and not lane_members(r)  # as before lanes
    assert r.exists(contract.inflight_key(MODEL, 0, "d1")) == 1
    assert engines_group(r, contract.request_stream(MODEL, 0)) is None  # the engines create that one
    first = enqueue(r, "acme", rid="a1")
    enqueue(r, "acme")
    assert r.exists(contract.inflight_key(MODEL, 0, "a1")) == 1
    lane = contract.lane_stream(MODEL, 0, "acme")
    assert lane == contract.request_stream(MODEL, 0) + ":acme"
    assert lane_members(r) == {"acme"} and r.xlen(lane) == 2
    group = engines_group(r, lane)
    assert group is not None and int(group["lag"]) == 2  # from id 0: nothing enqueued is skipped
    got = r.xreadgroup(contract.CONSUMER_GROUP, "e1", {lane: ">"}, count=10)
    assert [eid for eid, _ in got[0][1]][0] == first


@pytest.mark.both_topologies
def test_an_idle_empty_lane_is_removed_and_comes_back_with_the_next_enqueue(redis_client):
    r = redis_client
    lane = contract.lane_stream(MODEL, 0, "acme")
    enqueue(r, "acme")
    later = int(time.time() * 1000) + 2 * contract.LANE_IDLE_S * 1000
    assert remove_lane(r, "acme", later) == 0  # an undelivered entry
    (_, [(eid, _)]), = r.xreadgroup(contract.CONSUMER_GROUP, "e1", {lane: ">"}, count=1)
    r.xtrim(lane, minid="0-1")
    assert remove_lane(r, "acme", later) == 0  # a pending one
    r.xack(lane, contract.CONSUMER_GROUP, eid)
    r.xtrim(lane, minid=f"{int(eid.decode().split('-')[0]) + 1}-0")
    assert r.xlen(lane) == 0
    assert remove_lane(r, "acme", int(time.time() * 1000)) == 0  # empty, but written within LANE_IDLE_S
    assert remove_lane(r, "acme", later) == 1
    assert not r.exists(lane) and not lane_members(r)
    assert remove_lane(r, "acme", later) == 1  # already gone: idempotent
    enqueue(r, "acme")
    assert lane_members(r) == {"acme"} and int(engines_group(r, lane)["lag"]) == 1


# --------------------------------------------------------------------------- the engine's reader


class SchedService:
    """RedisIO + Worker around the bench's SimEngine: the real Scheduler (fair share included),
    a step costing ``decode_ms``, fake tokens."""

    def __init__(self, url: str, max_num_seqs: int = 2, decode_ms: float = 5.0, **settings) -> None:
        self.settings = ServiceSettings(redis_url=url, engine_id=f"sched-{uuid.uuid4().hex[:6]}",
                                        heartbeat_ttl_s=2.0, heartbeat_interval_s=0.5, queue_shards=1, **settings)
        self.engine = SimEngine(num_blocks=512, block_size=4, max_num_seqs=max_num_seqs, max_model_len=64,
                                prefill_s_per_token=0.0, decode_s_per_step=decode_ms / 1000)
        self.io = RedisIO(self.settings, MODEL, new_inbox(), fake_card(self.settings), lambda: {})
        self.worker = Worker(self.engine, self.io, self.settings, MODEL)
        self.thread = threading.Thread(target=self.worker.run, daemon=True)

    def start(self) -> SchedService:
        self.io.start()
        self.thread.start()
        return self

    def stop(self) -> None:
        self.worker.request_stop()
        self.thread.join(10)
        self.io.stop(flush_timeout=5.0)


@pytest.fixture
def sched_service(clean_redis):
    started: list[SchedService] = []

    def start(**kw) -> SchedService:
        svc = SchedService(clean_redis, **kw).start()
        started.append(svc)
        return svc

    yield start
    for svc in started:
        svc.stop()


def first_token_order(client: WireClient, light_tenant: str, flood: int = 40) -> list[str]:
    """A flood of ``flood`` requests (tenant "flood", 16 tokens each), then one light request (of
    ``light_tenant``): the request ids in the order of their first tokens."""
    reply = client.new_reply_id()
    pubsub = client.subscribe(reply)
    order: list[str] = []
    try:
        for i in range(flood):
            client.enqueue(codec.make_request(f"f{i}", MODEL, [5, 6, 7], {"max_tokens": 16, "ignore_eos": True},
                                              reply_to=reply, tenant="flood"), shard=0)
        time.sleep(0.3)  # the flood holds every slot and its backlog waits in Redis
        client.enqueue(codec.make_request("light", MODEL, [8, 9], {"max_tokens": 4, "ignore_eos": True},
                                          reply_to=reply, tenant=light_tenant), shard=0)
        end = time.monotonic() + 60
        while len(order) < flood + 1 and time.monotonic() < end:
            message = read_shard_message(pubsub, 0.5)
            if not message or message.get("type") not in (b"smessage", "smessage"):
                continue
            for ev in codec.decode_events(message["data"]):
                if ev.token_ids and ev.request_id not in order:
                    order.append(ev.request_id)
    finally:
        pubsub.close()
    return order


@pytest.mark.both_topologies
def test_a_light_tenants_request_leaves_redis_ahead_of_a_floods_backlog(sched_service, redis_client):
    svc = sched_service(max_num_seqs=2)
    client = WireClient(redis_client)
    client.wait_for_engine(MODEL, timeout=10)
    order = first_token_order(client, "light")
    assert len(order) == 41, order
    # the flood held both slots when the light request came; it went ahead of the flood's backlog
    assert len(order) - 1 - order.index("light") >= 20, order
    wait_until(lambda: not svc.worker.live, 10, "everything finished")


@pytest.mark.both_topologies
def test_with_every_slot_held_by_a_flood_a_newcomer_is_read_ahead_and_takes_a_slot(sched_service, redis_client):
    """No slot frees while the light request runs (the flood's requests outlast it by far): it can
    only have left Redis ahead of the credit, and run on a slot the flood gave up."""
    svc = sched_service(max_num_seqs=2, decode_ms=20.0)
    client = WireClient(redis_client)
    client.wait_for_engine(MODEL, timeout=10)
    flood_lane = contract.lane_stream(MODEL, 0, "flood")
    flood = [client.submit(MODEL, [5, 6, 7], {"max_tokens": 50, "ignore_eos": True}, tenant="flood", shard=0)
             for _ in range(4)]
    wait_until(lambda: len(svc.worker.live) == 2, 10, "the flood holds both slots")
    light = client.submit(MODEL, [8, 9], {"max_tokens": 3, "ignore_eos": True}, tenant="light", shard=0)
    assert light.collect(timeout=20).finish_reason == "length"
    assert int(engines_group(redis_client, flood_lane)["lag"]) == 2  # the flood's backlog never moved
    assert svc.engine.scheduler.stats.preemptions == 1  # one slot taken, once
    for h in flood:
        assert h.collect(timeout=30).finish_reason == "length"


def test_in_the_floods_own_tenant_the_same_request_waits_behind_its_backlog(sched_service, redis_client):
    sched_service(max_num_seqs=2)
    client = WireClient(redis_client)
    client.wait_for_engine(MODEL, timeout=10)
    order = first_token_order(client, "flood")
    assert order[-1] == "light", order  # first come, first served within a tenant


def test_a_lanes_set_member_that_is_not_a_tenant_id_is_never_read(sched_service, redis_client):
    svc = sched_service()
    r = redis_client
    bad = "no such tenant!"
    r.sadd(contract.lanes_key(MODEL, 0), bad)
    stream = contract.lane_stream(MODEL, 0, bad)
    r.xgroup_create(stream, contract.CONSUMER_GROUP, id="0", mkstream=True)
    req = codec.make_request("smuggled", MODEL, [1, 2], PARAMS, reply_to="g")
    r.xadd(stream, codec.encode_request(req))
    client = WireClient(r)
    client.wait_for_engine(MODEL, timeout=10)
    ok = client.submit(MODEL, [1, 2, 3], PARAMS, tenant="acme", shard=0).collect(timeout=10)
    assert ok.finish_reason == "length"
    assert svc.io.lanes == {0: ("acme",)}
    assert int(engines_group(r, stream)["lag"]) == 1  # still there, unread


def test_reclaim_trim_and_lane_removal_work_lane_by_lane(clean_redis, redis_client, monkeypatch):
    r = redis_client
    client = WireClient(r)
    lane = contract.lane_stream(MODEL, 0, "acme")
    # a dead engine's pending entry on a tenant's lane
    handle = client.listen(codec.make_request("orphan", MODEL, [1, 2, 3], PARAMS, reply_to=client.new_reply_id(),
                                              tenant="acme"))
    client.enqueue(codec.make_request("orphan", MODEL, [1, 2, 3], PARAMS, reply_to=handle.reply_to, tenant="acme"),
                   shard=0)
    r.xreadgroup(contract.CONSUMER_GROUP, "dead-engine", {lane: ">"}, count=1)
    svc = FakeService(clean_redis, queue_shards=1, reclaim_min_idle_ms=100, trim_interval_s=0.2).start()
    try:
        result = handle.collect(timeout=15)
        assert result.finish_reason == "length" and svc.io.stats["reclaimed"] == 1
        wait_until(lambda: r.xlen(lane) == 0, 10, "the lane's acknowledged entry trimmed")
        assert lane_members(r) == {"acme"}  # empty, but not idle long enough
        monkeypatch.setattr(contract, "LANE_IDLE_S", 0)
        wait_until(lambda: not r.exists(lane) and not lane_members(r), 10, "the idle lane removed")
        wait_until(lambda: svc.io.lanes == {}, 5, "the reader forgot it")
        again = client.submit(MODEL, [1, 2, 3], PARAMS, tenant="acme", shard=0).collect(timeout=10)
        assert again.finish_reason == "length"
    finally:
        svc.stop()


class SilentEngine(FakeEngine):
    """Holds its requests and never produces a token: a drain hands every one back."""

    def step(self):
        time.sleep(0.01)
        return []


def test_a_drain_hands_a_tenants_request_back_to_its_lane(clean_redis, redis_client):
    r = redis_client
    svc = FakeService(clean_redis, queue_shards=1, drain_grace_s=5.0)
    svc.engine = svc.worker.engine = SilentEngine()
    svc.start()
    client = WireClient(r)
    client.wait_for_engine(MODEL, timeout=10)
    lane = contract.lane_stream(MODEL, 0, "acme")
    # four: the fake engine's every slot, so that no read is under way when the drain starts
    handles = [client.submit(MODEL, [1, 2, 3], PARAMS, tenant="acme", shard=0) for _ in range(4)]
    wait_until(lambda: len(svc.worker.live) == 4, 10, "all four in the engine")
    svc.worker.request_drain(2.0)
    svc.thread.join(10)
    svc.io.stop(flush_timeout=5.0)
    assert svc.worker.counters["handed_back"] == 4
    assert int(engines_group(r, lane)["lag"]) == 4  # back in the tenant's lane, unread
    assert r.xlen(contract.request_stream(MODEL, 0)) == 0
    for h in handles:
        h.close()


@pytest.mark.both_topologies
def test_the_gateways_queue_depth_and_audit_see_every_lane(clean_redis, redis_client):
    r = redis_client
    for tenant, n in (("", 2), ("acme", 3), ("beta", 1)):
        for _ in range(n):
            enqueue(r, tenant)
    r.xgroup_create(contract.request_stream(MODEL, 0), contract.CONSUMER_GROUP, id="0")
    r.sadd(contract.lanes_key(MODEL, 0), "not a tenant!")  # ignored
    r.xreadgroup(contract.CONSUMER_GROUP, "e1", {contract.lane_stream(MODEL, 0, "acme"): ">"}, count=1)

    async def look() -> tuple[int, dict]:
        broker = Broker(clean_redis)
        try:
            depth = await broker.queue_depth(MODEL)
            delivered = await broker._last_delivered({(MODEL, 0, "acme"), (MODEL, 0, "beta"), (MODEL, 0, "")})
            return depth, delivered
        finally:
            await broker.redis.aclose()

    depth, delivered = asyncio.run(look())
    assert depth == 2 + 2 + 1
    assert set(delivered) == {(MODEL, 0, "acme"), (MODEL, 0, "beta"), (MODEL, 0, "")}
    assert delivered[(MODEL, 0, "acme")] > (0, 0) and delivered[(MODEL, 0, "beta")] == (0, 0)


def test_entries_of_a_lane_that_vanished_while_the_reader_looked_are_not_lost(sched_service, redis_client):
    """A lane removed between the reader's lookup and its read (NOGROUP) only makes it look again."""
    svc = sched_service()
    r = redis_client
    client = WireClient(r)
    client.wait_for_engine(MODEL, timeout=10)
    assert client.submit(MODEL, [1, 2], PARAMS, tenant="acme", shard=0).collect(timeout=10).finish_reason == "length"
    wait_until(lambda: svc.io.lanes == {0: ("acme",)}, 5, "the reader knows the lane")
    lane = contract.lane_stream(MODEL, 0, "acme")
    r.delete(lane)  # gone under the reader (as LANE_REMOVE_SCRIPT does once it is idle)
    r.srem(contract.lanes_key(MODEL, 0), "acme")
    time.sleep(0.3)
    result = client.submit(MODEL, [1, 2], PARAMS, tenant="acme", shard=0).collect(timeout=10)
    assert result.finish_reason == "length" and not result.timed_out
