"""``sluice bench structured``: how many schema-constrained outputs parse and validate when the
token budget runs out, with and without the budget steering, and what the steering costs.

Ten JSON schemas whose arrays, strings and nesting are unbounded (``UNBOUNDED_SCHEMAS``), each
asked of ten subjects: ``--num-requests`` chat requests (100 by default) at ``--temperature``
(0.7) with a small ``--max-tokens`` (64), seeded per request. The same requests run twice in one
process, on one engine, one after the other: with the grammar masks only (``budget_steering``
off: the grammar masks alone) and with the steering on; ``--repeats`` alternates
the pair (off, on, off, on, ...) so that a machine whose load drifts weighs on both alike. For each
mode: how many outputs parse as JSON, validate against their schema and end with
``finish_reason`` "stop" (the same in every repeat: the requests are seeded), the finish reasons,
the output tokens, tokens/s (output tokens over wall time, all repeats together) and tokens per
CPU-second of the process, and the time the steering spent walking completions (its own cost,
timed where it runs: on a shared machine the wall and CPU times of whole runs move with the other
processes' load more than with the steering); every run starts with a cold prefix cache. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

_STR = {"type": "string"}

# Every array, string and nesting level unbounded: a model that keeps adding items, characters or
# levels is never closed by the schema, only by max_tokens (or, with the steering, by the budget).
UNBOUNDED_SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": _STR, "tags": {"type": "array", "items": _STR}},
     "required": ["name", "tags"]},
    {"type": "object", "properties": {"description": _STR}, "required": ["description"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"name": _STR, "note": _STR}, "required": ["name", "note"]}}},
     "required": ["items"]},
    {"type": "object", "properties": {"title": _STR, "paragraphs": {"type": "array", "items": _STR}},
     "required": ["title", "paragraphs"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "items": {"type": "array", "items": {
        "type": "integer"}}}}, "required": ["matrix"]},
    {"type": "object", "properties": {"people": {"type": "array", "items": {"type": "object", "properties": {
        "name": _STR, "friends": {"type": "array", "items": _STR}}, "required": ["name", "friends"]}}},
     "required": ["people"]},
    {"$defs": {"node": {"type": "object", "properties": {"name": _STR, "children": {
        "type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["name", "children"]}},
     "$ref": "#/$defs/node"},
    {"type": "object", "properties": {"summary": _STR, "facts": {"type": "array", "items": _STR},
                                      "numbers": {"type": "array", "items": {"type": "number"}}},
     "required": ["summary", "facts", "numbers"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "array", "items": _STR}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"steps": {"type": "array", "items": {"type": "object", "properties": {
        "action": _STR, "details": {"type": "array", "items": _STR}}, "required": ["action", "details"]}},
        "result": _STR}, "required": ["steps", "result"]},
]
SUBJECTS = ["a cat", "a city", "a book", "a car", "a planet", "a song", "a recipe", "a tree", "a river",
            "a teacher"]


def unbounded_cases(count: int) -> list[tuple[str, dict]]:
    """``count`` (prompt, schema) pairs: every schema in turn, each with the subjects in turn."""
    out = []
    for i in range(count):
        schema = UNBOUNDED_SCHEMAS[i % len(UNBOUNDED_SCHEMAS)]
        subject = SUBJECTS[(i // len(UNBOUNDED_SCHEMAS)) % len(SUBJECTS)]
        out.append((f"Describe {subject} as JSON, in as much detail as you can.", schema))
    return out


def validates(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run_once(llm, pairs: list[tuple[str, dict]], max_tokens: int, temperature: float,
             steering: bool) -> dict:
    from engine_service.core.sampling_params import SamplingParams

    grammars = llm.engine.grammars
    grammars.budget_steering = steering
    walked = grammars.walk_seconds
    if not llm.engine.scheduler.block_pool.reset_prefix_cache():
        raise RuntimeError("the engine still holds blocks: cannot start the run with a cold prefix cache")
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens,
                             structured_outputs={"json": schema}) for i, (_, schema) in enumerate(pairs)]
    started, cpu_started = time.perf_counter(), time.process_time()
    outs = llm.chat([[{"role": "user", "content": p}] for p, _ in pairs], params)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    valid, reasons, tokens = 0, {}, 0
    for out, (_, schema) in zip(outs, pairs, strict=True):
        c = out.outputs[0]
        reasons[c.finish_reason] = reasons.get(c.finish_reason, 0) + 1
        tokens += len(c.token_ids)
        valid += c.finish_reason == "stop" and validates(c.text, schema)
    return {"steering": steering, "requests": len(pairs), "valid": valid, "finish_reasons": reasons,
            "output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "cpu_seconds": cpu_seconds, "tokens_per_cpu_s": tokens / cpu_seconds,
            "walk_seconds": grammars.walk_seconds - walked,
            "sample": outs[0].outputs[0].text}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model directory (default: the embedded model)")
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each mode, alternated")
    parser.add_argument("--dtype", default=None, help="as sluice engine's --dtype (default: auto)")
    parser.add_argument("--json", type=Path, default=Path("bench-results/structured.json"))


def run(args: argparse.Namespace) -> int:
    from engine_service.llm import LLM

    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024)
    pairs = unbounded_cases(args.num_requests)
    llm.chat([[{"role": "user", "content": "Hi"}]], None)  # warm-up: the first step's one-off costs
    runs = [run_once(llm, pairs, args.max_tokens, args.temperature, steering)
            for _ in range(max(1, args.repeats)) for steering in (False, True)]
    rows = []
    for steering in (False, True):
        mine = [r for r in runs if r["steering"] is steering]
        tokens, seconds = sum(r["output_tokens"] for r in mine), sum(r["seconds"] for r in mine)
        cpu, walk = sum(r["cpu_seconds"] for r in mine), sum(r["walk_seconds"] for r in mine)
        rows.append({**mine[0], "output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                     "cpu_seconds": cpu, "tokens_per_cpu_s": tokens / cpu, "walk_seconds": walk,
                     "valid_per_repeat": [r["valid"] for r in mine],
                     "tokens_per_s_per_repeat": [r["tokens_per_s"] for r in mine]})
    print(f"\nsluice bench structured: {len(pairs)} chat requests over {len(UNBOUNDED_SCHEMAS)} unbounded JSON "
          f"schemas, temperature {args.temperature}, max_tokens {args.max_tokens}, one engine, "
          f"{max(1, args.repeats)} run(s) of each mode, alternated")
    print(f"{'budget steering':<18}{'valid':>10}{'finish reasons':>34}{'tokens':>9}{'tokens/s':>10}"
          f"{'tokens/CPU-s':>14}")
    for r in rows:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["finish_reasons"].items()))
        print(f"{'on' if r['steering'] else 'off':<18}{r['valid']:>5}/{r['requests']:<4}{reasons:>34}"
              f"{r['output_tokens']:>9}{r['tokens_per_s']:>10.1f}{r['tokens_per_cpu_s']:>14.1f}")
    # CPU time (all of the process's threads) is what the steering adds; wall time on a shared
    # machine also carries the other processes' load, run to run
    cost = 1 - rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    cpu_cost = 1 - rows[1]["tokens_per_cpu_s"] / rows[0]["tokens_per_cpu_s"]
    print(f"with the steering: tokens/s {-100 * cost:+.1f}%, tokens per CPU-second {-100 * cpu_cost:+.1f}%; "
          f"walking completions took {rows[1]['walk_seconds']:.1f} s of its {rows[1]['seconds']:.1f} s "
          f"({100 * rows[1]['walk_seconds'] / rows[1]['seconds']:.1f}%)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "requests": len(pairs), "max_tokens": args.max_tokens, "temperature": args.temperature,
        "repeats": max(1, args.repeats), "all_runs": runs,
        "dtype": str(llm.engine.dtype), "machine": {"platform": platform.platform()}, "runs": rows,
        "steering_throughput_cost": cost, "steering_cpu_cost": cpu_cost}, indent=2))
    print(f"wrote {args.json}")
    return 0
