"""``sluice bench event-log``: the cost of the per-request event log, side by side in one run: every
request logged (as a resumable stream or a background response is) against none.

    sluice bench event-log [--duration 8] [--rounds 1] [--concurrency 32] [--tokens 64] [--json PATH]

On one private ``redis-server`` it runs ``sluice_bench.redis_capacity.measure`` -- engine processes
with the REAL ``RedisIO`` publisher (whose per-step pipeline carries the log's XADD and EXPIREs) and
``Worker`` around a fake engine that emits one token per request per step with no model, and load
generators each holding a real ``gateway.broker.Broker`` (which writes the record before the XADD)
-- with ``log_events`` off, then on, ``--rounds`` times alternately. It reports token events/s,
Redis commands and client round trips per request (by command), Redis CPU per 1,000 requests, and
the logged/plain ratios. The model is taken out on purpose: what is left is the whole Redis cost;
with a model each step takes milliseconds and the same cost is a smaller share.

Memory: a 1,000-token log written with the engine's own encoding (``sluice.wire.event_log``; one
element per step, one token per element, the worst case: the publisher coalesces steps, and a
prefill's or several completions' element holds more tokens), measured with ``MEMORY USAGE``; and
the mean of the logs the logged run left, per 1,000 of their tokens, with their keys' overhead.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import redis

from sluice.wire import contract, event_log
from sluice.wire.messages_pb2 import Event
from sluice_bench import results
from sluice_bench.redis_capacity import BenchConfig, Standalone, mean_result, measure

VOCAB = 49152  # SmolLM2's: token ids of realistic size (varints of 1-3 bytes)


def log_memory(client: redis.Redis, tokens: int = 1000) -> dict[str, float]:
    """Bytes of one ``tokens``-token log (and a chat request's record) as the engine writes it."""
    rid = f"chatcmpl-{random.getrandbits(128):032x}"
    key = contract.log_key(rid)
    pipe = client.pipeline(transaction=False)
    for _ in range(tokens):
        event = Event(request_id=rid, index=0, token_ids=[random.randrange(VOCAB)], engine_id="engine-0123abcd")
        pipe.rpush(key, event_log.encode_entry([event]))
    pipe.execute()
    log_bytes = client.memory_usage(key, samples=0)
    record = event_log.StreamRecord(id=rid, endpoint="chat", model="SmolLM2-135M-Instruct", created=int(time.time()),
                                    reply_to="0123456789abcdef0123456789abcdef", request_ids=[rid],
                                    prompt_ids=[[random.randrange(VOCAB) for _ in range(5)]], prompt_tokens=[200], deadline=time.time(),
                                    render={"body": {"model": "SmolLM2-135M-Instruct", "stream": True, "max_tokens": 256},
                                            "prompt": "", "opts": {"stop": [], "include_stop_str": False,
                                                                   "skip_special_tokens": True, "logprobs": None},
                                            "n": 1})
    client.set(contract.record_key(rid), record.encode())
    record_bytes = client.memory_usage(contract.record_key(rid), samples=0)
    client.delete(key, contract.record_key(rid))
    return {"log_bytes_per_1k_tokens": log_bytes * 1000 / tokens, "record_bytes_chat": record_bytes}


def left_logs(client: redis.Redis, tokens_each: int, sample: int = 200) -> dict[str, float]:
    """Mean memory of the logs a logged run left (each ``tokens_each`` tokens), per 1,000 tokens."""
    sizes = []
    for key in client.scan_iter(match=f"{contract.PREFIX}:{{r:*}}:log", count=1000):
        sizes.append(client.memory_usage(key, samples=0))
        if len(sizes) >= sample:
            break
    if not sizes:
        return {}
    mean = sum(sizes) / len(sizes)
    return {"logs_sampled": len(sizes), "mean_log_bytes": mean, "log_bytes_per_1k_tokens_at_run": mean * 1000 / tokens_each}


ROWS = [("token events/s", "token_events_per_s", "{:,.0f}"),
        ("requests/s", "requests_per_s", "{:,.0f}"),
        ("Redis commands / request", "commands_per_request", "{:.2f}"),
        ("Redis commands / token", "commands_per_token", "{:.2f}"),
        ("Redis bytes in / token", "redis_bytes_in_per_token", "{:,.1f}"),
        ("Redis bytes out / token", "redis_bytes_out_per_token", "{:,.1f}"),
        ("client round trips / request", "round_trips_per_request", "{:.2f}"),
        ("  engines", "round_trips_per_request_engines", "{:.2f}"),
        ("  load generators (gateways)", "round_trips_per_request_loadgens", "{:.2f}"),
        ("Redis CPU s / 1k requests", "redis_cpu_s_per_1k_requests", "{:.3f}"),
        ("requests / CPU-second (all)", "requests_per_cpu_s", "{:,.0f}")]


def table(plain: dict[str, Any], logged: dict[str, Any]) -> str:
    lines = [f"{'':34} {'no log':>12} {'logged':>12} {'logged/no':>10}"]
    for label, key, fmt in ROWS:
        a, b = plain[key], logged[key]
        lines.append(f"{label:34} {fmt.format(a):>12} {fmt.format(b):>12} {b / a if a else float('nan'):>10.2f}")
    commands = sorted(set(plain["commands_per_request_by_command"]) | set(logged["commands_per_request_by_command"]))
    lines.append("commands / request, by command:")
    for cmd in commands:
        a = plain["commands_per_request_by_command"].get(cmd, 0.0)
        b = logged["commands_per_request_by_command"].get(cmd, 0.0)
        if a or b:
            lines.append(f"  {cmd:32} {a:>12.2f} {b:>12.2f}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=8.0, help="measured seconds per run (default: 8)")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=1, help="plain/logged pairs, alternating (default: 1)")
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--gateways", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight per load generator")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request (default: 64)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")


def run(args: argparse.Namespace) -> int:
    cfg = BenchConfig(duration_s=args.duration, warmup_s=args.warmup, engines=args.engines, gateways=args.gateways,
                      concurrency=args.concurrency, tokens=args.tokens)
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "logged": []}
    with Standalone() as topology:
        client = redis.Redis.from_url(topology.url)
        memory = log_memory(client)
        for _ in range(args.rounds):
            for name, logged in (("plain", False), ("logged", True)):
                client.flushall()
                runs[name].append(measure(topology, replace(cfg, log_events=logged)))
                if logged:
                    memory.update(left_logs(client, cfg.tokens))
        client.close()
    plain, logged = mean_result(runs["plain"]), mean_result(runs["logged"])
    print(table(plain, logged))
    print(f"log memory: {memory['log_bytes_per_1k_tokens']:,.0f} bytes per 1,000 tokens (one token per entry); "
          f"record of a chat request (its prompt's tail only): {memory['record_bytes_chat']:,} bytes")
    if "log_bytes_per_1k_tokens_at_run" in memory:
        print(f"logs left by the run ({cfg.tokens} tokens each, {memory['logs_sampled']} sampled): "
              f"{memory['mean_log_bytes']:,.0f} bytes each, {memory['log_bytes_per_1k_tokens_at_run']:,.0f} per 1,000 tokens")
    for name, r in (("plain", plain), ("logged", logged)):
        check = r["check"]
        if check["bad"] or check["events_of_completed"] != check["expected_events"]:
            print(f"WARNING: {name}: {check}", file=sys.stderr)
    results.write(args.json, "event-log", {"config": vars(args) | {"json": str(args.json)}, "plain": plain,
                                           "logged": logged, "memory": memory})
    return 0
