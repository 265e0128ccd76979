"""The native decode step in CPU's default engine, side by side with what it replaced, in one engine,
the two variants alternating on the same prompts (prefix caching off, greedy, EOS ignored).

    python scripts/bench_native_default_ab.py [--prompts 64] [--input-len 128] [--output-len 64]
        [--rounds 5] [--against eager|rows16|prefill16] [--compiled] [--json PATH]

``--against eager`` (the default): the default engine's decode steps (the eager forward with the
native step, as ``sluice serve`` and ``LLM()`` start on CPU) against the same engine with its native
step switched off, which is the eager reference (``--enforce-eager``) for every step. ``--against
rows16``: the native step taking up to 64 rows (bfloat16 through AMX tiles) against it capped at
16, as it was, the rest going to the eager forward, or with ``--compiled`` to the compiled step
(``--no-enforce-eager``; its warm-up comes first). Each round runs both variants on that round's
fresh prompts (``sluice bench serve``'s random dataset), in alternating order; the table gives each
round's output tokens/s (prefill included) and the median ratio.

``--against prefill16``: prefill alone, the prompts one after another (each ``--input-len`` tokens,
one output token, so each is one prefill chunk and no decode step): the prepacked products of up
to 64 rows taking the native kernel, as they do now, against those of 17-64 rows taking oneDNN's,
as they did when the kernel took 16. The table gives prompt tokens/s, the inverse of the mean
time to first token per token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", choices=["eager", "rows16", "prefill16"], default="eager")
    parser.add_argument("--compiled", action="store_true", help="with --against rows16: compile the decode step")
    parser.add_argument("--json", type=lambda s: Path(s) if s else None,
                        default=Path("bench-results/native-default-ab.json"), help="where to write ('': nowhere)")
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.rounds < 1 or args.input_len < 1 or args.output_len < 1:
        parser.error("--prompts, --rounds, --input-len and --output-len must be at least 1")
    if args.compiled and args.against != "rows16":
        parser.error("--compiled compares the 16-row cap: use it with --against rows16")
    prefill = args.against == "prefill16"
    if prefill and (args.input_len > 64 or args.output_len != 1):
        parser.error("--against prefill16 compares chunks of up to 64 tokens: --input-len 64 or less, --output-len 1")
    os.environ.pop("SLUICE_ENFORCE_EAGER", None)  # the engine's own default, not a test's
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as a served engine waits

    from engine_service import LLM, SamplingParams
    from sluice_cli.bench_serve import synthetic_dataset

    llm = LLM(None, dtype="bfloat16", enable_prefix_caching=False,
              **({"enforce_eager": False} if args.compiled else {}))
    runner = llm.engine.runner
    native = runner.native_decode
    if native is None:
        print("bench_native_default_ab: no native decode step on this machine (see the engine's log)")
        return 2
    full = native.max_rows
    if args.against == "rows16" and full <= 17:
        print(f"bench_native_default_ab: the native step takes {full - 1} rows here: nothing to cap")
        return 2
    names = {"eager": ("native step", "eager reference"),
             "rows16": (f"native up to {full - 1} rows", "native up to 16 rows"),
             "prefill16": ("kernel up to 64 rows", "kernel up to 16 rows")}[args.against]
    from engine_service.model.prepacked import PrepackedLinear

    prepacked = [m for m in runner.model.modules() if isinstance(m, PrepackedLinear) and m.gemv]
    numel = {m: m.gemv_max_numel for m in prepacked}

    def run(seed: str, variant: int) -> float:
        if args.against == "eager":
            runner.native_decode = native if variant == 0 else None
        elif args.against == "rows16":
            native.max_rows = full if variant == 0 else 17
        else:
            for m in prepacked:  # more rows than this go to oneDNN's product (PrepackedLinear.forward)
                m.gemv_max_numel = numel[m] if variant == 0 else 16 * m.in_features
        reqs = synthetic_dataset(args.prompts, args.input_len, args.output_len,
                                 0.5 if args.prompts > 1 and not prefill else 0.0, (100, 10000), seed)
        params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
        started = time.perf_counter()
        if prefill:  # one at a time: each prompt is one chunk of its own
            outs = [out for r, p in zip(reqs, params, strict=True)
                    for out in llm.generate([r.prompt], [p], use_tqdm=False)]
            return sum(len(o.prompt_token_ids) for o in outs) / (time.perf_counter() - started)
        outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - started)

    for variant in (1, 0):
        run(f"warm-up {variant}", variant)
    rounds = []
    print(f"{args.prompts} prompt(s) of ~{args.input_len} tokens, ~{args.output_len} out, "
          f"{llm.engine.decode_mode} engine{' (compiled)' if args.compiled else ''}")
    unit = "prompt tok/s" if prefill else "tok/s"
    print(f"{'round':>5}  {names[0] + ' ' + unit:>28}  {names[1] + ' ' + unit:>28}  {'ratio':>6}")
    for r in range(args.rounds):
        got = {v: run(f"round {r}", v) for v in ((1, 0) if r % 2 == 0 else (0, 1))}
        rounds.append({names[0]: got[0], names[1]: got[1], "ratio": got[0] / got[1]})
        print(f"{r:>5}  {got[0]:>28.1f}  {got[1]:>28.1f}  {got[0] / got[1]:>6.3f}", flush=True)
    median = statistics.median(x["ratio"] for x in rounds)
    print(f"median {names[0]} / {names[1]}: {median:.3f}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"prompts": args.prompts, "input_len": args.input_len,
                                         "output_len": args.output_len, "against": args.against,
                                         "compiled": args.compiled, "rounds": rounds, "median_ratio": median},
                                        indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
