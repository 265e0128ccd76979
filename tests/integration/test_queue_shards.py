"""The sharded request queue against a real Redis, with fake (model-free) engines so it runs in
seconds: engines split the shards by rendezvous hashing and serve their own, an engine with room
steals what waits past the bound (or what a saturated or absent owner holds), kill -9 of a busy
shard's owner, an engine joining mid-load, a shard count changed on restart. Every request is
answered exactly once, by one engine.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterable

import pytest

from sluice.wire import contract, registry, shards
from sluice.wire.client import Result, WireClient
from tests.integration.test_engine_reliability import MODEL, FakeService
from tests.queue_helpers import pending_refs
from tests.waiting import wait_until

pytestmark = [pytest.mark.docker, pytest.mark.redis]

S = 8
HASH_ONLY = 1e9  # a --shard-load-slack no load reaches: rendezvous ownership alone
PARAMS = {"temperature": 0.0, "max_tokens": 3}


def sharing_id(others: Iterable[str]) -> str:
    """A random engine id that leaves each of ``others``, and itself, some of the S shards beside
    them. Why: rendezvous hashing gives all 8 shards of two engines to one of them for one pair of
    random ids in 128 by the odds (0.55% of 20,000 pairs drawn), and a test that needs both to own
    shards then failed."""
    others = list(others)
    for _ in range(10_000):
        candidate = f"fake-{uuid.uuid4().hex[:6]}"
        if set(shards.owners(S, [*others, candidate])) >= {*others, candidate}:
            return candidate
    raise AssertionError(f"no id leaves each of {len(others) + 1} engines one of {S} shards")


@pytest.fixture
def services(clean_redis):
    started: list[FakeService] = []

    def start(beside: Iterable[str] = (), **kw) -> FakeService:
        """A fake engine on S shards; by default with an id that leaves every engine started here,
        and each id in ``beside`` (a ghost's), some of the shards (sharing_id)."""
        kw.setdefault("queue_shards", S)
        if "engine_id" not in kw:
            kw["engine_id"] = sharing_id([*(s.settings.engine_id for s in started), *beside])
        svc = FakeService(clean_redis, **kw).start()
        started.append(svc)
        return svc

    yield start
    for svc in started:
        if svc.thread.is_alive():
            svc.stop()


def prompt(tenant: int, turn: int = 0) -> list[int]:
    """A tenant's 40-token prefix (the fake card: 4-token blocks, 8 of them choose the shard) and a
    turn (token ids within the fake engine's vocabulary of 1,000)."""
    return [50 + tenant % 900, 50 + tenant // 900] * 20 + [7, turn + 1]


def split(*svcs: FakeService) -> bool:
    """Every service sees all the others: their owned shards partition the queue."""
    owned = [set(s.io.view.owned) for s in svcs]
    return sum(len(o) for o in owned) == S and set().union(*owned) == set(range(S))


def served_once(result: Result, one_engine: bool = True) -> str:
    """The engine that ended the request: exactly one terminal event, the last; with
    ``one_engine``, every event from that engine (nobody else ran it)."""
    assert not result.timed_out, result
    terminal = [e for e in result.events if e.HasField("finished") or e.HasField("error")]
    assert len(terminal) == 1 and result.events[-1] is terminal[0], result.events
    if one_engine:
        assert len({e.engine_id for e in result.events}) == 1, result.events
        assert result.error_code is None and result.finish_reason == "length", result
    return terminal[0].engine_id


def ghost(r, engine_id: str, waiting: int = 0, room: bytes = b"1", ttl_s: float = 60.0) -> None:
    """A registered, live engine of the model that never reads: it says it has room (a hung
    reader), or says it has none (``room=b"0"``, or requests ``waiting`` in its registry entry)."""
    entry = registry.EngineEntry(engine_id=engine_id, model=MODEL, heartbeat=time.time(), waiting=waiting)
    r.hset(contract.ENGINES_KEY, engine_id, entry.encode())
    r.set(contract.engine_key(engine_id), json.dumps({"model": MODEL}), px=int(ttl_s * 1000))
    r.set(contract.room_key(engine_id), room, px=int(ttl_s * 1000))


def tenants_on(shard_ids: set[int], count: int) -> list[int]:
    """Tenants whose prompts go to one of ``shard_ids`` (as WireClient chooses)."""
    out = []
    for t in range(10_000):
        if shards.choose_shard(prompt(t), shards=S, block_size=4, prefix_blocks=8, request_id="x") in shard_ids:
            out.append(t)
            if len(out) == count:
                return out
    raise AssertionError("no tenant lands there")


def test_engines_split_the_shards_and_serve_their_own(services, redis_client):
    # ownership by the hash alone here (a slack no load reaches): the requests below go to one
    # engine's tenants first, which bounded ownership would rightly answer by moving shards
    a = services(steal_after_ms=60_000, shard_load_slack=HASH_ONLY)
    b = services(steal_after_ms=60_000, shard_load_slack=HASH_ONLY)
    # (and neither is saturated any more in the other's view: an engine's first beat, before its
    # worker gave it credit, says it has no room, and a peer takes what it owns at once)
    wait_until(lambda: split(a, b) and a.io.view.owners == b.io.view.owners
               and not a.io.view.saturated and not b.io.view.saturated, 10, "both engines see each other with room")
    # A read that blocked under the old view (the first engine alone owned every shard) may still
    # take one entry of a shard it no longer owns: it ends within read_block_ms.
    time.sleep(a.settings.read_block_ms / 1000 + 0.05)
    owners = a.io.view.owners
    # six tenants on each engine's shards: the engine ids are random, so tenants 0-11 alone all
    # landed on one engine's shards now and then (two random ids can split the 8 shards 7 to 1)
    tenants = [t for svc in (a, b)
               for t in tenants_on({s for s in range(S) if owners[s] == svc.settings.engine_id}, 6)]
    client = WireClient(redis_client)
    handles, served = [], []
    for t in tenants:
        for turn in range(2):
            # One request at a time: an owner whose credit (4 here) ran out says it has no room,
            # and a peer then takes its entries at once, by design. With room and the bound a
            # minute away, nothing is stolen: the owner of the request's shard served it.
            h = client.submit(MODEL, prompt(t, turn), PARAMS)
            served.append(served_once(h.collect(timeout=10)))
            assert served[-1] == owners[h.shard]
            handles.append(h)
    # a tenant's turns share a shard; both engines served
    assert all(handles[2 * i].shard == handles[2 * i + 1].shard for i in range(len(tenants)))
    assert set(served) == {a.settings.engine_id, b.settings.engine_id}
    wait_until(lambda: not pending_refs(redis_client, MODEL, shards=S), 5, "everything acknowledged")
    assert a.io.stats["stolen"] == b.io.stats["stolen"] == 0


@pytest.mark.both_topologies
def test_what_a_silent_owner_holds_is_stolen_past_the_bound(services, redis_client):
    """A live owner that never reads (hung, or busy): an engine with room takes its shards' entries
    once they waited ``steal_after_ms``, oldest first, and each exactly once."""
    ghost(redis_client, "ghost")
    svc = services(steal_after_ms=300, beside=["ghost"])
    wait_until(lambda: "ghost" in svc.io.view.owners and svc.io.view.owned, 10, "the ghost owns shards")
    theirs = {i for i, o in enumerate(svc.io.view.owners) if o == "ghost"}
    client = WireClient(redis_client)
    sent = time.monotonic()
    handles = [client.submit(MODEL, prompt(t), PARAMS) for t in tenants_on(theirs, 6)]
    for h in handles:
        assert h.shard in theirs
        assert served_once(h.collect(timeout=10)) == svc.settings.engine_id
    assert time.monotonic() - sent >= 0.3, "taken before the bound: the owner's shards were read as our own"
    assert svc.io.stats["stolen"] == len(handles)
    wait_until(lambda: not pending_refs(redis_client, MODEL, shards=S), 5, "everything acknowledged")


@pytest.mark.parametrize("signal", ["room", "registry"])
def test_a_saturated_owners_entries_are_taken_at_once(services, redis_client, signal):
    """An owner without room (its reader's credit spent: ``contract.room_key``, or requests waiting
    inside it in its registry entry) cannot take them: its shards' entries are taken without
    waiting for the bound (a minute here)."""
    if signal == "room":
        ghost(redis_client, "busy", room=b"0")
    else:
        ghost(redis_client, "busy", waiting=5)
    svc = services(steal_after_ms=60_000, beside=["busy"])
    wait_until(lambda: "busy" in svc.io.view.owners, 10, "the busy owner seen")
    if signal == "registry":
        wait_until(lambda: "busy" in svc.io.view.saturated, 10, "the busy owner seen as saturated")
    theirs = {i for i, o in enumerate(svc.io.view.owners) if o == "busy"}
    client = WireClient(redis_client)
    handles = [client.submit(MODEL, prompt(t), PARAMS) for t in tenants_on(theirs, 4)]
    for h in handles:
        assert served_once(h.collect(timeout=10)) == svc.settings.engine_id
    assert svc.io.stats["stolen"] == len(handles)


def test_kill9_of_a_busy_shards_owner(services, redis_client):
    """Two engines, load on both; one dies without a word. Its running entries are reclaimed per
    shard (restarted when nothing was emitted, errored when something was), its shards taken over
    when its heartbeat lapses: every request ends exactly once, nothing stays pending."""
    a = services(slow=0.02, steal_after_ms=200)
    b = services(slow=0.02, steal_after_ms=200)
    wait_until(lambda: split(a, b), 10, "both engines see each other")
    client = WireClient(redis_client)
    params = {"temperature": 0.0, "max_tokens": 25}
    handles = [client.submit(MODEL, prompt(t), params) for t in range(24)]
    wait_until(lambda: a.worker.live, 10, "the doomed engine runs requests")
    a.stop(deregister=False)  # as a kill -9: its liveness key lapses after 2 s, its entries stay pending
    results = [h.collect(timeout=30) for h in handles]
    for r in results:
        engine = served_once(r, one_engine=False)
        if r.error_code is not None:  # it had emitted tokens on the dead engine
            assert r.error_code == contract.ERR_ENGINE_LOST and engine == b.settings.engine_id, r
        else:
            assert r.finish_reason == "length" and len(r.token_ids) == 25
            assert len({e.engine_id for e in r.events}) == 1, "restarted after tokens were sent"
    assert any(r.error_code is None and r.events[-1].engine_id == b.settings.engine_id for r in results)
    wait_until(lambda: not pending_refs(redis_client, MODEL, shards=S), 10, "nothing left pending")
    wait_until(lambda: len(b.io.view.owned) == S, 10, "the survivor owns every shard")


def test_an_engine_joining_mid_load_takes_its_shards(services, redis_client):
    a = services(slow=0.01)
    wait_until(lambda: len(a.io.view.owned) == S, 10, "alone: every shard")
    client = WireClient(redis_client)
    handles: list = []
    results: list[Result] = []
    stop = threading.Event()

    def load() -> None:
        # Each open handle holds a pub/sub connection: collect the oldest answers as the load goes
        # on, so a slow newcomer meets a steady stream, not a client out of connections.
        t = 0
        while not stop.is_set():
            handles.append(client.submit(MODEL, prompt(t % 16, t), PARAMS))
            t += 1
            if len(handles) - len(results) > 32:
                results.append(handles[len(results)].collect(timeout=15))
            time.sleep(0.01)

    feeder = threading.Thread(target=load)
    feeder.start()
    try:
        time.sleep(0.3)
        b = services(slow=0.01)
        wait_until(lambda: split(a, b), 10, "the newcomer owns its share")
        wait_until(lambda: b.worker.counters is not None and b.engine.iterations > 0, 10, "the newcomer serves")
    finally:
        stop.set()
        feeder.join()
    owners = a.io.view.owners
    assert set(owners) == {a.settings.engine_id, b.settings.engine_id}
    results += [h.collect(timeout=15) for h in handles[len(results):]]
    served = [served_once(r) for r in results]
    assert b.settings.engine_id in served and a.settings.engine_id in served
    wait_until(lambda: not pending_refs(redis_client, MODEL, shards=S), 5, "everything acknowledged")


def test_a_shard_count_lowered_on_restart_strands_nothing(services, redis_client):
    """An engine published 8 shards and left entries queued on shards 4..7 (gateways followed its
    card); it comes back with 4: it still serves all 8 (the largest count ever published)."""
    first = services(queue_shards=S)
    wait_until(lambda: redis_client.sismember(contract.queue_shards_key(MODEL), S), 5, "8 shards published")
    first.stop()
    client = WireClient(redis_client)
    high = [client.submit(MODEL, prompt(t), PARAMS, shard=s) for t, s in enumerate(range(4, S))]
    again = services(queue_shards=4)
    wait_until(lambda: again.io.view.count == S, 10, "the restarted engine serves the old shards too")
    for h in high:
        assert served_once(h.collect(timeout=10)) == again.settings.engine_id
    assert len(again.io.streams) == S


@pytest.mark.both_topologies
def test_ownership_bounded_by_load_moves_a_busy_engines_shards(services, redis_client):
    """Four tenants, each on its own shard, all four shards owned by one engine by the hash: by the
    hash alone that engine would serve everything while the other idles. Each engine publishes the
    prompt tokens it took per shard; ownership bounded by load (slack 0.1: within 1.1x of an
    even share for a new placement, 1.2x to keep one) moves two of them, both engines agree, and
    from then on each serves its two tenants' requests, half the prompt tokens each, nothing stolen."""
    a = services(steal_after_ms=60_000)
    b = services(steal_after_ms=60_000)
    wait_until(lambda: split(a, b) and a.io.view.owners == b.io.view.owners
               and not a.io.view.saturated and not b.io.view.saturated, 10, "both engines see each other with room")
    busy = max((a, b), key=lambda svc: len(svc.io.view.owned))  # 4 or more of the 8
    theirs = set(busy.io.view.owned)
    tenants: list[int] = []
    for t in tenants_on(theirs, 200):  # four tenants on four distinct shards of one engine
        if shards.choose_shard(prompt(t), shards=S, block_size=4, prefix_blocks=8, request_id="x") not in \
                {shards.choose_shard(prompt(u), shards=S, block_size=4, prefix_blocks=8, request_id="x") for u in tenants}:
            tenants.append(t)
        if len(tenants) == 4:
            break
    assert len(tenants) == 4
    client = WireClient(redis_client)

    def burst(turn: int) -> list[tuple[int, str]]:
        handles = [client.submit(MODEL, prompt(t, turn * 10 + k), PARAMS) for k in range(6) for t in tenants]
        return [(h.shard, served_once(h.collect(timeout=10))) for h in handles]

    burst(0)
    moved = {shards.choose_shard(prompt(t), shards=S, block_size=4, prefix_blocks=8, request_id="x") for t in tenants}

    def settled() -> bool:
        owners = a.io.view.owners
        per = [sum(owners[s] == svc.settings.engine_id for s in moved) for svc in (a, b)]
        # agreed, two each, and the hand-over over (each takes only its own)
        return owners == b.io.view.owners and per == [2, 2] and not a.io.view.handed_over | b.io.view.handed_over

    try:
        wait_until(settled, 10, "two of the busy engine's shards moved")
    except AssertionError as exc:  # what each engine saw, for the report
        views = {svc.settings.engine_id: (svc.io.view.owners, sorted(svc.io.view.handed_over),
                                          getattr(svc.io.view, "loads", None)) for svc in (a, b)}
        raise AssertionError(f"{exc}; moved {sorted(moved)}; busy {busy.settings.engine_id}; views {views}") from None
    owners = a.io.view.owners
    # the first burst moved the shards while it ran: its hand-over may take entries past the owner;
    # from now on nothing is stolen
    stolen = [svc.io.stats["stolen"] for svc in (a, b)]
    served = burst(1)
    assert all(engine == owners[shard] for shard, engine in served), (owners, served)
    per_engine = [sum(engine == svc.settings.engine_id for _, engine in served) for svc in (a, b)]
    assert per_engine == [12, 12]  # equal prompts: equal prompt tokens
    assert [svc.io.stats["stolen"] for svc in (a, b)] == stolen
    wait_until(lambda: not pending_refs(redis_client, MODEL, shards=S), 5, "everything acknowledged")
