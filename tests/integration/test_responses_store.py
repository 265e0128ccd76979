"""The stored responses' Redis layout (``contract.response_key``, ``sluice.wire.stored_response``)
on a real Redis, standalone and Cluster: one hash per response written with its TTL by one script,
an update that never brings back a deleted response, decoding what was written, and the walk of a
``previous_response_id`` chain along its links."""

from __future__ import annotations

import pytest

from gateway.responses.store import MissingLink, ResponseStore
from sluice.wire import contract
from sluice.wire import stored_response as sr
from sluice.wire.connection import connect

pytestmark = [pytest.mark.both_topologies, pytest.mark.redis]


async def test_save_update_load_delete(clean_redis, redis_client):
    r = connect(clean_redis, asyncio=True)
    try:
        store = ResponseStore(r)
        rid = "resp_abc}{odd"  # a `}` in the id still keeps the key in one slot
        assert await store.load(rid) is None
        # an update of a response that does not exist writes nothing
        assert not await store.save(rid, 100, **{sr.F_STATUS: "completed"})
        assert not redis_client.exists(contract.response_key(rid))
        assert await store.save(rid, 100, create=True, **{sr.F_STATUS: "in_progress", sr.F_RECORD: '{"id": 1}',
                                                          sr.F_INPUT: [{"id": "msg_1"}]})
        assert 0 < redis_client.pttl(contract.response_key(rid)) <= 100_000
        running = await store.load(rid)
        assert running.running and running.record == '{"id": 1}' and running.input == [{"id": "msg_1"}]
        assert running.response is None and running.conversation is None and not running.background
        assert await store.save(rid, 3600, **{sr.F_STATUS: "completed", sr.F_RESPONSE: {"id": rid},
                                              sr.F_CONVERSATION: [{"type": "message"}]})
        assert redis_client.pttl(contract.response_key(rid)) > 100_000  # the full TTL now
        done = await store.load(rid)
        assert not done.running and done.status == "completed" and done.response == {"id": rid}
        assert done.input == [{"id": "msg_1"}] and done.conversation == [{"type": "message"}]
        assert await store.delete(rid) and not await store.delete(rid)
        # a response deleted while it ran stays deleted
        assert not await store.save(rid, 3600, **{sr.F_STATUS: "completed"})
        assert await store.load(rid) is None
    finally:
        await r.aclose()


def _turn(i: int) -> dict:
    return {sr.F_STATUS: "completed",
            sr.F_INPUT: [{"type": "message", "id": f"in{i}"}, {"type": "reasoning", "id": f"rs{i}"}],
            sr.F_RESPONSE: {"id": f"resp_{i}", "output": [{"type": "message", "id": f"out{i}"}]}}


async def _chain_of(store: ResponseStore, n: int, ttl_s: float = 100) -> list[str]:
    """resp_0 .. resp_{n-1}, each continuing the one before (its ancestors as the gateway links them)."""
    ids: list[str] = []
    ancestors: list[str] = []
    for i in range(n):
        rid = f"resp_{i}"
        assert await store.save(rid, ttl_s, create=True, **_turn(i), **{sr.F_ANCESTORS: ancestors or None})
        ancestors = [rid, *ancestors[:sr.ANCESTOR_WINDOW - 1]]
        ids.append(rid)
    return ids


class _Counting:
    """The client, counting its pipelines (one round trip each)."""

    def __init__(self, redis) -> None:
        self.redis, self.pipelines = redis, 0

    def pipeline(self, **kw):
        self.pipelines += 1
        return self.redis.pipeline(**kw)

    def __getattr__(self, name):
        return getattr(self.redis, name)


async def test_a_chain_is_walked_along_its_links(clean_redis, redis_client):
    """Each response keeps its own turn and the ids of its nearest ancestors: the walk reads a
    window of them per round trip, oldest item first, renews every TTL on the way (never
    shortening one), stops at its bound, and names a link that is gone or another tenant's."""
    r = connect(clean_redis, asyncio=True)
    try:
        store = ResponseStore(r, tenant="team-a")
        n = 3 * sr.ANCESTOR_WINDOW + 2
        ids = await _chain_of(store, n)
        last = await store.load(ids[-1])
        assert len(last.ancestors) == sr.ANCESTOR_WINDOW and last.ancestors[0] == ids[-2]
        counting = _Counting(r)
        chain = await ResponseStore(counting, tenant="team-a").chain(ids[-1], last, 3600, most=10_000)
        expected = [item for i in range(n) for item in (f"in{i}", f"rs{i}", f"out{i}")]
        assert [item["id"] for item in chain.items] == expected and not chain.cut
        # one round trip per window of ancestors (each renewing the TTLs of what it reads)
        assert counting.pipelines == -(-(n - 1) // sr.ANCESTOR_WINDOW)
        ttls = [redis_client.pttl(contract.response_key(rid)) for rid in ids]
        assert all(3_000_000 < t <= 3_600_000 for t in ttls), ttls
        await store.chain(ids[-1], last, 50, most=10_000)  # a shorter TTL shortens nothing
        assert all(redis_client.pttl(contract.response_key(rid)) > 3_000_000 for rid in ids)
        # bounded: the newest items within `most` prompt items (reasoning ones are not counted)
        cut = await store.chain(ids[-1], last, 3600, most=7)
        assert cut.cut and [i["id"] for i in cut.items] == expected[-11:]
        # a link deleted (or expired) in the middle of the chain is named
        assert await store.delete(ids[5])
        with pytest.raises(MissingLink) as missing:
            await store.chain(ids[-1], last, 3600, most=10_000)
        assert missing.value.response_id == ids[5]
        # another tenant's response in the chain is a missing link too
        foreign = ResponseStore(r, tenant="team-b")
        assert await foreign.save(ids[5], 100, create=True, **_turn(5))
        with pytest.raises(MissingLink):
            await store.chain(ids[-1], last, 3600, most=10_000)
        assert await foreign.load(ids[-1]) is None
    finally:
        await r.aclose()


async def test_a_chain_ends_at_a_response_stored_whole(clean_redis):
    """A response written before chains were linked holds its whole conversation: a chain that
    reaches it takes that and stops there."""
    r = connect(clean_redis, asyncio=True)
    try:
        store = ResponseStore(r)
        whole = [{"type": "message", "id": "old-in"}, {"type": "message", "id": "old-out"}]
        assert await store.save("resp_old", 100, create=True, **{sr.F_STATUS: "completed",
                                                                  sr.F_CONVERSATION: whole})
        assert await store.save("resp_new", 100, create=True, **_turn(1), **{sr.F_ANCESTORS: ["resp_old"]})
        chain = await store.chain("resp_new", await store.load("resp_new"), 3600, most=100)
        assert [i["id"] for i in chain.items] == ["old-in", "old-out", "in1", "rs1", "out1"]
    finally:
        await r.aclose()
