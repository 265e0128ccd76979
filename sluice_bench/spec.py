"""``sluice bench spec``: one stream's tokens/s with and without n-gram speculative decoding, side
by side in one run, on two workloads:

- **grounded**: edit or extract from a passage or code file given in the prompt (rename an
  identifier in a function, copy a paragraph, list a file's functions), rendered with the model's
  chat template, greedy, one request at a time: the outputs repeat the input, so drafts are kept;
- **random** (W1's shape, smaller): random-token prompts of ``--random-prompt-len`` tokens with
  ``--random-output-len`` greedy tokens, EOS ignored, all submitted at once: drafts are rarely
  right, and speculation must not cost anything: the back-off pauses a request's drafts where its
  verifying rows cost enough to matter (``speculative_config.backoff``, printed with the table).

One engine is loaded, with ``speculative_config``; each request runs with speculation and
without it in turn (alternating which goes first; "without" is the same engine with its
scheduler's ``speculative_config`` set aside for that run), so drift in the machine's speed hits
both and nothing but speculation differs: the same weights at the same addresses, the same
compiled graphs. Two engines would not do for the comparison of outputs: float32 GEMMs round
differently with their operands' addresses, and int4's activation rounding turns that into
different tokens at near-ties (two int4 engines of one configuration disagree on some greedy
outputs without any speculation). Greedy outputs are compared token by token. Rates are given
twice: over the whole run (prefill included, which speculation does not touch) and over decoding
alone (first token to last: the one-stream rate ``sluice bench latency`` and ``anchor`` report).
Prints a table and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from sluice.cpuinfo import cpu_model
from sluice_bench.modes import MODES

CODE = '''import json
from dataclasses import dataclass


@dataclass
class Order:
    order_id: str
    items: list[dict]
    discount: float = 0.0

    def subtotal(self) -> float:
        total = 0.0
        for item in self.items:
            total += item["price"] * item["quantity"]
        return total

    def total(self) -> float:
        subtotal = self.subtotal()
        return subtotal - subtotal * self.discount


def load_orders(path: str) -> list[Order]:
    with open(path) as f:
        records = json.load(f)
    return [Order(r["order_id"], r["items"], r.get("discount", 0.0)) for r in records]


def revenue(orders: list[Order]) -> float:
    return sum(order.total() for order in orders)
'''

PASSAGE = """The lighthouse stood at the end of a narrow spit of rock, a mile from the village. Every
evening at dusk the keeper climbed the one hundred and twelve steps to the lamp room, trimmed the
wick, polished the great lens and lit the lamp. Ships passing in the night saw its beam sweep across
the water once every ten seconds, and they knew where the rocks were. In winter storms the waves
broke over the gallery, and the keeper stayed awake until dawn, watching the light turn."""

GROUNDED_TASKS = [
    f"Rewrite this Python code with the class Order renamed to Invoice. Output only the code.\n\n{CODE}",
    f"Rewrite this Python code with the variable subtotal renamed to base_amount everywhere. Output only "
    f"the code.\n\n{CODE}",
    f"Copy the following passage exactly, word for word.\n\n{PASSAGE}",
    f"Repeat the function load_orders from this file, unchanged.\n\n{CODE}",
]

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def grounded_prompts(tokenizer) -> list[str]:
    """GROUNDED_TASKS as user turns rendered with the model's chat template."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": task}], add_generation_prompt=True)
            for task in GROUNDED_TASKS]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model directory (default: the embedded model)")
    parser.add_argument("--speculative-config", default=json.dumps(DEFAULT_SPEC), metavar="JSON",
                        help="the speculating engine's speculative_config (default: %(default)s)")
    # not the "-steps" modes: several decode steps a call and speculation exclude each other
    parser.add_argument("--mode", default="float32", choices=[m for m in MODES if "num_scheduler_steps" not in MODES[m]],
                        help="the engine's mode, as `sluice bench anchor` names them (dtype, quantization, "
                             "compiled or eager; default: %(default)s)")
    parser.add_argument("--output-len", type=int, default=128, help="grounded workload: max tokens per request")
    parser.add_argument("--num-grounded", type=int, default=len(GROUNDED_TASKS),
                        help=f"grounded requests (cycling through {len(GROUNDED_TASKS)} tasks)")
    parser.add_argument("--num-random", type=int, default=8, help="random workload: requests (0: skip)")
    parser.add_argument("--random-prompt-len", type=int, default=128)
    parser.add_argument("--random-output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1,
                        help="times each workload runs (each time with and without speculation, the order "
                             "alternating): more rounds average out this VM's drift")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("bench-results/spec.json"))


def _engine(args: argparse.Namespace):
    from engine_service import LLM

    return LLM(args.model, speculative_config=args.speculative_config, **MODES[args.mode],
               kv_cache_memory=256 << 20)


def _timed(llm, prompts, params, speculate: bool) -> tuple[float, float, list[list[int]]]:
    """Seconds end to end, decode seconds (first token to last, the batch's span) and the outputs."""
    scheduler = llm.engine.scheduler
    config = scheduler.speculative_config
    if not speculate:  # requests added now get no drafter: they decode plainly
        scheduler.speculative_config = None
    try:
        scheduler.block_pool.reset_prefix_cache()  # every run prefills its prompts
        started = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - started
        firsts = [o.metrics.first_token_time for o in outs if o.metrics and o.metrics.first_token_time]
        lasts = [o.metrics.finished_time for o in outs if o.metrics and o.metrics.finished_time]
        decode = max(lasts) - min(firsts) if firsts and lasts else 0.0
        return seconds, decode, [o.outputs[0].token_ids for o in outs]
    finally:
        scheduler.speculative_config = config


def _side_by_side(llm, batches, params) -> dict:
    """Each batch with and without speculation in turn (alternating the order); seconds, tokens,
    identity."""
    seconds = {"plain": 0.0, "spec": 0.0}
    decode_seconds = {"plain": 0.0, "spec": 0.0}
    tokens = {"plain": 0, "spec": 0}
    decode_tokens = {"plain": 0, "spec": 0}  # after each request's first
    identical = 0
    total = 0
    stats = llm.engine.scheduler.spec_stats
    before = stats.as_dict()
    for i, prompts in enumerate(batches):
        order = ["plain", "spec"]
        if i % 2:
            order.reverse()
        outs = {}
        for name in order:
            s, d, out = _timed(llm, prompts, params, speculate=name == "spec")
            seconds[name] += s
            decode_seconds[name] += d
            tokens[name] += sum(len(t) for t in out)
            decode_tokens[name] += sum(max(len(t) - 1, 0) for t in out)
            outs[name] = out
        identical += sum(a == b for a, b in zip(outs["plain"], outs["spec"], strict=True))
        total += len(prompts)
    after = stats.as_dict()
    drafts = after["num_drafts"] - before["num_drafts"]
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    rate = {k: tokens[k] / seconds[k] if seconds[k] else 0.0 for k in seconds}
    decode_rate = {k: decode_tokens[k] / decode_seconds[k] if decode_seconds[k] else 0.0 for k in seconds}
    return {
        "requests": total, "identical_outputs": identical,
        **{name: {"seconds": seconds[name], "tokens": tokens[name], "tokens_per_s": rate[name],
                  "decode_seconds": decode_seconds[name], "decode_tokens": decode_tokens[name],
                  "decode_tokens_per_s": decode_rate[name]} for name in ("plain", "spec")},
        "speedup": rate["spec"] / rate["plain"] if rate["plain"] else 0.0,
        "decode_speedup": decode_rate["spec"] / decode_rate["plain"] if decode_rate["plain"] else 0.0,
        "num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
    }


def run(args: argparse.Namespace) -> int:
    import random

    from engine_service.config import SpeculativeConfig
    from engine_service.core.sampling_params import SamplingParams

    try:
        SpeculativeConfig.parse(args.speculative_config)
    except ValueError as exc:
        print(f"sluice bench spec: {exc}")
        return 2
    if args.rounds < 1:
        print(f"sluice bench spec: --rounds must be at least 1 (got {args.rounds})")
        return 2
    llm = _engine(args)
    rendered = grounded_prompts(llm.get_tokenizer())
    grounded = [rendered[i % len(rendered)] for i in range(args.num_grounded)]
    # warm-up: the first forward of each engine pays one-time costs (kernels, allocations)
    for speculate in (False, True):
        _timed(llm, [rendered[0]], SamplingParams(temperature=0.0, max_tokens=4), speculate)
    results = {}
    if grounded:  # --num-grounded 0: the random workload only
        greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len)
        results["grounded, 1 stream"] = _side_by_side(llm, [[p] for p in grounded] * args.rounds, greedy)
    if args.num_random > 0:
        rng = random.Random(args.seed)
        vocab = llm.engine.vocab_size
        prompts = [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.random_prompt_len)]}
                   for _ in range(args.num_random)]
        params = SamplingParams(temperature=0.0, max_tokens=args.random_output_len, ignore_eos=True)
        results[f"random, {args.num_random} at once"] = _side_by_side(llm, [prompts, prompts] * args.rounds, params)

    header = (f"{'workload':<22} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} {'decode plain':>12} "
              f"{'decode spec':>11} {'ratio':>6} {'accept':>7} {'tok/verify':>10} {'identical':>9}")
    spec = llm.engine.speculative_config
    capabilities = llm.engine.scheduler.config.decode
    print(f"sluice bench spec: {args.mode}, back-off {spec.backoff} (the {capabilities.path} path takes up to "
          f"{capabilities.one_pass_rows} rows at one row's cost)")
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        print(f"{name:<22} {r['plain']['tokens_per_s']:>11.1f} {r['spec']['tokens_per_s']:>10.1f} "
              f"{r['speedup']:>5.2f}x {r['plain']['decode_tokens_per_s']:>12.1f} "
              f"{r['spec']['decode_tokens_per_s']:>11.1f} {r['decode_speedup']:>5.2f}x "
              f"{r['acceptance_rate']:>7.0%} {r['mean_acceptance_length']:>10.2f} "
              f"{r['identical_outputs']:>4}/{r['requests']:<4}")
    print("tok/s: tokens over the whole run, prefill included; decode: tokens after each request's first "
          "over the time from its first token to its last (the one-stream figure of `sluice bench latency` "
          "and `anchor`)")
    report = {
        "bench": "spec", "speculative_config": llm.engine.speculative_config.as_dict(),
        "one_pass_rows": llm.engine.scheduler.config.decode.one_pass_rows,
        "mode": args.mode, "dtype": str(llm.engine.dtype), "attention_backend": llm.engine.attention_backend,
        "output_len": args.output_len, "random_prompt_len": args.random_prompt_len,
        "random_output_len": args.random_output_len, "rounds": args.rounds, "machine": platform.machine(),
        "processor": cpu_model(), "results": results,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice bench spec", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
