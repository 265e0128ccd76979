"""One bfloat16 row (`--rows N`: N rows, up to `gemv_max_rows()`: 64 with AMX, 16 without) through
every projection of SmolLM2-135M: the native kernel on oneDNN's packed weight
(kernels/packed_gemv.c: one row VDPBF16PS; several AMX tiles, or VDPBF16PS on groups of rows
without AMX) against oneDNN's own product on the same weight.
`python scripts/bench_gemv.py [--rows 1] [--repeats 15] [--prefetch-ab] [--json PATH]`;
`--prefetch-ab` adds the kernel with its one-row prefetch forced on and off (the CPU decides it
otherwise: off on AMD), the paths alternating.

`--int4`: one row (`--rows N`: N rows) through the same projections quantized to int4, the native
kernel on its own layout (kernels/q4_gemv.c) against torch's packed int4 kernel, both taking the
row as the engine's int4 layers do; with `--prefetch-ab`, the native kernel with its one-row
prefetch forced on and off as well.

The 30 layers' four projections and the output projection (270 MB of bfloat16 weights, so they
stream from memory as in a decode step, not from a cache) run back to back, the two paths
alternating; the table gives the median milliseconds for all of them and the bandwidth that means.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine_service.model.prepacked import (
    PrepackedLinear,
    _gemv_supported,
    _packed_linear,
    gemv_max_rows,
    prepacked_linear_op,
)

SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]
LAYERS = 30
LM_HEAD = ("lm_head", 49152, 576)


def _alternate(paths: dict, repeats: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, fn in paths.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return times


def _prefetch_paths(name: str, fn, set_prefetch) -> dict:
    """``fn`` with the kernel's one-row prefetch forced on and off (``set_prefetch``: the kernel's
    override), the CPU's own choice first: the ratio against the other kernel is against it."""
    default = set_prefetch(-1)

    def with_prefetch(mode: int):
        def run() -> None:
            set_prefetch(mode)
            try:
                fn()
            finally:
                set_prefetch(-1)
        return run

    return {f"{name}, prefetch {'on' if m else 'off'}{' (default)' if m == default else ''}": with_prefetch(m)
            for m in (default, 1 - default)}


def int4_main(args: argparse.Namespace) -> None:
    from engine_service.model import quantization

    gen = torch.Generator().manual_seed(0)
    shapes = [s for _ in range(LAYERS) for s in SHAPES] + [LM_HEAD]
    weights = [torch.randn(n, k, generator=gen) * 0.05 for _, n, k in shapes]
    native = [quantization.QuantizedLinear.from_float(w, None, "int4", torch.bfloat16) for w in weights]
    if not all(layer.native_q4 for layer in native):
        raise SystemExit("no native int4 kernel here (native operators unavailable, or no AVX512-VNNI)")
    available = quantization._native_q4
    quantization._native_q4 = lambda: False  # torch's packed layout and kernel, as without the native one
    try:
        packed = [quantization.QuantizedLinear.from_float(w, None, "int4", torch.bfloat16) for w in weights]
    finally:
        quantization._native_q4 = available
    del weights
    for layer in native + packed:
        layer.dense_min_rows = None  # the kernels themselves, whatever the row count
    xs = {k: torch.randn(args.rows, k, generator=gen) for _, _, k in shapes}  # float32, the default model dtype
    nbytes = sum(b.numel() * b.element_size() for layer in native for b in layer.buffers())

    def run(layers):
        return lambda: [layer(xs[k]) for (_, _, k), layer in zip(shapes, layers, strict=True)]

    paths = {"native int4": run(native)}
    if args.prefetch_ab:
        from engine_service.model.native import native_library

        paths = _prefetch_paths("native int4", run(native), native_library().q4_gemv_set_prefetch)
    times = _alternate({**paths, "torch int4": run(packed)}, args.repeats)
    print(f"{args.rows} float32 row(s) through {len(shapes)} int4 projections ({nbytes / 1e6:.0f} MB), torch "
          f"threads {torch.get_num_threads()}, median of {args.repeats}")
    rows = []
    for name, samples in times.items():
        ms = statistics.median(samples) * 1e3
        rows.append({"path": name, "ms": round(ms, 3), "gb_per_s": round(nbytes / ms / 1e6, 2),
                     "min_ms": round(min(samples) * 1e3, 3), "max_ms": round(max(samples) * 1e3, 3)})
        print(f"{name:<12} {ms:>8.2f} ms {nbytes / ms / 1e6:>7.1f} GB/s  (range {min(samples) * 1e3:.2f}-"
              f"{max(samples) * 1e3:.2f})")
    ratio = rows[-1]["ms"] / rows[0]["ms"]
    print(f"torch / native: {ratio:.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"bytes": nbytes, "rows_per_product": args.rows, "repeats": args.repeats,
                                     "threads": torch.get_num_threads(), "rows": rows,
                                     "torch_over_native": round(ratio, 3)}, indent=2) + "\n")
    print(f"wrote {args.json}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--int4", action="store_true", help="the int4 kernels instead of the bfloat16 GEMV")
    p.add_argument("--rows", type=int, default=1, help="rows per product")
    p.add_argument("--prefetch-ab", action="store_true",
                   help="also time the native kernel with its one-row software prefetch forced on and off, alternating")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.json is None:
        args.json = Path("bench-results/gemv-int4.json" if args.int4 else "bench-results/gemv.json")
    if args.int4:
        int4_main(args)
        return
    if not _gemv_supported():
        raise SystemExit("no bfloat16 GEMV here (native operators unavailable, or no AVX512-BF16)")
    gen = torch.Generator().manual_seed(0)
    shapes = [s for _ in range(LAYERS) for s in SHAPES] + [LM_HEAD]
    layers = [PrepackedLinear((torch.randn(n, k, generator=gen) * 0.05).bfloat16(), None) for _, n, k in shapes]
    if not all(layer.gemv for layer in layers):
        raise SystemExit("oneDNN chose a layout the GEMV does not read for some shape here")
    if not 1 <= args.rows <= gemv_max_rows():
        raise SystemExit(f"--rows must be 1..{gemv_max_rows()} here")
    xs = {k: torch.randn(args.rows, k, generator=gen).bfloat16() for _, _, k in shapes}
    nbytes = sum(n * k * 2 for _, n, k in shapes)

    def gemv() -> None:
        for (_, n, k), layer in zip(shapes, layers, strict=True):
            prepacked_linear_op(xs[k], layer.handle, None, n)

    def onednn() -> None:
        for (_, _, k), layer in zip(shapes, layers, strict=True):
            _packed_linear(xs[k], layer.packed, None)

    paths = {"native GEMV": gemv}
    if args.prefetch_ab:
        from engine_service.model.native import native_library

        paths = _prefetch_paths("native", gemv, native_library().packed_gemv_set_prefetch)
    times = _alternate({**paths, "oneDNN": onednn}, args.repeats)
    rows = []
    print(f"{args.rows} bfloat16 row(s) through {len(shapes)} projections ({nbytes / 1e6:.0f} MB), torch threads "
          f"{torch.get_num_threads()}, median of {args.repeats}")
    width = max(12, *(len(name) for name in times))
    print(f"{'path':<{width}} {'ms':>8} {'GB/s':>7}")
    for name, samples in times.items():
        ms = statistics.median(samples) * 1e3
        rows.append({"path": name, "ms": round(ms, 3), "gb_per_s": round(nbytes / ms / 1e6, 2)})
        print(f"{name:<{width}} {ms:>8.2f} {nbytes / ms / 1e6:>7.1f}")
    ratio = rows[-1]["ms"] / rows[0]["ms"]
    print(f"oneDNN / GEMV: {ratio:.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"bytes": nbytes, "rows_per_product": args.rows, "repeats": args.repeats,
                                     "threads": torch.get_num_threads(), "rows": rows, "onednn_over_gemv": round(ratio, 3)}, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
