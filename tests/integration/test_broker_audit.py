"""The gateway broker's audit after a resubscription, against a real Redis.

A resubscription opens a window in which published events were missed, so the requests an engine
had taken by then are ended with a retryable 503. The audit must cover exactly the requests in
flight when the resubscription was confirmed: one enqueued after it can have missed nothing, and
ending it as soon as an engine takes it turned a healthy request into a 503 (a CI run of the Redis
restart test: one ``request_lost`` 1 s after Redis was back).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from gateway.broker import Broker, Lost
from sluice.wire import contract
from sluice.wire.messages_pb2 import GenerateRequest

pytestmark = pytest.mark.redis

MODEL = "audit-model"


def _request(rid: str) -> GenerateRequest:
    return GenerateRequest(version=contract.CONTRACT_VERSION, request_id=rid, model=MODEL,
                           prompt_token_ids=[1, 2, 3], deadline=time.time() + 60)


def test_the_audit_covers_only_requests_in_flight_at_the_resubscription(redis_url):
    sync = redis.Redis.from_url(redis_url)
    stream = contract.request_stream(MODEL, 0)
    sync.delete(stream)
    sync.xgroup_create(stream, contract.CONSUMER_GROUP, id="0", mkstream=True)

    async def scenario() -> tuple[object, object]:
        broker = Broker(redis_url)
        await broker.start()
        try:
            before, after = asyncio.Queue(), asyncio.Queue()
            broker.register(["before"], before)
            broker.register(["after"], after)
            await broker.enqueue(_request("before"))
            await broker.enqueue(_request("after"))
            # An engine takes both: the group's last-delivered id passes both entries.
            taken = await asyncio.to_thread(sync.xreadgroup, contract.CONSUMER_GROUP, "engine-1", {stream: ">"}, 10)
            assert len(taken[0][1]) == 2
            # "after" is enqueued once the resubscription is confirmed but before the spawned audit
            # runs its first command: out of the tracked set at the confirmation, back right after.
            late = broker._tracked.pop("after")
            audit = broker._resubscribed()
            broker._tracked["after"] = late
            await asyncio.wait_for(audit, 10)
            return (before.get_nowait() if not before.empty() else None,
                    after.get_nowait() if not after.empty() else None)
        finally:
            await broker.close()

    try:
        lost_before, lost_after = asyncio.run(scenario())
    finally:
        sync.delete(stream)
        sync.close()
    assert isinstance(lost_before, Lost) and lost_before.code.value == "request_lost", lost_before
    assert lost_after is None, f"a request enqueued after the resubscription was ended: {lost_after}"
