"""Fair share between tenants in the scheduler (engine_service/core/fair_share.py): a flood cannot
delay another tenant's request beyond a bound, weights split the tokens of backlogged tenants in
proportion, preemption takes from the tenant furthest over its share, slot moves stop, and an idle
tenant banks no credit. Driven through the real Scheduler with ``FakeKVRunner`` (every context read
back through its block table), the invariants checked after every step."""

from __future__ import annotations

import itertools

import pytest

from engine_service.config import SchedulerConfig
from engine_service.core.fair_share import FairShare, may_take_slot
from engine_service.core.request import Request
from engine_service.core.sampling_params import SamplingParams
from engine_service.core.scheduler import RequestRejected, Scheduler
from sluice_bench.scheduler import FakeKVRunner


def request(rid: str, tenant: str = "", weight: int = 1, prompt: int = 8, max_tokens: int = 8) -> Request:
    base = 100 + 37 * (sum(map(ord, rid)) % 500)  # prompts share nothing by accident
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return Request(rid, list(range(base, base + prompt)), params, tenant=tenant, tenant_weight=weight)


class Sim:
    """A scheduler, its fake runner and a step clock (the scheduler's clock: times are in steps)."""

    def __init__(self, num_blocks: int = 400, block_size: int = 4, max_num_seqs: int = 4, budget: int = 64,
                 watermark: int = 0, moves: bool = True) -> None:
        self.now = 0.0
        cfg = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=budget, max_model_len=4096, watermark_blocks=watermark,
                              fair_share_preemption=moves)
        self.sched = Scheduler(cfg, clock=lambda: self.now)
        self.runner = FakeKVRunner(num_blocks, block_size)
        self.forwarded: dict[str, int] = {}  # tokens forwarded per tenant
        self.preempted: list[Request] = []

    def add(self, req: Request) -> Request:
        req.arrival_time = self.now
        self.sched.add_request(req)
        return req

    def step(self) -> None:
        out = self.sched.schedule()
        self.sched.check_invariants()
        for c in out.chunks:
            self.forwarded[c.request.tenant] = self.forwarded.get(c.request.tenant, 0) + c.num_tokens
        self.preempted += out.preempted
        self.sched.update_from_output(out, self.runner.step(out))
        self.sched.check_invariants()
        self.now += 1.0

    def until(self, done, limit: int = 5000) -> int:
        steps = 0
        while not done():
            self.step()
            steps += 1
            assert steps <= limit, "did not happen"
        return steps


def light_ttft(moves: bool, light_tenant: str, flood: int = 100) -> float:
    """Steps from the light request's arrival to its first token, behind a flood of ``flood``
    requests of tenant "flood" that fill the 4 slots first."""
    sim = Sim(moves=moves)
    for i in range(flood):
        sim.add(request(f"f{i}", "flood", max_tokens=20))
    for _ in range(5):
        sim.step()
    light = sim.add(request("light", light_tenant, max_tokens=4))
    sim.until(lambda: light.first_token_time is not None)
    sim.until(lambda: not sim.sched.has_unfinished_requests())
    return light.time_to_first_token


def test_a_flood_cannot_delay_another_tenants_request_beyond_a_bound():
    # another tenant: it takes a slot of the flood at the next step's start and has its first token then
    assert light_ttft(moves=True, light_tenant="light") <= 1.0
    # without slot moves it still goes ahead of the whole backlog: the next slot that frees is its own
    # (a flood request lives 8 + 20 tokens at most: 2 prefill steps at this budget, then 20 decodes)
    assert light_ttft(moves=False, light_tenant="light") <= 22.0
    # the same request in the flood's own tenant waits behind the backlog (first come, first served)
    assert light_ttft(moves=True, light_tenant="flood") > 300.0


@pytest.mark.parametrize("weights", [(1, 1), (3, 1), (1, 4)])
def test_weights_split_tokens_in_proportion_while_both_are_backlogged(weights):
    wa, wb = weights
    sim = Sim(max_num_seqs=4, budget=16)
    for i in range(150):  # alternate, so neither backlog is ahead by arrival
        sim.add(request(f"a{i}", "a", wa, prompt=4, max_tokens=12))
        sim.add(request(f"b{i}", "b", wb, prompt=4, max_tokens=12))
    for _ in range(20):  # warm up
        sim.step()
    before = dict(sim.forwarded)
    for _ in range(200):
        sim.step()
    a = sim.forwarded["a"] - before["a"]
    b = sim.forwarded["b"] - before["b"]
    view = sim.sched.fair_view().tenants
    assert view["a"].waiting and view["b"].waiting  # both still backlogged
    assert a / b == pytest.approx(wa / wb, rel=0.15), (a, b)


def test_preemption_takes_the_youngest_request_of_the_tenant_furthest_over_its_share():
    # a tight pool: 4 requests of 2 prompt tokens grow to 13 tokens (7 blocks of 2) each in 12 blocks
    sim = Sim(num_blocks=12, block_size=2, max_num_seqs=4, budget=8)
    a = [sim.add(request(f"a{i}", "a", prompt=2, max_tokens=12)) for i in range(3)]
    sim.step()
    b = sim.add(request("b0", "b", prompt=2, max_tokens=12))
    sim.step()
    assert [r.request_id for r in sim.sched.running] == ["a0", "a1", "a2", "b0"]  # b0 is the youngest
    sim.until(lambda: sim.preempted)
    assert sim.preempted[0] is a[2], sim.preempted  # a holds 3 slots, b 1: a's youngest gives way
    assert b.num_preemptions == 0
    sim.until(lambda: not sim.sched.has_unfinished_requests())
    assert a[0].num_preemptions == 0  # the oldest running request is never preempted


def test_slot_moves_are_bounded_by_the_takers_arrivals():
    sim = Sim()
    for i in range(60):
        sim.add(request(f"f{i}", "flood", max_tokens=20))
    lights = []
    for k in range(12):  # one light request every 15 steps
        for _ in range(15):
            sim.step()
        lights.append(sim.add(request(f"l{k}", "light", max_tokens=4)))
    sim.until(lambda: not sim.sched.has_unfinished_requests())
    moves = [r for r in sim.preempted if r.tenant == "flood"]
    assert 1 <= len(moves) <= len(lights)  # one move per light request at most: nothing thrashes
    assert all(r.tenant != "light" for r in sim.preempted)
    assert all(r.time_to_first_token <= 1.0 for r in lights)


def test_a_slot_move_leaves_the_taker_no_more_slots_by_weight_than_the_giver():
    fair = FairShare()
    heavy, light = fair.join("heavy", 3), fair.join("light", 1)
    running = [request(f"r{i}", "light") for i in range(4)]  # light holds every slot
    light.num_running = light.num_requests = 4
    heavy.waiting.append(request("h0", "heavy"))
    heavy.num_requests = 1
    moves = []
    while (move := fair.slot_move(running)) is not None:
        taker, j = move
        assert taker is heavy and running[j].tenant == "light" and j > 0  # never the oldest
        running[j] = heavy.waiting.popleft()  # the scheduler preempts it and admits the taker's head
        light.num_running -= 1
        heavy.num_running += 1
        moves.append(j)
        assert heavy.num_running / heavy.weight <= light.num_running / light.weight
        heavy.waiting.append(request(f"h{len(moves)}", "heavy"))
    # weight 3 against 1: moves until 3 against 1 (3 / 3 <= 1 / 1); a fourth would leave 4 / 3 > 0 / 1
    assert (heavy.num_running, light.num_running) == (3, 1) and len(moves) == 3


def test_backlogged_tenants_hold_slots_in_proportion_to_their_weights():
    sim = Sim(max_num_seqs=4, budget=64)
    for i in range(100):
        sim.add(request(f"b{i}", "b", 1, max_tokens=30))
    sim.step()
    for i in range(100):
        sim.add(request(f"a{i}", "a", 3, max_tokens=30))
    held = {"a": 0, "b": 0}
    for _ in range(300):
        sim.step()
        view = sim.sched.fair_view().tenants
        assert view["a"].waiting and view["b"].waiting  # both backlogged throughout
        held["a"] += view["a"].running
        held["b"] += view["b"].running
    assert held["a"] / (held["a"] + held["b"]) == pytest.approx(0.75, abs=0.1), held


def test_a_tenant_joins_at_the_least_virtual_time_and_an_idle_one_banks_no_credit():
    sim = Sim(max_num_seqs=2, budget=64)
    a = sim.add(request("a0", "a", max_tokens=30))
    sim.until(lambda: a.is_finished)
    assert "a" not in sim.sched.fair_view().tenants  # idle: forgotten
    b = [sim.add(request(f"b{i}", "b", max_tokens=30)) for i in range(2)]
    sim.until(lambda: all(r.num_output_tokens >= 10 for r in b))
    b_vtime = sim.sched.fair_view().tenants["b"].vtime
    sim.add(request("a1", "a", max_tokens=30))
    view = sim.sched.fair_view()
    assert view.tenants["a"].vtime == b_vtime == view.floor  # not a's old, lower time: no credit banked


def test_fair_share_unit_rules():
    fair = FairShare()
    x = fair.join("x", 2)
    fair.charge(x, 10)
    assert x.vtime == 5.0
    y = fair.join("y", 1)
    assert y.vtime == 5.0  # the least virtual time of the active tenants
    fair.leave(x)
    fair.leave(y)
    assert fair.join("z", 1).vtime == 5.0  # nobody active: where the last one left
    assert fair.join("z", 7).weight == 7  # the latest request's weight
    view = fair.view()
    assert view.priority("absent") == (view.floor, 0.0)


def test_every_slot_move_lowers_the_potential():
    """may_take_slot's rule makes sum(n^2 / w) fall with every move: moves cannot cycle, and a
    giver keeps a slot."""
    for nt, ng, wt, wg in itertools.product(range(5), range(1, 6), range(1, 5), range(1, 5)):
        if may_take_slot(nt, wt, ng, wg):
            before = nt * nt / wt + ng * ng / wg
            after = (nt + 1) ** 2 / wt + (ng - 1) ** 2 / wg
            assert after < before, (nt, ng, wt, wg)
            assert ng >= 2


def test_the_view_says_who_could_take_a_slot_and_how_many_there_are_to_give():
    sim = Sim(max_num_seqs=4)
    for i in range(10):
        sim.add(request(f"f{i}", "flood", weight=2, max_tokens=20))
    sim.step()
    view = sim.sched.fair_view()
    assert view.giver == "flood" and view.slots_to_give == 2  # 4 running over a weight of 2
    assert view.may_take_slot("absent") and not view.may_take_slot("flood")
    sim.add(request("l0", "light", max_tokens=20))
    view = sim.sched.fair_view()
    assert view.slots_to_give == 1  # light waits for one of them
    assert not view.may_take_slot("light")  # it waits already: nothing more to read ahead
    sim.step()  # light took a slot: 3 against 1; (1 + 1) / 1 <= (3 - 1) / 2 does not hold
    view = sim.sched.fair_view()
    assert view.tenants["light"].running == 1 and not view.may_take_slot("light")
    assert view.may_take_slot("absent")  # (0 + 1) / 1 <= (3 - 1) / 2


@pytest.mark.parametrize(("tenant", "weight", "param"), [("no spaces", 1, "tenant"), ("", 0, "tenant_weight"),
                                                        ("t", 1001, "tenant_weight")])
def test_the_door_refuses_a_bad_tenant_or_weight(tenant, weight, param):
    sim = Sim()
    with pytest.raises(RequestRejected, match=param.replace("_", " ")):
        sim.add(request("r", tenant, weight))
    assert not sim.sched.has_unfinished_requests() and not sim.sched.fair_view().tenants
