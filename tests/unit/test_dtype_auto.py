"""``dtype="auto"``, and every other ``auto``, decided by facts: the device, the CPU's features, the
torch build, the checkpoint and the quantization; the same on every start of the same machine."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from engine_service.config import DecodeCapabilities, EngineConfig, SpeculativeConfig
from engine_service.model import dtype as auto


def test_cpu_without_native_bf16_is_float32(monkeypatch, tmp_path):
    monkeypatch.setattr(auto, "cpu_has_native_bf16", lambda: False)
    dtype, why = auto.resolve_auto_dtype(torch.device("cpu"), tmp_path)
    assert dtype == torch.float32 and "no native bfloat16" in why


def test_cpu_with_native_bf16_takes_it_unless_quantized_or_unprepackable(monkeypatch, tmp_path):
    import engine_service.model.prepacked as prepacked

    monkeypatch.setattr(auto, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(prepacked, "prepack_unavailable", lambda dtype, device: None)
    assert auto.resolve_auto_dtype(torch.device("cpu"), tmp_path) == (
        torch.bfloat16, "this CPU computes bfloat16 natively (AVX512-BF16 or AMX, as oneDNN reports it)")
    # weight-only quantization: the native int4 step's float32 activations
    dtype, why = auto.resolve_auto_dtype(torch.device("cpu"), tmp_path, "int4")
    assert dtype == torch.float32 and "int4" in why
    monkeypatch.setattr(prepacked, "prepack_unavailable", lambda dtype, device: "this torch has no oneDNN")
    dtype, why = auto.resolve_auto_dtype(torch.device("cpu"), tmp_path)
    assert dtype == torch.float32 and why.endswith("this torch has no oneDNN")


def test_the_choice_is_the_same_at_every_start_and_nothing_is_timed(monkeypatch, tmp_path):
    """No clock is read while choosing: the same facts, the same answer, however loaded the machine."""
    import time

    def no_clock():
        raise AssertionError("auto read a clock")

    choices = {auto.resolve_auto_dtype(torch.device("cpu"), tmp_path) for _ in range(2)}
    monkeypatch.setattr(time, "perf_counter", no_clock)
    monkeypatch.setattr(time, "monotonic", no_clock)
    choices.add(auto.resolve_auto_dtype(torch.device("cpu"), tmp_path))
    assert len(choices) == 1


@pytest.mark.parametrize("name,expected", [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                           ("float32", torch.float32), (None, torch.float32)])
def test_cuda_takes_the_checkpoint_dtype(tmp_path, name, expected):
    cfg = {"architectures": ["LlamaForCausalLM"]} | ({"torch_dtype": name} if name else {})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert auto.resolve_auto_dtype(torch.device("cuda"), tmp_path)[0] == expected


def test_a_quantized_layers_kernel_dtype_is_a_rule_not_a_timing():
    from engine_service.model.quantization import pick_kernel_dtype

    assert pick_kernel_dtype([torch.bfloat16, torch.float32]) == torch.bfloat16
    assert pick_kernel_dtype([torch.float32]) == torch.float32


@pytest.mark.parametrize("k,caps,expected", [
    (4, DecodeCapabilities(path="native step", fast_step_max_rows=17, one_pass_rows=7), "off"),  # 5 rows, one pass
    (6, DecodeCapabilities(path="native step", fast_step_max_rows=17, one_pass_rows=7), "off"),
    (7, DecodeCapabilities(path="native step", fast_step_max_rows=17, one_pass_rows=7), "on"),  # 8 rows: two passes
    (4, DecodeCapabilities(path="native step", fast_step_max_rows=64, one_pass_rows=1), "on"),  # int4: a row's own cost
    (4, DecodeCapabilities(path="eager"), "on"),
])
def test_the_speculative_back_off_auto_reads_the_paths_capabilities(k, caps, expected, caplog):
    from engine_service.engine import LLMEngine

    spec = SpeculativeConfig(num_speculative_tokens=k)
    with caplog.at_level(logging.INFO, logger="engine_service.engine"):
        assert LLMEngine._resolve_backoff(spec, caps).backoff == expected
    assert f"back-off {expected} (auto: the {caps.path} path takes {k + 1} rows" in caplog.text


def test_default_is_auto_and_the_environment_or_a_keyword_pins_it(monkeypatch):
    monkeypatch.delenv("SLUICE_DTYPE", raising=False)
    assert EngineConfig().resolved_dtype() == "auto"
    monkeypatch.setenv("SLUICE_DTYPE", "bfloat16")
    assert EngineConfig().resolved_dtype() == "bfloat16"
    assert EngineConfig(dtype="float32").resolved_dtype() == "float32"


def test_enforce_eager_default_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("SLUICE_ENFORCE_EAGER", raising=False)
    assert EngineConfig().resolved_enforce_eager() is True  # CPU: the compiled step's warm-up is long
    assert EngineConfig().eager_asked() is None  # ... but not asked for: the native step stays
    assert EngineConfig(enforce_eager=True).eager_asked() is True
    assert EngineConfig(enforce_eager=False).eager_asked() is False
    # CUDA: not eager, so decode steps replay CUDA graphs (no long compile at start)
    assert EngineConfig(device="cuda").resolved_enforce_eager() is False
    assert EngineConfig(device="cuda:1").resolved_enforce_eager() is False
    monkeypatch.setenv("SLUICE_ENFORCE_EAGER", "0")
    assert EngineConfig().resolved_enforce_eager() is False and EngineConfig().eager_asked() is False
    monkeypatch.setenv("SLUICE_ENFORCE_EAGER", "1")
    assert EngineConfig().eager_asked() is True
    assert EngineConfig(device="cuda").resolved_enforce_eager() is True
    assert EngineConfig(enforce_eager=True).resolved_enforce_eager() is True
