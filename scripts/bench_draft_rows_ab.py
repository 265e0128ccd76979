"""A verifying step's native decode with and without attention's prefetches for a draft chunk's
rows after its first (`paged_decode_attention_set_follower_fetch`; docs/performance.md, stop 55),
side by side in one engine: the two settings alternate step by step, and the script prints the
median paired ratio (every row prefetching over the default) for a draft chunk of `--rows` rows at
each context, and for as many separate sequences (no row follows another: the ratio reads the
harness's noise), checks that both give the same logits bit for bit, and writes JSON.

    python scripts/bench_draft_rows_ab.py [--mode bfloat16-native] [--rows 7] [--contexts 300 600]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from pathlib import Path

import torch

from engine_service import LLM
from engine_service.bench.modes import MODES
from engine_service.model.attention import AttentionMetadata
from engine_service.model.native import native_library


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="bfloat16-native", choices=[m for m in MODES if m.endswith("-native")])
    parser.add_argument("--rows", type=int, default=7, help="a draft chunk's rows: its last token and k drafts")
    parser.add_argument("--contexts", type=int, nargs="+", default=[300, 600])
    parser.add_argument("--pairs", type=int, default=24)
    parser.add_argument("--json", type=Path, default=Path("bench-results/draft-rows-ab.json"))
    args = parser.parse_args()
    if args.rows < 2 or args.pairs < 1 or min(args.contexts) < 1:
        parser.error("--rows takes 2 or more, --pairs 1 or more, --contexts positive lengths")
    llm = LLM(None, **MODES[args.mode], kv_cache_memory=256 << 20)
    native = llm.engine.runner.native_decode
    if native is None or not native.runs(args.rows):
        print(f"{args.mode}: no native decode step of {args.rows} rows here")
        return 2
    set_fetch = native_library().paged_decode_attention_set_follower_fetch
    set_fetch.restype, set_fetch.argtypes = ctypes.c_int, [ctypes.c_int]
    caches = native.kv_caches
    block_size, num_blocks = caches[0][0].shape[1], caches[0][0].shape[0]
    widest = -(-(max(args.contexts) + args.rows) // block_size)
    if args.rows * widest + 1 > num_blocks:
        parser.error(f"the pool holds {num_blocks} blocks: contexts up to {max(args.contexts)} need fewer rows")
    scratch = (num_blocks - 1) * block_size  # the step writes its K/V here, a slot no table holds
    native.model.rotary.ensure_positions(max(args.contexts) + args.rows)
    g = torch.Generator().manual_seed(0)
    for k, v in caches:  # values to attend over, so that every row's scores differ
        k.copy_(torch.randn(k.shape, generator=g).to(k.dtype))
        v.copy_(torch.randn(v.shape, generator=g).to(v.dtype))

    def step(context: int, draft: bool):
        lens = [context + j for j in range(args.rows)] if draft else [context] * args.rows
        width = -(-(context + args.rows) // block_size)
        tables = (torch.arange(width).repeat(args.rows, 1) if draft
                  else torch.stack([torch.arange(width) + i * width for i in range(args.rows)]))
        meta = AttentionMetadata(slot_mapping=torch.full((args.rows,), scratch, dtype=torch.long), prefills=[],
                                 decode_token_index=None, decode_block_tables=tables,
                                 decode_context_lens=torch.tensor(lens, dtype=torch.long))
        return torch.arange(args.rows) + 100, torch.tensor(lens) - 1, meta

    results = []
    try:
        for context in args.contexts:
            for draft in (True, False):
                ids, positions, meta = step(context, draft)
                ratios, same = [], True
                for n in range(args.pairs + 2):
                    seconds, logits = {}, {}
                    for fetch in (0, 1) if n % 2 else (1, 0):
                        set_fetch(fetch)
                        started = time.perf_counter()
                        logits[fetch] = native(ids, positions, meta, logits=True).clone()
                        seconds[fetch] = time.perf_counter() - started
                    same &= torch.equal(logits[0], logits[1])
                    if n >= 2:  # two warm-up pairs
                        ratios.append(seconds[1] / seconds[0])
                results.append({"context": context, "rows": "one draft chunk" if draft else "separate sequences",
                                "median_ratio": statistics.median(ratios), "ratios": ratios, "same_logits": same})
    finally:
        set_fetch(0)
    print(f"{args.mode}, {args.rows} rows, {args.pairs} pairs: every row prefetching over the default "
          "(a draft chunk's later rows without prefetches)")
    for r in results:
        print(f"context {r['context']:>5}, {r['rows']:<19} median {r['median_ratio']:.3f} "
              f"(range {min(r['ratios']):.3f}-{max(r['ratios']):.3f}), the same logits bit for bit: "
              f"{'yes' if r['same_logits'] else 'NO'}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"mode": args.mode, "rows": args.rows, "pairs": args.pairs,
                                     "results": results}, indent=1))
    print(f"wrote {args.json}")
    return 0 if all(r["same_logits"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
