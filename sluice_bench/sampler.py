"""``sluice bench sampler``: the sampler's cost per engine step on a synthetic batch, the sparse path
against the dense reference side by side in one run (``sluice bench offline`` reports it too)."""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from engine_service.core.request import Request
from engine_service.sampling.sampler import Sampler
from sluice_bench import results


def benchmark_sampler(
    batch_size: int = 256,
    vocab: int = 49152,
    steps: int = 20,
    warmup: int = 3,
    device: torch.device | str = "cpu",
    prompt_len: int = 256,
    output_len: int = 128,
    logprobs: int | None = None,
    num_threads: int | None = None,
    clock: str = "wall",
    vocab_size: int | None = None,
    mix: str = "mixed",
    dense: bool = False,
) -> float:
    """Median wall time in ms of one ``Sampler`` call on a mixed batch: a quarter each greedy,
    top-p (0.9, temperature 0.8), penalties (presence 0.5, frequency 0.5, repetition 1.1, top_k 50)
    and seeded (temperature 1.0, top_k 40, min_p 0.05), with ``prompt_len`` prompt and
    ``output_len`` generated tokens per request (penalties look at them). ``num_threads`` sets
    torch's CPU threads for the measurement (restored after). ``clock="cpu"`` measures the process's
    CPU time instead of wall time (with one thread, the cost on an idle core of a shared machine).
    ``vocab_size`` is an alias of ``vocab`` (it wins when given). ``mix="greedy"`` makes every
    request greedy; ``dense=True`` measures the dense reference pipeline instead of the sparse one."""
    if vocab_size is not None:
        vocab = vocab_size
    from engine_service.core.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(1234)
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=None),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=None),
        SamplingParams(
            temperature=1.0,
            top_k=50,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            repetition_penalty=1.1,
            max_tokens=None,
        ),
        None,  # seeded, built per request
    ]
    requests = []
    for i in range(batch_size):
        params = kinds[0] if mix == "greedy" else kinds[i % 4] or SamplingParams(
            temperature=1.0, top_k=40, min_p=0.05, seed=i, max_tokens=None
        )
        if logprobs is not None:
            params = params.replace(logprobs=logprobs)
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        output = torch.randint(0, vocab, (output_len,), generator=gen).tolist()
        requests.append(Request(f"bench-{i}", prompt, params, output_token_ids=output))
    sampler = Sampler(vocab, device=device, seed=0)
    # Logits shaped like a language model's: Zipf-like (exponent 1.2) over a random order per row,
    # plus noise; top-p 0.9 then needs a few hundred to a few thousand candidates, not a full sort.
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    zipf = -1.2 * torch.log(ranks)
    perm = torch.argsort(torch.rand(batch_size, vocab, generator=gen), dim=1)
    logits = (zipf[perm] + 0.1 * torch.randn(batch_size, vocab, generator=gen)).to(device)
    times = []
    previous_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        timer = time.process_time if clock == "cpu" else time.perf_counter
        _run_benchmark(sampler, logits, requests, device, warmup, steps, times, timer, dense)
    finally:
        torch.set_num_threads(previous_threads)
    times.sort()
    return times[len(times) // 2] if times else math.nan


def _run_benchmark(sampler, logits, requests, device, warmup, steps, times, timer, dense=False) -> None:
    for step in range(warmup + steps):
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        t0 = timer()
        out = sampler(logits, requests, dense=dense)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        if step >= warmup:
            times.append((timer() - t0) * 1e3)
        for req, tok in zip(requests, out.token_ids, strict=True):
            req.append_output_token(tok)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="alternate sparse and dense this many times")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--json", type=Path, default=None)


def run(args: argparse.Namespace) -> int:
    rows = {}
    for _ in range(args.rounds):
        for mix in ("mixed", "greedy"):
            for dense in (False, True):
                ms = benchmark_sampler(batch_size=args.batch_size, vocab=args.vocab, steps=args.steps,
                                       num_threads=args.num_threads, clock=args.clock, mix=mix, dense=dense)
                key = f"{mix}, {'dense reference' if dense else 'sparse (default)'}"
                rows[key] = min(rows.get(key, math.inf), ms)
    print(f"sampler, batch {args.batch_size}, vocab {args.vocab}, {args.clock} clock, "
          f"threads {args.num_threads or torch.get_num_threads()}; best of {args.rounds} rounds of the median")
    for key, ms in rows.items():
        print(f"  {key:<34} {ms:8.2f} ms/step")
    results.write(args.json, "sampler", {"args": vars(args) | {"json": str(args.json)}, "ms_per_step": rows})
    return 0
