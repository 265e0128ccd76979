"""Replay the n-gram drafter on recorded greedy outputs: how many decode steps speculation would
take on `sluice bench spec`'s grounded workload, free of this VM's drift.

`python scripts/replay_drafter.py [--mode bfloat16-native] [--output-len 64] [--json PATH]`

It decodes the bench's four grounded tasks once, plainly (greedy), then walks each output as a
speculating engine would: at every step the drafter (``NgramDrafter``, the engine's own) proposes
up to k tokens, the longest prefix equal to the recorded output is kept plus the model's own
token, and the step costs ``1 + r * drafts`` one-row steps, r being a verifying row's cost as a
share of a one-row step. The table gives plain steps / speculative cost, the decode speedup a
bench run would measure if steps cost exactly that, for each k and r, with the copy cursor and
without it (``--no-copy-cursor``: the drafter before the eighth round). Greedy outputs are the
same with and without speculation where the verifying rows round as a lone row does (int4
native, float32); elsewhere the replay is of plain decoding's outputs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine_service.bench.spec import grounded_prompts
from engine_service.config import SpeculativeConfig
from engine_service.core import spec_decode


def record(mode: str, output_len: int) -> list[tuple[list[int], list[int]]]:
    from engine_service import LLM
    from engine_service.bench.modes import MODES
    from engine_service.core.sampling_params import SamplingParams

    llm = LLM(None, **MODES[mode], kv_cache_memory=256 << 20)
    prompts = grounded_prompts(llm.get_tokenizer())
    greedy = SamplingParams(temperature=0.0, max_tokens=output_len)
    # one at a time, as the bench's grounded workload runs: a batch's rows may round apart from a lone row's
    outs = [llm.generate([p], greedy)[0] for p in prompts]
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]


def replay(records, k: int, row_cost: float, lo: int, hi: int) -> dict:
    """Plain steps, speculative steps, drafted and accepted tokens, and the predicted speedup."""
    plain = steps = drafted = accepted = 0
    cost = 0.0
    for prompt, out in records:
        drafter = spec_decode.NgramDrafter(SpeculativeConfig(
            num_speculative_tokens=k, prompt_lookup_max=hi, prompt_lookup_min=lo, backoff="off"))
        plain += len(out) - 1  # the first token comes from prefill
        n = 1
        while n < len(out):
            limit = len(out) - n - 1  # with every draft kept, the model's token still fits
            drafts = drafter.propose(prompt + out[:n], limit) if limit > 0 else []
            kept = 0
            while kept < len(drafts) and drafts[kept] == out[n + kept]:
                kept += 1
            if drafts:
                drafter.observe(len(drafts), kept)
            steps += 1
            drafted += len(drafts)
            accepted += kept
            cost += 1 + row_cost * len(drafts)
            n += kept + 1
    return {"k": k, "row_cost": row_cost, "plain_steps": plain, "steps": steps, "drafted": drafted,
            "accepted": accepted, "speedup": plain / cost if cost else 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="bfloat16-native")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--k", default="4,6,8,10", help="draft lengths, comma-separated")
    parser.add_argument("--row-costs", default="0,0.04,0.1", help="a verifying row's cost, comma-separated")
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--no-copy-cursor", action="store_true", help="the drafter without its copy cursor")
    parser.add_argument("--json", type=lambda s: Path(s) if s else None, default=Path("bench-results/replay-drafter.json"),
                        help="where to write the results ('': nowhere)")
    args = parser.parse_args(argv)
    if args.no_copy_cursor:
        spec_decode.COPY_WINDOW = -1  # an empty window: the most recent occurrence only
    records = record(args.mode, args.output_len)
    ks = [int(k) for k in args.k.split(",")]
    costs = [float(r) for r in args.row_costs.split(",")]
    rows = [replay(records, k, r, args.prompt_lookup_min, args.prompt_lookup_max) for r in costs for k in ks]
    print(f"replay: {args.mode}, {args.output_len} tokens, copy cursor {'off' if args.no_copy_cursor else 'on'}")
    print(f"{'row cost':>8} " + " ".join(f"{'k=' + str(k):>7}" for k in ks))
    for r in costs:
        print(f"{r:>8.2f} " + " ".join(f"{x['speedup']:>6.2f}x" for x in rows if x["row_cost"] == r))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"mode": args.mode, "output_len": args.output_len,
                                         "copy_cursor": not args.no_copy_cursor, "results": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
