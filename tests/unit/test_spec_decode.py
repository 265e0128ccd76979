"""Speculative decoding with n-gram prompt lookup, model-free: the configuration's refusals, the
drafter (against a brute-force lookup), its back-off, and the scheduler's side (the k + 1 tokens
budgeted, KV rolled back to the accepted drafts, preemption and abort mid-speculation, max_tokens
and EOS inside drafts) with ``FakeKVRunner``, which checks every block table it reads and whose
"model" is a function of the context read back."""

from __future__ import annotations

import random

import pytest

from engine_service.config import (
    DecodeCapabilities,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
    engine_cli_args,
)
from engine_service.core.request import FinishReason, Request, RequestStatus
from engine_service.core.sampling_params import SamplingParams
from engine_service.core.scheduler import Scheduler
from engine_service.core.spec_decode import COPY_WINDOW, NgramDrafter
from sluice_bench.scheduler import FakeKVRunner

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


# --- configuration ---
@pytest.mark.parametrize(("value", "knob"), [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": -2}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 1000}, "prompt_lookup_max"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_model": "x"}, "draft_model"),
    ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": "4"}, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": True}, "disable_by_batch_size"),
    ('{"method": "ngram", "num_speculative_tokens": ', "JSON"),
    ({"method": "ngram", "num_speculative_tokens": 3, "backoff": "sometimes"}, "backoff"),
    ({"method": "ngram", "num_speculative_tokens": 3, "backoff": False}, "backoff"),
])
def test_a_configuration_that_cannot_work_is_refused_naming_the_knob(value, knob):
    with pytest.raises(ValueError, match=knob):
        SpeculativeConfig.parse(value)


def test_k_larger_than_the_token_budget_allows_is_refused():
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 8})
    config.check(max_num_batched_tokens=9)  # k + 1 fits
    with pytest.raises(ValueError, match=r"num_speculative_tokens \(8\).*max_num_batched_tokens \(8\)"):
        config.check(max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(SchedulerConfig(num_blocks=8, max_num_batched_tokens=4, speculative_config=config))


@pytest.mark.slow
def test_the_engine_refuses_a_bad_configuration_at_start():
    from engine_service.engine import LLMEngine

    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLMEngine(EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 0}))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLMEngine(EngineConfig(max_num_batched_tokens=4,
                               speculative_config='{"method": "ngram", "num_speculative_tokens": 4}'))


def test_vllm_defaults_and_the_cli_round_trip():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.parse({"num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 4)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    args = engine_cli_args(EngineConfig(speculative_config=NGRAM))
    i = args.index("--speculative-config")
    assert SpeculativeConfig.parse(args[i + 1]) == SpeculativeConfig.parse(NGRAM)
    off_above_2 = {**NGRAM, "disable_by_batch_size": 2}
    args = engine_cli_args(EngineConfig(speculative_config=off_above_2))
    c = SpeculativeConfig.parse(args[args.index("--speculative-config") + 1])
    assert c.disable_by_batch_size == 2 and c == SpeculativeConfig.parse(off_above_2)
    assert SpeculativeConfig.parse(NGRAM).disable_by_batch_size is None  # vLLM's default: never off


# --- the drafter ---
def brute_force(tokens: list[int], lo: int, hi: int, limit: int) -> list[int]:
    """The most recent earlier occurrence of the longest matching suffix (n from hi down to lo)."""
    length = len(tokens)
    for n in range(hi, lo - 1, -1):
        if n > length:
            continue
        suffix = tokens[length - n:]
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n:end] == suffix:
                return tokens[end:end + limit]
    return []


def test_the_drafter_proposes_what_a_full_scan_finds_while_the_sequence_grows():
    rng = random.Random(0)
    for trial in range(20):
        config = SpeculativeConfig.parse({"num_speculative_tokens": 5, "prompt_lookup_max": 1 + trial % 4,
                                          "prompt_lookup_min": 1 + trial % 2 if trial % 4 else 1})
        drafter = NgramDrafter(config)
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 30))]
        for _ in range(60):
            limit = rng.randrange(0, 7)
            drafter.k_next = config.num_speculative_tokens  # no back-off here: the lookup alone
            want = brute_force(tokens, config.prompt_lookup_min, config.prompt_lookup_max,
                               min(limit, config.num_speculative_tokens))
            assert drafter.propose(tokens, limit) == want, (tokens, limit)
            tokens.extend(rng.randrange(6) for _ in range(rng.randrange(1, 4)))


def copy_reference(tokens: list[int], lo: int, hi: int, limit: int, cursor: int | None) -> tuple[list[int], int | None]:
    """The drafter with a copy cursor, by full scans: for n from hi down to 1, the nearest
    occurrence ending within COPY_WINDOW at or after the cursor, else (n >= lo) the most recent.
    Returns the drafts and the end of the occurrence they came from."""
    length = len(tokens)
    for n in range(min(hi, length), 0, -1):
        suffix = tokens[length - n:]
        if cursor is not None:
            near = [e for e in range(n, length) if tokens[e - n:e] == suffix and 0 <= e - cursor <= COPY_WINDOW]
            if near:
                return tokens[min(near):min(near) + limit], min(near)
        if n >= lo:
            ends = [e for e in range(n, length) if tokens[e - n:e] == suffix]
            if ends:
                return tokens[max(ends):max(ends) + limit], max(ends)
    return [], None


def test_the_copy_cursor_matches_a_full_scan_as_drafts_are_accepted():
    rng = random.Random(1)
    for trial in range(30):
        config = SpeculativeConfig.parse({"num_speculative_tokens": 5, "prompt_lookup_max": 2 + trial % 3,
                                          "prompt_lookup_min": 2, "backoff": "off"})
        drafter = NgramDrafter(config)
        tokens = [rng.randrange(8) for _ in range(rng.randrange(2, 40))]
        cursor = None
        for _ in range(50):
            limit = rng.randrange(0, 7)
            want, source = copy_reference(tokens, 2, config.prompt_lookup_max, min(limit, 5), cursor)
            drafts = drafter.propose(tokens, limit)
            assert drafts == want, (tokens, limit, cursor)
            accepted = rng.randrange(len(drafts) + 1)
            if drafts:
                drafter.observe(len(drafts), accepted)
                cursor = source + accepted + 1
            tokens.extend(drafts[:accepted] + [rng.randrange(8)])


def test_after_a_reworded_token_the_copy_goes_on_from_the_cursor():
    """A passage copied with one token changed (the model writes 90 where the source has 5): no
    2-gram of the output matches any more, and the most recent 1-gram occurrence (of 6) is not
    where the copy is; the drafter picks the copy up right after the cursor."""
    config = SpeculativeConfig.parse({"num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2,
                                      "backoff": "off"})
    passage = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    prompt = passage + [6, 40, 41]  # 6 recurs later, followed by something else
    drafter = NgramDrafter(config)
    tokens = prompt + [0, 1, 2]  # the model starts copying: 1 2 matches the passage
    assert drafter.propose(tokens, 4) == [3, 4, 5, 6]
    drafter.observe(4, 2)  # 3 4 kept, then the model's own token replaces 5
    tokens += [3, 4, 90, 6]  # ... and goes on with 6
    assert NgramDrafter(config).propose(tokens, 4) == []  # without the cursor: no 2-gram matches
    assert drafter.propose(tokens, 4) == [7, 8, 9, 10]  # with it: the 6 right after the cursor


def test_the_drafter_indexes_each_token_once():
    drafter = NgramDrafter(SpeculativeConfig.parse(NGRAM))
    tokens = list(range(50)) * 4
    assert drafter.propose(tokens, 4) == [0, 1, 2, 3]  # after the last occurrence of 47 48 49
    tokens.append(0)
    index_sizes = [len(d) for d in drafter._index.values()]
    assert drafter.propose(tokens, 4) == [1, 2, 3, 4]
    # one more token: at most one new entry per n-gram size, no rescan
    assert sum(len(d) for d in drafter._index.values()) - sum(index_sizes) <= 3


def test_back_off_skips_drafting_after_failures_and_recovers_after_success():
    drafter = NgramDrafter(SpeculativeConfig.parse(NGRAM))
    tokens = [1, 2, 3, 1, 2]
    assert drafter.propose(tokens, 4) == [3, 1, 2]
    drafter.observe(3, 0)  # nothing accepted: one draft token next, after skipping one step
    assert drafter.propose(tokens, 4) == []
    assert drafter.propose(tokens, 4) == [3]
    drafter.observe(1, 0)  # again: skip two steps
    assert [drafter.propose(tokens, 4) for _ in range(3)] == [[], [], [3]]
    drafter.observe(1, 1)  # all kept: twice as many next time
    assert drafter.propose(tokens, 4) == [3, 1]
    drafter.observe(2, 1)  # one of two kept: one more than kept
    assert drafter.propose(tokens, 4) == [3, 1]


def test_with_the_back_off_off_every_draft_offers_k():
    config = SpeculativeConfig.parse({**NGRAM, "backoff": "off"})
    assert config.as_dict()["backoff"] == "off" and SpeculativeConfig.parse(config.as_dict()) == config
    assert SpeculativeConfig.parse(NGRAM).backoff == "auto"
    drafter = NgramDrafter(config)
    tokens = [1, 2, 3, 1, 2]
    for accepted in (0, 0, 1, 3):
        assert drafter.propose(tokens, 4) == [3, 1, 2]
        drafter.observe(3, accepted)


# --- the scheduler ---
def cyclic_model(period: int = 7, vocab: int = 50):
    """A "model" whose next token follows the last one in a cycle: its text repeats itself, so
    n-gram drafts are often right (and wrong where the prompt's own n-grams mislead them)."""
    return lambda context: (context[-1] + 1) % period if context[-1] < vocab else 0


def make(num_blocks=64, block_size=4, budget=64, max_num_seqs=8, spec=NGRAM, caching=True, model=None,
         max_model_len=4096, fast_step_max_rows=0):
    config = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget,
                             max_num_seqs=max_num_seqs, max_model_len=max_model_len, watermark_blocks=0,
                             enable_prefix_caching=caching,
                             speculative_config=SpeculativeConfig.parse(spec) if spec else None,
                             decode=DecodeCapabilities(fast_step_max_rows=fast_step_max_rows))
    return Scheduler(config), FakeKVRunner(num_blocks, block_size, next_token=model or cyclic_model())


def requests(seed: int, count: int, max_tokens=(4, 40), eos: frozenset[int] = frozenset(), ignore_eos=True):
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt = [rng.randrange(7) for _ in range(rng.randrange(2, 20))]
        sp = SamplingParams(max_tokens=rng.randrange(*max_tokens), ignore_eos=ignore_eos, temperature=0.0)
        out.append(Request(f"r{i}", prompt, sp, eos_token_ids=eos))
    return out


def run(sched: Scheduler, runner: FakeKVRunner, reqs: list[Request], abort_at: dict[int, str] | None = None):
    for r in reqs:
        sched.add_request(r)
    steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.check_invariants()
        assert out.num_batched_tokens == sum(c.num_tokens for c in out.chunks) <= sched.max_num_batched_tokens
        for c in out.chunks:
            if c.draft_token_ids:
                req = c.request
                room = sched.max_model_len - req.num_tokens
                if req.sampling_params.max_tokens is not None:
                    room = min(room, req.sampling_params.max_tokens - req.num_output_tokens)
                assert c.num_tokens == 1 + len(c.draft_token_ids) <= room, "drafts cross max_tokens or the context"
        sampled = runner.step(out)
        if abort_at and steps in abort_at:
            sched.abort_requests([abort_at[steps]])
        sched.update_from_output(out, sampled)
        sched.check_invariants()
        steps += 1
        assert steps < 5000
    pool = sched.block_pool
    assert pool.num_free_blocks == pool.num_total_blocks
    return steps


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("num_blocks", [64, 14])  # 14: a tight pool, preemptions mid-speculation
def test_speculation_produces_the_tokens_of_plain_decoding_in_fewer_steps(caching, num_blocks):
    plain_s, plain_r = make(spec=None, caching=caching, num_blocks=num_blocks)
    plain = requests(1, 12)
    plain_steps = run(plain_s, plain_r, plain)
    spec_s, spec_r = make(caching=caching, num_blocks=num_blocks)
    spec = requests(1, 12)
    spec_steps = run(spec_s, spec_r, spec)
    assert [r.output_token_ids for r in spec] == [r.output_token_ids for r in plain]
    assert [r.finish_reason for r in spec] == [FinishReason.LENGTH] * len(spec)
    stats = spec_s.spec_stats
    assert stats.num_accepted_tokens > 0 and stats.num_drafts > 0
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # some drafts were rejected, and rolled back
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    assert spec_steps < plain_steps
    if num_blocks == 14:
        assert spec_s.stats.preemptions > 0


def test_eos_inside_accepted_drafts_ends_the_request_where_plain_decoding_does():
    eos = frozenset({5})
    plain_s, plain_r = make(spec=None)
    plain = requests(2, 10, max_tokens=(30, 60), eos=eos, ignore_eos=False)
    run(plain_s, plain_r, plain)
    spec_s, spec_r = make()
    spec = requests(2, 10, max_tokens=(30, 60), eos=eos, ignore_eos=False)
    run(spec_s, spec_r, spec)
    assert [r.output_token_ids for r in spec] == [r.output_token_ids for r in plain]
    assert all(r.finish_reason is FinishReason.STOP and r.output_token_ids[-1] == 5 for r in spec)
    assert spec_s.spec_stats.num_accepted_tokens > 0


def test_drafts_stop_at_max_tokens_and_the_context_end():
    sched, runner = make(max_model_len=40)
    reqs = [Request("a", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2], SamplingParams(max_tokens=9, ignore_eos=True)),
            Request("b", [0, 1, 2, 3, 4, 5, 6, 0, 1], SamplingParams(max_tokens=None, ignore_eos=True))]
    run(sched, runner, reqs)
    assert len(reqs[0].output_token_ids) == 9 and reqs[0].finish_reason is FinishReason.LENGTH
    assert reqs[1].num_tokens == 40 and reqs[1].finish_reason is FinishReason.LENGTH


def test_the_k_plus_one_tokens_are_budgeted_and_never_squeeze_out_a_running_request():
    # budget 6, three decoding requests: drafts may use what the other two decodes leave
    sched, runner = make(budget=6, max_num_seqs=3)
    reqs = [Request(f"r{i}", [0, 1, 2, 3, 4, 5, 6, 0, 1], SamplingParams(max_tokens=30, ignore_eos=True))
            for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    saw_drafts = False
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert out.num_batched_tokens <= 6
        if all(r.num_output_tokens for r in reqs) and sched.num_running == 3:
            assert len(out.chunks) == 3, "a running request was left out of a step for someone's drafts"
        saw_drafts |= any(c.draft_token_ids for c in out.chunks)
        sched.update_from_output(out, runner.step(out))
        sched.check_invariants()
    assert saw_drafts


def _decode_steps(fast_step_max_rows: int, admit_late: bool = False):
    """Four requests decoding a text that repeats (so each drafts k = 6 when it can), run to the
    end; the rows of every step, whether it held a prefill chunk, and the requests."""
    sched, runner = make(fast_step_max_rows=fast_step_max_rows)
    reqs = [Request(f"r{i}", [0, 1, 2, 3, 4, 5, 6, 0, 1, i % 3], SamplingParams(max_tokens=40, ignore_eos=True))
            for i in range(4)]
    late = Request("late", list(range(1, 7)) * 3, SamplingParams(max_tokens=8, ignore_eos=True))
    for r in reqs:
        sched.add_request(r)
    steps, n = [], 0
    while sched.has_unfinished_requests():
        if admit_late and n == 6:
            sched.add_request(late)
        out = sched.schedule()
        prefill = any(c.num_tokens > 1 and not c.draft_token_ids for c in out.chunks)
        steps.append((out.num_batched_tokens, len(out.chunks), prefill,
                      sum(len(c.draft_token_ids or ()) for c in out.chunks)))
        sched.update_from_output(out, runner.step(out))
        sched.check_invariants()
        n += 1
    return steps, reqs, sched.spec_stats


def test_drafts_keep_a_step_of_decodes_on_the_fast_steps_rows():
    """Where the runner's fast step (the native decode step) takes fewer than 12 rows, four
    decoding requests draft no step of decodes up to 12 rows; without the limit they do. They
    still draft, and the tokens are plain decoding's either way. A step that prefills runs the
    full forward anyway, so its drafts keep the token budget alone."""
    free_steps, free_reqs, free_stats = _decode_steps(0)
    assert any(rows >= 12 and not prefill for rows, _, prefill, _ in free_steps), "the limit would not bind"
    capped_steps, capped_reqs, capped_stats = _decode_steps(12)
    assert all(rows < 12 for rows, _, prefill, _ in capped_steps if not prefill)
    assert capped_stats.num_drafts > 0 and capped_stats.num_accepted_tokens > 0
    assert capped_stats.num_draft_tokens < free_stats.num_draft_tokens
    plain_s, plain_r = make(spec=None)
    plain = [Request(f"r{i}", [0, 1, 2, 3, 4, 5, 6, 0, 1, i % 3], SamplingParams(max_tokens=40, ignore_eos=True))
             for i in range(4)]
    run(plain_s, plain_r, plain)
    want = [r.output_token_ids for r in plain]
    assert [r.output_token_ids for r in capped_reqs] == want == [r.output_token_ids for r in free_reqs]
    # with a prefill in the step, the drafts before it are not held to the fast step's rows
    late_steps, _, _ = _decode_steps(12, admit_late=True)
    assert any(prefill and rows >= 12 and drafted for rows, _, prefill, drafted in late_steps)


def test_a_batch_the_fast_step_cannot_take_drafts_as_without_the_limit():
    """Where the fast step takes fewer than 4 rows, a step of four decodes cannot run it whatever
    it drafts, so it drafts within the token budget alone; once fewer run, their steps keep under
    4 rows."""
    steps, _, stats = _decode_steps(4)
    assert any(chunks == 4 and not prefill and drafted > 0 for _, chunks, prefill, drafted in steps)
    assert all(rows < 4 for rows, chunks, prefill, _ in steps if chunks < 4 and not prefill)
    assert any(chunks < 4 for _, chunks, _, _ in steps) and stats.num_accepted_tokens > 0


def test_no_drafts_in_a_step_of_more_requests_than_disable_by_batch_size():
    """Three requests with speculation off above two: the steps that run three draft nothing; once
    one has finished, the two left draft again; the tokens are plain decoding's throughout."""
    sched, runner = make(spec={**NGRAM, "disable_by_batch_size": 2})
    lengths = (12, 30, 30)
    reqs = [Request(f"r{i}", [0, 1, 2, 3, 4, 5, 6, 0, 1], SamplingParams(max_tokens=n, ignore_eos=True))
            for i, n in enumerate(lengths)]
    for r in reqs:
        sched.add_request(r)
    drafted_by_batch = {2: 0, 3: 0}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        n = len(out.chunks)
        drafted_by_batch[n] = drafted_by_batch.get(n, 0) + sum(len(c.draft_token_ids or ()) for c in out.chunks)
        sched.update_from_output(out, runner.step(out))
        sched.check_invariants()
    assert drafted_by_batch[3] == 0 and drafted_by_batch[2] > 0
    plain_s, plain_r = make(spec=None)
    plain = [Request(f"r{i}", [0, 1, 2, 3, 4, 5, 6, 0, 1], SamplingParams(max_tokens=n, ignore_eos=True))
             for i, n in enumerate(lengths)]
    run(plain_s, plain_r, plain)
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in plain]


def test_abort_mid_speculation_releases_the_drafts_blocks():
    sched, runner = make()
    req = Request("a", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    other = Request("b", [3, 3, 3, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    sched.add_request(req)
    sched.add_request(other)
    for _ in range(20):
        out = sched.schedule()
        drafted = [c for c in out.chunks if c.request is req and c.draft_token_ids]
        if drafted:
            break
        sched.update_from_output(out, runner.step(out))
    assert drafted, "the repetitive request never drafted"
    assert req.num_computed_tokens > req.num_tokens  # the drafts' KV is in flight
    sampled = runner.step(out)
    sched.abort_requests(["a"])
    assert req.status is RequestStatus.FINISHED and req.block_ids == []
    sched.update_from_output(out, sampled)
    sched.check_invariants()
    sched.abort_requests(["b"])
    assert sched.block_pool.num_free_blocks == sched.block_pool.num_total_blocks


def test_a_grammar_constrained_request_never_drafts():
    sched, runner = make()
    sp = SamplingParams(max_tokens=20, ignore_eos=True, structured_outputs={"regex": "[0-9]+"})
    req = Request("a", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2], sp)
    sched.add_request(req)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert not any(c.draft_token_ids for c in out.chunks)
        sched.update_from_output(out, runner.step(out))
    assert sched.spec_stats.num_drafts == 0


def test_a_bad_verification_result_ends_the_request_with_an_error():
    sched, runner = make()
    req = Request("a", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2], SamplingParams(max_tokens=50, ignore_eos=True))
    sched.add_request(req)
    for _ in range(20):
        out = sched.schedule()
        chunk = next((c for c in out.chunks if c.draft_token_ids), None)
        if chunk is not None:
            wrong = [chunk.draft_token_ids[0] + 1, 0]  # a "kept draft" that is not the draft
            sched.update_from_output(out, {"a": wrong})
            break
        sched.update_from_output(out, runner.step(out))
    assert req.finish_reason is FinishReason.ERROR
    sched.check_invariants()
    assert sched.block_pool.num_free_blocks == sched.block_pool.num_total_blocks


# --- metrics ---
def test_spec_decode_counters_are_exported_with_vllms_names():
    from prometheus_client.parser import text_string_to_metric_families

    from engine_service.service.metrics import EngineMetrics

    sched, runner = make()
    run(sched, runner, requests(3, 6))
    stats = sched.spec_stats
    m = EngineMetrics("smol", "e1", process_metrics=False)
    unbound = {s.name: s.value for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}
    assert unbound["sluice:spec_decode_num_drafts_total"] == 0  # exported at 0 when nothing speculates
    m.bind(lambda: None, spec_decode=lambda: stats)
    got: dict[tuple, float] = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            if s.name.startswith("sluice:spec_decode"):
                assert s.labels["model"] == "smol" and s.labels["engine_id"] == "e1"
                got[s.name, s.labels.get("position")] = s.value
    assert got["sluice:spec_decode_num_drafts_total", None] == stats.num_drafts > 0
    assert got["sluice:spec_decode_num_draft_tokens_total", None] == stats.num_draft_tokens
    assert got["sluice:spec_decode_num_accepted_tokens_total", None] == stats.num_accepted_tokens > 0
    per_pos = [got["sluice:spec_decode_num_accepted_tokens_per_pos_total", str(p)] for p in range(4)]
    assert per_pos == stats.num_accepted_tokens_per_pos and per_pos[0] >= per_pos[1] >= per_pos[2]


def test_sluice_engine_refuses_a_bad_speculative_config_before_loading_the_model(caplog):
    from sluice_cli.cli import main

    rc = main(["engine", "--redis-url", "redis://127.0.0.1:1", "--max-num-batched-tokens", "8",
               "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 8}'])
    assert rc == 2
    assert "--speculative-config" in caplog.text and "max_num_batched_tokens (8)" in caplog.text
