"""A model nobody serves any more (contract 6, ``contract.served_key``, gateway/unserved.py): its
queued requests are answered ``no_engine`` and their entries deleted; once its grace period is over,
the gateway removes its card, shard counts, name, queue streams and tenants' lanes (and the entries
nobody waits for: a gone gateway's, a passed deadline's), and stops exporting its gauge. An engine
that serves it again keeps everything.

The engine here is the gateway tests' stand-in (test_gateway_support.FakeEngine): its ``kill()`` stops
its heartbeat and drops its liveness key without a word, as ``kill -9`` leaves a real engine's.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from gateway import broker as broker_module
from gateway import generation, unserved
from sluice.wire import codec, contract
from sluice.wire.client import WireClient
from sluice.wire.connection import connect
from tests.integration import test_gateway_support as support
from tests.integration.test_gateway_api import assert_error
from tests.integration.test_gateway_support import MODEL
from tests.waiting import wait_until

make_gateway = support.make_gateway
make_fake_engine = support.make_fake_engine

pytestmark = [pytest.mark.model, pytest.mark.redis]


def _model_keys(r) -> list[str]:
    """Every key of the model: its card, name, shard counts, served key, queue shards and lanes."""
    keys = [k.decode() for k in r.scan_iter(match=f"*{MODEL}*", count=1000)]
    if r.sismember(contract.MODELS_KEY, MODEL):
        keys.append(f"{contract.MODELS_KEY} member {MODEL}")
    return sorted(keys)


@pytest.mark.both_topologies
def test_a_model_nobody_serves_is_answered_no_engine_then_forgotten(make_gateway, make_fake_engine, clean_redis,
                                                                    monkeypatch):
    monkeypatch.setattr(generation, "LIVENESS_CHECK_S", 0.2)
    monkeypatch.setattr(generation, "NO_ENGINE_WAIT_S", 1.0)
    monkeypatch.setattr(broker_module, "UNSERVED_CHECK_S", 0.5)
    engine = make_fake_engine(clean_redis, model_grace_s=3.0)
    gateway = make_gateway()
    engine.pause()  # requests stay queued
    r = connect(clean_redis)
    wc = WireClient.from_url(clean_redis)
    try:
        # left behind: a gone gateway's request on a tenant's lane, and a request whose deadline passed
        wc.submit(MODEL, [1, 2, 3], {"max_tokens": 3}, gateway_id="gone-gateway", deadline=time.time() + 600,
                  tenant="acme", shard=3)
        wc.submit(MODEL, [4, 5, 6], {"max_tokens": 3}, deadline=time.time() - 1, shard=5)
        result = {}

        def ask() -> None:
            result["r"] = httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30)

        t = threading.Thread(target=ask)
        t.start()
        # "x" is shorter than a block, so its shard comes from its request id: any of them, shard 5 too
        wait_until(lambda: sum(r.xlen(s) for s in contract.request_streams(MODEL, contract.DEFAULT_QUEUE_SHARDS)
                               if r.exists(s)) == 2, 5, "the request queued")
        assert httpx.get(f"{gateway.url}/metrics").text.count(f'num_requests_waiting{{model="{MODEL}"}}') == 1
        engine.kill()  # no heartbeat, no liveness key: what kill -9 leaves
        t.join(20)
        assert_error(result["r"], 503, code="no_engine")
        assert result["r"].headers["retry-after"] == "1"
        # its entry went with the answer; the others wait for the grace period to end
        waiting = [s for s in contract.request_streams(MODEL, contract.DEFAULT_QUEUE_SHARDS) if r.exists(s) and r.xlen(s)]
        assert waiting == [contract.request_stream(MODEL, 5)]
        assert r.exists(contract.model_card_key(MODEL))  # within the grace: still known (503, not 404)
        assert_error(httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "x"}), 503,
                     code="no_engine")
        # past the grace: every key of the model is gone, and the gateway no longer knows the model
        wait_until(lambda: _model_keys(r) == [], 15, "the model's keys removed")
        assert not r.exists(contract.lanes_key(MODEL, 3))
        assert contract.model_card_key(MODEL) not in [k.decode() for k in r.scan_iter(count=1000)]
        assert r.hget(contract.ENGINES_KEY, engine.engine_id) is None  # its dead engine's registry entry too
        wait_until(lambda: httpx.post(f"{gateway.url}/v1/completions",
                                      json={"model": MODEL, "prompt": "x"}).status_code == 404, 10, "404 for the model")
        assert "num_requests_waiting{" not in httpx.get(f"{gateway.url}/metrics").text
        assert httpx.get(f"{gateway.url}/v1/models").json()["data"] == []
    finally:
        wc.close()
        r.close()


def test_a_served_model_and_a_waited_for_request_are_kept(clean_redis):
    """forget_model takes nothing from a model an engine serves again, and leaves (with the model)
    the entry of a request its gateway still waits for (that gateway answers it)."""
    r = connect(clean_redis)
    wc = WireClient.from_url(clean_redis)

    async def forget() -> tuple[list[str], bool]:
        client = connect(clean_redis, asyncio=True)
        try:
            return await unserved.unserved_models(client), await unserved.forget_model(client, MODEL, grace_s=60)
        finally:
            await client.aclose()

    try:
        card = {"name": MODEL, "queue_shards": "2"}
        r.hset(contract.model_card_key(MODEL), mapping=card)
        r.sadd(contract.MODELS_KEY, MODEL)
        r.sadd(contract.queue_shards_key(MODEL), 2)
        r.set(contract.served_key(MODEL), "e1", px=60_000)
        assert asyncio.run(forget()) == ([], False)  # the forget script refuses a served model
        assert r.exists(contract.model_card_key(MODEL)) and r.sismember(contract.MODELS_KEY, MODEL)
        r.delete(contract.served_key(MODEL))
        # a live gateway waits for this one: its liveness key and in-flight marker exist
        req = codec.make_request("waited", MODEL, [1, 2], {"max_tokens": 2}, reply_to="gw-live", gateway_id="gw-live",
                                 deadline=time.time() + 600)
        wc.enqueue(req, shard=1)
        r.set(contract.gateway_key("gw-live"), b"1", ex=60)
        r.set(contract.inflight_key(MODEL, 1, "waited"), b"1", ex=600)
        r.xgroup_create(contract.request_stream(MODEL, 0), contract.CONSUMER_GROUP, id="0", mkstream=True)
        assert asyncio.run(forget()) == ([MODEL], False)
        assert r.xlen(contract.request_stream(MODEL, 1)) == 1  # kept, and the model with it
        assert not r.exists(contract.request_stream(MODEL, 0))  # the empty shard went
        assert r.exists(contract.model_card_key(MODEL))
        r.delete(contract.inflight_key(MODEL, 1, "waited"))  # its gateway answered it (and is done)
        assert asyncio.run(forget()) == ([MODEL], True)
        assert _model_keys(r) == []
    finally:
        wc.close()
        r.close()
