"""``dtype="auto"``: which floating-point type the engine computes in, as vLLM decides it.

* CUDA: the checkpoint's dtype (``torch_dtype`` / ``dtype`` in config.json; float32 when absent).
* CPU: bfloat16 only where the CPU has native bf16 arithmetic (AVX512-BF16 or AMX, as oneDNN
  reports it) *and* a probe at engine start measures it faster; float32 otherwise. The probe times
  a decode-shaped product (one token through the model's largest projection, the matmul that
  dominates a decode step) in both types, interleaved, each as the engine runs it (bfloat16 weights
  prepacked for oneDNN, ``engine_service.model.prepacked``), and takes bfloat16 only when its median is
  at least ``BF16_MARGIN`` times faster, so noise does not flip the choice.

The decision and the probe's timings are logged. ``SLUICE_DTYPE`` in the environment sets the
default for a configuration that does not name one (the test suite pins float32 this way).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

BF16_MARGIN = 1.2
_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def checkpoint_dtype(model_dir: Path) -> torch.dtype:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)


def cpu_has_native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def probe_cpu_bf16(in_features: int, out_features: int, rounds: int = 5, reps: int = 20) -> tuple[float, float]:
    """Median seconds of one decode-shaped linear, (float32, bfloat16), measured interleaved."""
    from engine_service.model.prepacked import PrepackedLinear, prepack_unavailable

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(1, in_features, generator=gen)
    # each type as the engine would run it: a bfloat16 model's weights are prepacked where they can be
    if prepack_unavailable(torch.bfloat16, torch.device("cpu")) is None:
        bf16 = PrepackedLinear(weight.bfloat16(), None)
    else:
        bf16 = torch.nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16)
        bf16.weight.data = weight.bfloat16()
    fp32 = torch.nn.Linear(in_features, out_features, bias=False)
    fp32.weight.data = weight
    pairs = {torch.float32: (x, fp32), torch.bfloat16: (x.bfloat16(), bf16)}
    times: dict[torch.dtype, list[float]] = {torch.float32: [], torch.bfloat16: []}
    with torch.inference_mode():
        for a, layer in pairs.values():
            layer(a)  # first-call set-up out of the timing
        for _ in range(rounds):
            for dtype, (a, layer) in pairs.items():
                started = time.perf_counter()
                for _ in range(reps):
                    layer(a)
                times[dtype].append((time.perf_counter() - started) / reps)
    return statistics.median(times[torch.float32]), statistics.median(times[torch.bfloat16])


def resolve_auto_dtype(device: torch.device, model_dir: Path, hidden_size: int, intermediate_size: int) -> torch.dtype:
    if device.type == "cuda":
        dtype = checkpoint_dtype(model_dir)
        logger.info("dtype auto: %s, the checkpoint's dtype (CUDA)", _NAMES[dtype])
        return dtype
    if device.type != "cpu":
        return torch.float32
    if not cpu_has_native_bf16():
        logger.info("dtype auto: float32 (this CPU has no native bfloat16 arithmetic)")
        return torch.float32
    fp32, bf16 = probe_cpu_bf16(hidden_size, 2 * intermediate_size)
    choice = torch.bfloat16 if fp32 >= BF16_MARGIN * bf16 else torch.float32
    logger.info("dtype auto: %s (native bf16 CPU; decode probe %dx%d: float32 %.0f us, bfloat16 %.0f us, "
                "bfloat16 needs %.1fx)", _NAMES[choice], hidden_size, 2 * intermediate_size, fp32 * 1e6,
                bf16 * 1e6, BF16_MARGIN)
    return choice
