"""A verifying step's attention scores through AMX tiles, a draft chunk's rows at once
(`paged_decode_attention_set_chunk_scores`; engine_service/model/kernels/paged_decode_attention.c,
"Draft chunks"), against each row's own VDPBF16PS scores, side by side in one engine: `sluice bench
spec`'s grounded prompts one at a time (its one-stream workload), each round running them with the
tiles, without them and without speculation, the order rotating from round to round. Prints each
round's decode tokens/s, the median ratio of the tiles to the lone rows and of each to plain
decoding, how many outputs equal plain decoding's, and writes JSON. On a CPU without AMX the two
speculating arms run the same code.

    python scripts/spec_chunk_scores_ab.py [--mode bfloat16-native] [--rounds 4] [--json F]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
from pathlib import Path

from engine_service import LLM
from engine_service.bench.modes import MODES
from engine_service.bench.spec import DEFAULT_SPEC, _timed, alternate, grounded_prompts
from engine_service.core.sampling_params import SamplingParams
from engine_service.model.native import native_library
from sluice.cpuinfo import cpu_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="bfloat16-native", choices=[m for m in MODES if "native" in m])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--json", type=Path, default=Path("bench-results/spec-chunk-scores-ab.json"))
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds takes at least 1")
    lib = native_library()
    switch, passes = lib.paged_decode_attention_set_chunk_scores, lib.paged_decode_attention_chunk_passes
    switch.restype, switch.argtypes = ctypes.c_int, [ctypes.c_int]
    passes.restype, passes.argtypes = ctypes.c_int64, []
    llm = LLM(None, speculative_config={**DEFAULT_SPEC, "backoff": "off"}, **MODES[args.mode],
              kv_cache_memory=256 << 20)
    scheduler = llm.engine.scheduler
    config = scheduler.speculative_config
    batches = [[p] for p in grounded_prompts(llm.get_tokenizer())]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    _timed(llm, batches[0], SamplingParams(temperature=0.0, max_tokens=4), True)  # warm-up

    def arm(tiles: bool | None):
        def setup() -> None:
            scheduler.speculative_config = config if tiles is not None else None
            switch(1 if tiles else 0)
        return setup

    arms = {"tiles": arm(True), "lone rows": arm(False), "plain": arm(None)}
    before = passes()
    try:
        rates, outputs = alternate(llm, batches, params, arms, args.rounds)
    finally:
        scheduler.speculative_config = config
        switch(1)
    print(f"{args.mode}, {len(batches)} grounded prompts one at a time, decode tokens/s per round "
          f"({passes() - before} chunk score passes)")
    print(f"{'round':>5} " + " ".join(f"{name:>10}" for name in arms))
    for i in range(args.rounds):
        print(f"{i:>5} " + " ".join(f"{rates[name][i]:>10.1f}" for name in arms))

    def median_ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(rates[a], rates[b], strict=True))

    same = {name: sum(a == b for a, b in zip(out, outputs["plain"], strict=True)) for name, out in outputs.items()}
    summary = {"tiles_over_lone_rows": median_ratio("tiles", "lone rows"),
               "speedup": {name: median_ratio(name, "plain") for name in ("tiles", "lone rows")}}
    print(f"median ratio, tiles over lone rows: {summary['tiles_over_lone_rows']:.3f}; over plain decoding: "
          f"tiles {summary['speedup']['tiles']:.3f}, lone rows {summary['speedup']['lone rows']:.3f}; outputs "
          f"equal to plain decoding's: tiles {same['tiles']}/{len(outputs['plain'])}, lone rows "
          f"{same['lone rows']}/{len(outputs['plain'])}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"mode": args.mode, "processor": cpu_model(), "rounds": args.rounds,
                                     "output_len": args.output_len, "speculative_config": DEFAULT_SPEC,
                                     "chunk_score_passes": passes() - before, "decode_tok_s": rates, **summary,
                                     "equal_to_plain": same}, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
