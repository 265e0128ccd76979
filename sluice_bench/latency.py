"""``sluice bench latency``: time to first token and time per output token of one batch (vLLM's
``bench latency``), side by side with transformers ``generate`` on the same prompts in the same run.

Each iteration submits ``--batch-size`` fresh random prompts of ``--input-len`` tokens (prefix
caching is off, so every prefill is real) with ``--output-len`` greedy tokens, EOS ignored, and
steps the engine until they finish, noting when each token arrives. TTFT is arrival to first
token; TPOT is (last token - first token) / (output tokens - 1), per request; decode tok/s is the
batch's tokens after the first over the decode time. transformers gets the same prompts (batch
size and dtype): its TTFT is a ``generate`` of one token, its TPOT the rest of a full ``generate``.
The engine's peak memory (peak RSS of this process before transformers runs; on CUDA also the
peak of allocated device memory) and the compile warm-up are reported.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine_service.config import add_engine_arguments
from sluice_bench.modes import BENCH_ENGINE_FLAGS, describe_engine


@dataclass
class LatencyRow:
    system: str
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    decode_tok_s: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        def stats(values: list[float]) -> dict:
            if not values:
                return {"mean": None, "p50": None, "p99": None}
            ordered = sorted(values)
            p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
            return {"mean": statistics.fmean(values), "p50": statistics.median(values), "p99": p99}

        return {"system": self.system, "ttft_ms": stats(self.ttft_ms), "tpot_ms": stats(self.tpot_ms),
                "decode_tok_s": stats(self.decode_tok_s)}


def make_prompts(vocab_size: int, batch_size: int, input_len: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(100, vocab_size) for _ in range(input_len)] for _ in range(batch_size)]


def run_sluice_iteration(engine, prompts: list[list[int]], output_len: int, row: LatencyRow | None) -> None:
    from engine_service.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    ids = [f"lat-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                count[out.request_id] = count.get(out.request_id, 0) + len(out.new_token_ids)
    if row is None:
        return
    for request_id in ids:
        row.ttft_ms.append((first[request_id] - start) * 1e3)
        if count[request_id] > 1:
            row.tpot_ms.append((last[request_id] - first[request_id]) / (count[request_id] - 1) * 1e3)
    decode_s = max(last.values()) - min(first.values())
    if decode_s > 0:
        row.decode_tok_s.append(sum(c - 1 for c in count.values()) / decode_s)


def run_transformers(model_dir: Path, prompts_per_iter: list[list[list[int]]], output_len: int, dtype,
                     device: str = "cpu") -> LatencyRow:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    row = LatencyRow("transformers generate")
    with torch.inference_mode():
        ids = torch.tensor(prompts_per_iter[0], device=device)
        model.generate(input_ids=ids, max_new_tokens=2, do_sample=False)  # warm-up
        for prompts in prompts_per_iter:
            ids = torch.tensor(prompts, device=device)
            started = time.perf_counter()
            model.generate(input_ids=ids, max_new_tokens=1, do_sample=False)
            sync()
            ttft = time.perf_counter() - started
            started = time.perf_counter()
            model.generate(input_ids=ids, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
            sync()
            total = time.perf_counter() - started
            decode = max(total - ttft, 1e-9)
            row.ttft_ms.extend([ttft * 1e3] * len(prompts))
            row.tpot_ms.extend([decode / max(output_len - 1, 1) * 1e3] * len(prompts))
            row.decode_tok_s.append(len(prompts) * (output_len - 1) / decode)
    return row


def peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model directory (default: the embedded model)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="generated tokens (EOS ignored)")
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--dtype", default=None, help="auto (default), float32, bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                        help="--enforce-eager: the eager reference (no torch.compile, no native decode step); "
                        "--no-enforce-eager: compile the decode step; default: the engine's (on CPU: eager with "
                        "the native decode step)")
    # the engine's own flags, as `sluice engine` has them (transformers runs unquantized, its own attention)
    add_engine_arguments(parser, title="the Sluice engine", only=BENCH_ENGINE_FLAGS)
    parser.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True,
                        help="also run transformers generate on the same prompts (default: yes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("bench-results/latency.json"))


def run(args: argparse.Namespace) -> int:
    import torch

    from engine_service.llm import LLM

    for name in ("batch_size", "input_len", "output_len", "num_iters"):
        if getattr(args, name) < 1:
            print(f"sluice bench latency: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    started = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, device=args.device, enforce_eager=args.enforce_eager,
              cuda_graphs=args.cuda_graphs, quantization=args.quantization, attention_backend=args.attention_backend,
              kv_cache_dtype=args.kv_cache_dtype, deterministic=args.deterministic, enable_prefix_caching=False, max_num_seqs=max(args.batch_size, 1),
              max_num_batched_tokens=max(2048, args.input_len))
    engine = llm.engine
    load_s = time.perf_counter() - started
    rng = random.Random(args.seed)
    prompts = [make_prompts(engine.vocab_size, args.batch_size, args.input_len, rng)
               for _ in range(args.num_iters)]
    for _ in range(args.num_iters_warmup):
        run_sluice_iteration(engine, make_prompts(engine.vocab_size, args.batch_size, args.input_len, rng),
                             args.output_len, None)
    mode = engine.decode_mode
    dtype_name = str(engine.dtype).removeprefix("torch.")
    sluice = LatencyRow(f"sluice ({describe_engine(engine)})")
    for batch in prompts:
        run_sluice_iteration(engine, batch, args.output_len, sluice)
    peak_mb = peak_rss_mb()
    cuda_peak_mb = (torch.cuda.max_memory_allocated() / (1 << 20)) if engine.device.type == "cuda" else None
    rows = [sluice]
    model_dir, dtype, warmup = engine.model_dir, engine.dtype, engine.compile_warmup_seconds
    graphed = engine.path_named("cuda graphs")
    cuda_graphs = graphed.graphed.report() if graphed is not None else None
    del llm, engine
    if args.hf:
        rows.append(run_transformers(model_dir, prompts, args.output_len, dtype, args.device))

    summaries = [r.summary() for r in rows]
    print(f"\nsluice bench latency: batch {args.batch_size}, prompt {args.input_len} tokens, "
          f"{args.output_len} output tokens, {args.num_iters} iterations, {dtype_name}, {mode}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'system':<28}{'TTFT mean':>10}{'p50':>8}{'p99':>8}{'TPOT mean':>11}{'p50':>8}{'p99':>8}"
          f"{'decode tok/s':>14}")
    for s in summaries:
        t, p, d = s["ttft_ms"], s["tpot_ms"], s["decode_tok_s"]
        fmt = lambda v: f"{v:.1f}" if v is not None else "-"  # noqa: E731
        print(f"{s['system']:<28}{fmt(t['mean']):>10}{fmt(t['p50']):>8}{fmt(t['p99']):>8}"
              f"{fmt(p['mean']):>11}{fmt(p['p50']):>8}{fmt(p['p99']):>8}{fmt(d['mean']):>14}")
    ratios = {}
    if len(summaries) > 1 and summaries[1]["decode_tok_s"]["mean"]:
        ratios = {"decode_speedup_vs_transformers": summaries[0]["decode_tok_s"]["mean"] / summaries[1]["decode_tok_s"]["mean"],
                  "ttft_ratio_vs_transformers": summaries[0]["ttft_ms"]["mean"] / summaries[1]["ttft_ms"]["mean"]}
        print(f"Sluice decodes {ratios['decode_speedup_vs_transformers']:.2f}x transformers' tokens/s; "
              f"its TTFT is {ratios['ttft_ratio_vs_transformers']:.2f}x transformers'")
    warmup_text = f"{warmup:.1f}s" if warmup is not None else "none"
    if cuda_graphs is not None:  # captured at start and in the warm-up iteration, before anything was timed
        warmup_text += f"; CUDA graphs: {cuda_graphs['captured']} captured in {cuda_graphs['capture_s']:.2f}s"
    print(f"engine: start {load_s:.1f}s, of which compile warm-up {warmup_text}; peak RSS {peak_mb:.0f} MB"
          + (f", CUDA peak allocated {cuda_peak_mb:.0f} MB" if cuda_peak_mb else ""))
    result = {
        "config": {"batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
                   "num_iters": args.num_iters, "dtype": dtype_name, "mode": mode, "device": args.device},
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads()},
        "engine_load_s": load_s,
        "compile_warmup_s": warmup,
        "cuda_graphs": cuda_graphs,
        "peak_rss_mb": peak_mb,
        "cuda_peak_allocated_mb": cuda_peak_mb,
        "rows": summaries,
        "raw": [asdict(r) for r in rows],
        **ratios,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0
