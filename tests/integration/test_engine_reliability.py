"""Engine-side reliability against a real Redis, with a fake (model-free) engine so it runs fast:
re-validation of queue entries, a restart with a fixed engine id while requests are queued, the
stream's trim, registry hygiene, healing connections after a Redis restart.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid

import pytest
import redis

from engine_service.service.housekeeping import trim_stream
from engine_service.service.io_types import EntryRef
from engine_service.service.redis_io import RedisIO
from engine_service.service.settings import ServiceSettings
from engine_service.service.worker import Worker, new_inbox
from sluice.wire import card, codec, contract, limits
from sluice.wire.client import WireClient
from sluice.wire.connection import connect
from sluice.wire.error_codes import Code
from tests.docker_support import free_port, wait_for_redis
from tests.integration.test_engine_service_worker import FakeEngine
from tests.queue_helpers import has_group, pending_refs, queue_length
from tests.waiting import wait_until

pytestmark = [pytest.mark.docker, pytest.mark.redis]

MODEL = "fake-model"


def fake_card(settings: ServiceSettings) -> dict[str, str]:
    """The card fields a fake engine publishes: enough for WireClient to shard as a gateway would."""
    return {card.F_NAME: MODEL, card.F_MAX_MODEL_LEN: "64", card.F_QUEUE_SHARDS: str(settings.queue_shards),
            card.F_BLOCK_SIZE: "4", card.F_SHARD_PREFIX_BLOCKS: str(settings.shard_prefix_blocks)}


class FakeService:
    """RedisIO + Worker around a FakeEngine, the step loop on a thread (like EngineService)."""

    def __init__(self, url: str, engine_id: str | None = None, slow: float = 0.0, **settings) -> None:
        self.settings = ServiceSettings(redis_url=url, engine_id=engine_id or f"fake-{uuid.uuid4().hex[:6]}",
                                        heartbeat_ttl_s=2.0, heartbeat_interval_s=0.5, **settings)
        self.engine = FakeEngine(slow=slow)
        inbox: queue.SimpleQueue = new_inbox()
        self.io = RedisIO(self.settings, MODEL, inbox, fake_card(self.settings),
                          lambda: {"running": len(self.engine.reqs)})
        self.worker = Worker(self.engine, self.io, self.settings, MODEL)
        self.thread = threading.Thread(target=self.worker.run, daemon=True)

    def start(self) -> FakeService:
        self.io.start()
        self.thread.start()
        return self

    def stop(self, deregister: bool = True) -> None:
        self.worker.request_stop()
        self.thread.join(10)
        self.io.stop(flush_timeout=5.0, deregister=deregister)


@pytest.fixture
def services(clean_redis):
    started: list[FakeService] = []

    def start(**kw) -> FakeService:
        svc = FakeService(clean_redis, **kw).start()
        started.append(svc)
        return svc

    yield start
    for svc in started:
        if svc.thread.is_alive():
            svc.stop()


def pending_ids(r: redis.Redis, consumer: str | None = None) -> set[EntryRef]:
    return pending_refs(r, MODEL, consumer)


# --------------------------------------------------------------------------- item 8: limits


def test_engine_refuses_entries_over_the_gateway_limits(services, redis_client):
    svc = services()
    client = WireClient(redis_client)
    client.wait_for_engine(MODEL, timeout=10)
    greedy = {"temperature": 0.0, "max_tokens": 4}
    cases = {
        "n_huge": {**greedy, "n": 20000},
        "logprobs": {**greedy, "logprobs": limits.LOGPROBS.high + 1},
        "prompt_logprobs": {**greedy, "prompt_logprobs": 1000},
        "stop_ids": {**greedy, "stop_token_ids": list(range(limits.STOP_TOKEN_IDS.max_items + 1))},
        "logit_bias": {**greedy, "logit_bias": {i: 1.0 for i in range(limits.LOGIT_BIAS.max_items + 1)}},
        "stop_id_vocab": {**greedy, "stop_token_ids": [FakeEngine.vocab_size + 7]},
    }
    handles = {name: client.submit(MODEL, [1, 2, 3], params) for name, params in cases.items()}
    vocab = client.submit(MODEL, [1, FakeEngine.vocab_size, 3], greedy)
    good = client.submit(MODEL, [1, 2, 3], greedy)
    started = time.monotonic()
    for name, handle in [*handles.items(), ("prompt_vocab", vocab)]:
        result = handle.collect(timeout=10)
        assert not result.timed_out, f"{name}: no answer"
        assert result.error_code == contract.ERR_INVALID_REQUEST, f"{name}: {result.error_code} {result.events}"
        assert result.error_message
    assert time.monotonic() - started < 5
    ok = good.collect(timeout=10)
    assert ok.error_code is None and ok.finish_reason == "length"
    # None of them reached the engine, and every entry was acknowledged.
    assert svc.worker.counters["invalid"] == len(cases) + 1
    wait_until(lambda: not pending_ids(redis_client), 5, "everything acknowledged")


def test_limits_check_request_unit():
    req = codec.make_request("r", MODEL, [1, 2, 3], {"max_tokens": 4, "n": 2}, reply_to="g")
    assert limits.check_request(req, vocab_size=10, max_model_len=64) is None
    req.params.n = limits.N.high + 1
    assert limits.check_request(req, vocab_size=10, max_model_len=64).code == Code.INVALID_REQUEST
    req.params.n = 1
    req.params.max_tokens = 62
    assert limits.check_request(req, vocab_size=10, max_model_len=64).code == Code.CONTEXT_LENGTH_EXCEEDED
    req.params.max_tokens = 61
    assert limits.check_request(req, vocab_size=10, max_model_len=64) is None
    req.prompt_token_ids.append(10)
    assert "vocabulary" in limits.check_request(req, vocab_size=10, max_model_len=64)[1]


# --------------------------------------------------------------------------- item 4: fixed id restart


@pytest.mark.parametrize("round_", range(3))
def test_restart_with_fixed_engine_id_while_queued_keeps_running_entries_pending(services, redis_client, round_):
    """A previous life left entries pending under the id; more are queued. The restarted engine must
    take its old entries once (reclaim) and the queued ones once (reader): no entry delivered
    twice, and every running request's entry stays pending until it finishes (so a peer could
    reclaim it if this engine died now)."""
    stream = contract.request_stream(MODEL, 0)
    redis_client.xgroup_create(stream, contract.CONSUMER_GROUP, id="0", mkstream=True)
    client = WireClient(redis_client)
    params = {"temperature": 0.0, "max_tokens": 30}
    handles = [client.submit(MODEL, [1, 2, i], params, shard=0) for i in range(2)]
    # The previous life of "fixed" read these two and died.
    redis_client.xreadgroup(contract.CONSUMER_GROUP, "fixed", {stream: ">"}, count=2)
    handles += [client.submit(MODEL, [1, 2, i], params) for i in range(2, 8)]
    svc = services(engine_id="fixed", slow=0.03)
    results: dict[int, object] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, handles[i].collect(timeout=20)))
               for i in range(len(handles))]
    for t in threads:
        t.start()
    violations = []
    while any(t.is_alive() for t in threads):
        live = {live.entry_id for live in list(svc.worker.live.values())}
        missing = live - pending_ids(redis_client)
        # The worker may have finished (and acked) one since we looked: recheck against live.
        missing &= {live.entry_id for live in list(svc.worker.live.values())}
        if missing:
            violations.append(missing)
        time.sleep(0.02)
    assert not violations, f"running entries not pending (acknowledged while running): {violations[:3]}"
    for r in results.values():
        assert not r.timed_out and r.error_code is None and r.finish_reason == "length", r
        assert len(r.token_ids) == 30
    assert svc.io.stats["reclaimed"] == 2, svc.io.stats
    wait_until(lambda: not pending_ids(redis_client), 5, "everything acknowledged")


# --------------------------------------------------------------------------- stream trim


def test_trim_never_drops_unread_or_pending_entries(redis_client):
    stream = contract.request_stream(MODEL, 0)
    ids = [redis_client.xadd(stream, {b"r": str(i).encode()}) for i in range(10)]
    # No group yet: nobody has read anything, nothing may go.
    assert trim_stream(redis_client, stream) == (None, 0)
    redis_client.xgroup_create(stream, contract.CONSUMER_GROUP, id="0")
    read = redis_client.xreadgroup(contract.CONSUMER_GROUP, "a", {stream: ">"}, count=6)[0][1]
    assert [eid for eid, _ in read] == ids[:6]
    # ids[1] stays pending; the others read are acknowledged; ids[6:] are unread.
    redis_client.xack(stream, contract.CONSUMER_GROUP, ids[0], *ids[2:6])
    trim_stream(redis_client, stream)
    left = [eid for eid, _ in redis_client.xrange(stream)]
    assert left == ids[1:], "only the acknowledged entries below the oldest pending one may go"
    redis_client.xack(stream, contract.CONSUMER_GROUP, ids[1])
    trim_stream(redis_client, stream)
    assert [eid for eid, _ in redis_client.xrange(stream)] == ids[6:], "the unread entries stay"
    # They are still readable, and read whole.
    rest = redis_client.xreadgroup(contract.CONSUMER_GROUP, "b", {stream: ">"}, count=10)[0][1]
    assert [eid for eid, _ in rest] == ids[6:] and all(fields for _, fields in rest)


def test_stream_length_bounded_over_10000_requests(redis_client):
    """10,000 synthetic requests through the group (read in bites, acknowledged out of order,
    a few left pending for long), the engine's trim routine every 200: the stream's length stays
    bounded by what is unread, pending or acknowledged since the last trim."""
    stream = contract.request_stream(MODEL, 0)
    redis_client.xgroup_create(stream, contract.CONSUMER_GROUP, id="0", mkstream=True)
    long_pending: list[bytes] = []
    inflight: list[bytes] = []
    max_len = 0
    for i in range(10_000):
        redis_client.xadd(stream, {b"r": b"x" * 64})
        if i % 10 == 9:
            got = redis_client.xreadgroup(contract.CONSUMER_GROUP, "e", {stream: ">"}, count=10)[0][1]
            inflight += [eid for eid, _ in got]
            if i % 1000 == 999:
                long_pending.append(inflight.pop(0))  # a straggler that runs for a long while
            done, inflight = inflight[:-5], inflight[-5:]  # a few stay running
            if done:
                redis_client.xack(stream, contract.CONSUMER_GROUP, *done)
            if len(long_pending) > 3:
                redis_client.xack(stream, contract.CONSUMER_GROUP, long_pending.pop(0))
        if i % 200 == 199:
            trim_stream(redis_client, stream)
            max_len = max(max_len, redis_client.xlen(stream))
            for eid in long_pending + inflight:  # never dropped
                assert redis_client.xrange(stream, eid, eid), eid
    # Bounded by the span from the oldest straggler (up to 4,000 requests back), not by 10,000.
    assert max_len <= 4_300, max_len
    redis_client.xack(stream, contract.CONSUMER_GROUP, *long_pending, *inflight)
    trim_stream(redis_client, stream)
    assert redis_client.xlen(stream) == 0


@pytest.mark.both_topologies
def test_engine_trims_acknowledged_entries(services, redis_client):
    svc = services(trim_interval_s=0.2)
    client = WireClient(redis_client)
    client.wait_for_engine(MODEL, timeout=10)
    handles = [client.submit(MODEL, [1, 2, i], {"temperature": 0.0, "max_tokens": 2}) for i in range(40)]
    assert all(not h.collect(timeout=20).timed_out for h in handles)
    # the housekeeper counts an XTRIM's removals once its reply is in: the stream can read empty a
    # moment before the count does (failed once in a full run)
    wait_until(lambda: queue_length(redis_client, MODEL) == 0 and svc.io.stats["trimmed"] >= 40, 5,
               "the streams trimmed, and the 40 entries counted")


# --------------------------------------------------------------------------- registry


@pytest.mark.both_topologies
def test_dead_engines_leave_the_registry(services, redis_client):
    dead_info = {"model": MODEL, "engine_id": "dead", "heartbeat": time.time() - 60}
    redis_client.hset(contract.ENGINES_KEY, "dead", json.dumps(dead_info))
    # Just registered (its liveness key is about to be written): not removed.
    young = {"model": MODEL, "engine_id": "young", "heartbeat": time.time() + 30}
    redis_client.hset(contract.ENGINES_KEY, "young", json.dumps(young))
    redis_client.hset(contract.ENGINES_KEY, "garbage", b"\xff not json")
    svc = services(trim_interval_s=0.2)
    wait_until(lambda: not redis_client.hexists(contract.ENGINES_KEY, "dead"), 5, "dead entry removed")
    assert not redis_client.hexists(contract.ENGINES_KEY, "garbage")
    assert redis_client.hexists(contract.ENGINES_KEY, "young")
    assert redis_client.hexists(contract.ENGINES_KEY, svc.settings.engine_id)


def test_kill9_engine_removed_by_peer(services, redis_client):
    a = services(trim_interval_s=0.2)
    b = services(trim_interval_s=0.2)
    wait_until(lambda: redis_client.hexists(contract.ENGINES_KEY, a.settings.engine_id)
               and redis_client.hexists(contract.ENGINES_KEY, b.settings.engine_id), 5, "both registered")
    a.stop(deregister=False)  # as a kill -9: no goodbye, the liveness key lapses (TTL 2 s)
    wait_until(lambda: not redis_client.hexists(contract.ENGINES_KEY, a.settings.engine_id), 10,
               "the dead engine's registry entry removed by its peer")
    assert redis_client.hexists(contract.ENGINES_KEY, b.settings.engine_id)


# --------------------------------------------------------------------------- healing connections


def test_engine_serves_within_a_second_of_redis_coming_back(restartable_redis):
    url = restartable_redis.url
    svc = FakeService(url).start()
    try:
        r = connect(url)
        client = WireClient(r)
        client.wait_for_engine(MODEL, timeout=10)
        params = {"temperature": 0.0, "max_tokens": 3}
        assert client.submit(MODEL, [1, 2, 3], params).collect(timeout=10).finish_reason == "length"
        r.close()
        restartable_redis.stop()
        time.sleep(3)  # every engine connection breaks; the reader backs off
        restartable_redis.start()
        wait_for_redis(url, timeout=30)
        time.sleep(1.0)
        r = connect(url)
        client = WireClient(r)
        started = time.monotonic()
        handles = [client.submit(MODEL, [1, 2, i], params) for i in range(20)]
        results = [h.collect(timeout=10) for h in handles]
        took = time.monotonic() - started
        assert all(res.error_code is None and res.finish_reason == "length" for res in results), results
        assert took < 3.0, f"20 requests took {took:.1f}s after Redis had been back for 1 s"
        r.close()
    finally:
        svc.stop()


# --------------------------------------------------------------------------- drain within its grace


def test_drain_exits_within_its_grace_period(clean_redis, redis_client, tmp_path):
    """A request that cannot finish in time: the whole service (step loop, flush, deregistration,
    threads) is done within the grace period counted from the drain request, not seconds after."""
    from engine_service.service.main import EngineService

    class Engine(FakeEngine):
        model_dir = str(tmp_path)
        max_model_len = 4096
        eos_token_ids = [0]
        model_name = MODEL

    settings = ServiceSettings(redis_url=clean_redis, engine_id="drainer", heartbeat_ttl_s=2.0,
                               heartbeat_interval_s=0.5)
    svc = EngineService(Engine(slow=0.05), settings, MODEL).start_in_thread()
    client = WireClient(redis_client)
    client.wait_for_engine(MODEL, timeout=10)
    handle = client.submit(MODEL, [1, 2, 3], {"temperature": 0.0, "max_tokens": 2000})
    first = next(iter(handle.events(timeout=10)))
    assert first.token_ids
    grace = 1.5
    started = time.monotonic()
    svc.worker.request_drain(grace)
    svc._thread.join(15)
    took = time.monotonic() - started
    assert not svc._thread.is_alive()
    assert took <= grace + 0.1, f"the drain took {took:.2f}s for a {grace}s grace period"
    result = handle.collect(timeout=5)
    assert result.error_code == contract.ERR_DRAINING, result
    assert not redis_client.hexists(contract.ENGINES_KEY, "drainer")


# --------------------------------------------------------------------------- lost acknowledgements


@pytest.mark.both_topologies
def test_own_pending_entry_with_a_lost_ack_is_taken_back(services, redis_client):
    """Redis crashed within its fsync second after this engine's XACK: the entry is pending again
    under a live consumer, which no peer reclaims. The engine finds it (pending, idle, not held)
    and takes it through the reclaim path; nothing stays pending, the stream can be trimmed."""
    svc = services(orphan_check_s=0.2, orphan_idle_ms=300, trim_interval_s=0.2)
    client = WireClient(redis_client)
    client.wait_for_engine(MODEL, timeout=10)
    stream = contract.request_stream(MODEL, 3)  # any shard: the engine owns them all
    # The registry entry is published by the housekeeper, the groups by the reader's first pass:
    # the XREADGROUP below needs the group, so wait for it rather than for the registry alone.
    wait_until(lambda: has_group(redis_client, stream), timeout=10, what=f"the consumer group on {stream}")
    # One that had emitted tokens (its client got them and its end): errored, acknowledged.
    done = codec.make_request("done-before-crash", MODEL, [1, 2, 3], {"temperature": 0.0, "max_tokens": 2},
                              reply_to=client.new_reply_id())
    redis_client.set(contract.emitted_key(done.reply_to, done.request_id), svc.settings.engine_id)
    # One that had not started (its read survived, its run did not): run again.
    fresh = codec.make_request("fresh-after-crash", MODEL, [1, 2, 3], {"temperature": 0.0, "max_tokens": 2},
                               reply_to=client.new_reply_id())
    handles = {}
    for req in (done, fresh):
        handles[req.request_id] = client.listen(req)
        pipe = redis_client.pipeline(transaction=True)  # pending under the engine's own name, unseen by it
        pipe.xadd(stream, codec.encode_request(req))
        pipe.xreadgroup(contract.CONSUMER_GROUP, svc.settings.engine_id, {stream: ">"}, count=1)
        pipe.execute()
    assert len(pending_ids(redis_client, svc.settings.engine_id)) == 2
    lost = handles["done-before-crash"].collect(timeout=10)
    assert lost.error_code == contract.ERR_ENGINE_LOST, lost
    again = handles["fresh-after-crash"].collect(timeout=10)
    assert again.error_code is None and again.finish_reason == "length", again
    wait_until(lambda: not pending_ids(redis_client), 5, "nothing left pending")
    wait_until(lambda: redis_client.xlen(stream) == 0, 5, "the stream trimmed past them")
    assert svc.io.stats["orphans"] == 2


def test_gateway_counts_as_lost_only_after_its_key_stays_missing(clean_redis, redis_client):
    """``RedisIO.check_gateways`` on a controlled clock: a gateway is lost once its key has been
    missing at every check for ``gateway_lost_after_s``; a key seen again, or a failed check,
    starts the count afresh; a lost gateway's requests are aborted, also those delivered later."""
    from engine_service.service.io_types import CancelNote, parse_entry

    settings = ServiceSettings(redis_url=clean_redis, engine_id="gw-check", gateway_lost_after_s=5.0)

    def ref(entry_id: bytes) -> EntryRef:
        return EntryRef(contract.request_stream(MODEL, 1), entry_id)

    inbox: queue.SimpleQueue = new_inbox()
    io = RedisIO(settings, MODEL, inbox, {card.F_NAME: MODEL}, dict)
    io._held.update({ref(b"1-0"): ("r1", "gA"), ref(b"2-0"): ("r2", "gB"), ref(b"3-0"): ("r3", "gB"),
                     ref(b"4-0"): ("r4", "")})
    client = WireClient(redis_client)
    client.heartbeat_gateway("gA", ttl_s=60)

    def cancels() -> list[CancelNote]:
        out = []
        while not inbox.empty():
            out.append(inbox.get_nowait())
        return out

    assert io.check_gateways(now=100.0) == [] and cancels() == []  # gB missing since 100
    assert io.check_gateways(now=104.0) == []
    client.heartbeat_gateway("gB", ttl_s=60)
    assert io.check_gateways(now=106.0) == []  # seen again: the count is reset
    redis_client.delete(contract.gateway_key("gB"))
    assert io.check_gateways(now=107.0) == []  # missing since 107
    assert io.check_gateways(now=111.5) == [] and cancels() == []
    # a failed check (Redis away) resets the count too
    good = io.redis
    io.redis = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5)
    with pytest.raises(redis.ConnectionError):
        io.check_gateways(now=111.8)
    io.redis = good
    assert io.check_gateways(now=112.0) == []  # missing since 112
    assert io.check_gateways(now=116.9) == [] and cancels() == []
    assert io.check_gateways(now=117.0) == ["gB"]
    [note] = cancels()
    assert note.cause == "gateway_lost" and sorted(note.request_ids) == ["r2", "r3"]
    assert io.stats["gateways_lost"] == 1
    # still held at the next check (the abort not acknowledged yet): aborted again, not re-declared
    assert io.check_gateways(now=118.0) == []
    assert [sorted(n.request_ids) for n in cancels()] == [["r2", "r3"]]
    # acknowledged: nothing more to abort
    for entry_id in (b"2-0", b"3-0"):
        io._held.pop(ref(entry_id))
    assert io.check_gateways(now=119.0) == [] and cancels() == []
    # an entry of the lost gateway read later is dropped on delivery; one of a live gateway is not
    late = [parse_entry(ref(f"{5 + i}-0".encode()), codec.encode_request(
        codec.make_request(f"late-{gid}", MODEL, [1, 2], {"max_tokens": 2}, gateway_id=gid, reply_to=gid)))
        for i, gid in enumerate(("gB", "gA"))]
    io._deliver(late)
    delivered = {e.request.request_id: e for e in cancels()}
    assert delivered["late-gB"].gateway_lost and not delivered["late-gA"].gateway_lost
    assert io.stats["gateways_lost"] == 1
    # a setting of 0 turns the watch off
    io.settings.gateway_lost_after_s = 0
    redis_client.delete(contract.gateway_key("gA"))
    assert io.check_gateways(now=200.0) == [] and io.check_gateways(now=300.0) == [] and cancels() == []
