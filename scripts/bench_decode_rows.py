"""The native decode step (every layer in one C call, kernels/decode_stack.c) at a few rows and
context lengths: what a verifying row adds to a one-row step.

`python scripts/bench_decode_rows.py [--mode bfloat16-native] [--rows 1,2,7,11] [--contexts 16,320]
[--rounds 3] [--json PATH]`

A fresh engine with nothing running: each row attends to a context of the given length laid in
the cache's first blocks (no request owns them), the last rows' positions as a verifying step's
(rows at context - rows + 1 ... context). The LM head and the Python around the call are not in
the figure. Each cell is the median of 7 calls; rounds repeat the whole table. To compare two
kernel libraries, run it from two checkouts alternately (the kernels are built per source hash).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="bfloat16-native")
    parser.add_argument("--rows", default="1,2,7,11")
    parser.add_argument("--contexts", default="16,320")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=lambda s: Path(s) if s else None, default=Path("bench-results/decode-rows.json"),
                        help="where to write the results ('': nowhere)")
    args = parser.parse_args(argv)

    from engine_service import LLM
    from engine_service.bench.modes import MODES
    from engine_service.model.attention import AttentionMetadata

    llm = LLM(None, **MODES[args.mode], kv_cache_memory=256 << 20)
    runner = llm.engine.runner
    native = runner.native_decode
    if native is None:
        print(f"bench_decode_rows: {args.mode} has no native decode step on this machine")
        return 2
    block_size = runner.kv_caches[0][0].shape[1]
    all_rows = [int(r) for r in args.rows.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    if max(all_rows) >= native.max_rows or min(all_rows) < 1 or any(c < max(all_rows) for c in contexts):
        print(f"bench_decode_rows: rows must be 1..{native.max_rows - 1} and no more than each context")
        return 2

    def step_ms(rows: int, context: int) -> float:
        runner.model.rotary.ensure_positions(context)
        positions = torch.arange(context - rows, context, dtype=torch.long)
        blocks = -(-context // block_size)
        meta = AttentionMetadata(
            slot_mapping=positions.clone(), prefills=[], decode_token_index=None,
            decode_block_tables=torch.arange(blocks, dtype=torch.long).repeat(rows, 1).contiguous(),
            decode_context_lens=positions + 1)
        ids = torch.zeros(rows, dtype=torch.long)
        times = []
        for _ in range(7):
            started = time.perf_counter()
            native(ids, positions, meta)
            times.append(time.perf_counter() - started)
        return statistics.median(times) * 1e3

    table: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for context in contexts:
            for rows in all_rows:
                table.setdefault(f"{rows}@{context}", []).append(step_ms(rows, context))
    print(f"native decode step, {args.mode}, ms (median of 7 calls; one column per round)")
    for key, values in table.items():
        rows, context = key.split("@")
        print(f"  {rows:>3} rows, context {context:>5}: " + " ".join(f"{v:7.2f}" for v in values))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"mode": args.mode, "ms": table}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
