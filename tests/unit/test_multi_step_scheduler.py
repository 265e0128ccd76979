"""Several greedy decode steps in one scheduling step (``num_scheduler_steps``), in the scheduler:
which steps get them, how many (max_tokens, the context, the free blocks beyond the watermark, never
a preemption), the KV they hold, a stop inside the burst, an abort between schedule() and the
update, and a knob that cannot work. ``FakeKVRunner`` runs each step as the native call does: it
writes the step's input at its slot and reads the whole context back through the block table."""

from __future__ import annotations

import pytest

from engine_service.config import MAX_SCHEDULER_STEPS, DecodeCapabilities, SchedulerConfig, SpeculativeConfig
from engine_service.core.block_pool import blocks_for_length
from engine_service.core.request import FinishReason, Request, RequestStatus
from engine_service.core.sampling_params import SamplingParams
from engine_service.core.scheduler import Scheduler
from sluice_bench.scheduler import FakeKVRunner


def make(steps=4, num_blocks=32, block_size=4, rows=16, watermark=0, max_model_len=4096, **kwargs):
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=8, max_num_batched_tokens=64,
                          max_model_len=max_model_len, watermark_blocks=watermark, num_scheduler_steps=steps,
                          decode=DecodeCapabilities(multi_step_max_rows=rows), **kwargs)
    return Scheduler(cfg), FakeKVRunner(num_blocks, block_size)


def request(rid: str, prompt: int = 6, max_tokens: int | None = 20, **params) -> Request:
    base = 100 + 50 * int(rid[1:])
    params = {"temperature": 0.0, "ignore_eos": True, **params}
    return Request(rid, list(range(base, base + prompt)), SamplingParams(max_tokens=max_tokens, **params))


def run(sched, runner):
    out = sched.schedule()
    sched.check_invariants()
    updated = sched.update_from_output(out, runner.step(out))
    sched.check_invariants()
    return out, updated


def test_a_greedy_decode_runs_the_steps_and_keeps_their_kv():
    sched, runner = make(steps=4)
    req = request("r1", prompt=6, max_tokens=11)
    sched.add_request(req)
    out, _ = run(sched, runner)  # the prefill: one step, one token
    assert [c.num_steps for c in out.chunks] == [1] and req.num_output_tokens == 1
    out, _ = run(sched, runner)
    (chunk,) = out.chunks
    assert chunk.num_steps == 4 and req.num_output_tokens == 5
    assert out.num_batched_tokens == 1 and out.num_step_tokens == 3  # the token budget counts one a row
    assert req.num_computed_tokens == 6 + 4 == req.num_tokens - 1
    assert len(req.block_ids) == blocks_for_length(10, 4)
    counts = []
    while req.status is RequestStatus.RUNNING:
        out, _ = run(sched, runner)
        counts.append(out.chunks[0].num_steps)
    assert counts == [4, 2]  # max_tokens: 11 outputs, the last burst cut to what is left
    assert req.num_output_tokens == 11 and req.finish_reason is FinishReason.LENGTH
    # the tokens are the ones plain single steps give (the fake model's tokens depend on the context)
    plain, prunner = make(steps=1)
    twin = request("r1", prompt=6, max_tokens=11)
    plain.add_request(twin)
    while not twin.is_finished:
        run(plain, prunner)
    assert twin.output_token_ids == req.output_token_ids
    assert sched.block_pool.num_free_blocks == sched.block_pool.num_total_blocks


def test_a_stop_token_inside_the_burst_ends_the_request_there():
    sched, runner = make(steps=8)
    probe, prunner = make(steps=1)
    twin = request("r2", max_tokens=12)
    probe.add_request(twin)
    while not twin.is_finished:
        run(probe, prunner)
    stop = twin.output_token_ids[4]  # the fifth output, inside the first burst of eight
    req = request("r2", max_tokens=12, stop_token_ids=[stop])
    sched.add_request(req)
    while not req.is_finished:
        run(sched, runner)
    assert req.output_token_ids == twin.output_token_ids[: twin.output_token_ids.index(stop) + 1]
    assert req.finish_reason is FinishReason.STOP and req.stop_reason == stop
    assert sched.block_pool.num_free_blocks == sched.block_pool.num_total_blocks


@pytest.mark.parametrize("params", [
    {"temperature": 0.8, "seed": 3}, {"logprobs": 2}, {"presence_penalty": 0.5}, {"repetition_penalty": 1.2},
    {"logit_bias": {5: 1.0}}, {"min_tokens": 3, "ignore_eos": False},
])
def test_requests_the_sampler_must_see_decode_one_step_at_a_time(params):
    sched, runner = make(steps=4)
    req = request("r3", max_tokens=10, **params)
    req.eos_token_ids = frozenset({999_999})  # min_tokens masks it: a processed row until the third output
    sched.add_request(req)
    steps = []
    while not req.is_finished:
        out, _ = run(sched, runner)
        steps.append(out.chunks[0].num_steps)
    if "min_tokens" in params:  # once min_tokens is reached nothing is masked any more
        assert steps[:3] == [1, 1, 1] and max(steps) == 4
    else:
        assert set(steps) == {1}


def test_one_request_that_needs_the_sampler_keeps_the_whole_step_single():
    sched, runner = make(steps=4)
    greedy, sampled = request("r1", max_tokens=9), request("r2", max_tokens=9, temperature=1.0, seed=1)
    sched.add_request(greedy)
    sched.add_request(sampled)
    while not greedy.is_finished:
        out, _ = run(sched, runner)
        assert all(c.num_steps == 1 for c in out.chunks)
    while not sampled.is_finished:  # alone, it still samples every step
        out, _ = run(sched, runner)
        assert all(c.num_steps == 1 for c in out.chunks)


def test_a_batch_runs_the_same_steps_and_a_waiting_request_ends_bursts():
    sched, runner = make(steps=4)
    a, b = request("r1", max_tokens=30), request("r2", max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    run(sched, runner)  # both prefill
    out, _ = run(sched, runner)
    assert [c.num_steps for c in out.chunks] == [4, 4] and out.num_step_tokens == 6
    out, _ = run(sched, runner)  # b has one token left: the batch's steps are its
    assert [c.num_steps for c in out.chunks] == [1, 1] and b.is_finished
    late = request("r4", max_tokens=3)
    sched.add_request(late)
    out, _ = run(sched, runner)  # admitted at once: its prefill shares the step, a single one
    assert [c.request.request_id for c in out.chunks] == ["r1", "r4"]
    assert all(c.num_steps == 1 for c in out.chunks)


def test_a_batch_as_wide_as_the_native_step_takes_decodes_one_step_at_a_time():
    sched, runner = make(steps=4, rows=2)  # the native step runs fewer than two rows
    a, b = request("r1", max_tokens=12), request("r2", max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    run(sched, runner)
    while not b.is_finished:
        out, _ = run(sched, runner)
        assert [c.num_steps for c in out.chunks] == [1, 1]
    out, _ = run(sched, runner)  # a alone: one row
    assert [c.num_steps for c in out.chunks] == [4]


def test_the_steps_shrink_to_the_free_blocks_and_never_preempt():
    # 6 blocks of 4, a watermark of 1: a 6-token prompt takes 2 blocks, so 3 are spare for growth
    sched, runner = make(steps=32, num_blocks=6, watermark=1)
    req = request("r1", prompt=6, max_tokens=17)  # its max_tokens would allow 16 steps
    sched.add_request(req)
    run(sched, runner)
    out, _ = run(sched, runner)
    (chunk,) = out.chunks
    assert chunk.num_steps == 5 * 4 - 6  # every block but the watermark's, full
    assert not out.preempted and sched.block_pool.num_free_blocks == 1


def test_the_context_bounds_the_steps():
    sched, runner = make(steps=16, max_model_len=12)
    req = request("r1", prompt=6, max_tokens=None)
    sched.add_request(req)
    while not req.is_finished:
        run(sched, runner)
    assert req.num_tokens == 12 and req.finish_reason is FinishReason.LENGTH


def _scheduled_burst():
    """A scheduler with one request whose step of 4 decode steps is scheduled, not yet updated."""
    sched, runner = make(steps=4)
    req = request("r1", max_tokens=20)
    sched.add_request(req)
    run(sched, runner)
    out = sched.schedule()
    assert out.chunks[0].num_steps == 4
    return sched, runner, req, out


def test_an_abort_between_schedule_and_update_frees_everything():
    sched, runner, _, out = _scheduled_burst()
    sampled = runner.step(out)
    sched.abort_requests(["r1"])
    assert sched.update_from_output(out, sampled) == []
    sched.check_invariants()
    assert sched.block_pool.num_free_blocks == sched.block_pool.num_total_blocks


def test_an_engine_answer_of_the_wrong_length_ends_the_request_with_an_error():
    sched, _, req, out = _scheduled_burst()
    sched.update_from_output(out, {"r1": [1, 2]})
    assert req.finish_reason is FinishReason.ERROR and "4 decode steps" in req.error
    sched.check_invariants()
    assert sched.block_pool.num_free_blocks == sched.block_pool.num_total_blocks


@pytest.mark.parametrize("steps, message", [
    (0, "between 1 and"), (MAX_SCHEDULER_STEPS + 1, "between 1 and"), (2.5, "must be an integer"),
])
def test_a_number_of_steps_that_cannot_work_is_refused_naming_the_knob(steps, message):
    with pytest.raises(ValueError, match=f"num_scheduler_steps.*{message}"):
        make(steps=steps)


def test_steps_and_speculation_are_refused_together():
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_scheduler_steps above 1 and speculative_config"):
        make(steps=2, speculative_config=spec)
    make(steps=1, speculative_config=spec)  # one step a step: speculation as before
