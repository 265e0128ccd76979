"""Throughput when the KV pool is what limits a batch: one mode over its own dtype's KV cache and
over a 16-bit one (``kv_cache_dtype``), in the same bytes (``kv_cache_memory``), side by side in one
process. Each run is W1's kind of workload (seeded random prompts and output lengths, greedy, EOS
ignored, every request submitted at once, a cold prefix cache); the two engines take turns, the
first alternating, and the table gives each run's tokens/s and the preemptions it caused, then the
median of the paired ratios.

`python scripts/bench_kv_capacity.py [--mode float32] [--kv-cache-dtype bfloat16] [--num-requests 128]
[--kv-cache-memory 1073741824] [--rounds 2] [--json bench-results/kv-capacity.json]`
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from engine_service import LLM
    from engine_service.bench.modes import MODES
    from engine_service.bench.offline import make_workload, run_sluice

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="float32", choices=[m for m in MODES if "kv_cache_dtype" not in MODES[m]])
    parser.add_argument("--kv-cache-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes of the KV pool, both engines")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--prompt-len", default="16-512")
    parser.add_argument("--output-len", default="16-256")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("bench-results/kv-capacity.json"))
    args = parser.parse_args(argv)

    def span(text: str) -> tuple[int, int]:
        low, high = (int(x) for x in text.split("-"))
        return low, high

    caches = ("auto", args.kv_cache_dtype)
    engines = {cache: LLM(None, **{**MODES[args.mode], "kv_cache_dtype": cache},
                          kv_cache_memory=args.kv_cache_memory) for cache in caches}
    vocab = engines["auto"].engine.vocab_size
    work = make_workload(vocab, args.num_requests, span(args.prompt_len), span(args.output_len), args.seed)
    runs: dict[str, list[dict]] = {cache: [] for cache in caches}
    ratios = []
    for r in range(args.rounds):
        for cache in (caches if r % 2 == 0 else caches[::-1]):
            llm = engines[cache]
            before = llm.engine.get_stats().preemptions
            row = run_sluice(llm, work)
            runs[cache].append({"tokens_per_s": row.tokens_per_s, "seconds": row.seconds,
                                "output_tokens": row.output_tokens,
                                "preemptions": llm.engine.get_stats().preemptions - before})
            gc.collect()
        ratios.append(runs[args.kv_cache_dtype][-1]["tokens_per_s"] / runs["auto"][-1]["tokens_per_s"])

    blocks = {cache: engines[cache].engine.scheduler.block_pool.num_total_blocks for cache in caches}
    dtypes = {cache: str(engines[cache].engine.kv_cache_dtype).removeprefix("torch.") for cache in caches}
    print(f"\n{args.mode}, {args.num_requests} requests (prompts {args.prompt_len}, outputs {args.output_len} tokens) "
          f"at once, a KV pool of {args.kv_cache_memory >> 20} MiB; runs alternating")
    print(f"{'KV cache':<12}{'blocks':>8}  {'tokens/s per run':<28}{'preemptions per run':<22}")
    for cache in caches:
        tps = ", ".join(f"{x['tokens_per_s']:.1f}" for x in runs[cache])
        pre = ", ".join(str(x["preemptions"]) for x in runs[cache])
        print(f"{dtypes[cache]:<12}{blocks[cache]:>8}  {tps:<28}{pre:<22}")
    print(f"{dtypes[args.kv_cache_dtype]} cache / {dtypes['auto']} cache: {statistics.median(ratios):.3f}x "
          f"(median of {len(ratios)} paired ratios: {', '.join(f'{x:.3f}' for x in ratios)})")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "config": vars(args) | {"json": str(args.json)}, "machine": {"platform": platform.platform()},
        "blocks": {dtypes[c]: blocks[c] for c in caches},
        "runs": {dtypes[c]: runs[c] for c in caches}, "paired_ratios": ratios,
        "median_ratio": statistics.median(ratios)}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
