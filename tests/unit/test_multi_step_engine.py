"""Several greedy decode steps in one scheduling step (``num_scheduler_steps``) with the real model
and its native step: the tokens are those of one step at a time, alone and batched; a stop token or
a stop string inside a burst ends the request where single steps end it; a request the sampler must
see decodes one step at a time; the engine refuses a number of steps that cannot work before it
loads the model, and runs one step at a time where it has no native step with its head."""

from __future__ import annotations

import pytest
import torch

from engine_service import LLM, SamplingParams
from engine_service.model.native_decode import NativeDecode

pytestmark = pytest.mark.model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "List three colours:"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True)


class _Spy:
    """The engine's native step, counting the steps of each greedy_steps call."""

    def __init__(self, native: NativeDecode) -> None:
        self.native, self.bursts = native, []

    def __getattr__(self, name):
        return getattr(self.native, name)

    def __call__(self, *args, **kwargs):
        return self.native(*args, **kwargs)

    def greedy_steps(self, ids, positions, *args):
        self.bursts.append(tuple(positions.shape))
        return self.native.greedy_steps(ids, positions, *args)


def _engine(model_dir, monkeypatch, steps: int) -> LLM:
    import engine_service.model.decode_paths.compiled as compiled_path
    from engine_service.model.native import native_ops_unavailable

    why = native_ops_unavailable()
    assert why is None, f"the native operators must build on this machine (gcc, g++): {why}"
    if not torch.ops.sluice.q4_supported():
        pytest.skip("this CPU has no AVX512-VNNI: no native int4 products, so no native decode step")
    # the native step does not need inductor: no compiler spares each engine its warm-up
    monkeypatch.setattr(compiled_path, "compile_supported", lambda device: "no compiler (the test says)")
    llm = LLM(str(model_dir), dtype="float32", quantization="int4", enforce_eager=False, kv_cache_memory=32 << 20,
              enable_prefix_caching=False, num_scheduler_steps=steps)
    assert llm.engine.decode_mode == "native step"
    # drafts keep a step of decodes on the native step (scheduler.py): the rows it takes
    assert llm.engine.scheduler.fast_step_max_rows == llm.engine.decode_path.native.max_rows > 1
    return llm


@pytest.fixture(scope="module")
def engines(model_dir):
    with pytest.MonkeyPatch.context() as monkeypatch:
        plain, steps = _engine(model_dir, monkeypatch, 1), _engine(model_dir, monkeypatch, 8)
    spy = _Spy(steps.engine.decode_path.native)
    steps.engine.decode_path.native = spy
    return plain, steps, spy


def test_the_tokens_are_those_of_one_step_at_a_time_alone_and_batched(engines):
    plain, steps, spy = engines
    alone = [plain.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
    spy.bursts.clear()
    assert [steps.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS] == alone
    # 20 tokens after the prefill's: bursts of 8, 8 and the 4 left, one row each
    assert spy.bursts == [(8, 1), (8, 1), (4, 1)] * len(PROMPTS)
    assert steps.engine.last_batch == (1, 4)  # the last burst's row and the tokens it forwarded
    spy.bursts.clear()
    assert [o.outputs[0].token_ids for o in steps.generate(PROMPTS, GREEDY)] == alone
    assert spy.bursts and all(rows == len(PROMPTS) for _, rows in spy.bursts)
    stats = steps.engine.get_stats()
    assert stats.free_blocks == stats.total_blocks


def test_a_stop_token_and_a_stop_string_inside_a_burst_end_where_single_steps_do(engines):
    plain, steps, spy = engines
    full = plain.generate(PROMPTS[1], GREEDY)[0].outputs[0]
    stop = full.token_ids[5]  # inside the first burst of eight
    params = SamplingParams(temperature=0.0, max_tokens=21, stop_token_ids=[stop])
    want = plain.generate(PROMPTS[1], params)[0].outputs[0]
    got = steps.generate(PROMPTS[1], params)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"
    assert got.stop_reason == want.stop_reason == stop
    word = full.text[len(full.text) // 3:][:4]  # a stop string a few tokens in
    params = SamplingParams(temperature=0.0, max_tokens=21, stop=[word])
    want = plain.generate(PROMPTS[1], params)[0].outputs[0]
    got = steps.generate(PROMPTS[1], params)[0].outputs[0]
    assert (got.text, got.finish_reason, got.stop_reason) == (want.text, "stop", word)
    stats = steps.engine.get_stats()
    assert stats.free_blocks == stats.total_blocks


def test_requests_the_sampler_must_see_take_one_step_at_a_time(engines):
    plain, steps, spy = engines
    for params in (SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
                   SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3)):
        spy.bursts.clear()
        got = steps.generate(PROMPTS[0], params)[0].outputs[0]
        assert not spy.bursts
        want = plain.generate(PROMPTS[0], params)[0].outputs[0]
        assert got.token_ids == want.token_ids


def test_the_runner_refuses_a_multi_step_batch_it_cannot_run(engines):
    """The scheduler hands the runner only one-token decodes of one number of steps; anything else
    is refused, not run."""
    from types import SimpleNamespace

    _, steps, _ = engines
    runner = steps.engine.runner
    req = SimpleNamespace(all_token_ids=[1, 2, 3], block_ids=[0])
    mixed = [SimpleNamespace(request=req, start=2, num_tokens=1, num_steps=4),
             SimpleNamespace(request=req, start=2, num_tokens=1, num_steps=3)]
    with pytest.raises(RuntimeError, match="one-token decodes of the same steps"):
        runner.execute(mixed)
    path = runner.path
    runner.use(path.fallback)  # the eager forward alone: no several steps in one call
    try:
        with pytest.raises(RuntimeError, match="runs no several decode steps in one call"):
            runner.execute(mixed[:1])
    finally:
        runner.use(path)


def test_the_engine_refuses_steps_that_cannot_work_before_loading_the_model(model_dir, monkeypatch):
    import engine_service.engine

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(engine_service.engine, "load_model", no_load)
    with pytest.raises(ValueError, match="num_scheduler_steps must be between 1 and"):
        LLM(str(model_dir), num_scheduler_steps=0)
    with pytest.raises(ValueError, match="num_scheduler_steps above 1 and speculative_config"):
        LLM(str(model_dir), num_scheduler_steps=4,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_without_a_native_step_the_engine_decodes_one_step_at_a_time(model_dir, caplog):
    llm = LLM(str(model_dir), dtype="float32", enforce_eager=True, kv_cache_memory=16 << 20, num_scheduler_steps=8)
    assert llm.engine.scheduler.multi_step_max_rows == llm.engine.scheduler.fast_step_max_rows == 0
    assert "--num-scheduler-steps 8 runs as 1" in caplog.text
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 6


def test_sluice_engine_refuses_a_bad_number_of_steps_before_loading_the_model(caplog):
    from sluice_cli.cli import main

    rc = main(["engine", "--redis-url", "redis://127.0.0.1:1", "--num-scheduler-steps", "65"])
    assert rc == 2
    assert "--num-scheduler-steps" in caplog.text and "between 1 and 64" in caplog.text
