"""The ``sluice`` console script.

Each sub-command lives in its own module, imported only when chosen, so that the gateway image
(which has no torch) can run ``sluice gateway`` and ``--help`` is instant. A command module provides
``add_arguments(parser)`` and ``run(args) -> int``; a command whose flags are knobs
(``sluice.config``) gets them resolved (flag > environment > ``--config`` file > default) before
``run``, and bad configuration input stops it here with exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from sluice.config import ConfigError, resolve_args

# (command words) -> (module, one-line help)
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("serve",): ("sluice_cli.serve", "run Redis, an engine and the gateway on this machine in one command"),
    ("engine",): ("engine_service.service.main", "run an engine process fed from Redis"),
    ("gateway",): ("gateway.main", "run the OpenAI-compatible HTTP gateway"),
    ("keys",): ("sluice_cli.keys", "create, list and revoke the API keys gateways read from Redis (--redis-keys)"),
    ("usage",): ("sluice_cli.usage", "each tenant's requests and tokens per model over a period, from Redis"),
    ("config",): ("sluice_cli.config_command",
                  "print a command's effective configuration (--print) or the configuration reference (--markdown)"),
    ("model", "prepare"): ("engine_service.model.prepare", "convert the embedded default model to a HF directory"),
    ("bench", "offline"): ("sluice_bench.offline", "offline throughput benchmark against transformers"),
    ("bench", "latency"): ("sluice_bench.latency", "TTFT and TPOT of one batch against transformers"),
    ("bench", "anchor"): ("sluice_bench.anchor",
                          "one decode stream of Sluice's modes side by side with llama.cpp (needs llama-cpp-python)"),
    ("bench", "structured"): ("sluice_bench.structured",
                              "constrained outputs that validate, with and without the token-budget steering"),
    ("bench", "quality"): ("sluice_bench.quality", "quantized modes against float32: greedy agreement, perplexity"),
    ("bench", "spec"): ("sluice_bench.spec", "one stream with and without n-gram speculative decoding"),
    ("bench", "scheduler"): ("sluice_bench.scheduler", "model-free scheduler benchmark (batchbench)"),
    ("bench", "serve"): ("sluice_bench.serve", "serving benchmark against a running gateway"),
    ("bench", "serving-path"): ("sluice_bench.serving_path",
                                "the serving path's own CPU per token: real engine + gateway around a stub model"),
    ("bench", "plot"): ("sluice_bench.plots", "charts of saved bench results (JSON), as the benches draw them"),
    ("bench", "prefix-affinity"): ("sluice_bench.prefix_affinity",
                                   "one request queue against a queue sharded by prompt prefix (3 engines)"),
    ("bench", "fairness"): ("sluice_bench.fairness",
                            "a flood tenant against a light one on real engines: the light tenant's TTFT, FIFO vs fair"),
    ("bench", "gateway-memory"): ("sluice_bench.gateway_memory",
                                  "gateway memory across requests naming random unknown models"),
    ("bench", "redis-capacity"): ("sluice_bench.redis_capacity",
                                  "requests/s and Redis cost per request, one Redis against a Redis Cluster (no model)"),
    ("bench", "event-log"): ("sluice_bench.event_log", "what logging every request's events costs Redis (no model)"),
    ("bench", "long-prompts"): ("sluice_bench.long_prompts",
                                "running streams' inter-token latency while long prompts arrive (a running gateway)"),
    ("bench", "sampler"): ("sluice_bench.sampler", "the sampler's cost per step, sparse path against the dense reference"),
    ("bench", "responses-memory"): ("sluice_bench.responses_memory",
                                    "Redis memory per turn of a long Responses conversation (stub engine)"),
    ("bench", "gateway-stall"): ("sluice_bench.gateway_stall",
                                 "streams' pauses and /health under large request bodies, prepare pool off and on"),
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
            if hasattr(module, "run_argv"):  # a command that parses its own line (sluice config)
                return int(module.run_argv(argv[len(words) :]) or 0)
            prog = "sluice " + " ".join(words)
            parser = argparse.ArgumentParser(prog=prog, description=help_text)
            module.add_arguments(parser)
            args = parser.parse_args(argv[len(words) :])
            try:  # flags > environment > --config file > defaults (sluice.config), bad input refused now
                resolve_args(args)
            except ConfigError as exc:
                print(f"{prog}: error: {exc}", file=sys.stderr)
                return 2
            return int(module.run(args) or 0)
    if argv and argv[0] not in ("-h", "--help", "help"):
        print(f"sluice: unknown command {' '.join(argv[:2])!r}\n", file=sys.stderr)
        print(_usage(), file=sys.stderr)
        return 2
    print(_usage())
    return 0


if __name__ == "__main__":
    sys.exit(main())
