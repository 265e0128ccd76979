"""``sluice bench long-prompts``: what a long prompt costs the streams already running: their
inter-token latency while long prompts arrive, against the same run while short prompts arrive,
side by side. ``sluice bench long-prompts --base-url http://127.0.0.1:8000 [--long-len 8000] [--json PATH]``.

Against a running gateway (``sluice serve``). Each round starts ``--streams`` streaming completions
that generate ``--stream-tokens`` tokens each; once all of them stream, ``--arrivals`` prompts of
one kind are sent one after another (``max_tokens`` 1; with ``--echo-logprobs`` they also ask for
``echo`` and ``logprobs``, so the engine scores every prompt token). The background streams' gaps
between chunks are collected from the first arrival to the last one's answer (then the streams
are cancelled; ``--stream-tokens`` must outlast the window, which the summary checks). Rounds alternate
the kinds (``--rounds`` of each): short prompts, prompts of one token budget (one step of prefill),
and long ones, so all see the same machine. The table gives the gaps' median, p99 and max per kind,
and the ratios long/short and long/budget: a long prompt should hold the streams no longer per step
than a budget-sized one does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

from sluice_bench import results


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


async def stream(client: httpx.AsyncClient, url: str, body: dict, stamps: list[float], started: asyncio.Event) -> None:
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    stamps.append(time.perf_counter())
                    started.set()


async def one_round(client: httpx.AsyncClient, args, model: str, prompt_len: int, rng: random.Random) -> dict:
    url = f"{args.base_url.rstrip('/')}/v1/completions"
    stamps: list[list[float]] = [[] for _ in range(args.streams)]
    events = [asyncio.Event() for _ in range(args.streams)]
    tasks = []
    for i in range(args.streams):
        body = {"model": model, "prompt": [rng.randrange(100, 10000) for _ in range(16)], "stream": True,
                "max_tokens": args.stream_tokens, "ignore_eos": True, "temperature": 0}
        tasks.append(asyncio.create_task(stream(client, url, body, stamps[i], events[i])))
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout=args.timeout)
    window_start = time.perf_counter()
    waits = []
    for _ in range(args.arrivals):
        body = {"model": model, "prompt": [rng.randrange(100, 10000) for _ in range(prompt_len)], "max_tokens": 1,
                "temperature": 0}
        if args.echo_logprobs:
            body.update(echo=True, logprobs=1)
        t = time.perf_counter()
        resp = await client.post(url, json=body)
        resp.raise_for_status()
        waits.append(time.perf_counter() - t)
    window_end = time.perf_counter()
    outlived = not any(t.done() for t in tasks)
    for t in tasks:  # the window is over: disconnecting cancels the streams at the gateway
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:], strict=False) if window_start <= b <= window_end]
    return {"gaps": gaps, "arrival_latency": waits, "streams_outlived_window": outlived}


async def measure(args) -> dict:
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(timeout=args.timeout) as client:
        model = args.model or (await client.get(f"{args.base_url.rstrip('/')}/v1/models")).json()["data"][0]["id"]
        kinds = {"short": args.short_len, "budget": args.budget_len, "long": args.long_len}
        out: dict = {k: {"gaps": [], "arrival_latency": [], "rounds_ok": 0} for k in kinds}
        for r in range(args.rounds):
            for kind in (tuple(kinds) if r % 2 == 0 else tuple(reversed(kinds))):
                res = await one_round(client, args, model, kinds[kind], rng)
                out[kind]["gaps"] += res["gaps"]
                out[kind]["arrival_latency"] += res["arrival_latency"]
                out[kind]["rounds_ok"] += res["streams_outlived_window"]
                print(f"round {r} {kind:>5}: {len(res['gaps'])} gaps, max {max(res['gaps'], default=0) * 1000:.0f} ms")
    summary = {"model": model, "args": {k: v for k, v in vars(args).items() if k != "json"}}
    for kind, d in out.items():
        g = d["gaps"] or [0.0]
        summary[kind] = {"prompt_len": kinds[kind], "gaps": len(d["gaps"]), "median_ms": statistics.median(g) * 1000,
                         "p99_ms": pct(g, 99) * 1000, "max_ms": max(g) * 1000,
                         "arrival_latency_median_ms": statistics.median(d["arrival_latency"]) * 1000,
                         "rounds_where_streams_outlived_the_arrivals": d["rounds_ok"]}
    summary["p99_long_over_short"] = summary["long"]["p99_ms"] / summary["short"]["p99_ms"]
    summary["p99_long_over_budget"] = summary["long"]["p99_ms"] / summary["budget"]["p99_ms"]
    return summary


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--streams", type=int, default=4, help="background streams per round")
    p.add_argument("--stream-tokens", type=int, default=4000, help="tokens each background stream generates")
    p.add_argument("--arrivals", type=int, default=2, help="prompts sent per round, one after another")
    p.add_argument("--long-len", type=int, default=8000)
    p.add_argument("--short-len", type=int, default=16)
    p.add_argument("--budget-len", type=int, default=2048,
                   help="the middle kind: one token budget (the engine's --max-num-batched-tokens), a single step")
    p.add_argument("--echo-logprobs", action="store_true", help="the arrivals ask for echo and logprobs")
    p.add_argument("--rounds", type=int, default=2, help="rounds of each kind, alternating")
    p.add_argument("--seed", type=int, default=None,
                   help="prompts' seed (default: a fresh one, so no prompt hits the prefix cache of an earlier run)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default=None, help="write the summary here")


def run(a: argparse.Namespace) -> int:
    s = asyncio.run(measure(a))
    print(f"{'arrivals':<10}{'prompt':>8}{'gaps':>7}{'ITL p50 ms':>12}{'ITL p99 ms':>12}{'ITL max ms':>12}")
    for kind in ("short", "budget", "long"):
        k = s[kind]
        print(f"{kind:<10}{k['prompt_len']:>8}{k['gaps']:>7}{k['median_ms']:>12.0f}{k['p99_ms']:>12.0f}{k['max_ms']:>12.0f}")
    print(f"ITL p99 long/short: {s['p99_long_over_short']:.2f}x, long/budget: {s['p99_long_over_budget']:.2f}x")
    results.write(a.json, "long-prompts", s)
    return 0
