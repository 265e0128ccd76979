"""Profile one decode step of the engine with torch.profiler: `python scripts/profile_decode.py --batch 1`.

Fills `--batch` sequences with a `--context`-token prompt each, then profiles `--steps` decode
steps of the engine and prints the top ops by self CPU time (torch.profiler), or with ``--cprofile``
the cumulative time of each Python call (cProfile: how a step divides into its parts).
"""

from __future__ import annotations

import argparse
import time

import torch

from engine_service import LLM, SamplingParams
from engine_service.config import add_engine_arguments


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--enforce-eager", action="store_true")
    add_engine_arguments(p, only=("quantization", "attention_backend"))
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--cprofile", action="store_true",
                   help="Python's cProfile instead of torch.profiler (cumulative times per Python call: "
                        "the step's parts, without the profiler's cost on each operator)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kwargs = {"dtype": args.dtype, "quantization": args.quantization, "attention_backend": args.attention_backend}
    try:
        llm = LLM(**kwargs, enforce_eager=args.enforce_eager)
    except TypeError:
        llm = LLM(**kwargs)
    engine = llm.engine
    prompts = [[100 + (i * 7 + j) % 4000 for j in range(args.context)] for i in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"p{i}", ids, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or engine.scheduler.num_waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    started = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    per_step = (time.perf_counter() - started) / args.steps
    print(f"batch {args.batch}: {per_step * 1e3:.1f} ms per engine step, {args.batch / per_step:.1f} tok/s")
    if args.cprofile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            engine.step()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.rows)
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
