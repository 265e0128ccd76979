"""The per-request event log at the engine, against a real Redis: what a logged request
leaves in its log and when it expires; the lost-gateway rule's exceptions (detached, leased).

The HTTP side (resumed streams across gateways) is in tests/e2e/test_resumable_streams.py.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from sluice.wire import codec, contract, event_log
from sluice.wire.client import WireClient
from sluice.wire.connection import connect
from tests.integration.test_engine_service import cleanup, greedy, keep_alive, llm, make_service, prompts  # noqa: F401
from tests.waiting import wait_until

pytestmark = [pytest.mark.model, pytest.mark.docker, pytest.mark.redis]


def submit(client: WireClient, model: str, prompt: list[int], params: dict, **flags):
    request = codec.make_request(f"req-{uuid.uuid4().hex}", model, prompt, params, reply_to=client.new_reply_id(),
                                 **flags)
    handle = client.listen(request)
    client.enqueue(request)
    return request, handle


def log_events(r, request_id: str) -> list:
    return [ev for raw in r.lrange(contract.log_key(request_id), 0, -1) for ev in event_log.decode_entry(raw, request_id)]


# A cluster places every log on its own request's slot: the one module test that runs on both.
@pytest.mark.both_topologies
def test_engine_writes_the_log_and_its_ttls(llm, clean_redis, redis_client, prompts):  # noqa: F811
    svc = make_service(llm, clean_redis)
    r = connect(clean_redis)
    client = WireClient(redis_client)
    try:
        deadline = time.time() + 120
        req, handle = submit(client, svc.model, prompts[3], greedy(max_tokens=40, ignore_eos=True),
                             deadline=deadline, log_events=True, log_ttl_s=30)
        # the record is the gateway's; the engine shortens its TTL with the log's at the end
        r.set(contract.record_key(req.request_id), b"{}", ex=1000)
        key = contract.log_key(req.request_id)
        end = time.monotonic() + 30
        while not r.exists(key) and time.monotonic() < end:
            time.sleep(0.01)
        running_ttl = r.ttl(key)
        result = handle.collect(timeout=60)
        assert result.finish_reason == "length" and len(result.token_ids) == 40, result
        # while it ran the log lived to its deadline plus the window; at its end the window alone
        assert running_ttl > 60, running_ttl
        # A step's writes are one pipeline, but on a cluster it reaches the channel's node and the
        # log's node separately: the terminal event can arrive a moment before its log entry and
        # the shortened TTLs (seen once in a full run). Both follow within the same step's round.
        def settled() -> bool:
            return (0 < r.ttl(key) <= 30 and 0 < r.ttl(contract.record_key(req.request_id)) <= 30
                    and any(codec.is_terminal(ev) for ev in log_events(r, req.request_id)))

        wait_until(settled, 5, "the terminal event in the log, and log and record shortened to the window")
        events = log_events(r, req.request_id)
        assert [t for ev in events for t in ev.token_ids] == result.token_ids
        assert sum(codec.is_terminal(ev) for ev in events) == 1 and codec.is_terminal(events[-1])
        assert events[-1].finished.usage.completion_tokens == 40
        assert r.llen(key) <= len(events)  # one element per publish: a step, or steps coalesced
        # a request that is not logged leaves no log
        plain, handle = submit(client, svc.model, prompts[4], greedy(max_tokens=4))
        assert handle.collect(timeout=60).finish_reason == "length"
        assert not r.exists(contract.log_key(plain.request_id))
    finally:
        cleanup(svc, llm)


def test_lost_gateway_spares_detached_and_leased_requests(llm, clean_redis, redis_client, prompts):  # noqa: F811
    """Three requests of a gateway that died: a logged one nobody resumed is aborted by the
    lost-gateway rule; a leased one runs while its lease is held and is aborted once it lapses; a
    detached one runs on, and a cancel from elsewhere (knowing its reply_to) ends it."""
    svc = make_service(llm, clean_redis, gateway_check_s=0.2, gateway_lost_after_s=1.0)
    r = connect(clean_redis)
    client = WireClient(redis_client)
    dead = f"gw-dead-{uuid.uuid4().hex[:6]}"
    client.heartbeat_gateway(dead, ttl_s=1.0)  # and never again
    long = greedy(max_tokens=240, ignore_eos=True)  # the module's engine: max_model_len 256
    flags = {"gateway_id": dead, "log_events": True, "log_ttl_s": 60}
    _, unleased = submit(client, svc.model, prompts[10], long, **flags)
    leased_req, leased = submit(client, svc.model, prompts[11], long, **flags)
    detached_req, detached = submit(client, svc.model, prompts[12], long, detached=True, **flags)
    stop_lease = threading.Event()

    def hold_lease() -> None:
        while not stop_lease.is_set():
            r.set(contract.lease_key(leased_req.request_id), b"test", px=800)
            stop_lease.wait(0.2)

    threading.Thread(target=hold_lease, daemon=True).start()
    try:
        first = unleased.collect(timeout=60)
        assert first.finish_reason == "abort" and 0 < len(first.token_ids) < 240, first
        time.sleep(1.0)  # five more checks: the leased one is spared at each of them
        assert svc.worker.counters["gateway_lost"] == 1
        stop_lease.set()
        second = leased.collect(timeout=60)
        assert second.finish_reason == "abort" and len(second.token_ids) > len(first.token_ids), second
        assert svc.worker.counters["gateway_lost"] == 2
        assert detached_req.request_id in svc.worker.live  # never for gateway loss
        other = WireClient(connect(clean_redis))  # any gateway: a cancel needs the request's reply_to
        other.cancel([detached_req.request_id], reply_to=detached_req.reply_to)
        third = detached.collect(timeout=60)
        assert third.finish_reason == "abort" and len(third.token_ids) > len(second.token_ids), third
        assert svc.worker.counters["gateway_lost"] == 2 and svc.worker.counters["cancelled"] == 1
        # the abort is in the log too: a resumed client sees the end
        assert log_events(r, detached_req.request_id)[-1].finished.finish_reason == codec.finish_reason("abort")
    finally:
        stop_lease.set()
        cleanup(svc, llm)
