"""The engine's configuration, in one place.

``EngineConfig`` is the single definition of every engine knob: its name, type, default, help text,
choices and environment variable (``sluice.config.knob``, the one knob machinery of every command).
Everything else is derived from it:

- the offline API: ``LLM(model, **knobs)`` passes its keywords to ``EngineConfig.from_kwargs``;
- ``sluice engine`` and ``sluice serve`` flags and ``--config`` keys: ``sluice.config`` generates
  one flag per field (``block_size`` → ``--block-size``; a bool ``x`` → ``--x`` / ``--no-x``), and
  ``sluice serve`` forwards the ones that differ from the default to the engine it starts;
- ``add_engine_arguments(parser, only=...)``: a bench's pass-through of a few engine flags;
- ``SchedulerConfig``'s defaults read ``EngineConfig``'s; docs/configuration.md lists them all.

**Adding a knob is one line** in ``EngineConfig``, e.g.::

    quantization: str | None = knob(None, "weight quantization", choices=["int8", "int4"])

and it is then a keyword of ``LLM``, a flag and a config key of ``sluice engine`` and of ``sluice
serve``, with the same name and default everywhere. ``knob(default, help, ...)`` takes
``choices``, ``metavar``, ``env``, ``bounds`` and the like (``sluice.config.knobs``); ``cli=False``
keeps a field off the command line.

Torch-free on purpose: the CLI imports it to build ``--help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from sluice.config import add_section_arguments, changed_argv, from_args, knob, knobs_of
from sluice.wire import dialects

DEFAULT_WATERMARK_SHARE = 0.01
# the values a knob takes, written once: the knob's choices, every bench's flag and the layer that
# reads the value all use these
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATION_METHODS = ("int8", "int4")
ATTENTION_BACKENDS = ("auto", "native", "torch")
# the environment variables of two knobs, read by LLM() too (it has no command line)
DTYPE_ENV = "SLUICE_DTYPE"
ENFORCE_EAGER_ENV = "SLUICE_ENFORCE_EAGER"


@dataclass
class EngineConfig:
    knob_title = "engine"  # its --help group and docs section (a class attribute, not a knob)

    model: str | None = knob(None, "a local Hugging Face model directory or a GGUF file, served as it is "
                             "(default: the prepared default model)")
    served_model_name: str | None = knob(None, "the name clients use (default: the model directory's name, or the GGUF file's without .gguf)")
    dtype: str | None = knob(
        None, "weights and activations dtype, and the KV cache's unless --kv-cache-dtype says otherwise. auto (the "
        "default): the checkpoint's on CUDA; on CPU float32 under --quantization, else bfloat16 where the CPU "
        "computes it natively (AVX512-BF16 or AMX), else float32: facts, never a timing (engine_service.model.dtype)",
        choices=list(MODEL_DTYPES), env=DTYPE_ENV)
    kv_cache_dtype: str = knob(
        "auto", "the KV cache's dtype (vLLM's name). auto: the model's dtype; bfloat16 or float16 under a float32 "
        "model halves the cache's bytes a token (twice the tokens in the same --kv-cache-memory) and the bytes "
        "attention reads; every attention path reads the values as the cache holds them (docs/scheduler.md)",
        choices=list(KV_CACHE_DTYPES))
    quantization: str | None = knob(None, "weight-only quantization computed at load (int8: per output "
                                     "channel; int4: groups of 32); default: none", choices=list(QUANTIZATION_METHODS))
    device: str = knob("cpu", "cpu | cuda | cuda:N")
    cpus: str | None = knob(
        None, "the CPUs the engine runs on, as a Linux CPU list (0-3,8): every thread of its process is pinned "
        "there (with LLM(), the calling process's), and torch computes with one thread a physical core of the "
        "list. Default: every CPU the process may use, torch's thread count. `sluice serve --reserved-cpus N` "
        "sets it to the CPUs after Redis's and the gateway's (sluice.cpu_placement)", metavar="LIST")
    block_size: int = knob(16, "tokens per KV-cache block")
    num_blocks: int | None = knob(None, "KV-cache blocks (default: as many as --kv-cache-memory allows)")
    kv_cache_memory: int | None = knob(None, "bytes for the KV pool (default: 1 GiB on CPU, 90% of free memory on CUDA)")
    max_num_seqs: int = knob(256, "most sequences in one step")
    max_num_batched_tokens: int = knob(2048, "most tokens in one step (the scheduler's token budget)")
    max_model_len: int | None = knob(None, "longest prompt + output (default: the model's context length)")
    watermark_blocks: int | None = knob(
        None, f"blocks admission keeps free (default: {DEFAULT_WATERMARK_SHARE:.0%} of the pool)")
    enable_prefix_caching: bool = knob(True, "reuse KV blocks of shared prompt prefixes")
    seed: int = knob(0, "seeds the sampler's generator for unseeded requests")
    enforce_eager: bool | None = knob(
        None, "no torch.compile, no CUDA graphs and no native decode step: run the eager forward only, the "
        "reference (vLLM's name). Default: on CPU the eager forward with the native "
        "decode step (--native-decode) and no torch.compile (the compiled decode step, --no-enforce-eager, "
        "takes less time per token, but its first warm-up is long on CPU; the figures, with the command that "
        "measures them: docs/performance.md), and not eager on CUDA (--cuda-graphs)", env=ENFORCE_EAGER_ENV)
    cuda_graphs: bool = knob(
        True, "on CUDA, unless --enforce-eager: decode-only steps replay CUDA graphs captured per batch and "
        "context bucket at first use (engine_service.model.cuda_graphs); --no-cuda-graphs compiles the decode "
        "step with inductor instead")

    def resolved_dtype(self) -> str:
        return self.dtype or os.environ.get(DTYPE_ENV) or "auto"

    def resolved_enforce_eager(self) -> bool:
        asked = self.eager_asked()
        if asked is not None:
            return asked
        # CPU: eager (the compiled step's first warm-up is long); CUDA: CUDA graphs (no inductor compile)
        return not self.device.startswith("cuda")

    def eager_asked(self) -> bool | None:
        """--enforce-eager / --no-enforce-eager, else $SLUICE_ENFORCE_EAGER, else None (the device's
        default). Asked for, eager is the reference: no native decode step either. CPU's default eager
        keeps the native step, which needs no warm-up to speak of: only torch.compile's is long."""
        if self.enforce_eager is not None:
            return self.enforce_eager
        env = os.environ.get(ENFORCE_EAGER_ENV)
        return env.lower() in ("1", "true", "yes") if env is not None else None
    attention_backend: str = knob(
        "auto", "decode attention: native (a C kernel built at first use that reads the paged KV cache in "
        "place; CPU only, needs gcc), torch (plain torch: a padded gather + SDPA, the reference), auto "
        "(native where it builds, else torch; docs/performance.md)", choices=list(ATTENTION_BACKENDS))
    native_decode: bool = knob(
        True, "decode steps of an int4 Llama-family model (and a bfloat16 one's, up to 64 rows where the CPU has "
        "AMX, 16 without) on CPU as one native call per step instead of the compiled or eager step "
        "(engine_service.model.native_decode; not with --enforce-eager asked for, which runs the eager reference)")
    deterministic: bool | None = knob(
        None, "a request's tokens (greedy, or sampled with a seed) the same alone or batched, on a prefix-cache "
        "hit or miss, whatever the chunked-prefill split, after preemption, with or without speculation and "
        "across restarts: every row computed as it would be alone (docs/determinism.md). Default: on where it "
        "costs next to nothing (CPU, the native attention, not compiled, a bfloat16 model with the native GEMV or "
        "an int4 one), else off with one line at start saying why; --deterministic also turns it on for float32, "
        "float16 and int8 models and refuses to start where it cannot, naming the knobs; --no-deterministic "
        "gives bfloat16 batches AMX tiles and prefill chunks oneDNN's and the dense products")
    generation_config: str = knob(
        "auto", "auto: the model's generation_config.json sets the temperature, top_p, top_k, min_p and "
        "repetition_penalty a request leaves unset (vLLM's behaviour); vllm: ignore it (neutral defaults)",
        choices=["auto", "vllm"])
    tool_call_parser: str | None = knob(None, "how gateways read tool calls in this model's output (vLLM's names; "
                                        "default: detected from the chat template, else hermes)",
                                        choices=list(dialects.TOOL_CALL_PARSERS))
    reasoning_parser: str | None = knob(None, "how gateways split <think> reasoning into reasoning_content (default: "
                                        "detected from the chat template; none: never)",
                                        choices=[*dialects.REASONING_PARSERS, dialects.NO_REASONING])
    speculative_config: str | dict | None = knob(
        None, "speculative decoding, as JSON (vLLM's shape): {\"method\": \"ngram\", \"num_speculative_tokens\": k, "
        "\"prompt_lookup_max\": n, \"prompt_lookup_min\": m}: each decode drafts up to k tokens from the request's "
        "own prompt and output and verifies them in one forward; \"disable_by_batch_size\": b drafts only in steps "
        "of at most b requests (docs/scheduler.md); default: none",
        metavar="JSON")
    num_scheduler_steps: int = knob(
        1, "decode steps per scheduling step (vLLM's name): with more than 1, a step whose every request decodes "
        "greedily (no penalties, logit bias, logprobs, min_tokens still pending or structured output) and none "
        "waits runs up to this many decode steps in one native call, the scheduler and the sampler once for them "
        "all; tokens then reach clients in bursts of that many. Needs the native decode step with its output "
        "projection (bfloat16, int4 or a GGUF file on CPU); not with --speculative-config (docs/scheduler.md)")
    # Benchmarks of the serving path only (engine_service.model.stub): fixed logits, no weights read.
    # Off the command line here: `sluice engine --stub-model` (hidden) sets it, and the engine
    # refuses it unless $SLUICE_BENCH_STUB_MODEL=1.
    stub_model: bool = knob(False, "bench only: a stub model that writes a fixed text", cli=False)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """``EngineConfig(**kwargs)`` with a clear error for an unknown keyword."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {', '.join(unknown)}; "
                            f"the engine takes: {', '.join(sorted(names))}")
        return cls(**kwargs)


def add_engine_arguments(parser: argparse.ArgumentParser | Any, *, title: str = "engine",
                         only: tuple[str, ...] | None = None) -> None:
    """One flag per ``EngineConfig`` knob (``only``: the knobs a bench passes through to its
    engine), with no ``--config``: the commands build their parsers with ``sluice.config.add_arguments``."""
    add_section_arguments(parser, EngineConfig, title=title, only=only)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` that a parsed command line describes (flags, environment and
    ``--config`` applied when the parser was a command's)."""
    return from_args(EngineConfig, args)


def engine_cli_args(config: EngineConfig) -> list[str]:
    """The ``sluice engine`` flags that reproduce ``config`` (only values that differ from the
    defaults, so the engine's own defaults stay the single source)."""
    return changed_argv(knobs_of(EngineConfig), dataclasses.asdict(config))


@dataclass(frozen=True)
class DecodeCapabilities:
    """What the engine's decode path (``engine_service.model.decode_paths``, chosen once at engine
    start) tells the scheduler: the only thing the scheduler knows of how steps run.

    ``fast_step_max_rows``: a step of decodes of fewer rows than this runs the path's fast step, which
    reads each weight once for all its rows (the native decode step), so drafts never push such a
    step past it (0: no fast step). ``multi_step_max_rows``: a step of plain greedy decodes of fewer
    rows than this may run several decode steps in one call (``num_scheduler_steps``; 0: never).
    ``one_pass_rows``: the most rows the fast step takes at about one row's cost (its products'
    rows share each weight load; 1: each row costs its own arithmetic), what the speculative
    back-off's ``"auto"`` reads."""

    path: str = "eager"
    fast_step_max_rows: int = 0
    multi_step_max_rows: int = 0
    one_pass_rows: int = 1


@dataclass
class SchedulerConfig:
    """What the scheduler and its block pool need; derived from ``EngineConfig`` once the model
    (and so ``max_model_len`` and the KV pool size) is known. Defaults are ``EngineConfig``'s."""

    num_blocks: int
    block_size: int = EngineConfig.block_size
    max_num_seqs: int = EngineConfig.max_num_seqs
    max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens
    max_model_len: int = 8192  # the scheduler alone has no model; the engine passes the model's
    watermark_blocks: int | None = EngineConfig.watermark_blocks  # None: DEFAULT_WATERMARK_SHARE of the pool
    enable_prefix_caching: bool = EngineConfig.enable_prefix_caching
    # query-key pairs a step's prefill chunks may attend to (scheduler.py, point 4); None: what a
    # fresh prefill of the whole budget attends to, B * (B + 1) / 2; 0: no limit
    max_num_batched_pairs: int | None = None
    speculative_config: SpeculativeConfig | None = None  # n-gram speculation (engine_service.core.spec_decode)
    # greedy decode steps one scheduling step may run (EngineConfig.num_scheduler_steps), in batches the
    # decode path's capabilities allow (decode.multi_step_max_rows)
    num_scheduler_steps: int = EngineConfig.num_scheduler_steps
    # what the engine's decode path can do, chosen once at engine start (engine_service.model.decode_paths)
    decode: DecodeCapabilities = field(default_factory=DecodeCapabilities)
    # fair share between tenants (engine_service.core.fair_share): a waiting tenant under its share
    # may take a slot of the tenant furthest over it when every slot is taken. Off only to measure
    # what that buys (sluice bench scheduler --tenants)
    fair_share_preemption: bool = True

    def resolved_watermark_blocks(self) -> int:
        if self.watermark_blocks is not None:
            return self.watermark_blocks
        return int(DEFAULT_WATERMARK_SHARE * self.num_blocks)


# The most decode steps one scheduling step may run: a burst of tokens a client waits for.
MAX_SCHEDULER_STEPS = 64


def check_num_scheduler_steps(steps: Any, speculative: bool) -> None:
    """Raise ValueError naming the knob when ``num_scheduler_steps`` cannot work."""
    if type(steps) is not int:
        raise ValueError(f"num_scheduler_steps must be an integer, got {steps!r}")
    if not 1 <= steps <= MAX_SCHEDULER_STEPS:
        raise ValueError(f"num_scheduler_steps must be between 1 and {MAX_SCHEDULER_STEPS}, got {steps}")
    if steps > 1 and speculative:
        raise ValueError("num_scheduler_steps above 1 and speculative_config cannot be combined: a speculating "
                         "request verifies drafts every step")


# The n-gram index keeps one entry per position and size: sizes are bounded so a token costs a
# bounded number of dictionary updates.
MAX_PROMPT_LOOKUP = 32


# speculative_config.backoff's values; "auto" turns it off where the decode path takes a verifying
# step's k + 1 rows at about one row's cost (DecodeCapabilities.one_pass_rows)
BACKOFF_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
    "prompt_lookup_min": m, "disable_by_batch_size": b}`` (vLLM's keys). A missing
    ``prompt_lookup_min`` / ``_max`` takes the other's value; both missing: 5 (vLLM's defaults).
    ``disable_by_batch_size``: no request drafts in a step that runs more than b requests (None:
    never off, vLLM's default). Why: each verifying row costs what a decode row's activations
    cost (a fifth of an int4 step here, docs/performance.md); a big batch is already bound by
    that arithmetic rather than by reading the weights, and its drafts can cost more than the
    tokens they save.

    ``backoff`` (Sluice's key): ``"on"`` shortens a request's drafts after a rejection and pauses
    them after a draft with nothing accepted (``NgramDrafter.observe``); ``"off"`` always offers k
    drafts where an n-gram matches, as vLLM does; ``"auto"`` (the default) turns the back-off off
    where the engine's decode path takes a verifying step's k + 1 rows at about one row's cost
    (``DecodeCapabilities.one_pass_rows``: its products read each weight once for all of them),
    on otherwise: a fact of the path and the CPU, the same at every start."""

    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    method: str = "ngram"
    disable_by_batch_size: int | None = None
    backoff: str = "auto"

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From a dict or its JSON text (``--speculative-config``); None or {} stays None. Raises
        ValueError naming the knob that is wrong."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON ({exc.msg}): {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, not {type(value).__name__}")
        if not value:
            return None
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size",
                 "backoff"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; "
                             f"it takes {', '.join(sorted(known))}")
        method = value.get("method", "ngram")
        if method != "ngram":
            raise ValueError(f"speculative_config.method {method!r} is not supported; the only method is "
                             "'ngram' (prompt lookup, no draft model)")
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            v = value.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"speculative_config.{key} must be an integer, got {v!r}")
        k = value.get("num_speculative_tokens")
        if k is None:
            raise ValueError("speculative_config.num_speculative_tokens is required (the draft length k)")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        backoff = value.get("backoff", "auto")
        if backoff not in BACKOFF_MODES:
            raise ValueError(f"speculative_config.backoff must be one of {', '.join(map(repr, BACKOFF_MODES))}, "
                             f"got {backoff!r}")
        config = cls(num_speculative_tokens=k, prompt_lookup_max=hi, prompt_lookup_min=lo, method=method,
                     disable_by_batch_size=value.get("disable_by_batch_size"), backoff=backoff)
        config.check()
        return config

    def check(self, max_num_batched_tokens: int | None = None) -> None:
        """Raise ValueError naming the knob when this configuration cannot work."""
        k = self.num_speculative_tokens
        if k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be at least 1, got {k}")
        if max_num_batched_tokens is not None and k + 1 > max_num_batched_tokens:
            raise ValueError(
                f"speculative_config.num_speculative_tokens ({k}) does not fit the step's token budget: a "
                f"request with k drafts forwards k + 1 = {k + 1} tokens, more than max_num_batched_tokens "
                f"({max_num_batched_tokens})")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo < 1:
            raise ValueError(f"speculative_config.prompt_lookup_min must be at least 1, got {lo}")
        if hi < lo:
            raise ValueError(f"speculative_config.prompt_lookup_max ({hi}) is below prompt_lookup_min ({lo})")
        if hi > MAX_PROMPT_LOOKUP:
            raise ValueError(f"speculative_config.prompt_lookup_max must be at most {MAX_PROMPT_LOOKUP}, got {hi}")
        b = self.disable_by_batch_size
        if b is not None and b < 1:
            raise ValueError(f"speculative_config.disable_by_batch_size must be at least 1 (or absent: never), got {b}")

    def as_dict(self) -> dict[str, Any]:
        out = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
               "prompt_lookup_max": self.prompt_lookup_max, "prompt_lookup_min": self.prompt_lookup_min}
        if self.disable_by_batch_size is not None:
            out["disable_by_batch_size"] = self.disable_by_batch_size
        out["backoff"] = self.backoff
        return out
