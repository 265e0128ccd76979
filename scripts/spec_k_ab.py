"""Speculative decoding at several draft lengths k side by side in one engine: `sluice bench
spec`'s grounded prompts one at a time (its one-stream workload), each round running them under
every k in turn, the order rotating from round to round. The engine is built for the largest k;
the others reuse it with their scheduler's `speculative_config` narrowed (the back-off off, as it
resolves for bfloat16 native on the VMs measured). Prints each round's decode tokens/s, the median
ratio of each k to the first, plain decoding's rate beside them, how many outputs equal plain
decoding's, and writes JSON.

    python scripts/spec_k_ab.py [--mode bfloat16-native] [--k 6 8 10] [--rounds 4] [--json F]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from engine_service import LLM
from engine_service.bench.modes import MODES
from engine_service.bench.spec import DEFAULT_SPEC, _timed, alternate, grounded_prompts
from engine_service.core.sampling_params import SamplingParams


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="bfloat16-native", choices=[m for m in MODES if "num_scheduler_steps" not in MODES[m]])
    parser.add_argument("--k", type=int, nargs="+", default=[6, 8, 10])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--json", type=Path, default=Path("bench-results/spec-k-ab.json"))
    args = parser.parse_args()
    if args.rounds < 1 or len(args.k) < 2 or min(args.k) < 1:
        parser.error("--k takes two or more draft lengths of at least 1, --rounds at least 1")
    llm = LLM(None, speculative_config={**DEFAULT_SPEC, "num_speculative_tokens": max(args.k), "backoff": "off"},
              **MODES[args.mode], kv_cache_memory=256 << 20)
    scheduler = llm.engine.scheduler
    config = scheduler.speculative_config
    batches = [[p] for p in grounded_prompts(llm.get_tokenizer())]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    _timed(llm, batches[0], SamplingParams(temperature=0.0, max_tokens=4), True)  # warm-up

    def arm(k: int):
        return lambda: setattr(scheduler, "speculative_config", dataclasses.replace(config, num_speculative_tokens=k))

    arms = {f"k={k}": arm(k) for k in args.k}
    arms["plain"] = lambda: setattr(scheduler, "speculative_config", None)
    try:
        rates, outputs = alternate(llm, batches, params, arms, args.rounds)
    finally:
        scheduler.speculative_config = config
    first = f"k={args.k[0]}"
    print(f"{args.mode}, {len(batches)} grounded prompts one at a time, decode tokens/s per round")
    print(f"{'round':>5} " + " ".join(f"{name:>8}" for name in arms))
    for i in range(args.rounds):
        print(f"{i:>5} " + " ".join(f"{rates[name][i]:>8.1f}" for name in arms))
    ratios = {name: statistics.median(a / b for a, b in zip(rates[name], rates[first], strict=True)) for name in arms}
    speedups = {name: statistics.median(a / b for a, b in zip(rates[name], rates["plain"], strict=True))
                for name in arms}
    same = {name: sum(a == b for a, b in zip(out, outputs["plain"], strict=True)) for name, out in outputs.items()}
    for name in arms:
        print(f"{name:>8}: median ratio to {first} {ratios[name]:.3f}, to plain {speedups[name]:.3f}, "
              f"outputs equal to plain decoding's {same[name]}/{len(outputs['plain'])}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"mode": args.mode, "k": args.k, "rounds": args.rounds,
                                     "output_len": args.output_len, "decode_tok_s": rates,
                                     "median_ratio_to_first": ratios, "median_speedup": speedups,
                                     "equal_to_plain": same}, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
