"""The engine service against a real Redis (testcontainers), with the step loop in a thread of the
test process: outputs equal the offline API's, cancels, deadlines, drain, gRPC, bad input.

Process-level faults (kill -9, SIGTERM of a real ``sluice engine``) are in
test_engine_service_processes.py.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_service.service.io_types import Entry, EntryRef, parse_entry
from engine_service.service.main import EngineService
from engine_service.service.settings import ServiceSettings
from sluice.wire import admin_pb2, admin_pb2_grpc, codec, contract
from sluice.wire.client import WireClient
from sluice.wire.messages_pb2 import GenerateRequest
from tests.docker_support import free_port
from tests.queue_helpers import pending_count
from tests.waiting import wait_until

pytestmark = [pytest.mark.model, pytest.mark.docker, pytest.mark.redis]

MAX_TOKENS = 6
NUM_BLOCKS = 256
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def llm(model_dir):
    from engine_service import LLM

    return LLM(model_dir, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN, max_num_seqs=64)


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.encode(f"Item {i}: the {['cat', 'river', 'house', 'song', 'number'][i % 5]} is") for i in range(50)]


@pytest.fixture(scope="module")
def reference(llm, prompts) -> list[list[int]]:
    from engine_service import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [list(o.outputs[0].token_ids) for o in outs]


def greedy(max_tokens: int = MAX_TOKENS, **kw):
    return {"temperature": 0.0, "max_tokens": max_tokens, **kw}


def make_service(llm, url: str, **overrides) -> EngineService:
    settings = ServiceSettings(
        redis_url=url, grpc_port=free_port(), engine_id=f"test-{uuid.uuid4().hex[:8]}", heartbeat_ttl_s=3.0,
        drain_grace_s=20.0, **overrides,
    )
    svc = EngineService(llm.engine, settings).start_in_thread()
    WireClient.from_url(url).wait_for_engine(svc.model, timeout=30)
    return svc


def cleanup(svc: EngineService, llm) -> None:
    svc.stop()
    leftover = list(svc.worker.live)
    if leftover:
        llm.engine.abort_request(leftover)
    assert not llm.engine.has_unfinished_requests()


@pytest.fixture
def service(llm, redis_client, clean_redis) -> Iterator[EngineService]:
    svc = make_service(llm, clean_redis)
    try:
        yield svc
    finally:
        cleanup(svc, llm)


@pytest.fixture
def client(redis_client) -> WireClient:
    return WireClient(redis_client)


def stats(svc: EngineService) -> admin_pb2.EngineStats:
    with grpc.insecure_channel(f"127.0.0.1:{svc.admin.port}") as channel:
        return admin_pb2_grpc.EngineAdminStub(channel).GetStats(admin_pb2.GetStatsRequest(), timeout=5)


def health(svc: EngineService) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{svc.admin.port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def wait_idle(svc: EngineService, timeout: float = 10.0) -> admin_pb2.EngineStats:
    end = time.monotonic() + timeout
    while True:
        s = stats(svc)
        if (s.running == 0 and s.waiting == 0 and s.live_requests == 0) or time.monotonic() > end:
            return s
        time.sleep(0.05)


def pending(redis_client, model: str) -> int:
    try:
        return pending_count(redis_client, model)
    except Exception:
        return 0


# --------------------------------------------------------------------------------------------
@pytest.mark.both_topologies
def test_model_card_and_registry(service, client, llm):
    card = client.model_card(service.model)
    assert card.max_model_len == MAX_MODEL_LEN
    assert card.eos_token_ids == llm.engine.eos_token_ids
    assert card.vocab_size == llm.engine.vocab_size
    assert card.tokenizer_json.startswith("{")
    assert card.chat_template == llm.get_tokenizer().chat_template
    assert card.contract_version == contract.CONTRACT_VERSION
    assert client.redis.sismember(contract.MODELS_KEY, service.model)
    assert service.settings.engine_id in client.engines()


def test_one_request_matches_offline(service, client, prompts, reference):
    handle = client.submit(service.model, prompts[0], greedy())
    result = handle.collect(timeout=60)
    assert not result.timed_out and result.error_code is None
    assert result.token_ids == reference[0]
    assert result.finish_reason in ("length", "stop")
    comp = result.completions[0]
    assert comp.prompt_tokens == len(prompts[0]) and comp.completion_tokens == len(reference[0])
    assert handle.extra_events(0.3) == []


def test_fifty_concurrent_requests_match_offline(service, client, prompts, reference, redis_client):
    handles = [client.submit(service.model, p, greedy()) for p in prompts]
    results = [h.collect(timeout=180) for h in handles]
    for i, result in enumerate(results):
        assert not result.timed_out, f"request {i} did not finish"
        assert result.error_code is None, result.error_message
        assert result.token_ids == reference[i], f"request {i} differs from the offline output"
    assert pending(redis_client, service.model) == 0  # every entry acknowledged
    s = wait_idle(service)
    assert s.finished_requests >= 50


@pytest.mark.both_topologies
def test_n_completions_each_end_once(service, client, prompts):
    handle = client.submit(service.model, prompts[1], {"temperature": 1.0, "seed": 7, "n": 3, "max_tokens": 4})
    result = handle.collect(timeout=60)
    assert not result.timed_out and result.error_code is None
    assert sorted(result.completions) == [0, 1, 2]
    finals = [e for e in result.events if e.HasField("finished")]
    assert sorted(e.index for e in finals) == [0, 1, 2]
    assert all(len(c.token_ids) == 4 for c in result.completions.values())


@pytest.mark.both_topologies
def test_cancel_before_during_and_after(service, client, prompts, reference):
    # before: the gateway remembers the cancel, then the entry is read
    rid, reply_to = f"before-{uuid.uuid4().hex}", client.new_reply_id()
    client.cancel([rid], reply_to=reply_to)
    before = client.submit(service.model, prompts[2], greedy(), request_id=rid, reply_to=reply_to).collect(timeout=30)
    assert before.finish_reason == "abort" and before.token_ids == []

    # during: wait for the first tokens, then cancel
    handle = client.submit(service.model, prompts[3], greedy(max_tokens=200, ignore_eos=True))
    seen = []
    for event in handle.events(timeout=60):
        seen.append(event)
        if event.token_ids:
            break
    assert seen and seen[-1].token_ids, "no tokens before the cancel"
    handle.cancel()
    during = handle.collect(timeout=30)
    assert not during.timed_out
    finals = [e for e in during.events if codec.is_terminal(e)]
    assert len(finals) == 1 and codec.finish_reason_name(finals[0].finished.finish_reason) == "abort"
    assert during.events[-1] is finals[0], "an event followed the final one"
    assert handle.extra_events(0.5) == []
    s = wait_idle(service)
    assert s.running == 0 and s.live_requests == 0
    assert s.free_blocks == s.total_blocks, "the cancelled request's blocks were not freed"

    # after: the request already ended; a cancel changes nothing and sends nothing
    done = client.submit(service.model, prompts[4], greedy())
    after = done.collect(timeout=60)
    assert after.token_ids == reference[4]
    done.cancel()
    done.cancel()  # idempotent
    assert done.extra_events(0.5) == []
    assert stats(service).free_blocks == s.total_blocks
    # still serving
    assert client.submit(service.model, prompts[5], greedy()).collect(timeout=60).token_ids == reference[5]


def test_deadlines_queued_and_running(service, client, prompts):
    queued = client.submit(service.model, prompts[6], greedy(), deadline=time.time() - 1).collect(timeout=30)
    assert queued.error_code == contract.ERR_DEADLINE and queued.token_ids == []

    handle = client.submit(service.model, prompts[7], greedy(max_tokens=200, ignore_eos=True), deadline=time.time() + 2.0)
    running = handle.collect(timeout=60)
    assert running.error_code == contract.ERR_DEADLINE
    assert running.events[-1].HasField("error")
    assert handle.extra_events(0.5) == []
    s = wait_idle(service)
    assert s.free_blocks == s.total_blocks


def test_malformed_entry_matrix(service, client, prompts, reference, redis_client, llm):
    model = service.model
    vocab = llm.engine.vocab_size

    def raw_request(rid: str, **changes) -> GenerateRequest:
        req = codec.make_request(rid, model, prompts[8], greedy(), reply_to=client.new_reply_id())
        for key, value in changes.items():
            if key == "params":
                req.params.CopyFrom(codec.sampling_params_to_proto(value))
            elif key == "prompt_token_ids":
                del req.prompt_token_ids[:]
                req.prompt_token_ids.extend(value)
            else:
                setattr(req, key, value)
        return req

    # Without a request id or a reply_to there is no channel to answer on: logged and acknowledged.
    client.enqueue_raw(model, {contract.REQUEST_FIELD: GenerateRequest(
        version=contract.CONTRACT_VERSION, request_id="no-reply", model=model, prompt_token_ids=[1]).SerializeToString()})
    client.enqueue_raw(model, {contract.REQUEST_FIELD: b"\xff\xfe garbage \x00\x01"})
    client.enqueue_raw(model, {b"something": b"else"})
    client.enqueue_raw(model, {contract.REQUEST_FIELD: GenerateRequest(version=1, model=model).SerializeToString()})

    cases = {
        "version": (dict(version=99), contract.ERR_CONTRACT_MISMATCH),
        "model": (dict(model="other-model"), contract.ERR_INVALID_REQUEST),
        "top_p": (dict(params={"temperature": 0.5, "top_p": 5.0, "max_tokens": 4}), contract.ERR_INVALID_REQUEST),
        "n0": (dict(params={"n": 0, "max_tokens": 4}), contract.ERR_INVALID_REQUEST),
        "min_gt_max": (dict(params={"min_tokens": 9, "max_tokens": 4}), contract.ERR_INVALID_REQUEST),
        "logit_bias_vocab": (dict(params={"logit_bias": {vocab + 5: 1.0}, "max_tokens": 4}), contract.ERR_INVALID_REQUEST),
        "too_long": (dict(prompt_token_ids=[1] * (MAX_MODEL_LEN + 10)), contract.ERR_CONTEXT_LENGTH),
        "too_long_with_max_tokens": (dict(params={"max_tokens": MAX_MODEL_LEN}), contract.ERR_CONTEXT_LENGTH),
        "empty": (dict(prompt_token_ids=[]), contract.ERR_INVALID_REQUEST),
        "vocab": (dict(prompt_token_ids=[1, vocab + 3, 2]), contract.ERR_INVALID_REQUEST),
        "negative_id": (dict(prompt_token_ids=[1, -4, 2]), contract.ERR_INVALID_REQUEST),
        # The gateway's limits (sluice.wire.limits), again at the engine: refused, never a stall.
        "n_huge": (dict(params={"n": 20000, "max_tokens": 4}), contract.ERR_INVALID_REQUEST),
        "logprobs_many": (dict(params={"logprobs": 500, "max_tokens": 4}), contract.ERR_INVALID_REQUEST),
        "stop_ids_many": (dict(params={"stop_token_ids": list(range(5000)), "max_tokens": 4}),
                          contract.ERR_INVALID_REQUEST),
        "logit_bias_many": (dict(params={"logit_bias": {i: 1.0 for i in range(5000)}, "max_tokens": 4}),
                            contract.ERR_INVALID_REQUEST),
        # a constraint the gateway would have refused: the engine compiles it again
        "bad_regex": (dict(params={"structured_outputs": {"regex": "[a-"}, "max_tokens": 4}),
                      contract.ERR_INVALID_REQUEST),
        "bad_schema": (dict(params={"structured_outputs": {"json": {"type": "nope"}}, "max_tokens": 4}),
                       contract.ERR_INVALID_REQUEST),
    }
    handles = {}
    for name, (changes, _) in cases.items():
        rid = f"bad-{name}-{uuid.uuid4().hex[:6]}"
        request = raw_request(rid, **changes)
        handles[name] = client.listen(request)
        redis_client.xadd(contract.request_stream(model, 0), codec.encode_request(request))
    for name, handle in handles.items():
        result = handle.collect(timeout=30)
        assert not result.timed_out, f"{name}: no answer"
        assert result.error_code == cases[name][1], f"{name}: {result.error_code} {result.error_message}"
        assert result.error_message
    # The engine still serves, correctly, and acknowledged everything.
    assert client.submit(model, prompts[9], greedy()).collect(timeout=60).token_ids == reference[9]
    end = time.monotonic() + 5
    while pending(redis_client, model) and time.monotonic() < end:
        time.sleep(0.1)
    assert pending(redis_client, model) == 0
    assert service.worker.running


def test_health_is_serving_before_the_engine_is_listed_in_redis(llm, clean_redis):
    """Whoever sees the engine registered may probe it at once: the health service answers SERVING
    from before the service's Redis I/O starts (which registers it), so no window reads NOT_SERVING.
    (The order was the other way round, and a loaded machine caught a probe in between.)"""
    settings = ServiceSettings(redis_url=clean_redis, grpc_port=free_port(),
                               engine_id=f"test-{uuid.uuid4().hex[:8]}", heartbeat_ttl_s=3.0)
    svc = EngineService(llm.engine, settings)
    at_io_start: list[int] = []
    start_io = svc.io.start

    def probing_start() -> None:
        at_io_start.append(health(svc))
        start_io()

    svc.io.start = probing_start
    svc.start_in_thread()
    try:
        WireClient.from_url(clean_redis).wait_for_engine(svc.model, timeout=30)
        assert at_io_start == [health_pb2.HealthCheckResponse.SERVING]
        assert health(svc) == health_pb2.HealthCheckResponse.SERVING
    finally:
        cleanup(svc, llm)


@pytest.mark.both_topologies
def test_health_stats_and_drain_hands_back(llm, clean_redis, redis_client, client, prompts, reference):
    svc = make_service(llm, clean_redis)
    try:
        assert health(svc) == health_pb2.HealthCheckResponse.SERVING
        client.submit(svc.model, prompts[10], greedy()).collect(timeout=60)
        s = wait_idle(svc)
        e = llm.engine.get_stats()
        assert (s.iterations, s.prompt_tokens_total, s.generation_tokens_total, s.finished_requests) == (
            e.iterations, e.prompt_tokens_total, e.generation_tokens_total, e.finished_requests
        )
        assert (s.free_blocks, s.total_blocks, s.preemptions, s.running, s.waiting) == (
            e.free_blocks, e.total_blocks, e.preemptions, e.running, e.waiting
        )
        assert not s.draining and s.engine_id == svc.settings.engine_id

        # A long request is running (it emitted tokens); then a drain, and a request delivered
        # during the drain: the running one finishes, the new one is handed back to the queue.
        long = client.submit(svc.model, prompts[11], greedy(max_tokens=30, ignore_eos=True))
        first = next(iter(long.events(timeout=60)))
        assert first.token_ids
        late_id = f"late-{uuid.uuid4().hex[:6]}"
        late_req = codec.make_request(late_id, svc.model, prompts[12], greedy(), reply_to=client.new_reply_id())
        stream = contract.request_stream(svc.model, 2)  # a shard; the hand-back must go back to it
        svc.io.stop_reading()  # so that this test, not the reader, takes the next entry
        time.sleep(svc.settings.read_block_ms / 1000 + 0.3)
        entry_id = redis_client.xadd(stream, codec.encode_request(late_req))
        # claim it for this engine's consumer, as its reader would have
        [(_, [(eid, fields)])] = redis_client.xreadgroup(
            contract.CONSUMER_GROUP, svc.settings.engine_id, {stream: ">"}, count=1
        )
        assert eid == entry_id
        with grpc.insecure_channel(f"127.0.0.1:{svc.admin.port}") as channel:
            reply = admin_pb2_grpc.EngineAdminStub(channel).Drain(admin_pb2.DrainRequest(grace_period_s=20.0), timeout=5)
        assert reply.accepted
        # delivered after the drain began (Drain queued its note first): handed back, not run
        svc.io._deliver([parse_entry(EntryRef(stream, eid), fields)])  # as the reader delivers
        end = time.monotonic() + 5
        while health(svc) != health_pb2.HealthCheckResponse.NOT_SERVING and time.monotonic() < end:
            time.sleep(0.05)
        assert health(svc) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert stats(svc).draining
        rest = long.collect(timeout=60)
        assert rest.finish_reason == "length" and len(first.token_ids) + len(rest.token_ids) == 30
        svc._thread.join(30)
        assert not svc._thread.is_alive(), "the drained service did not stop"
        # The late request was handed back: a new entry (attempt 1), the old one acknowledged.
        assert pending(redis_client, svc.model) == 0
        entries = redis_client.xrange(stream)
        handed = [parse_entry(i, f).request for i, f in entries if i != entry_id]
        handed = [r for r in handed if r is not None and r.request_id == late_id]
        assert len(handed) == 1 and handed[0].attempt == 1
        assert svc.settings.engine_id not in client.engines()
    finally:
        cleanup(svc, llm)
    # A fresh engine picks it up.
    late = client.listen(late_req)
    svc2 = make_service(llm, clean_redis)
    try:
        result = late.collect(timeout=60)
        assert result.token_ids == reference[12]
    finally:
        cleanup(svc2, llm)


def test_redis_restart_mid_run(llm, restartable_redis, prompts, reference):
    url = restartable_redis.url
    svc = make_service(llm, url)
    try:
        client = WireClient.from_url(url)
        assert client.submit(svc.model, prompts[13], greedy()).collect(timeout=60).token_ids == reference[13]
        inflight = client.submit(svc.model, prompts[14], greedy(max_tokens=60, ignore_eos=True))
        next(iter(inflight.events(timeout=60)))
        restartable_redis.restart(hard=True)
        inflight.close()
        client = WireClient.from_url(url)
        client.wait_for_engine(svc.model, timeout=30)  # heartbeat back
        assert client.model_card(svc.model) is not None  # card republished
        result = client.submit(svc.model, prompts[15], greedy()).collect(timeout=90)
        assert not result.timed_out and result.token_ids == reference[15]
        assert svc.worker.running
    finally:
        cleanup(svc, llm)


def keep_alive(url: str, gateway_id: str, ttl_s: float, every_s: float) -> threading.Event:
    """Refresh a gateway's liveness key like a gateway's broker does, through Redis restarts; set
    the returned event to stop."""
    stop = threading.Event()

    def beat() -> None:
        client = WireClient.from_url(url)
        while not stop.is_set():
            try:
                client.heartbeat_gateway(gateway_id, ttl_s)
            except Exception:  # noqa: BLE001 - Redis is restarting: again at the next beat
                pass
            stop.wait(every_s)

    threading.Thread(target=beat, daemon=True).start()
    return stop


@pytest.mark.both_topologies
def test_requests_of_a_lost_gateway_are_aborted(llm, clean_redis, redis_client, prompts):
    svc = make_service(llm, clean_redis, gateway_check_s=0.2, gateway_lost_after_s=1.0)
    client = WireClient(redis_client)
    alive, dead = f"gw-alive-{uuid.uuid4().hex[:6]}", f"gw-dead-{uuid.uuid4().hex[:6]}"
    stop = keep_alive(clean_redis, alive, ttl_s=1.0, every_s=0.3)
    try:
        client.heartbeat_gateway(dead, ttl_s=1.0)  # and never again: the gateway "crashed"
        long = greedy(max_tokens=200, ignore_eos=True)
        orphan = client.submit(svc.model, prompts[20], long, gateway_id=dead)
        kept = client.submit(svc.model, prompts[21], greedy(max_tokens=120, ignore_eos=True), gateway_id=alive)
        plain = client.submit(svc.model, prompts[22], greedy(max_tokens=120, ignore_eos=True))  # no gateway named
        started = time.monotonic()
        aborted = orphan.collect(timeout=60)
        took = time.monotonic() - started
        assert not aborted.timed_out and aborted.finish_reason == "abort", aborted
        assert 0 < len(aborted.token_ids) < 200
        assert took >= 1.7, took  # its key lapsed after 1 s, and the engine then waited 1 s more
        for handle in (kept, plain):
            result = handle.collect(timeout=60)
            assert result.finish_reason == "length" and len(result.token_ids) == 120, result
        assert svc.worker.counters["gateway_lost"] == 1 and svc.io.stats["gateways_lost"] == 1
        # what the lost gateway left in the queue is dropped when it is read, without running
        late = client.submit(svc.model, prompts[23], long, gateway_id=dead).collect(timeout=30)
        assert late.finish_reason == "abort" and late.token_ids == []
        assert svc.worker.counters["gateway_lost"] == 2
        s = wait_idle(svc)
        assert s.free_blocks == s.total_blocks
    finally:
        stop.set()
        cleanup(svc, llm)


def test_redis_restart_does_not_abort_live_gateways_requests(llm, restartable_redis, prompts):
    """Redis restarted without its data has lost every gateway's liveness key; a live gateway puts
    its key back once it has reconnected, so the engine must not take the gap for a crash."""
    url = restartable_redis.url
    lost_after = 3.0
    svc = make_service(llm, url, gateway_check_s=0.1, gateway_lost_after_s=lost_after)
    gateway = f"gw-{uuid.uuid4().hex[:6]}"
    stop = keep_alive(url, gateway, ttl_s=5.0, every_s=contract.GATEWAY_HEARTBEAT_INTERVAL_S)
    try:
        client = WireClient.from_url(url)
        handles = [client.submit(svc.model, prompts[24 + i], greedy(max_tokens=160, ignore_eos=True), gateway_id=gateway)
                   for i in range(8)]
        for handle in handles:
            next(iter(handle.events(timeout=60)))
        stop.set()  # the gateway's beat stops during the outage ...
        restartable_redis.restart(hard=True)
        for handle in handles:
            handle.close()
        assert not client.redis.exists(contract.gateway_key(gateway))  # the restart lost the key
        time.sleep(1.0)  # ... and resumes only a while after Redis is back (reconnecting, its next beat)
        stop = keep_alive(url, gateway, ttl_s=5.0, every_s=contract.GATEWAY_HEARTBEAT_INTERVAL_S)
        # A wrong abort would come within lost_after of the engine's first look at the empty Redis.
        watched = time.monotonic()
        while time.monotonic() - watched < lost_after + 0.5:
            assert svc.worker.counters["gateway_lost"] == 0, "a live gateway's request was aborted"
            assert all(h.request_id in svc.worker.live for h in handles), "requests ended too early for the test to mean anything"
            time.sleep(0.05)
        end = time.monotonic() + 90
        while svc.worker.live and time.monotonic() < end:
            time.sleep(0.1)
        assert not svc.worker.live
        assert svc.worker.counters["gateway_lost"] == 0 and svc.worker.counters["cancelled"] == 0
    finally:
        stop.set()
        cleanup(svc, llm)


def test_structured_request_through_the_queue(service, client, prompts, llm):
    params = {"temperature": 0.0, "max_tokens": 8, "structured_outputs": {"choice": ["alpha", "beta"]}}
    result = client.submit(service.model, prompts[2], params).collect(timeout=60)
    assert result.error_code is None, result.error_message
    assert llm.get_tokenizer().decode(result.token_ids) in ("alpha", "beta")
    assert result.finish_reason == "stop"
    assert llm.engine.grammars.num_active == 0


def test_parse_entry():
    assert parse_entry(b"1-0", {}).problem
    assert parse_entry(b"1-0", {b"x": b"y"}).problem
    ok = parse_entry(b"1-0", codec.encode_request(codec.make_request("r", "m", [1], None, reply_to="g")))
    assert isinstance(ok, Entry) and ok.request.request_id == "r"
    no_reply = codec.make_request("r", "m", [1], None, reply_to="g")
    no_reply.reply_to = ""  # a contract-2 entry: nobody could hear an answer
    assert "reply_to" in parse_entry(b"1-0", codec.encode_request(no_reply)).problem


def test_logprobs_cross_the_wire(service, client, prompts, reference):
    handle = client.submit(service.model, prompts[16], greedy(max_tokens=3, logprobs=2, prompt_logprobs=1))
    result = handle.collect(timeout=60)
    assert not result.timed_out and result.error_code is None
    token_events = [e for e in result.events if e.token_ids]
    for event in token_events:
        assert len(event.logprobs) == len(event.token_ids)
        for token_id, position in zip(event.token_ids, event.logprobs, strict=True):
            assert position.entries[0].token_id == token_id  # the chosen token first
            assert position.entries[0].rank == 1  # greedy: the top token
            assert len(position.entries) >= 2
    prompt_lps = [e for e in result.events if e.prompt_logprobs]
    assert len(prompt_lps) == 1 and len(prompt_lps[0].prompt_logprobs) == len(prompts[16])
    assert len(prompt_lps[0].prompt_logprobs[0].entries) == 0  # the first prompt token has none
    assert prompt_lps[0].prompt_logprobs[1].entries[0].token_id == prompts[16][1]


@pytest.mark.both_topologies
def test_usage_per_tenant_written_by_the_engine(service, client, prompts, redis_client, clean_redis, capsys):
    """Every engine request that ends adds its tokens to its tenant's usage of the hour, in the
    engine's per-step pipeline; `sluice usage` reads it back."""
    from sluice.wire import usage
    from sluice_cli import cli

    handles = []
    for i, tenant in enumerate(["team-a", "team-a", "team-b", ""]):
        req = codec.make_request(f"usage-{i}-{uuid.uuid4().hex[:6]}", service.model, prompts[i],
                                 greedy(n=2 if tenant == "team-b" else 1), reply_to=client.new_reply_id(),
                                 tenant=tenant)
        handle = client.listen(req)
        client.enqueue(req)
        handles.append((tenant, len(prompts[i]), handle))
    results = [(tenant, n, h.collect(timeout=60)) for tenant, n, h in handles]
    expected: dict[str, list[int]] = {}
    for tenant, n_prompt, result in results:
        assert result.error_code is None, result.error_message
        got = expected.setdefault(tenant, [0, 0, 0])
        got[0] += 1
        got[1] += n_prompt
        got[2] += sum(c.completion_tokens for c in result.completions.values())

    def read() -> dict[str, list[int]]:
        rows = usage.read(redis_client, time.time() - 3600, time.time())
        return {u.tenant: [u.requests, u.prompt_tokens, u.completion_tokens] for u in rows if u.model == service.model}

    wait_until(lambda: read() == expected, 10, f"usage {expected}")
    assert cli.main(["usage", "--json", "--since", "1h", "--redis-url", clean_redis]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    by_tenant = {row["tenant"]: row for row in lines}
    assert set(by_tenant) == {"team-a", "team-b", "default"}
    assert by_tenant["team-b"]["completion_tokens"] == expected["team-b"][2]
    assert cli.main(["usage", "--tenant", "team-a", "--redis-url", clean_redis]) == 0
    table = capsys.readouterr().out
    assert "team-a" in table and "team-b" not in table
    assert cli.main(["usage", "--since", "yesterday", "--redis-url", clean_redis]) == 2
