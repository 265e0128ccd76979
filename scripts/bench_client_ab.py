"""The CPU ``sluice bench serve``'s client spends per streamed token: its aiohttp client against an
httpx one that reads the same stream the same way, taking turns on one running gateway.

    python scripts/bench_client_ab.py [--base-url URL] [--rounds 3] [--num-prompts 64]

Each round sends the same 64 prompts (fresh ones each round, so that no side finds the other's in
the prefix cache) once through each client, in alternating order, and times the process's CPU
over each pass. Prints µs of client CPU per output token, per pass and the median of each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import aiohttp
import httpx

from sluice_cli import bench_serve


async def httpx_pass(base: str, model: str, requests: list[bench_serve.BenchRequest], args) -> int:
    async def one(client, req) -> int:
        payload = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "stream": True,
                   "stream_options": {"include_usage": True}, "temperature": 0.0, "ignore_eos": True}
        tokens = 0
        async with client.stream("POST", f"{base}/v1/completions", json=payload) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line[6:] != "[DONE]":
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
        return tokens

    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        return sum(await asyncio.gather(*(one(client, r) for r in requests)))


async def aiohttp_pass(base: str, model: str, requests: list[bench_serve.BenchRequest], args) -> int:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=args.timeout)) as client:
        results = await asyncio.gather(*(bench_serve.send_one(client, f"{base}/v1/completions", model, r, args)
                                         for r in requests))
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise SystemExit(f"aiohttp pass: {len(failed)} requests failed: {failed[0]}")
    return sum(r.output_tokens for r in results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    args.temperature, args.ignore_eos = 0.0, True  # what send_one reads
    base = args.base_url.rstrip("/")
    per_token: dict[str, list[float]] = {"httpx": [], "aiohttp": []}
    for i in range(args.rounds):
        order = ["httpx", "aiohttp"] if i % 2 == 0 else ["aiohttp", "httpx"]
        for name in order:
            requests = bench_serve.synthetic_dataset(args.num_prompts, 128, 64, 0.5, (100, 10000),
                                                     f"client ab {time.time_ns()} {name}")
            run = httpx_pass if name == "httpx" else aiohttp_pass
            cpu = time.process_time()
            tokens = asyncio.run(run(base, args.model, requests, args))
            us = (time.process_time() - cpu) / max(tokens, 1) * 1e6
            per_token[name].append(us)
            print(f"round {i + 1} {name:<8} {tokens} tokens, {us:.1f} us of client CPU a token", flush=True)
    print(" | ".join(f"{name} median {statistics.median(v):.1f} us" for name, v in per_token.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
