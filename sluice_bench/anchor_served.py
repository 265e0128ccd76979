"""``sluice bench anchor --served``: Sluice served (gateway, Redis, engine) against llama.cpp's own
``llama-server``, on the same GGUF file, with the same client and the same requests.

Both servers start once and stay up; for each concurrency (``--concurrency 16,64``) and round, the
two take turns on a fresh set of seeded random token-id prompts (the same set for both in a round):
``sluice bench serve``'s client (``sluice_bench.serve.benchmark``: streamed ``/v1/completions``, EOS
ignored, every request's output tokens from its usage, a fresh connection each: llama-server closes
a kept-alive one after a few requests, and a request written to it fails) sends ``--served-prompts-per-stream`` x the
concurrency requests, at most the concurrency in flight. The idle server holds its memory and takes
no CPU to speak of. Sluice serves the GGUF file as it is (``--model FILE.gguf``), llama-server with
one slot per concurrent request (``sluice_bench.llama_server.command``). Reports output tokens/s,
TTFT and TPOT medians and failed requests per system, and Sluice's ratio to llama-server per round.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

from sluice_bench import llama_server
from sluice_bench.stack import HOST, Stack, free_port, http_get


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--served", action="store_true",
                        help="served throughput against llama-server instead of one stream (sluice_bench.anchor_served)")
    parser.add_argument("--concurrency", default="16,64", help="served: concurrent streams, comma-separated")
    parser.add_argument("--served-prompts-per-stream", type=int, default=4,
                        help="served: requests per round, as a multiple of the concurrency")
    parser.add_argument("--served-input-len", type=int, default=128)
    parser.add_argument("--served-output-len", type=int, default=64)
    parser.add_argument("--served-rounds", type=int, default=2, help="served: turns of each system per concurrency")
    parser.add_argument("--llama-server", type=Path, default=None,
                        help=f"served: the llama-server binary (default: ${llama_server.BINARY_ENV}, else the one "
                             "--build-llama-server put in the cache)")
    parser.add_argument("--build-llama-server", action="store_true",
                        help="served: build llama-server from the llama-cpp-python sdist first (cmake, ~10 minutes)")
    parser.add_argument("--engine-args", default="",
                        help="served: extra `sluice engine` flags, space-separated, given with an equals sign "
                             "(--engine-args='--no-deterministic')")


def _client_args(base_url: str, concurrency: int, seed: int) -> argparse.Namespace:
    from sluice_bench import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args([])
    args.base_url, args.max_concurrency, args.seed, args.disable_tqdm = base_url, concurrency, seed, True
    args.fresh_connections = True  # llama-server closes a kept-alive connection after 5 requests or 5 s idle
    return args


def _round(base_url: str, concurrency: int, seed: int, args: argparse.Namespace, vocab: int) -> dict:
    from sluice_bench import serve

    requests = serve.synthetic_dataset(concurrency * args.served_prompts_per_stream, args.served_input_len,
                                       args.served_output_len, 0.0, (100, vocab), seed)
    warmups = serve.synthetic_dataset(min(concurrency, 8), 16, 4, 0.0, (100, vocab), f"warm-{seed}")
    summary, _ = asyncio.run(serve.benchmark(_client_args(base_url, concurrency, seed), requests, warmups))
    return {key: summary[key] for key in ("completed", "failed", "output_throughput", "duration_s", "errors")} | {
        "ttft_median_ms": summary["ttft_ms"]["median"], "tpot_median_ms": summary["tpot_ms"]["median"]}


def _vocab_size(gguf: Path) -> int:
    """The file's vocabulary (its metadata directory's config): the prompts' token ids stay below it."""
    import json

    from engine_service.model.gguf_model import metadata_dir

    return int(json.loads((metadata_dir(gguf) / "config.json").read_text())["vocab_size"])


def run(args: argparse.Namespace, gguf: Path) -> dict:
    """Both servers up, their turns, a printed table; returns the result for the JSON."""
    import torch

    binary = llama_server.find(args.llama_server)
    if binary is None and args.build_llama_server:
        binary = llama_server.build()
    if binary is None:
        raise SystemExit("sluice bench anchor --served: no llama-server; pass --build-llama-server (builds it "
                         f"with cmake, ~10 minutes, once) or --llama-server PATH / ${llama_server.BINARY_ENV}")
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not levels or min(levels) < 1:
        raise SystemExit(f"--concurrency: positive integers, got {args.concurrency!r}")
    threads = args.threads or torch.get_num_threads()
    ctx = args.served_input_len + args.served_output_len + 16
    with Stack(label="anchor --served") as stack:
        redis = stack.redis()
        engine_args = ["--model", str(gguf), "--max-num-seqs", str(max(levels)), *args.engine_args.split()]
        stack.engine(redis, engine_args)
        gateway = stack.gateway(redis)
        stack.wait_ready(gateway, timeout=600)
        port = free_port()
        stack.command("llama-server", llama_server.command(binary, gguf, port, slots=max(levels), ctx_per_slot=ctx,
                                                           threads=threads), port)
        llama_url = f"http://{HOST}:{port}"
        stack.wait_for(lambda: http_get(f"{llama_url}/health") is not None, 300, "llama-server's /health")
        systems = {"sluice": gateway.url, "llama-server": llama_url}
        vocab = _vocab_size(gguf)
        runs: dict[int, dict[str, list[dict]]] = {c: {name: [] for name in systems} for c in levels}
        for c in levels:
            for r in range(args.served_rounds):
                for name, url in systems.items():
                    started = time.perf_counter()
                    runs[c][name].append(_round(url, c, args.seed * 1000 + c * 10 + r, args, vocab))
                    print(f"  {c} streams, round {r + 1}, {name}: "
                          f"{runs[c][name][-1]['output_throughput']:.1f} output tok/s "
                          f"({time.perf_counter() - started:.0f} s)", flush=True)
    print(f"\nsluice bench anchor --served: {gguf.name}, {args.served_input_len}-token random prompts, "
          f"{args.served_output_len} output tokens (EOS ignored), {args.served_prompts_per_stream} requests a stream "
          f"a round, {args.served_rounds} rounds, the two servers taking turns; {threads} threads each")
    print(f"{'streams':>8}  {'system':<14}{'output tok/s':>14}{'range':>17}{'TTFT p50 ms':>13}{'TPOT p50 ms':>13}"
          f"{'failed':>8}{'x llama-server':>16}")
    table = []
    for c in levels:
        base = [x["output_throughput"] for x in runs[c]["llama-server"]]
        for name in systems:
            rows = runs[c][name]
            tok_s = [x["output_throughput"] for x in rows]
            ratios = [a / b for a, b in zip(tok_s, base, strict=True) if b]
            failed = sum(x["failed"] for x in rows)
            ratio_text = f"{min(ratios):.2f}-{max(ratios):.2f}" if name == "sluice" and ratios else ""
            print(f"{c:>8}  {name:<14}{statistics.median(tok_s):>14.1f}{f'{min(tok_s):.1f}-{max(tok_s):.1f}':>17}"
                  f"{statistics.median(x['ttft_median_ms'] for x in rows):>13.1f}"
                  f"{statistics.median(x['tpot_median_ms'] for x in rows):>13.2f}{failed:>8}{ratio_text:>16}")
            table.append({"streams": c, "system": name, "rounds": rows, "output_tok_s_median": statistics.median(tok_s),
                          "ratio_to_llama_server_per_round": ratios if name == "sluice" else None})
    return {"served": table, "llama_server": str(binary), "threads": threads}
