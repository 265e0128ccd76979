"""``sluice bench offline``: output tokens/s of the offline engine against transformers ``generate``.

One seeded workload (default 64 requests, prompts 16-512 tokens, outputs 16-256 tokens, EOS
ignored) runs through Sluice's continuous batching and through transformers' static batching at
batch sizes 1 and 8, on the same requests, in the same process, one after the other. Static
batches generate until their longest member is done; only each request's own tokens count.
It prints a table, writes JSON (``--json``) and a bar chart of the systems compared (``--plot``).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from engine_service.config import add_engine_arguments
from sluice_bench import plots
from sluice_bench.flops import ModelShape, gemm_peak_gflops
from sluice_bench.modes import BENCH_ENGINE_FLAGS, describe_engine


@dataclass
class WorkItem:
    prompt_token_ids: list[int]
    output_len: int


@dataclass
class BenchRow:
    system: str
    requests: int
    output_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


def make_workload(vocab_size: int, num_requests: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int], seed: int) -> list[WorkItem]:
    """Random token prompts (ids above the special tokens) and target lengths, from one seed."""
    rng = random.Random(seed)
    items = []
    for _ in range(num_requests):
        plen = rng.randint(*prompt_range)
        items.append(WorkItem([rng.randrange(100, vocab_size) for _ in range(plen)], rng.randint(*output_range)))
    return items


def run_sluice(llm, work: list[WorkItem], structured_share: float = 0.0) -> BenchRow:
    """``structured_share`` of the requests (spread evenly) decode under a JSON schema of one
    unbounded string. The greedy model rarely closes it on these random prompts, and where it does
    not the token budget closes it on the request's last tokens (``engine_service.sampling.grammar``),
    so both runs generate nearly the same tokens (each row counts its own) and the cost measured
    is the grammar's, budget steering included. (A schema that cannot end before the output length,
    as this bench used, is now refused at the door: it cannot be completed within max_tokens.)"""
    from engine_service.core.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=w.output_len, ignore_eos=True) for w in work]
    constrained = 0
    if structured_share > 0:
        every = max(1, round(1 / structured_share))
        for i in range(0, len(work), every):
            schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
            params[i] = params[i].replace(structured_outputs={"json": schema})
            constrained += 1
    # Every run starts with a cold prefix cache: otherwise a second run over the same prompts (the
    # structured-share row) skips their prefill and looks faster than the first.
    if not llm.engine.scheduler.block_pool.reset_prefix_cache():
        raise RuntimeError("the engine still holds blocks: cannot start the run with a cold prefix cache")
    started = time.perf_counter()
    outs = llm.generate([w.prompt_token_ids for w in work], params)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    name = "sluice (continuous batching)"
    if constrained:
        name = f"sluice, {constrained}/{len(work)} under a JSON schema"
    return BenchRow(name, len(work), tokens, seconds)


def run_transformers(model_dir: Path, work: list[WorkItem], batch_size: int, dtype, device: str = "cpu") -> BenchRow:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # EOS ignored, as in the Sluice run
    model.generation_config.pad_token_id = 0
    tokens = 0
    started = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(work), batch_size):
            batch = work[i : i + batch_size]
            width = max(len(w.prompt_token_ids) for w in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, w in enumerate(batch):  # left padding
                ids[row, width - len(w.prompt_token_ids) :] = torch.tensor(w.prompt_token_ids)
                mask[row, width - len(w.prompt_token_ids) :] = 1
            longest = max(w.output_len for w in batch)
            model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False)
            tokens += sum(w.output_len for w in batch)
    seconds = time.perf_counter() - started
    return BenchRow(f"transformers generate, batch {batch_size}", len(work), tokens, seconds)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model directory (default: the embedded model)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", default="16-512", help="range of prompt lengths, tokens")
    parser.add_argument("--output-len", default="16-256", help="range of output lengths, tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 | auto")
    parser.add_argument("--enforce-eager", dest="enforce_eager", action=argparse.BooleanOptionalAction,
                        default=None, help="--enforce-eager: the eager reference, no torch.compile and no native "
                        "decode step (vLLM's name); --no-enforce-eager: compile the decode step (default: the "
                        "engine's, $SLUICE_ENFORCE_EAGER, else on CPU eager with the native decode step)")
    parser.add_argument("--compile", dest="enforce_eager", action="store_false",
                        help="the same as --no-enforce-eager")
    # the engine's own flags, as `sluice engine` has them (transformers runs unquantized, its own attention)
    add_engine_arguments(parser, title="the Sluice engine", only=BENCH_ENGINE_FLAGS)
    parser.add_argument("--cycled-concurrency", type=int, default=0, metavar="N",
                        help="also run the workload's requests cycled to N at once (e.g. 128): throughput "
                             "should not fall with concurrency")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--hf-batch-sizes", default="1,8",
                        help="transformers static batch sizes to compare; empty to skip")
    parser.add_argument("--hf-num-requests", type=int, default=None,
                        help="run transformers on only the first N requests (default: all)")
    parser.add_argument("--structured-share", type=float, default=0.0,
                        help="also run the workload with this share of requests under a JSON schema "
                             "(e.g. 0.25) and report the throughput cost side by side")
    parser.add_argument("--sampler-batch", type=int, default=256, help="batch size for the sampler cost probe")
    parser.add_argument("--json", type=Path, default=Path("bench-results/offline.json"))
    plots.add_plot_arguments(parser, "a bar chart of the systems compared", "next to --json, .png")


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def run(args: argparse.Namespace) -> int:
    import torch

    from engine_service.llm import LLM
    from engine_service.model.loader import parse_dtype

    chart = plots.plot_target(args, args.json, "bench-results/offline.png", "sluice bench offline")
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, quantization=args.quantization, attention_backend=args.attention_backend,
              enforce_eager=args.enforce_eager, cuda_graphs=args.cuda_graphs, kv_cache_dtype=args.kv_cache_dtype,
              deterministic=args.deterministic)
    engine = llm.engine
    mode = describe_engine(engine)
    work = make_workload(engine.vocab_size, args.num_requests, _range(args.prompt_len),
                         _range(args.output_len), args.seed)
    llm.generate([work[0].prompt_token_ids[:16]], None)  # warm-up
    rows = [run_sluice(llm, work)]
    stats = engine.get_stats()
    if args.structured_share > 0:
        rows.append(run_sluice(llm, work, args.structured_share))
    cycled_row = None
    if args.cycled_concurrency > 0:
        cycled = [work[i % len(work)] for i in range(args.cycled_concurrency)]
        cycled_row = run_sluice(llm, cycled)
        cycled_row.system = f"sluice, {args.cycled_concurrency} at once"
        rows.append(cycled_row)
    # Peak resident memory of this process while only the Sluice engine had run (the
    # transformers runs below come later in the same process).
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    peak_cuda_mb = (torch.cuda.max_memory_allocated(engine.device) / 2**20
                    if engine.device.type == "cuda" else None)
    compile_warmup_s = getattr(engine, "compile_warmup_seconds", None)
    graphed = engine.path_named("cuda graphs")
    cuda_graphs = graphed.graphed.report() if graphed is not None else None
    shape = ModelShape.from_config(engine.runner.model.config)
    del llm
    hf_work = work[: args.hf_num_requests] if args.hf_num_requests else work
    for size in [int(s) for s in args.hf_batch_sizes.split(",") if s.strip()]:
        rows.append(run_transformers(engine.model_dir, hf_work, size, parse_dtype(args.dtype), args.device))

    from sluice_bench.sampler import benchmark_sampler

    # on the engine's device: the figure is what the engine's own steps pay
    sampler_ms = benchmark_sampler(batch_size=args.sampler_batch, vocab_size=engine.vocab_size,
                                   device=engine.device)

    # FLOP utilisation: the workload's useful FLOPs at Sluice's pace against a GEMM in the same run
    workload_flops = sum(shape.request_flops(len(w.prompt_token_ids), w.output_len) for w in work)
    sluice_gflops = workload_flops / rows[0].seconds / 1e9
    gemm_dtype = torch.bfloat16 if engine.quantization else engine.dtype  # quantized: the dense prefill's
    peak_gflops = gemm_peak_gflops(gemm_dtype) if engine.device.type == "cpu" else None

    base = rows[0].tokens_per_s
    print(f"\nsluice bench offline: {args.num_requests} requests, prompts {args.prompt_len}, "
          f"outputs {args.output_len} tokens, EOS ignored, {mode}, torch threads {torch.get_num_threads()}")
    print(f"{'system':<36}{'requests':>9}{'out tokens':>12}{'seconds':>10}{'tok/s':>10}{'sluice x':>10}")
    for row in rows:
        ratio = base / row.tokens_per_s if row.tokens_per_s else float("nan")
        print(f"{row.system:<36}{row.requests:>9}{row.output_tokens:>12}{row.seconds:>10.1f}"
              f"{row.tokens_per_s:>10.1f}{ratio:>10.2f}")
    print(f"preemptions {stats.preemptions}, iterations {stats.iterations}")
    print(f"peak memory of the engine process (RSS, before the transformers runs): {peak_rss_mb:,.0f} MiB"
          + (f"; CUDA peak allocated {peak_cuda_mb:,.0f} MiB" if peak_cuda_mb is not None else ""))
    if compile_warmup_s is not None:
        print(f"compile warm-up at engine start: {compile_warmup_s:.1f} s")
    if cuda_graphs is not None:
        print(f"CUDA graphs: {cuda_graphs['captured']} captured in {cuda_graphs['capture_s']:.2f} s "
              "(each bucket at its first step: some inside the timed run)")
    if cycled_row is not None:
        print(f"cycled to {args.cycled_concurrency} at once: {cycled_row.tokens_per_s:.1f} tok/s against "
              f"{rows[0].tokens_per_s:.1f} for the {args.num_requests} requests "
              f"({cycled_row.tokens_per_s / rows[0].tokens_per_s:.2f}x)")
    structured_cost = None
    if args.structured_share > 0:
        structured_cost = 1 - rows[1].tokens_per_s / rows[0].tokens_per_s
        print(f"structured outputs: {rows[1].system}: {100 * structured_cost:.1f}% below the unconstrained run")
    if peak_gflops is not None:
        print(f"FLOP utilisation: the workload's {workload_flops / 1e12:.2f} TFLOP at Sluice's pace are "
              f"{sluice_gflops:.1f} GFLOP/s; a {str(gemm_dtype).removeprefix('torch.')} GEMM (2048^3, "
              f"torch.mm) reaches {peak_gflops:.1f} GFLOP/s here: {sluice_gflops / peak_gflops:.1%}")
    print(f"sampler cost per step at batch {args.sampler_batch} on {engine.device}: {sampler_ms:.2f} ms")
    result = {
        "workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len,
                     "output_len": args.output_len, "seed": args.seed, "dtype": args.dtype,
                     "quantization": args.quantization, "cycled_concurrency": args.cycled_concurrency,
                     "attention_backend": engine.attention_backend},
        "sluice_mode": mode,
        "peak_rss_mb": peak_rss_mb,
        "peak_cuda_allocated_mb": peak_cuda_mb,
        "compile_warmup_s": compile_warmup_s,
        "cuda_graphs": cuda_graphs,
        "machine": {"platform": platform.platform(), "torch_threads": torch.get_num_threads()},
        "rows": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in rows],
        "sluice_preemptions": stats.preemptions,
        "sluice_iterations": stats.iterations,
        "sampler_ms_per_step": sampler_ms,
        "sampler_batch": args.sampler_batch,
        "structured_share": args.structured_share,
        "structured_throughput_cost": structured_cost,
        "workload_flops": workload_flops,
        "sluice_gflops": sluice_gflops,
        "gemm_dtype": str(gemm_dtype).removeprefix("torch."),
        "gemm_peak_gflops": peak_gflops,
        "flop_utilisation": sluice_gflops / peak_gflops if peak_gflops else None,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    if chart is not None:
        print(f"wrote {plots.plot_offline(result, chart)}")
    return 0
