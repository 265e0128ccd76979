"""Where a quantized product of many rows should leave torch's packed kernel for a dequantized dense
GEMM: `python scripts/bench_dense_crossover.py [--kernel-dtype bfloat16] [--json PATH]`.

For each of SmolLM2-135M's projection shapes (the fused qkv and gate_up, o, down, the output
projection) and each method, it times the layer's product both ways over a range of row counts and
prints the ratio packed / dense (above 1: the dense path is faster), plus the time of the
dequantization itself, native against its torch reference. `DENSE_MIN_ROWS` and
`DENSE_MIN_ROWS_Q4` in `engine_service/model/quantization.py` come from this table
(docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine_service.model.quantization import (
    QuantizedLinear,
    dequantize_int4_packed,
    dequantize_int8_rows,
    dequantize_q4,
)

SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
          ("lm_head", 49152, 576)]
ROWS = [16, 32, 48, 64, 96, 128, 256, 512, 1024, 2048]


def best_ms(fn, iters: int) -> float:
    fn()
    best = float("inf")
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def reference_dequantize(mod: QuantizedLinear, k: int) -> torch.Tensor:
    if mod.method == "int4" and mod.native_q4:
        return dequantize_q4(mod.codes, mod.scales_zeros, mod.kernel_dtype)
    if mod.method == "int4":
        return dequantize_int4_packed(mod.qweight, mod.scales_zeros, mod.qweight.shape[0], k, mod.group_size)
    return dequantize_int8_rows(mod.qweight, mod.scales)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kernel-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--iters", type=int, default=9)
    p.add_argument("--json", type=Path, default=Path("bench-results/dense-crossover.json"))
    args = p.parse_args()
    dtype = getattr(torch, args.kernel_dtype)
    gen = torch.Generator().manual_seed(0)
    results = []
    print(f"packed kernel time / dense path time, kernel dtype {args.kernel_dtype} (>1: dense is faster)")
    print(f"{'layer':<22}{'method':<7}" + "".join(f"{r:>7}" for r in ROWS)
          + f"{'dequant native':>16}{'torch':>12}")
    for name, n, k in SHAPES:
        w = torch.randn(n, k, generator=gen) * 0.05
        for method in ("int4", "int8"):
            mod = QuantizedLinear.from_float(w, None, method, dtype)
            if mod.dense_min_rows is None:
                raise SystemExit(f"{name} {method}: no dense path here (native operators unavailable?)")
            threshold = mod.dense_min_rows
            ratios = []
            for rows in ROWS:
                x = torch.randn(rows, k, generator=gen).to(dtype)  # the model's activations
                mod.dense_min_rows = 1
                dense = best_ms(lambda: mod(x), args.iters)  # noqa: B023 - timed at once
                mod.dense_min_rows = None
                packed = best_ms(lambda: mod(x), args.iters)  # noqa: B023
                ratios.append(packed / dense)
            mod.dense_min_rows = threshold
            native = best_ms(mod.dense_weight, args.iters)
            ref = best_ms(lambda m=mod, k=k: reference_dequantize(m, k), 3)
            label = f"{name} [{n}, {k}]"
            print(f"{label:<22}{method:<7}" + "".join(f"{r:>7.2f}" for r in ratios)
                  + f"{native:>13.3f} ms{ref:>9.2f} ms")
            results.append({"layer": name, "shape": [n, k], "method": method, "dense_min_rows": threshold,
                            "packed_over_dense": dict(zip(ROWS, ratios, strict=True)),
                            "dequantize_native_ms": native, "dequantize_torch_ms": ref})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"kernel_dtype": args.kernel_dtype, "torch": torch.__version__,
                                     "threads": torch.get_num_threads(), "rows": results}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
