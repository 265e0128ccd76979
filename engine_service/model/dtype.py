"""``dtype="auto"``: which floating-point type the engine computes in, decided by facts alone: the
device, the CPU's features, the torch build, the checkpoint and the quantization asked for. The same
machine, build and configuration always get the same type (nothing is timed).

* CUDA: the checkpoint's dtype (``torch_dtype`` / ``dtype`` in config.json; float32 when absent).
* CPU with weight-only quantization, or a GGUF file's blocks: float32 activations, the native int4
  decode step's
  (``engine_service.model.native_decode``); the quantized kernels pick their own kernel dtype
  (``engine_service.model.quantization.pick_kernel_dtype``).
* CPU otherwise: bfloat16 where the CPU computes it natively (AVX512-BF16 or AMX, as oneDNN reports
  it) and oneDNN prepacks bfloat16 weights here (``engine_service.model.prepacked``), so that its
  products and the native decode step run; float32 otherwise.

The choice and its reason are logged in the engine's start-up line. ``SLUICE_DTYPE`` in the
environment sets the default for a configuration that does not name one (the test suite pins
float32 this way).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def checkpoint_dtype(model_dir: Path) -> torch.dtype:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bfloat16 arithmetic (AVX512-BF16 or AMX-BF16), as oneDNN reads its ISA."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_auto_dtype(device: torch.device, model_dir: Path, quantization: str | None = None) -> tuple[torch.dtype, str]:
    """The dtype ``auto`` means here, and why (for the start-up line)."""
    if device.type == "cuda":
        dtype = checkpoint_dtype(model_dir)
        return dtype, f"the checkpoint's dtype on CUDA ({NAMES[dtype]})"
    if device.type != "cpu":
        return torch.float32, f"float32 on {device.type}"
    if quantization is not None:
        return torch.float32, (f"{quantization} weights take float32 activations on CPU (the native int4 step's; "
                               "the quantized kernels' own dtype is chosen per layer)")
    from engine_service.model.gguf_model import gguf_source

    if gguf_source(model_dir) is not None:
        return torch.float32, "a GGUF file's blocks take float32 activations on CPU (the native int4 step's)"
    if not cpu_has_native_bf16():
        return torch.float32, "this CPU has no native bfloat16 arithmetic (no AVX512-BF16 or AMX)"
    from engine_service.model.prepacked import prepack_unavailable

    why_not = prepack_unavailable(torch.bfloat16, device)
    if why_not is not None:
        return torch.float32, f"native bfloat16 CPU, but {why_not}"
    return torch.bfloat16, "this CPU computes bfloat16 natively (AVX512-BF16 or AMX, as oneDNN reports it)"
