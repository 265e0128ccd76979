"""``sluice bench responses-memory``: the Redis memory a long conversation takes, turn by turn.

Starts the serving-path bench's stack (a private ``redis-server``, an engine on the stub model: no
weights, the real scheduler and Redis I/O; one gateway) and builds a ``--turns``-turn conversation
through ``POST /v1/responses``: each turn a short input and ``--max-output-tokens`` of output,
continuing the previous one by ``previous_response_id`` (``--mode chain``) or in one conversation
(``--mode conversation``, ``/v1/conversations``). After each turn it reads Redis's ``MEMORY USAGE``
(every value sampled) of what the turn added:

- ``stored``: the turn's stored response (``sluice:{resp:<id>}``, kept ``--responses-ttl-s``), and
  in ``conversation`` mode the growth of the conversation's three keys;
- ``log``: the event log and record of the turn's engine request (kept ``--event-log-ttl-s`` after
  its end);
- ``copy``: what the turn's response would take holding its whole conversation again (its hash
  plus the conversation's items as one JSON field, as the responses were stored before their
  chain was linked), measured on a scratch key: the quadratic layout, side by side.

It prints the mean bytes per turn for each tenth of the turns and the ratio of the last tenth to
the first, and writes every turn's figures as JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from sluice_bench import results as results_file
from sluice_bench.stack import Stack, StackError

STUB_ENV = "SLUICE_BENCH_STUB_MODEL"  # engine_service.model.stub.BENCH_ENV (no torch imported here)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--mode", choices=("chain", "conversation"), default="chain")
    parser.add_argument("--max-output-tokens", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=8192, help="the stub engine's context")
    parser.add_argument("--json", "--result-file", dest="json", default=None, metavar="FILE",
                        help="write every turn's figures as JSON here")


def _memory(redis, key: str) -> int:
    return int(redis.memory_usage(key, samples=0) or 0)


def _turn_input(i: int) -> str:
    return f"Turn {i}: tell me one more thing about the sea."


def run(args: argparse.Namespace) -> int:
    import httpx

    from sluice.wire import contract
    from sluice.wire.connection import connect

    stack = Stack("responses-memory", env={STUB_ENV: "1"})
    turns: list[dict] = []
    try:
        try:
            redis_url = stack.redis()
            stack.engine(redis_url, ["--stub-model", "--log-level", "WARNING", "--max-model-len",
                                     str(args.max_model_len)], name="engine")
            gateway = stack.gateway(redis_url, ["--log-level", "warning"], name="gateway")
            model = stack.wait_ready(gateway)
        except StackError as exc:
            print(f"sluice bench responses-memory: {exc}", file=sys.stderr)
            return 1
        redis = connect(redis_url)
        http = httpx.Client(base_url=f"http://127.0.0.1:{gateway.port}", timeout=120)
        conversation: list[dict] = []
        previous: str | None = None
        conv_id: str | None = None
        if args.mode == "conversation":
            conv_id = http.post("/v1/conversations", json={}).json()["id"]
        conv_before = 0
        for i in range(1, args.turns + 1):
            body: dict = {"model": model, "input": _turn_input(i), "max_output_tokens": args.max_output_tokens}
            if conv_id is not None:
                body["conversation"] = conv_id
            elif previous is not None:
                body["previous_response_id"] = previous
            t0 = time.perf_counter()
            r = http.post("/v1/responses", json=body)
            seconds = time.perf_counter() - t0
            if r.status_code != 200:
                print(f"turn {i}: HTTP {r.status_code} {r.text[:300]}", file=sys.stderr)
                return 1
            resp = r.json()
            key = contract.response_key(resp["id"])
            stored = _memory(redis, key)
            if conv_id is not None:
                conv_now = sum(_memory(redis, k) for k in contract.conversation_keys(conv_id))
                stored += conv_now - conv_before
                conv_before = conv_now
            rid = json.loads(redis.hget(key, "record"))["request_id"]
            log = _memory(redis, contract.log_key(rid)) + _memory(redis, contract.record_key(rid))
            conversation += json.loads(redis.hget(key, "input")) + resp["output"]
            scratch = "sluice-bench:copy"
            redis.copy(key, scratch, replace=True)
            redis.hset(scratch, "conversation", json.dumps(conversation, separators=(",", ":")))
            copy = _memory(redis, scratch)
            redis.delete(scratch)
            turns.append({"turn": i, "stored_bytes": stored, "log_bytes": log, "copy_bytes": copy,
                          "seconds": round(seconds, 4), "input_tokens": resp["usage"]["input_tokens"]})
            previous = resp["id"]
            if i % 20 == 0:
                print(f"turn {i:>4}: stored {stored:>6} B, log {log:>6} B, whole-conversation copy {copy:>8} B, "
                      f"prompt {resp['usage']['input_tokens']} tokens", flush=True)
        used = int(redis.info("memory")["used_memory"])
    finally:
        stack.stop()
    summary = summarize(turns)
    summary.update({"mode": args.mode, "turns": args.turns, "max_output_tokens": args.max_output_tokens,
                    "redis_used_memory_bytes": used, "per_turn": turns})
    print()
    print(format_table(summary))
    results_file.write(args.json, "responses-memory", summary)
    return 0


def summarize(turns: list[dict]) -> dict:
    """Mean bytes per turn for each tenth of the turns, and the last tenth over the first."""
    n = len(turns)
    tenth = max(1, n // 10)
    buckets = []
    for start in range(0, n, tenth):
        part = turns[start:start + tenth]
        buckets.append({"turns": f"{part[0]['turn']}-{part[-1]['turn']}",
                        **{f"{k}_bytes": round(sum(t[f'{k}_bytes'] for t in part) / len(part))
                           for k in ("stored", "log", "copy")}})
    first, last = buckets[0], buckets[-1]
    return {"buckets": buckets,
            "late_over_early": {k: round(last[f"{k}_bytes"] / max(1, first[f"{k}_bytes"]), 3)
                                for k in ("stored", "log", "copy")},
            "stored_total_bytes": sum(t["stored_bytes"] for t in turns),
            "copy_total_bytes": sum(t["copy_bytes"] for t in turns)}


def format_table(summary: dict) -> str:
    lines = ["| turns | stored B/turn | log B/turn | whole-conversation copy B/turn |", "|---|---|---|---|"]
    for b in summary["buckets"]:
        lines.append(f"| {b['turns']} | {b['stored_bytes']:,} | {b['log_bytes']:,} | {b['copy_bytes']:,} |")
    r = summary["late_over_early"]
    lines.append(f"| last / first | {r['stored']:.2f}x | {r['log']:.2f}x | {r['copy']:.2f}x |")
    lines.append(f"\nall turns: stored {summary['stored_total_bytes']:,} B; "
                 f"as whole-conversation copies {summary['copy_total_bytes']:,} B")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice bench responses-memory", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
