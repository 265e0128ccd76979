"""Gateway state stays bounded whatever names clients send.

An unknown model name must leave nothing behind in the gateway (a per-name lock kept forever would
grow it without bound). The memory measurement over many requests is a benchmark
(``sluice bench gateway-memory``, docs/benchmarks.md), not a timed test; this test checks the
structures themselves.
"""

from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from gateway.broker import Broker, _KeyedLocks
from tests.integration import test_gateway_support as support
from tests.integration.test_gateway_support import MODEL

fake_engine = support.fake_engine
make_gateway = support.make_gateway
gateway = support.gateway

pytestmark = [pytest.mark.model, pytest.mark.redis]


def _broker_state(broker: Broker) -> dict[str, int]:
    return {"card_locks": len(broker._card_locks), "cards": len(broker._cards), "tracked": len(broker._tracked),
            "queues": len(broker._queues), "forget": len(broker._forget),
            "pending_cancels": len(broker._pending_cancels)}


def test_unknown_model_names_leave_nothing_behind(gateway, fake_engine):
    broker: Broker = gateway.app.state.broker
    names = [f"nope-{uuid.uuid4().hex}-" + "x" * 4000 for _ in range(200)]

    def one(name: str) -> int:
        body = {"model": name, "prompt": "x", "max_tokens": 2}
        return httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=30).status_code

    with ThreadPoolExecutor(12) as pool:
        statuses = list(pool.map(one, names))
    assert set(statuses) == {404}
    ok = httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200
    state = _broker_state(broker)
    assert state == {"card_locks": 0, "cards": 1, "tracked": 0, "queues": 0, "forget": state["forget"],
                     "pending_cancels": 0}
    assert state["forget"] <= 1  # the finished request's marker, deleted at the next housekeeping tick


async def test_keyed_locks_exclude_per_key_and_forget_idle_keys():
    locks = _KeyedLocks()
    inside: dict[str, int] = {}
    peak: dict[str, int] = {}

    async def work(key: str) -> None:
        async with locks.hold(key):
            inside[key] = inside.get(key, 0) + 1
            peak[key] = max(peak.get(key, 0), inside[key])
            await asyncio.sleep(0.01)
            inside[key] -= 1

    await asyncio.gather(*(work(k) for k in ["a", "b"] * 10 + [f"k{i}" for i in range(200)]))
    assert peak["a"] == peak["b"] == 1  # one holder per key at a time
    assert len(locks) == 0

    async def boom() -> None:
        async with locks.hold("c"):
            raise ValueError

    with pytest.raises(ValueError):
        await boom()
    assert len(locks) == 0
