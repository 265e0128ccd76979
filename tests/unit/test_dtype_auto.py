"""``dtype="auto"``: the checkpoint's dtype on CUDA; on CPU bfloat16 only where native and faster."""

from __future__ import annotations

import json

import pytest
import torch

from engine_service.config import EngineConfig
from engine_service.model import dtype as auto


def test_cpu_without_native_bf16_is_float32(monkeypatch, tmp_path):
    monkeypatch.setattr(auto, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(auto, "probe_cpu_bf16", lambda *a: pytest.fail("no probe without native bf16"))
    assert auto.resolve_auto_dtype(torch.device("cpu"), tmp_path, 64, 128) == torch.float32


@pytest.mark.parametrize("fp32_s,bf16_s,expected", [
    (2.0, 1.0, torch.bfloat16),  # twice as fast: taken
    (1.1, 1.0, torch.float32),  # 10% is inside the margin: not taken
    (1.0, 2.0, torch.float32),  # slower (the GEMV case on many CPUs)
])
def test_cpu_with_native_bf16_takes_it_only_when_measured_faster(monkeypatch, tmp_path, fp32_s, bf16_s, expected):
    monkeypatch.setattr(auto, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(auto, "probe_cpu_bf16", lambda *a: (fp32_s, bf16_s))
    assert auto.resolve_auto_dtype(torch.device("cpu"), tmp_path, 64, 128) == expected


def test_probe_measures_both_types():
    fp32, bf16 = auto.probe_cpu_bf16(64, 128, rounds=2, reps=2)
    assert fp32 > 0 and bf16 > 0


@pytest.mark.parametrize("name,expected", [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                           ("float32", torch.float32), (None, torch.float32)])
def test_cuda_takes_the_checkpoint_dtype(tmp_path, name, expected):
    cfg = {"architectures": ["LlamaForCausalLM"]} | ({"torch_dtype": name} if name else {})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert auto.resolve_auto_dtype(torch.device("cuda"), tmp_path, 64, 128) == expected


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
