"""How much of one stream's decode is the native decode call: the engine's time per token beside the
time its NativeDecode calls took, iteration by iteration, in one engine.

    python scripts/native_call_share.py [--mode bfloat16-native-steps] [--iters 6] [--json out.json]

Each iteration decodes --output-len greedy tokens after a --prompt-len random prompt (the anchor's
shape, `sluice bench anchor`), timed from the first token to the last as the anchor times it. The
rest of a token's time is the engine around the call: the scheduler, the sampler, Python.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from engine_service.bench.modes import MODES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="bfloat16-native-steps",
                        choices=[m for m, kw in MODES.items() if kw.get("native_decode")])
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.iters < 1 or args.prompt_len < 1 or args.output_len < 2:
        parser.error("--iters and --prompt-len must be at least 1, --output-len at least 2")

    from engine_service.bench.anchor import SluiceStream, StreamRow
    from engine_service.bench.latency import make_prompts

    stream = SluiceStream(args.mode, None, args.threads)  # the anchor's engine, as `sluice bench anchor` builds it
    native = stream.llm.engine.runner.native_decode
    if native is None:
        raise SystemExit(f"{args.mode}: this engine has no native decode step here")
    spent: list[float] = []  # seconds of each native call, decode steps only (a prefill never takes it)

    def timed(fn):
        def call(*a, **k):
            started = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent.append(time.perf_counter() - started)
        return call

    class Timed:
        """The runner's NativeDecode, its one-step call and its several-steps call timed."""

        def __init__(self, inner) -> None:
            self._inner = inner
            self.greedy_steps = timed(inner.greedy_steps)
            self._call = timed(inner)

        def __getattr__(self, item):
            return getattr(self._inner, item)

        def __call__(self, *a, **k):
            return self._call(*a, **k)

    stream.llm.engine.runner.native_decode = Timed(native)
    rng = random.Random(0)
    vocab = stream.llm.engine.vocab_size
    rows = []
    print(f"{args.mode}: one stream, prompt {args.prompt_len}, {args.output_len} greedy tokens, {args.threads} threads")
    print(f"{'iteration':>9}{'ms a token':>12}{'native ms a token':>19}{'native share':>14}")
    for it in range(args.iters):
        row = StreamRow("sluice")
        spent.clear()
        tokens = stream.run(make_prompts(vocab, 1, args.prompt_len, rng)[0], args.output_len, row)
        decoded = len(tokens) - 1  # the anchor's count: the tokens after the first
        per_token, native_per_token = row.tpot_ms[0] / 1e3, sum(spent) / decoded
        rows.append({"iteration": it, "ms_per_token": 1e3 * per_token, "native_ms_per_token": 1e3 * native_per_token,
                     "native_share": native_per_token / per_token})
        print(f"{it:>9}{1e3 * per_token:>12.3f}{1e3 * native_per_token:>19.3f}{native_per_token / per_token:>14.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "rows": rows},
                                        indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
