"""The ``sluice`` console script.

Each sub-command lives in its own module, imported only when chosen, so that the gateway image
(which has no torch) can run ``sluice gateway`` and ``--help`` is instant. A command module provides
``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (command words) -> (module, one-line help)
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("serve",): ("sluice_cli.serve", "run Redis, an engine and the gateway on this machine in one command"),
    ("engine",): ("engine_service.service.main", "run an engine process fed from Redis"),
    ("gateway",): ("gateway.main", "run the OpenAI-compatible HTTP gateway"),
    ("model", "prepare"): ("engine_service.model.prepare", "convert the embedded default model to a HF directory"),
    ("bench", "offline"): ("engine_service.bench.offline", "offline throughput benchmark against transformers"),
    ("bench", "latency"): ("engine_service.bench.latency", "TTFT and TPOT of one batch against transformers"),
    ("bench", "anchor"): ("engine_service.bench.anchor",
                          "one decode stream of Sluice's modes side by side with llama.cpp (needs llama-cpp-python)"),
    ("bench", "structured"): ("engine_service.bench.structured",
                              "constrained outputs that validate, with and without the token-budget steering"),
    ("bench", "quality"): ("engine_service.bench.quality", "quantized modes against float32: greedy agreement, perplexity"),
    ("bench", "spec"): ("engine_service.bench.spec", "one stream with and without n-gram speculative decoding"),
    ("bench", "scheduler"): ("engine_service.bench.scheduler", "model-free scheduler benchmark (batchbench)"),
    ("bench", "serve"): ("sluice_cli.bench_serve", "serving benchmark against a running gateway"),
    ("bench", "serving-path"): ("sluice_cli.bench_serving_path",
                                "the serving path's own CPU per token: real engine + gateway around a stub model"),
    ("bench", "plot"): ("sluice.plots", "charts of saved bench results (JSON), as the benches draw them"),
    ("bench", "prefix-affinity"): ("engine_service.bench.prefix_affinity",
                                   "one request queue against a queue sharded by prompt prefix (3 engines)"),
    ("bench", "fairness"): ("sluice_cli.bench_fairness",
                            "a flood tenant against a light one on real engines: the light tenant's TTFT, FIFO vs fair"),
    ("bench", "gateway-memory"): ("sluice_cli.bench_gateway_memory",
                                  "gateway memory across requests naming random unknown models"),
}


def _usage() -> str:
    lines = ["usage: sluice COMMAND [options]", "", "commands:"]
    for words, (_, help_text) in COMMANDS.items():
        lines.append(f"  {' '.join(words):<16} {help_text}")
    lines.append("")
    lines.append("Run `sluice COMMAND --help` for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for words, (module_name, help_text) in sorted(COMMANDS.items(), key=lambda kv: -len(kv[0])):
        if tuple(argv[: len(words)]) == words:
            module = importlib.import_module(module_name)
            parser = argparse.ArgumentParser(prog="sluice " + " ".join(words), description=help_text)
            module.add_arguments(parser)
            args = parser.parse_args(argv[len(words) :])
            return int(module.run(args) or 0)
    if argv and argv[0] not in ("-h", "--help", "help"):
        print(f"sluice: unknown command {' '.join(argv[:2])!r}\n", file=sys.stderr)
        print(_usage(), file=sys.stderr)
        return 2
    print(_usage())
    return 0


if __name__ == "__main__":
    sys.exit(main())
