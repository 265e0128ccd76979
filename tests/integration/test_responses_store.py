"""The stored responses' Redis layout (``contract.response_key``, ``sluice.wire.stored_response``)
on a real Redis, standalone and Cluster: one hash per response written with its TTL by one script,
an update that never brings back a deleted response, and decoding what was written."""

from __future__ import annotations

import pytest

from gateway.responses.store import ResponseStore
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
