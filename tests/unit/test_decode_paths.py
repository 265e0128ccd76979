"""The decode-path seam (``engine_service.model.decode_paths``): one choice at engine start, a path
per module and one registry entry each, the scheduler told only the chosen path's capabilities."""

from __future__ import annotations

import logging

import pytest
import torch

from engine_service.config import DecodeCapabilities
from engine_service.model.decode_paths import (
    DECODE_PATHS,
    DecodePath,
    PathSetup,
    PathSpec,
    choose_decode_path,
)


def _setup(**facts) -> PathSetup:
    return PathSetup(model=None, kv_caches=[], device=torch.device("cpu"), block_size=16, scratch_slot=0,
                     max_batch=8, max_model_len=64, **facts)


class _Every(DecodePath):
    name = "every"

    def hidden(self, input_ids, positions, meta):
        return torch.zeros(input_ids.shape[0], 2)


class _Few(DecodePath):
    name = "few"

    def hidden(self, input_ids, positions, meta):
        if input_ids.shape[0] <= 2:
            return torch.ones(input_ids.shape[0], 2)
        return self.fallback.hidden(input_ids, positions, meta)

    def capabilities(self) -> DecodeCapabilities:
        return DecodeCapabilities(path=self.name, fast_step_max_rows=3)


def _broken(setup, fallback):
    raise RuntimeError("no kernel today")


def test_the_first_step_path_that_runs_is_built_over_the_first_path_that_runs_every_step(caplog):
    specs = (
        PathSpec("refused step", unavailable=lambda s: "not here", build=_broken, runs_every_step=False),
        PathSpec("broken step", unavailable=lambda s: None, build=_broken, runs_every_step=False),
        PathSpec("few", unavailable=lambda s: None, build=lambda s, f: _Few(s, f), runs_every_step=False),
        PathSpec("refused every", unavailable=lambda s: "no compiler", build=_broken, runs_every_step=True),
        PathSpec("every", unavailable=lambda s: None, build=lambda s, f: _Every(s), runs_every_step=True),
    )
    with caplog.at_level(logging.ERROR, logger="engine_service.model.decode_paths"):
        choice = choose_decode_path(_setup(), specs)
    assert isinstance(choice.path, _Few) and isinstance(choice.path.fallback, _Every)
    assert choice.passed_over == {"refused every": "no compiler", "refused step": "not here",
                                  "broken step": "failed to start (RuntimeError: no kernel today)"}
    assert "the broken step path failed to start; passing it over" in caplog.text
    # the path takes its own steps and hands the rest to the one it was built over
    assert choice.path.hidden(torch.zeros(2, dtype=torch.long), None, None).sum() == 4
    assert choice.path.hidden(torch.zeros(5, dtype=torch.long), None, None).sum() == 0
    assert choice.path.capabilities() == DecodeCapabilities(path="few", fast_step_max_rows=3)
    assert choice.path.logits(None, None, None, None) is None  # no fused head: the runner takes the hidden states
    with pytest.raises(RuntimeError, match="runs no several decode steps"):
        choice.path.greedy_steps(None, None, None, None, None)


def test_without_a_step_path_the_every_step_path_runs_alone_and_none_at_all_is_an_error():
    every = PathSpec("every", unavailable=lambda s: None, build=lambda s, f: _Every(s), runs_every_step=True)
    choice = choose_decode_path(_setup(), (every,))
    assert isinstance(choice.path, _Every) and choice.path.capabilities() == DecodeCapabilities(path="every")
    with pytest.raises(RuntimeError, match="no decode path runs every step"):
        choose_decode_path(_setup(), (PathSpec("x", unavailable=lambda s: "no", build=_broken, runs_every_step=True),))


def test_the_registry_ends_in_the_eager_forward_and_each_path_says_why_it_does_not_run():
    names = [spec.name for spec in DECODE_PATHS]
    assert names == ["cuda graphs", "native step", "compiled", "eager"]
    assert DECODE_PATHS[-1].runs_every_step and DECODE_PATHS[-1].unavailable(_setup()) is None
    by_name = {spec.name: spec for spec in DECODE_PATHS}
    assert by_name["cuda graphs"].unavailable(_setup(compile=True, cuda_graphs=True)) == "not a CUDA device"
    assert "enforce_eager" in by_name["compiled"].unavailable(_setup(reference=True))
    assert "reference" in by_name["native step"].unavailable(_setup(reference=True, native_decode=True))
    assert by_name["native step"].unavailable(_setup(native_decode=False)) == "--no-native-decode"
    assert "torch attention" in by_name["native step"].unavailable(_setup(native_decode=True))
