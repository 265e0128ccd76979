"""Speculative decoding with and without the scheduler's limit that keeps a step of decodes on the
native step (`SchedulerConfig.fast_step_max_rows`; docs/scheduler.md, "Drafts keep the fast
step"), side by side in one engine: several grounded prompts of `sluice bench spec` at once, the
limit switched on and off between runs, the order alternating. Prints each pair's decode tokens/s
and their ratio, how many outputs equal plain decoding's, and writes JSON.

    python scripts/spec_fast_step_ab.py [--mode bfloat16-native] [--streams 4] [--pairs 6] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from engine_service import LLM
from engine_service.bench.modes import MODES
from engine_service.bench.spec import _timed, alternate, grounded_prompts
from engine_service.core.sampling_params import SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="bfloat16-native", choices=[m for m in MODES if "native" in m])
    parser.add_argument("--streams", type=int, default=4, help="grounded prompts at once (1 to 4)")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--json", type=Path, default=Path("bench-results/spec-fast-step-ab.json"))
    args = parser.parse_args()
    if not 1 <= args.streams <= 4 or args.pairs < 1:
        parser.error("--streams takes 1 to 4 and --pairs at least 1")
    llm = LLM(None, speculative_config={**SPEC, "backoff": "off"}, **MODES[args.mode], kv_cache_memory=256 << 20)
    scheduler = llm.engine.scheduler
    limit = scheduler.fast_step_max_rows
    if limit == 0:
        print(f"{args.mode}: no native decode step here, so no limit to switch")
        return 2
    prompts = grounded_prompts(llm.get_tokenizer())[: args.streams]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    _timed(llm, prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), True)  # warm-up
    arms = {rows: (lambda rows=rows: setattr(scheduler, "fast_step_max_rows", rows)) for rows in (limit, 0)}
    rates, outputs = alternate(llm, [prompts], params, arms, args.pairs)
    scheduler.fast_step_max_rows = limit
    _, _, plain = _timed(llm, prompts, params, False)
    ratios = [a / b for a, b in zip(rates[limit], rates[0], strict=True)]
    same = {rows: sum(a == b for a, b in zip(out, plain, strict=True)) for rows, out in outputs.items()}
    print(f"{args.mode}, {args.streams} grounded prompts at once, k = {SPEC['num_speculative_tokens']}, "
          f"decode tokens/s with the limit (fewer than {limit} rows) and without")
    print(f"{'pair':>4} {'limit':>8} {'none':>8} {'ratio':>7}")
    for i, (a, b, r) in enumerate(zip(rates[limit], rates[0], ratios, strict=True)):
        print(f"{i:>4} {a:>8.1f} {b:>8.1f} {r:>7.3f}")
    print(f"median ratio {statistics.median(ratios):.3f}; outputs equal to plain decoding's: with the limit "
          f"{same[limit]}/{len(plain)}, without {same[0]}/{len(plain)}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "mode": args.mode, "streams": args.streams, "speculative_config": SPEC, "fast_step_max_rows": limit,
        "decode_tok_s": {"limit": rates[limit], "none": rates[0]}, "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "equal_to_plain": {"limit": same[limit], "none": same[0], "of": len(plain)},
    }, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
