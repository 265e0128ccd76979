"""Decode attention over a paged cache the size of a real step: the native kernel against the plain-torch
reference, per dtype. `python scripts/bench_attention.py [--batch 32] [--context 330] [--json PATH]`.

Thirty layers' caches (SmolLM2-135M's shape: 9 query heads over 3 kv heads of size 64, blocks of 16),
each sequence's blocks allocated in order as the block pool hands them out, so the KV bytes of a step
stream from memory as they do in the engine, not from a cache a single layer would fit in. Prints a
table and writes JSON; the kernel's output is checked against the reference on the way.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine_service.model.attention import AttentionMetadata, decode_attention_reference
from engine_service.model.native import load_paged_decode_attention


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=330)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", type=Path, default=Path("bench-results/attention.json"))
    args = p.parse_args()
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    per_seq = -(-args.context // block_size)
    num_blocks = args.batch * per_seq + 1
    tables = torch.arange(args.batch * per_seq).reshape(args.batch, per_seq)
    lens = torch.full((args.batch,), args.context)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(args.batch, heads, head_dim, generator=gen)
    native = load_paged_decode_attention()
    rows = []
    print(f"decode attention: batch {args.batch}, context {args.context}, {args.layers} layers, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'cache dtype':<12} {'native ms':>10} {'reference ms':>13} {'speed-up':>9} {'KV GB/s (native)':>17}")
    for dtype in (torch.float32, torch.bfloat16):
        caches = [(torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype),
                   torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype))
                  for _ in range(args.layers)]
        meta = AttentionMetadata(slot_mapping=torch.zeros(args.batch, dtype=torch.long), prefills=[],
                                 decode_token_index=None, decode_block_tables=tables, decode_context_lens=lens)

        def run_native(caches=caches):
            return [native.op(q, k, v, tables, lens, 0.125) for k, v in caches]

        def run_reference(caches=caches, dtype=dtype, meta=meta):
            return [decode_attention_reference(q.to(dtype), k, v, meta, 0.125) for k, v in caches]

        got, ref = run_native(), run_reference()
        torch.testing.assert_close(got[0].float(), ref[0].float(), atol=1e-2, rtol=1e-2)
        timings = {}
        for name, fn in (("native", run_native), ("reference", run_reference)):
            started = time.perf_counter()
            for _ in range(args.iters):
                fn()
            timings[name] = (time.perf_counter() - started) / args.iters
        kv_bytes = 2 * args.layers * args.batch * args.context * kv_heads * head_dim * dtype.itemsize
        row = {"dtype": str(dtype).removeprefix("torch."), "native_ms": timings["native"] * 1e3,
               "reference_ms": timings["reference"] * 1e3,
               "native_kv_gb_per_s": kv_bytes / timings["native"] / 1e9}
        rows.append(row)
        print(f"{row['dtype']:<12} {row['native_ms']:>10.2f} {row['reference_ms']:>13.2f} "
              f"{row['reference_ms'] / row['native_ms']:>8.1f}x {row['native_kv_gb_per_s']:>17.1f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"batch": args.batch, "context": args.context, "layers": args.layers,
                                     "threads": torch.get_num_threads(), "rows": rows}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
