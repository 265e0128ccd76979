"""The continuous-batching scheduler: the door, chunked prefill, growth, preemption by recompute, the
watermark that never excludes, abort from any state, and prefix caching.

The model is replaced by ``FakeKVRunner``, which writes every scheduled token into its KV slot and
reads each request's whole context back through its block table, so a wrong table or cache hit
fails the test, and whose "sampled" token depends on that context."""

from __future__ import annotations

import pytest

from engine_service.config import SchedulerConfig
from engine_service.core.request import FinishReason, Request, RequestStatus
from engine_service.core.sampling_params import SamplingParams
from engine_service.core.scheduler import (
    RequestRejected,
    ScheduledChunk,
    Scheduler,
    SchedulerOutput,
    attention_pairs,
)
from sluice_bench.scheduler import FakeKVRunner


def make_request(rid: str, prompt: int | list[int], max_tokens: int | None = 4, **params) -> Request:
    if isinstance(prompt, int):  # distinct tokens per request id, so prompts share nothing by accident
        base = 10_000 + 1000 * (sum(map(ord, rid)) % 1000)
        tokens = list(range(base, base + prompt))
    else:
        tokens = list(prompt)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, **params)
    return Request(rid, tokens, sp)


def make_scheduler(
    num_blocks=16, block_size=4, max_num_seqs=4, budget=64, max_model_len=4096, watermark=0, caching=True,
    pairs=None,
) -> tuple[Scheduler, FakeKVRunner]:
    cfg = SchedulerConfig(
        max_num_batched_pairs=pairs,
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        watermark_blocks=watermark,
        enable_prefix_caching=caching,
    )
    return Scheduler(cfg), FakeKVRunner(num_blocks, block_size)


def step(sched: Scheduler, runner: FakeKVRunner) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    sched.check_invariants()
    assert out.num_batched_tokens == sum(c.num_tokens for c in out.chunks) <= sched.max_num_batched_tokens
    updated = sched.update_from_output(out, runner.step(out))
    sched.check_invariants()
    return out, updated


def run_all(sched: Scheduler, runner: FakeKVRunner, max_steps: int = 1000) -> int:
    n = 0
    while sched.has_unfinished_requests():
        step(sched, runner)
        n += 1
        assert n <= max_steps, "did not finish"
    pool = sched.block_pool
    assert pool.num_free_blocks == pool.num_total_blocks
    return n


# --- the door ---
def test_context_length_exceeded_says_by_how_much():
    sched, _ = make_scheduler(num_blocks=1000, block_size=16, max_model_len=1024)
    with pytest.raises(RequestRejected) as e:
        sched.add_request(make_request("r", 900, max_tokens=200))
    assert e.value.code == "context_length_exceeded"
    assert str(e.value).startswith(
        "This model's maximum context length is 1024 tokens. However, you requested 1100 tokens "
        "(900 in the prompt, 200 for the completion)")
    assert not sched.has_unfinished_requests() and sched.num_waiting == 0
    # exactly max_model_len is fine
    sched.add_request(make_request("ok", 900, max_tokens=124))
    with pytest.raises(RequestRejected) as e:
        sched.add_request(make_request("none", 1024, max_tokens=None))
    assert e.value.code == "context_length_exceeded" and "is 1024 tokens" in str(e.value)
    assert "1024 tokens, which leaves no room" in str(e.value)


def test_never_fitting_prompt_is_refused_at_the_door_and_nothing_is_queued():
    sched, _ = make_scheduler(num_blocks=6, block_size=4)
    with pytest.raises(RequestRejected) as e:
        sched.add_request(make_request("big", 30, max_tokens=1))
    assert e.value.code == "kv_cache_too_small"
    msg = str(e.value)
    assert "30 tokens" in msg and "8 blocks of 4" in msg and "2 more than the whole KV cache (6 blocks" in msg
    assert not sched.has_unfinished_requests()
    assert sched.num_waiting == sched.num_running == 0
    assert sched.block_pool.num_free_blocks == 6
    assert sched.stats.requests_rejected == 1
    assert sched.schedule().chunks == []
    # the same prompt with generation that needs the whole pool exactly passes: 24 + 1 - 1 tokens of KV
    sched.add_request(make_request("fits", 24, max_tokens=1))
    assert sched.num_waiting == 1
    # max_tokens=None is bounded by max_model_len, which must fit the pool too
    sched2, _ = make_scheduler(num_blocks=6, block_size=4, max_model_len=100)
    with pytest.raises(RequestRejected) as e:
        sched2.add_request(make_request("open", 4, max_tokens=None))
    assert e.value.code == "kv_cache_too_small" and "max_model_len (100 tokens)" in str(e.value)


def test_invalid_requests_are_refused():
    sched, _ = make_scheduler()
    with pytest.raises(RequestRejected) as e:
        sched.add_request(make_request("empty", []))
    assert e.value.code == "invalid_request"
    zero = make_request("zero", 4, max_tokens=1)
    zero.sampling_params.max_tokens = 0  # SamplingParams refuses it itself; the door checks again
    with pytest.raises(RequestRejected) as e:
        sched.add_request(zero)
    assert e.value.code == "invalid_request"
    sched.add_request(make_request("dup", 4))
    with pytest.raises(RequestRejected) as e:
        sched.add_request(make_request("dup", 4))
    assert e.value.code == "invalid_request" and sched.num_waiting == 1
    assert isinstance(e.value, ValueError)


def test_config_is_validated():
    with pytest.raises(ValueError):
        Scheduler(SchedulerConfig(num_blocks=0))
    with pytest.raises(ValueError):
        Scheduler(SchedulerConfig(num_blocks=4, max_num_batched_tokens=0))
    with pytest.raises(ValueError):
        Scheduler(SchedulerConfig(num_blocks=4), watermark_blocks=-1)
    assert Scheduler(SchedulerConfig(num_blocks=400)).watermark_blocks == 4  # 1% of the pool
    assert Scheduler(SchedulerConfig(num_blocks=400), watermark_blocks=7).watermark_blocks == 7


# --- basic flow ---
def test_single_request_lifecycle_and_timings():
    t = [10.0]
    cfg = SchedulerConfig(num_blocks=8, block_size=4, max_num_batched_tokens=64, watermark_blocks=0)
    sched = Scheduler(cfg, clock=lambda: t[0])
    runner = FakeKVRunner(8, 4)
    req = make_request("r", 6, max_tokens=3)
    req.arrival_time = 7.0
    sched.add_request(req)
    assert req.status is RequestStatus.WAITING and sched.num_waiting == 1
    out, updated = step(sched, runner)
    assert [(c.request, c.start, c.num_tokens, c.samples) for c in out.chunks] == [(req, 0, 6, True)]
    assert updated == [req] and req.num_output_tokens == 1 and req.status is RequestStatus.RUNNING
    assert req.queue_time == 3.0 and req.time_to_first_token == 3.0
    t[0] = 11.0
    out, _ = step(sched, runner)
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(6, 1)]
    out, updated = step(sched, runner)
    assert req.is_finished and req.finish_reason is FinishReason.LENGTH and updated == [req]
    assert req.num_output_tokens == 3 and not req.block_ids
    assert not sched.has_unfinished_requests() and sched.stats.iterations == 3
    assert sched.stats.forwarded_tokens == 8 and sched.stats.recomputed_tokens == 0
    # with nothing to do, schedule() is empty and counts no iteration
    assert sched.schedule().chunks == [] and sched.stats.iterations == 3


def test_eos_stops_and_frees():
    sched, runner = make_scheduler()
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=10), eos_token_ids=frozenset({99}))
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, {"r": 5})
    out = sched.schedule()
    sched.update_from_output(out, {"r": 99})
    assert req.finish_reason is FinishReason.STOP and not sched.has_unfinished_requests()
    assert sched.block_pool.num_free_blocks == sched.block_pool.num_total_blocks
    sched.check_invariants()


def test_slots_and_budget_limit_a_step_and_chunks_prefill():
    sched, runner = make_scheduler(num_blocks=64, max_num_seqs=2, budget=10)
    reqs = [make_request(f"r{i}", 7, max_tokens=2) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    out, _ = step(sched, runner)
    # r0 gets 7, r1 the remaining 3 as a first chunk (no sample), r2 waits for a slot
    assert [(c.request.request_id, c.start, c.num_tokens, c.samples) for c in out.chunks] == [
        ("r0", 0, 7, True),
        ("r1", 0, 3, False),
    ]
    assert sched.num_running == 2 and sched.num_waiting == 1
    out, _ = step(sched, runner)
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks] == [("r0", 7, 1), ("r1", 3, 4)]
    run_all(sched, runner)
    assert all(r.num_output_tokens == 2 for r in reqs)


def test_prompt_that_exactly_fills_its_blocks_buys_a_block_on_its_first_decode():
    sched, runner = make_scheduler(num_blocks=4, block_size=4, watermark=0)
    req = make_request("r", 8, max_tokens=3)
    sched.add_request(req)
    out, _ = step(sched, runner)
    assert len(req.block_ids) == 2 and req.num_computed_tokens == 8 and out.chunks[0].samples
    assert sched.block_pool.num_free_blocks == 2
    out, _ = step(sched, runner)
    (chunk,) = out.chunks
    assert (chunk.start, chunk.num_tokens) == (8, 1)
    assert len(req.block_ids) == 3 and sched.block_pool.num_free_blocks == 1
    run_all(sched, runner)
    assert req.num_output_tokens == 3


def test_a_request_needing_the_whole_pool_runs():
    sched, runner = make_scheduler(num_blocks=3, block_size=4, budget=5, watermark=2)
    req = make_request("r", 11, max_tokens=2)  # 12 tokens of KV: the whole pool
    sched.add_request(req)
    run_all(sched, runner)
    assert req.num_output_tokens == 2


# --- the deadlock, as a regression ---
@pytest.mark.parametrize("caching", [True, False])
def test_preempted_request_needing_more_than_the_reserve_leaves_is_readmitted_when_idle(caching):
    """6 blocks of 4, a reserve of 3: b is admitted holding 1 block, grows to 4, is preempted; a
    finishes; with the pool empty b (needing 4 > 6 - 3 blocks) is admitted again and finishes."""
    sched, runner = make_scheduler(
        num_blocks=6, block_size=4, max_num_seqs=4, budget=10, watermark=3, caching=caching,
        pairs=0,  # chunks cut by tokens only: the scenario's chunk sizes are its subject
    )
    assert sched.admissible_blocks == 3
    a = make_request("a", 6, max_tokens=8)
    b = make_request("b", 13, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    assert len(a.block_ids) == 2 and len(b.block_ids) == 1
    step(sched, runner)
    assert len(b.block_ids) == 4 and b.num_output_tokens == 1
    step(sched, runner)
    out, _ = step(sched, runner)
    assert out.preempted == [b]
    assert b.status is RequestStatus.PREEMPTED and b.num_preemptions == 1 and not b.block_ids
    assert b.num_computed_tokens == 0 and b.num_output_tokens == 2  # outputs are kept
    assert sched.waiting == (b,)
    # b now needs blocks_for(15) = 4 blocks: more than the reserve leaves, so the reserve does not apply
    while not a.is_finished:
        assert b.status is RequestStatus.PREEMPTED
        step(sched, runner)
    assert sched.block_pool.num_free_blocks == 6 and sched.num_running == 0
    out, _ = step(sched, runner)
    assert b.status is RequestStatus.RUNNING and out.chunks[0].request is b
    run_all(sched, runner)
    assert b.finish_reason is FinishReason.LENGTH and b.num_output_tokens == 4
    assert a.num_output_tokens == 8
    st = sched.stats
    assert st.preemptions == 1 and st.thrashed_admissions == 0
    # b had computed 14 tokens; all are forwarded again, but those its own cached blocks still hold
    assert st.recomputed_tokens == 14 - (b.num_cached_tokens if caching else 0)
    assert (b.num_cached_tokens > 0) == caching
    assert 0 < st.recompute_share < 1


def test_fresh_prompt_larger_than_the_reserve_leaves_runs_once_the_pool_is_idle():
    sched, runner = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4, budget=32, watermark=3)
    a = make_request("a", 12, max_tokens=3)  # 3 blocks, admitted under the reserve (3 + 3 <= 6)
    c = make_request("c", 16, max_tokens=1)  # 4 blocks: never admissible under a reserve of 3
    sched.add_request(a)
    sched.add_request(c)
    out, _ = step(sched, runner)
    assert [ch.request for ch in out.chunks] == [a] and c.status is RequestStatus.WAITING
    while not a.is_finished:
        step(sched, runner)
        assert a.is_finished or c.status is RequestStatus.WAITING
    out, _ = step(sched, runner)
    assert out.chunks[0].request is c and out.chunks[0].num_tokens == 16 and out.chunks[0].samples
    run_all(sched, runner)
    assert c.is_finished and c.num_output_tokens == 1


def test_watermark_delays_a_request_that_fits_under_it():
    sched, runner = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=4, budget=64, watermark=3)
    a = make_request("a", 12, max_tokens=6)  # 3 blocks, growing to 5
    b = make_request("b", 12, max_tokens=2)  # 3 blocks: 3 + 3 > 8 - 3 free, so it waits
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched, runner)
    assert [ch.request for ch in out.chunks] == [a]
    assert b.status is RequestStatus.WAITING
    run_all(sched, runner)
    assert b.num_output_tokens == 2


def test_growth_ignores_the_watermark():
    sched, runner = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4, budget=64, watermark=3)
    a = make_request("a", 4, max_tokens=12)  # 1 block admitted under the reserve, grows to 4
    sched.add_request(a)
    run_all(sched, runner)
    assert a.num_output_tokens == 12 and sched.stats.preemptions == 0


def test_oldest_running_request_is_never_preempted():
    sched, runner = make_scheduler(num_blocks=6, block_size=2, max_num_seqs=3, budget=8, watermark=0)
    reqs = [make_request(f"r{i}", 2, max_tokens=9) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    oldest_seen = []
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        oldest = sched.running[0] if sched.running else None
        out, _ = step(sched, runner)
        if oldest is not None:
            assert oldest not in out.preempted
            oldest_seen.append(oldest.request_id)
    assert not sched.has_unfinished_requests()
    assert sched.stats.preemptions > 0
    assert all(r.num_output_tokens == 9 for r in reqs)


# --- aborts ---
def test_abort_of_a_preempted_request_releases_everything():
    sched, runner = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4, budget=10, watermark=3)
    a = make_request("a", 6, max_tokens=8)
    b = make_request("b", 13, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(4):
        step(sched, runner)
    assert b.status is RequestStatus.PREEMPTED
    assert sched.abort_requests(["b"]) == [b]
    assert b.finish_reason is FinishReason.ABORT and b.status is RequestStatus.FINISHED
    assert sched.num_waiting == 0 and not b.block_ids
    sched.check_invariants()
    assert sched.abort_requests(["b"]) == []  # already finished: a no-op
    run_all(sched, runner)
    assert a.num_output_tokens == 8 and sched.stats.requests_aborted == 1


def test_abort_in_the_middle_of_a_chunked_prefill():
    # cut by tokens only: the chunk sizes are the scenario
    sched, runner = make_scheduler(num_blocks=8, block_size=4, budget=4, pairs=0)
    prompt = list(range(20))
    r = make_request("r", prompt, max_tokens=2)
    sched.add_request(r)
    out, _ = step(sched, runner)
    out, updated = step(sched, runner)
    assert r.num_computed_tokens == 8 and not out.chunks[0].samples and updated == []
    assert sched.abort_requests(["r"]) == [r]
    assert r.finish_reason is FinishReason.ABORT and not r.block_ids
    assert sched.num_running == 0 and not sched.has_unfinished_requests()
    pool = sched.block_pool
    assert pool.num_free_blocks == pool.num_total_blocks
    assert pool.num_cached_blocks == 2  # the KV it wrote stays reusable
    sched.check_invariants()
    # the same prompt later reuses the two computed blocks
    r2 = make_request("r2", prompt, max_tokens=2)
    sched.add_request(r2)
    out, _ = step(sched, runner)
    assert (out.chunks[0].start, r2.num_cached_tokens) == (8, 8)
    run_all(sched, runner)


def test_abort_of_waiting_running_unknown_and_finished():
    sched, runner = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 5), make_request("b", 5)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    assert b.status is RequestStatus.WAITING
    assert sched.abort_requests(["b", "nope"]) == [b]
    assert sched.num_waiting == 0 and b.finish_reason is FinishReason.ABORT
    sched.check_invariants()
    assert sched.abort_requests("a") == [a]  # a single id is accepted as such
    assert sched.num_running == 0 and not sched.has_unfinished_requests()
    assert sched.block_pool.num_free_blocks == sched.block_pool.num_total_blocks
    assert sched.abort_requests(["a", "b"]) == []
    sched.check_invariants()


def test_abort_between_schedule_and_update_is_skipped():
    sched, runner = make_scheduler()
    a, b = make_request("a", 5), make_request("b", 5)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sampled = runner.step(out)
    sched.abort_requests(["a"])
    updated = sched.update_from_output(out, sampled)
    assert updated == [b] and a.num_output_tokens == 0 and a.finish_reason is FinishReason.ABORT
    sched.check_invariants()
    run_all(sched, runner)


def test_a_missing_sampled_token_ends_the_request_with_an_error_instead_of_a_hang():
    sched, runner = make_scheduler()
    a, b = make_request("a", 5), make_request("b", 5)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sampled = runner.step(out)
    del sampled["a"]
    assert sched.update_from_output(out, sampled) == [a, b]
    assert a.finish_reason is FinishReason.ERROR and "no token" in a.error and not a.block_ids
    sched.check_invariants()
    run_all(sched, runner)


def test_finish_requests_with_an_error():
    sched, runner = make_scheduler()
    a = make_request("a", 5)
    sched.add_request(a)
    assert sched.finish_requests(["a"], FinishReason.ERROR, error="deadline expired") == [a]
    assert a.finish_reason is FinishReason.ERROR and a.error == "deadline expired"
    assert not sched.has_unfinished_requests()


# --- prefix caching ---
SHARED = list(range(500, 532))  # 32 tokens: 8 full blocks of 4


def _two_with_shared_prefix(caching: bool, same_step: bool):
    sched, runner = make_scheduler(num_blocks=64, block_size=4, budget=256, caching=caching)
    a = make_request("a", SHARED + [1, 2, 3], max_tokens=4)
    b = make_request("b", SHARED + [7, 8, 9], max_tokens=4)
    sched.add_request(a)
    if not same_step:
        step(sched, runner)
    sched.add_request(b)
    run_all(sched, runner)
    return sched, a, b


@pytest.mark.parametrize("same_step", [False, True])
def test_shared_prefix_is_computed_once(same_step):
    on, a1, b1 = _two_with_shared_prefix(True, same_step)
    off, a0, b0 = _two_with_shared_prefix(False, same_step)
    assert b1.num_cached_tokens == 32 and a1.num_cached_tokens == 0
    assert on.stats.prefix_cache_hits == 32 and on.stats.prefix_cache_queries == 70
    assert on.stats.prefix_cache_hit_rate == pytest.approx(32 / 70)
    assert off.stats.prefix_cache_hits == 0 and b0.num_cached_tokens == 0
    # the 32 shared tokens are forwarded once with the cache, twice without
    assert off.stats.forwarded_tokens - on.stats.forwarded_tokens == 32
    assert on.stats.forwarded_tokens == 35 + 3 + 2 * 3
    # outputs depend on the KV read back through the tables: identical with the cache on and off
    assert a1.output_token_ids == a0.output_token_ids and b1.output_token_ids == b0.output_token_ids


def test_identical_prompts_in_one_step_share_blocks_but_compute_the_last_token():
    """n > 1 copies of one prompt: the copies hit the blocks the first registers in the same step."""
    sched, runner = make_scheduler(num_blocks=64, block_size=4, budget=256)
    prompt = list(range(700, 716))  # 16 tokens: exactly 4 blocks
    reqs = [make_request(f"c{i}", prompt, max_tokens=3) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    out, _ = step(sched, runner)
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(0, 16), (12, 4), (12, 4)]
    assert all(c.samples for c in out.chunks)
    first = reqs[0].block_ids
    for r in reqs[1:]:
        assert r.block_ids[:3] == first[:3] and r.block_ids[3] != first[3]
        assert r.num_cached_tokens == 12
    assert sched.block_pool.ref_count(first[0]) == 3
    run_all(sched, runner)
    assert reqs[0].output_token_ids == reqs[1].output_token_ids == reqs[2].output_token_ids


def test_fully_cached_prompt_still_computes_its_last_token():
    sched, runner = make_scheduler(num_blocks=16, block_size=4)
    prompt = list(range(300, 308))
    first = make_request("first", prompt, max_tokens=1)
    sched.add_request(first)
    run_all(sched, runner)
    again = make_request("again", prompt, max_tokens=2)
    sched.add_request(again)
    out, _ = step(sched, runner)
    assert [(c.start, c.num_tokens, c.samples) for c in out.chunks] == [(4, 4, True)]
    assert again.output_token_ids[0] == first.output_token_ids[0]
    run_all(sched, runner)


def test_a_request_wanting_prompt_logprobs_computes_its_whole_prompt():
    sched, runner = make_scheduler(num_blocks=16, block_size=4)
    prompt = list(range(300, 310))
    sched.add_request(make_request("first", prompt, max_tokens=1))
    run_all(sched, runner)
    scored = make_request("scored", prompt, max_tokens=2, prompt_logprobs=1)
    sched.add_request(scored)
    out, _ = step(sched, runner)
    assert (out.chunks[0].start, out.chunks[0].num_tokens) == (0, 10) and scored.num_cached_tokens == 0
    run_all(sched, runner)


def test_readmission_after_preemption_reuses_its_own_cached_blocks():
    sched, runner = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4, budget=10, watermark=3,
                                   pairs=0)  # cut by tokens only: the chunk sizes are the scenario
    a = make_request("a", 6, max_tokens=8)
    b = make_request("b", 13, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    run_all(sched, runner)
    # b's recompute found its own first blocks still cached, so only the rest is forwarded again
    assert sched.stats.preemptions == 1 and b.num_preemptions == 1
    assert b.num_cached_tokens == 8 and sched.stats.recomputed_tokens == 14 - 8
    assert b.num_output_tokens == 4


def test_outputs_survive_preemption_unchanged():
    """The same workload on a tight pool (preemptions) and a roomy one (none): identical outputs."""
    results = {}
    for num_blocks in (7, 64):
        for caching in (True, False):
            sched, runner = make_scheduler(
                num_blocks=num_blocks, block_size=4, max_num_seqs=4, budget=12, watermark=0, caching=caching
            )
            reqs = [
                make_request(f"r{i}", list(range(i * 10, i * 10 + 3 + 2 * i)), max_tokens=12)
                for i in range(4)
            ]
            for r in reqs:
                sched.add_request(r)
            run_all(sched, runner)
            results[(num_blocks, caching)] = ([r.output_token_ids for r in reqs], sched.stats.preemptions)
    assert results[(7, True)][1] > 0 and results[(64, True)][1] == 0
    outs = {k: v[0] for k, v in results.items()}
    assert len({str(v) for v in outs.values()}) == 1


# --- invariants catch breakage ---
def test_check_invariants_catches_a_leak():
    sched, runner = make_scheduler()
    sched.add_request(make_request("a", 5))
    step(sched, runner)
    (a,) = sched.running
    a.block_ids.pop()
    with pytest.raises(AssertionError):
        sched.check_invariants()


def test_scheduled_chunk_token_ids():
    req = make_request("x", 6)
    c = ScheduledChunk(req, 2, 3)
    assert c.token_ids == req.all_token_ids[2:5] and not c.samples
    assert ScheduledChunk(req, 2, 4).samples


# --- what a long prompt costs the others ---
def _step_cost(out: SchedulerOutput) -> tuple[int, int]:
    """(budget tokens, attention pairs of the prefill chunks) a step took: a prompt-logprobs row
    counts two tokens; a chunk of c tokens after s > 0 computed ones attends to c * (s + c) pairs
    through a mask, a fresh one to c * (c + 1) / 2 causally."""
    tokens = pairs = 0
    for ch in out.chunks:
        req = ch.request
        plp = req.sampling_params.prompt_logprobs is not None and ch.start < req.num_prompt_tokens - 1
        tokens += ch.num_tokens * (2 if plp else 1)
        if ch.num_tokens > 1:
            pairs += ch.num_tokens * (ch.start + ch.num_tokens) if ch.start else ch.num_tokens * (ch.num_tokens + 1) // 2
    return tokens, pairs


def test_attention_pairs():
    assert attention_pairs(0, 4) == 10 and attention_pairs(4, 4) == 32 and attention_pairs(100, 1) == 101


@pytest.mark.parametrize("prompt_logprobs", [None, 1])
@pytest.mark.parametrize("long_first", [False, True])
def test_a_long_prefill_costs_the_running_requests_one_budget_step_at_most(prompt_logprobs, long_first):
    """A 500-token prompt (8 budgets) beside streams already decoding: every step gives each running stream
    its token and costs no more than a fresh prefill of the budget: at most B tokens (a prompt
    logprobs row counting two, as it also scores the whole vocabulary) and at most the B * (B + 1) / 2
    attention pairs of a fresh B-token prefill. Before, the prompt's later chunks took the whole budget at any offset (a chunk of B
    tokens after 436 attends to 8 times the pairs of a fresh one), and prompt-logprob rows
    counted one. With ``long_first`` the prompt is the oldest request: streams admitted beside it
    must still get a token every step once they run."""
    budget = 64
    sched, runner = make_scheduler(num_blocks=2048, block_size=4, max_num_seqs=8, budget=budget)
    long = make_request("long", 500, max_tokens=2, prompt_logprobs=prompt_logprobs)
    streams = [make_request(f"s{i}", 5, max_tokens=400) for i in range(3)]
    if long_first:
        sched.add_request(long)
    for s in streams:
        sched.add_request(s)
    if not long_first:
        for _ in range(3):
            step(sched, runner)
        assert all(s.num_output_tokens == 3 for s in streams)
        sched.add_request(long)
    steps = 0
    while long.num_output_tokens == 0:
        running = [s for s in streams if s.status is RequestStatus.RUNNING]
        before = {s.request_id: s.num_output_tokens for s in running}
        out, _ = step(sched, runner)
        steps += 1
        tokens, pairs = _step_cost(out)
        assert tokens <= budget and pairs <= budget * (budget + 1) // 2, (steps, tokens, pairs)
        for s in running:  # a stream that runs is never held for more than this one step
            assert s.num_output_tokens == before[s.request_id] + 1, (steps, s.request_id)
        assert steps < 500
    assert all(s.status is RequestStatus.RUNNING for s in streams)
    # the prompt still moves: its prefill took more steps than 500 / B, but a bounded number
    assert 500 / budget < steps < 100
    run_all(sched, runner)


def test_the_pair_budget_never_stops_the_oldest_request():
    """A chunk the pair budget cuts to nothing still gets one token when it is the step's first."""
    sched, runner = make_scheduler(num_blocks=256, block_size=4, budget=4, max_model_len=1024)
    r = make_request("r", 600, max_tokens=1)
    sched.add_request(r)
    out, _ = step(sched, runner)
    assert out.chunks[0].num_tokens == 4  # fresh: 10 pairs, the whole budget
    while r.num_output_tokens == 0:
        out, _ = step(sched, runner)
        assert out.chunks[0].num_tokens >= 1
    assert sched.max_num_batched_pairs == 10
