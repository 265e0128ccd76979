"""``sluice bench gateway-memory``: the gateway's memory across many requests naming unknown models.

A gateway must keep nothing per unknown model name a client sends, or memory grows without bound
under a stream of bad requests. This starts a private ``redis-server`` (unless ``--redis-url``) and one gateway process (``sluice gateway``,
one worker), sends ``--num-requests`` completions each naming a different random model (all 404),
``--concurrency`` at a time, and samples the gateway's resident memory (``/proc/PID/status``,
VmRSS) every ``--sample-every`` requests. It prints a table and writes JSON (``--json``).

The figure to look at is the growth after warm-up: RSS at the end minus RSS after the first
sample (allocator arenas and caches fill during the first requests).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import string
import sys
import time
from pathlib import Path

from sluice_bench import results
from sluice_bench.stack import Stack, StackError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=100_000)
    parser.add_argument("--name-length", type=int, default=4000, help="characters per random model name")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--sample-every", type=int, default=10_000)
    parser.add_argument("--redis-url", default=None, help="use this Redis instead of a private redis-server")
    parser.add_argument("--json", "--result-file", dest="json", default=None, help="write the samples as JSON here")
    parser.add_argument("--seed", type=int, default=0)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def _drive(base: str, args: argparse.Namespace, pid: int) -> list[dict]:
    import httpx

    rng = random.Random(args.seed)
    alphabet = string.ascii_letters + string.digits + "-_."
    samples: list[dict] = []
    statuses: dict = {}
    sent = 0
    done = 0
    start = time.monotonic()

    def sample() -> None:
        samples.append({"requests": sent, "rss_mib": round(_rss_kib(pid) / 1024, 2),
                        "seconds": round(time.monotonic() - start, 1), "statuses": dict(statuses)})
        print(f"{sent:>9,} requests  RSS {samples[-1]['rss_mib']:8.1f} MiB  {samples[-1]['seconds']:7.1f} s",
              flush=True)

    async with httpx.AsyncClient(base_url=base, timeout=60,
                                 limits=httpx.Limits(max_connections=args.concurrency)) as client:
        sample()
        queue: asyncio.Queue = asyncio.Queue(maxsize=args.concurrency * 2)

        async def worker() -> None:
            while True:
                body = await queue.get()
                if body is None:
                    return
                nonlocal done
                try:
                    r = await client.post("/v1/completions", content=body,
                                          headers={"content-type": "application/json"})
                    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                except httpx.HTTPError as exc:
                    statuses[type(exc).__name__] = statuses.get(type(exc).__name__, 0) + 1
                done += 1

        workers = [asyncio.create_task(worker()) for _ in range(args.concurrency)]
        for _ in range(args.num_requests):
            name = "".join(rng.choices(alphabet, k=args.name_length))
            await queue.put(json.dumps({"model": name, "prompt": "x", "max_tokens": 1}).encode())
            sent += 1
            if sent % args.sample_every == 0:
                while done < sent:  # let the in-flight ones land before sampling
                    await asyncio.sleep(0.01)
                sample()
        for _ in workers:
            await queue.put(None)
        await asyncio.gather(*workers)
    if samples[-1]["requests"] != sent:
        sample()
    return samples


def run(args: argparse.Namespace) -> int:
    with Stack("gateway-memory") as stack:
        try:
            redis_url = stack.redis(args.redis_url)
            gateway = stack.gateway(redis_url, ["--log-level", "warning"])
            stack.wait_http(f"{gateway.url}/health", 60)
        except StackError as exc:
            print(exc, file=sys.stderr)
            return 2
        samples = asyncio.run(_drive(gateway.url, args, gateway.pid))
    first, last = samples[0], samples[-1]
    warm = samples[1] if len(samples) > 1 else first
    peak = max(s["rss_mib"] for s in samples[1:] or samples)
    summary = {
        "num_requests": last["requests"], "name_length": args.name_length, "concurrency": args.concurrency,
        "statuses": last["statuses"], "rss_start_mib": first["rss_mib"], "rss_after_first_sample_mib": warm["rss_mib"],
        "rss_end_mib": last["rss_mib"], "rss_peak_mib": peak,
        "growth_after_warmup_mib": round(last["rss_mib"] - warm["rss_mib"], 2),
        "spread_after_warmup_mib": round(peak - min(s["rss_mib"] for s in samples[1:] or samples), 2),
        "seconds": last["seconds"], "samples": samples,
    }
    print()
    print("| requests | RSS MiB |")
    print("|---|---|")
    for s in samples:
        print(f"| {s['requests']:,} | {s['rss_mib']:.1f} |")
    print(f"\nstatuses {last['statuses']}; growth after the first {warm['requests']:,} requests: "
          f"{summary['growth_after_warmup_mib']:+.1f} MiB (spread {summary['spread_after_warmup_mib']:.1f} MiB)")
    results.write(args.json, "gateway-memory", summary)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice bench gateway-memory", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
