"""Property-based test of the scheduler: random pool sizes, block sizes, budgets, slots, watermarks,
arrivals, aborts, lengths and tenants with weights (one tenant: the plain FIFO path; several: the fair
share, slot moves on or off). Every admitted request finishes or is aborted within a bounded number
of steps, no block leaks, and the invariants hold after every step. ``FakeKVRunner`` checks that
every scheduled request reads its exact context back through its block table (so prefix-cache hits,
shared blocks and recompute are checked too), and makes outputs depend on that context."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_service.config import DecodeCapabilities, SchedulerConfig
from engine_service.core.block_pool import blocks_for_length
from engine_service.core.request import FinishReason, Request, RequestStatus
from engine_service.core.sampling_params import SamplingParams
from engine_service.core.scheduler import RequestRejected, Scheduler
from sluice_bench.scheduler import FakeKVRunner

EOS = 0
VOCAB = 12  # small, so that EOS is sampled now and then


@st.composite
def scenarios(draw, pressure: bool = False):
    """A config and a list of request specs. ``pressure``: a small pool, several slots, a small
    reserve and early arrivals, so that growth outruns the pool and preemption is the rule."""
    block_size = draw(st.integers(1, 6))
    num_blocks = draw(st.integers(2, 8) if pressure else st.integers(1, 16))
    cfg = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=draw(st.integers(2, 5) if pressure else st.integers(1, 5)),
        max_num_batched_tokens=draw(st.integers(1, 40)),
        max_model_len=draw(st.integers(num_blocks * block_size + 1, 80) if pressure else st.integers(2, 64)),
        watermark_blocks=draw(
            st.integers(0, 3) if pressure else st.integers(0, 2) | st.integers(0, num_blocks + 1)
        ),
        enable_prefix_caching=draw(st.booleans()),
        # several greedy decode steps a step (num_scheduler_steps) where no one waits
        num_scheduler_steps=draw(st.sampled_from([1, 1, 3, 8])),
        decode=DecodeCapabilities(multi_step_max_rows=draw(st.integers(0, 6))),
        fair_share_preemption=draw(st.booleans()),
    )
    # tenants: "" (the default) alone, or with others; a request's weight may differ from its
    # tenant's earlier ones (the latest counts)
    tenant_names = ["", "a", "b"][: draw(st.integers(1, 3))]
    pool_tokens = num_blocks * block_size
    # most requests are sized to pass the door (their KV fits the pool, so they compete for it);
    # a few are drawn freely and may be refused
    fit_cap = min(cfg.max_model_len, pool_tokens + 1)
    n = draw(st.integers(3, 8) if pressure else st.integers(1, 8))
    # prompts start with a prefix of one of two base prompts, so prefix-cache hits are common
    tokens = st.integers(1, 3)
    bases = [draw(st.lists(tokens, min_size=1, max_size=40)) for _ in range(2)]
    requests = []
    for i in range(n):
        if fit_cap >= 2 and (pressure or draw(st.integers(0, 9)) < 8):
            total = draw(st.integers(max(2, fit_cap // 2) if pressure else 2, fit_cap))
            prompt_len = draw(st.integers(1, total - 1))
            max_tokens = total - prompt_len
        else:
            prompt_len = draw(st.integers(1, 40))
            max_tokens = draw(st.integers(1, 16))
        base = bases[draw(st.integers(0, 1))]
        prompt = base[: draw(st.integers(0, len(base)))] + draw(st.lists(tokens, max_size=8))
        prompt = (prompt + [3, 1, 2] * prompt_len)[:prompt_len]
        requests.append(
            {
                "id": f"r{i}",
                "arrival": draw(st.integers(0, 2) if pressure else st.integers(0, 2) | st.integers(0, 12)),
                "prompt": prompt,
                "max_tokens": max_tokens,
                "ignore_eos": draw(st.booleans()),
                "tenant": draw(st.sampled_from(tenant_names)),
                "weight": draw(st.integers(1, 3)),
                # abort: None, or (step, between schedule and update?)
                "abort": draw(st.none() | st.tuples(st.integers(0, 40), st.booleans())),
            }
        )
    return cfg, requests


def expected_rejection(cfg: SchedulerConfig, spec: dict) -> str | None:
    total = len(spec["prompt"]) + spec["max_tokens"]
    if total > cfg.max_model_len:
        return "context_length_exceeded"
    if blocks_for_length(total - 1, cfg.block_size) > cfg.num_blocks:
        return "kv_cache_too_small"
    return None


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_every_admitted_request_finishes_without_leaks(scenario):
    run_scenario(*scenario)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(pressure=True))
def test_under_pool_pressure_every_admitted_request_finishes_without_leaks(scenario):
    run_scenario(*scenario)


def run_scenario(cfg: SchedulerConfig, specs: list[dict]) -> Scheduler:
    """Drive the scenario step by step with every check; return the scheduler for inspection."""
    sched = Scheduler(cfg)
    runner = FakeKVRunner(cfg.num_blocks, cfg.block_size, vocab_size=VOCAB)
    by_step: dict[int, list[dict]] = {}
    for spec in specs:
        by_step.setdefault(spec["arrival"], []).append(spec)
    aborts_before: dict[int, list[str]] = {}
    aborts_mid: dict[int, list[str]] = {}
    for spec in specs:
        if spec["abort"] is not None:
            at, mid = spec["abort"]
            (aborts_mid if mid else aborts_before).setdefault(at, []).append(spec["id"])
    admitted: dict[str, tuple[Request, dict]] = {}
    aborted: set[str] = set()
    # The oldest running request forwards at least one token a step and is never preempted, so each
    # admitted request needs at most len(prompt) + max_tokens steps as the oldest.
    bound = max(s["arrival"] for s in specs) + sum(len(s["prompt"]) + s["max_tokens"] for s in specs) + 2
    last_arrival = max(by_step)
    step = 0
    while step <= last_arrival or sched.has_unfinished_requests():
        for spec in by_step.get(step, []):
            params = SamplingParams(
                max_tokens=spec["max_tokens"], ignore_eos=spec["ignore_eos"], temperature=0.0
            )
            req = Request(spec["id"], list(spec["prompt"]), params, eos_token_ids=frozenset({EOS}),
                          tenant=spec["tenant"], tenant_weight=spec["weight"])
            want = expected_rejection(cfg, spec)
            before = (sched.num_waiting, sched.num_running, sched.block_pool.num_free_blocks)
            try:
                sched.add_request(req)
            except RequestRejected as e:
                assert e.code == want, (e.code, want, str(e))
                assert sched.get_request(spec["id"]) is None
                assert (sched.num_waiting, sched.num_running, sched.block_pool.num_free_blocks) == before
            else:
                assert want is None, f"{spec['id']} should have been refused ({want})"
                admitted[spec["id"]] = (req, spec)
        for rid in aborts_before.get(step, []):
            for r in sched.abort_requests([rid]):
                aborted.add(r.request_id)
        sched.check_invariants()

        out = sched.schedule()
        sched.check_invariants()
        assert out.num_batched_tokens == sum(c.num_tokens for c in out.chunks) <= cfg.max_num_batched_tokens
        assert len(out.chunks) <= cfg.max_num_seqs
        assert len({c.request.request_id for c in out.chunks}) == len(out.chunks)
        for c in out.chunks:
            assert c.num_tokens >= 1 and c.request.num_computed_tokens == c.start + c.num_tokens + c.num_steps - 1
            assert c.num_steps == 1 or (c.num_tokens == 1 and len(out.chunks) < cfg.decode.multi_step_max_rows)
        sampled = runner.step(out)  # the forward runs every scheduled chunk
        for rid in aborts_mid.get(step, []):
            for r in sched.abort_requests([rid]):
                aborted.add(r.request_id)
        updated = sched.update_from_output(out, sampled)
        assert all(r.request_id not in aborted for r in updated)
        sched.check_invariants()
        step += 1
        assert step <= bound, f"not finished after {step} steps (bound {bound})"

    pool = sched.block_pool
    assert pool.num_free_blocks == pool.num_total_blocks, "blocks leaked"
    assert sched.num_waiting == sched.num_running == 0
    for rid, (req, spec) in admitted.items():
        assert req.status is RequestStatus.FINISHED, rid
        assert not req.block_ids
        if rid in aborted:
            assert req.finish_reason is FinishReason.ABORT
            continue
        assert req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), (rid, req.finish_reason)
        assert 1 <= req.num_output_tokens <= spec["max_tokens"]
        if req.finish_reason is FinishReason.STOP:
            assert not spec["ignore_eos"] and req.output_token_ids[-1] == EOS
        else:
            assert req.num_output_tokens == spec["max_tokens"] or req.num_tokens >= cfg.max_model_len
        assert req.first_scheduled_time is not None and req.queue_time is not None
    # within a tenant, first come, first served: first admissions keep the order of arrival
    for tenant in {spec["tenant"] for _, spec in admitted.values()}:
        times = [req.first_scheduled_time for req, spec in admitted.values()
                 if spec["tenant"] == tenant and req.first_scheduled_time is not None]
        assert times == sorted(times), f"tenant {tenant!r} admitted out of its order"
    assert not sched.fair_view().tenants, "a tenant stays active with nothing left"
    st_ = sched.stats
    assert st_.recomputed_tokens <= st_.forwarded_tokens
    assert st_.thrashed_admissions <= st_.preemptions
    assert st_.prefix_cache_hits <= st_.prefix_cache_queries
    if not cfg.enable_prefix_caching:
        assert st_.prefix_cache_queries == 0 and pool.num_cached_blocks == 0
    return sched


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(2, 12), st.integers(0, 4), st.booleans(), st.sampled_from([1, 4]))
def test_outputs_do_not_depend_on_pool_pressure_or_caching(block_size, budget, watermark, caching, steps):
    """Outputs depend on the context read back through the block tables: a tight pool (preemption,
    recompute) and a roomy one, with and without the prefix cache, and with several decode steps a
    step, give the same tokens."""
    prompts = [[1, 2, 3, 1, 2] * 2, [1, 2, 3, 1, 2, 3, 3], [2] * 9, [1, 2, 3, 1, 2] * 2 + [3]]
    results = []
    for num_blocks, cache, multi in ((blocks_for_length(22, block_size) + 1, caching, steps), (200, False, 1)):
        cfg = SchedulerConfig(
            num_scheduler_steps=multi,
            decode=DecodeCapabilities(multi_step_max_rows=5),
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=4,
            max_num_batched_tokens=budget,
            max_model_len=64,
            watermark_blocks=watermark,
            enable_prefix_caching=cache,
        )
        sched = Scheduler(cfg)
        runner = FakeKVRunner(num_blocks, block_size, vocab_size=1000)
        reqs = [
            Request(f"r{i}", p, SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0))
            for i, p in enumerate(prompts)
        ]
        for r in reqs:
            sched.add_request(r)
        steps = 0
        while sched.has_unfinished_requests():
            out = sched.schedule()
            sched.update_from_output(out, runner.step(out))
            sched.check_invariants()
            steps += 1
            assert steps < 2000
        results.append([r.output_token_ids for r in reqs])
    assert results[0] == results[1]
