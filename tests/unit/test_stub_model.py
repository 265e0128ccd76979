"""The stub model of the serving-path bench (engine_service.model.stub): fixed, deterministic text
through the real engine, and never loaded outside a benchmark."""

from __future__ import annotations

import os

import pytest
import torch

from engine_service import LLM, SamplingParams
from engine_service.model.architectures import ARCHITECTURES, UnsupportedModelError, resolve_architecture
from engine_service.model.stub import BENCH_ENV, STUB_PASSAGE, StubModel, StubModelRefused


@pytest.fixture(scope="module")
def stub_llm(model_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(BENCH_ENV, "1")
        yield LLM(str(model_dir), stub_model=True)


@pytest.mark.model
def test_refused_outside_bench_mode(model_dir, monkeypatch):
    monkeypatch.delenv(BENCH_ENV, raising=False)
    with pytest.raises(StubModelRefused, match=BENCH_ENV):
        LLM(str(model_dir), stub_model=True)
    monkeypatch.setenv(BENCH_ENV, "yes")  # only "1" opens it
    with pytest.raises(StubModelRefused):
        LLM(str(model_dir), stub_model=True)


def test_engine_command_refuses_it_without_the_bench_env(monkeypatch, caplog):
    import argparse

    from engine_service.service import main

    monkeypatch.delenv(BENCH_ENV, raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    assert "--stub-model" not in parser.format_help()  # not a user-facing option
    args = parser.parse_args(["--stub-model", "--redis-url", "redis://127.0.0.1:1/0", "--grpc-port", "0"])
    assert main.run(args) == 2
    assert any(BENCH_ENV in r.getMessage() for r in caplog.records)
    # a served engine's OpenMP threads wait passively unless the environment says otherwise
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert main.run(args) == 2
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_no_config_can_name_it():
    assert not any("Stub" in name for name in ARCHITECTURES)
    with pytest.raises(UnsupportedModelError):
        resolve_architecture({"architectures": ["StubModel"]})


@pytest.mark.model
def test_greedy_text_is_the_passage_from_the_position_on(stub_llm):
    tok = stub_llm.engine.tokenizer
    passage = tok.encode(STUB_PASSAGE, add_special_tokens=False)
    prompt_a, prompt_b = [11, 12, 13], [21, 22, 23, 24, 25]
    outs = stub_llm.generate([prompt_a, prompt_b], SamplingParams(max_tokens=len(passage) + 7, temperature=0))
    for prompt, out in zip([prompt_a, prompt_b], outs, strict=True):
        ids = out.outputs[0].token_ids
        assert len(ids) == len(passage) + 7 and out.outputs[0].finish_reason == "length"
        # the token after position p is passage[(p + 1) % len]: the last prompt position is len(prompt) - 1
        assert ids == [passage[(len(prompt) + i) % len(passage)] for i in range(len(ids))]
    assert stub_llm.engine.model_name.endswith("-stub")
    # the same again, alone or in a batch: nothing depends on the batch or on earlier steps
    again = stub_llm.generate([prompt_b], SamplingParams(max_tokens=len(passage) + 7, temperature=0))
    assert again[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    # the detokenized text is the passage's (multi-byte characters whole)
    text = stub_llm.generate([[1] * len(passage)], SamplingParams(max_tokens=len(passage)))[0].outputs[0].text
    assert text == STUB_PASSAGE


def test_logits_favour_one_token_per_row_and_reset_between_steps():
    model = StubModel(50, [3, 7, 9])
    first = model.compute_logits(model(None, torch.tensor([0, 1, 2, 5]), None, None)).clone()
    assert first.argmax(dim=1).tolist() == [7, 9, 3, 3]
    assert (first != 0).sum().item() == 4  # one favoured entry per row, every other at 0
    second = model.compute_logits(model(None, torch.tensor([1]), None, None))
    assert second.shape == (1, 50) and second.argmax(dim=1).tolist() == [9]
    assert (second != 0).sum().item() == 1  # the last step's entries were reset
    # a second call in the same step (prompt-logprob rows) does not overwrite the first's logits
    model(None, torch.tensor([0]), None, None)
    a = model.compute_logits(torch.tensor([0]))
    b = model.compute_logits(torch.tensor([1, 2]))
    assert a.argmax(dim=1).tolist() == [7] and b.argmax(dim=1).tolist() == [9, 3]
