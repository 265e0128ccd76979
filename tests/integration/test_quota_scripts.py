"""The quota scripts (``sluice.wire.quota``) on a real Redis, on one server and on a Redis Cluster:
each check-and-take is one script in one slot, so a burst of admissions from many clients never
overshoots a limit, and what is given back comes back exactly once."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from sluice.wire import contract, quota
from sluice.wire.connection import connect

pytestmark = [pytest.mark.both_topologies, pytest.mark.redis]


def _admit(client, tenant="t", *, rpm=0, tpm=0, conc=0, queued=0, tokens=1, member="m", ttl_ms=60_000):
    script = client.register_script(quota.ADMIT_SCRIPT)
    return quota.Verdict.decode(script(keys=quota.tenant_keys(tenant),
                                       args=[rpm, tpm, conc, queued, tokens, member, ttl_ms]))


def test_a_burst_never_overshoots_the_concurrency_limit(redis_client, clean_redis):
    clients = [connect(clean_redis) for _ in range(8)]  # as many gateways, each its own connection
    try:
        with ThreadPoolExecutor(32) as pool:
            verdicts = list(pool.map(lambda i: _admit(clients[i % 8], conc=10, member=f"r{i}"), range(200)))
    finally:
        for c in clients:
            c.close()
    assert sum(v.ok for v in verdicts) == 10
    assert {v.refused for v in verdicts if not v.ok} == {quota.CONCURRENT}
    assert redis_client.zcard(contract.active_key("t")) == 10


def test_the_model_gate_holds_under_a_burst(redis_client, clean_redis):
    gate = redis_client.register_script(quota.GATE_SCRIPT)
    with ThreadPoolExecutor(32) as pool:
        taken = list(pool.map(lambda i: gate(keys=[contract.model_queued_key("m")], args=[10, 60_000, f"r{i}"]),
                              range(200)))
    assert sum(taken) == 10
    # several places at once are all or nothing
    redis_client.zrem(contract.model_queued_key("m"), *redis_client.zrange(contract.model_queued_key("m"), 0, 2))
    assert gate(keys=[contract.model_queued_key("m")], args=[10, 60_000, "a", "b", "c", "d"]) == 0
    assert gate(keys=[contract.model_queued_key("m")], args=[10, 60_000, "a", "b", "c"]) == 1


def test_requests_per_minute_is_a_bucket(redis_client):
    verdicts = [_admit(redis_client, rpm=5, member=f"r{i}") for i in range(6)]
    assert [v.ok for v in verdicts] == [True] * 5 + [False]
    assert [v.requests_remaining for v in verdicts[:5]] == [4, 3, 2, 1, 0]
    refused = verdicts[5]
    assert refused.refused == quota.REQUESTS and 11_000 <= refused.retry_after_ms <= 12_000  # a request every 12 s
    assert refused.requests_reset_ms > 55_000 and refused.tokens_remaining is None


def test_tokens_reserved_and_given_back_once(redis_client):
    release = redis_client.register_script(quota.RELEASE_SCRIPT)
    keys = quota.tenant_keys("t")
    assert _admit(redis_client, tpm=1000, tokens=600, member="a").tokens_remaining == 400
    second = _admit(redis_client, tpm=1000, tokens=600, member="b")
    assert not second.ok and second.refused == quota.TOKENS and second.retry_after_ms > 0
    release(keys=keys, args=["a", 0, 0, 1000, 500])  # used 100 of the 600
    assert _admit(redis_client, tpm=1000, tokens=600, member="c").ok
    too_large = _admit(redis_client, tpm=1000, tokens=1001, member="d")
    assert not too_large.ok and too_large.refused == quota.TOO_LARGE


def test_places_lapse_and_a_refused_request_is_given_back(redis_client):
    assert _admit(redis_client, conc=1, member="a", ttl_ms=300).ok
    assert not _admit(redis_client, conc=1, member="b", ttl_ms=300).ok
    time.sleep(0.4)  # the holder's gateway died: its place lapses by itself
    assert _admit(redis_client, conc=1, rpm=2, member="c").ok
    release = redis_client.register_script(quota.RELEASE_SCRIPT)
    release(keys=quota.tenant_keys("t"), args=["c", 2, 1, 0, 0])  # refused after admission: all back
    release(keys=quota.tenant_keys("t"), args=["c", 0, 0, 0, 0])  # idempotent for the places
    assert redis_client.zcard(contract.active_key("t")) == 0
    peek = redis_client.register_script(quota.PEEK_SCRIPT)
    assert quota.Verdict.decode_peek(peek(keys=quota.tenant_keys("t")[:2], args=[2, 0])).requests_remaining == 2


def test_tenants_never_share_counters(redis_client):
    assert _admit(redis_client, "a", rpm=1, member="x").ok
    assert not _admit(redis_client, "a", rpm=1, member="y").ok
    assert _admit(redis_client, "b", rpm=1, member="y").ok
