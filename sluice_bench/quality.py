"""``sluice bench quality``: what weight quantization costs in output quality, measured honestly.

For each mode (``sluice_bench.modes``, the names every bench takes; float32, eager, is the
reference; ``int8`` and ``int4`` are float32 activations with weights quantized at load; ``gguf`` is
the default model's own GGUF file served as it is; the compiled and native modes show what their
fast paths change), in one process, one after the other:

- **greedy agreement** with float32 over a fixed set of prompts (chat-templated, greedy, EOS
  ignored, ``--max-tokens`` each): the share of output positions whose token equals float32's,
  and the mean number of tokens generated before the first difference (after a difference the
  continuations condition on different text, so the position-wise share understates agreement
  once they diverge);
- **perplexity** of a held-out text (``sluice_bench/data/heldout.txt``, prose, a little
  arithmetic and code; never used to choose anything) from the engine's own prompt logprobs;
- with ``--anchor``, llama.cpp (llama-cpp-python) on the default model's GGUF file as a row of its
  own (its greedy outputs and its perplexity of the same text, the same token ids), and each mode's
  mean tokens before its first difference from llama.cpp's outputs.

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import time
from pathlib import Path

from sluice_bench.modes import GGUF_MODES, MODES, describe_engine, mode_model

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for sleeping better.",
    "Translate 'good morning, how are you?' into Spanish.",
    "What is 17 times 23?",
    "Write a haiku about autumn leaves.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "What does a compiler do?",
    "List the planets of the solar system in order from the Sun.",
    "How do I reverse a list in Python?",
    "Why do cats purr?",
    "Write a short email asking a colleague to move a meeting to Friday.",
    "What is the difference between weather and climate?",
    "Describe the water cycle.",
    "Suggest a name for a small bakery.",
    "What is photosynthesis?",
    "Explain what a hash table is to a beginner.",
    "Tell me a fun fact about octopuses.",
    "How many minutes are there in a day?",
    "What are the primary colours?",
    "Write a SQL query that counts the rows of a table called users.",
    "Who wrote Pride and Prejudice?",
    "Give a one-sentence definition of gravity.",
]
HELDOUT = Path(__file__).parent / "data" / "heldout.txt"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model directory (default: the embedded model)")
    parser.add_argument("--modes", default="float32,int8,int4,gguf",
                        help=f"comma-separated, float32 first (the reference); of {', '.join(MODES)}")
    parser.add_argument("--num-prompts", type=int, default=len(PROMPTS), help=f"at most {len(PROMPTS)}")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--heldout", type=Path, default=HELDOUT, help="text for the perplexity")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="the GGUF file of the gguf modes and of --anchor (default: the default model's Q4_1 file)")
    parser.add_argument("--anchor", action="store_true",
                        help="add llama.cpp on that GGUF file (needs llama-cpp-python)")
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp's threads (default: torch's)")
    parser.add_argument("--json", type=Path, default=Path("bench-results/quality.json"))


def _perplexity(llm, text: str) -> tuple[float, int]:
    from engine_service.core.sampling_params import SamplingParams

    ids = llm.get_tokenizer().encode(text)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    lps = [d[tok].logprob for d, tok in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
    return math.exp(-sum(lps) / len(lps)), len(lps)


def _first_differences(outs: list[list[int]], reference: list[list[int]]) -> list[int]:
    return [next((i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b), len(ref))
            for got, ref in zip(outs, reference, strict=True)]


def _anchor_row(args: argparse.Namespace, prompts: list, text: str) -> dict:
    """llama.cpp on the default model's GGUF: its greedy outputs for the same chat-templated token ids
    and its perplexity of the same text's token ids (the GGUF's tokenizer is the engine's)."""
    import importlib.util

    import torch

    from sluice.text.tokenizer import Tokenizer
    from sluice_bench.anchor import INSTALL_HINT, LlamaCppStream, find_gguf

    if importlib.util.find_spec("llama_cpp") is None:
        raise SystemExit(f"sluice bench quality --anchor: llama-cpp-python is not installed: {INSTALL_HINT}")
    from engine_service.engine import resolve_model_dir

    gguf = find_gguf(args.gguf)
    tokenizer = Tokenizer.from_dir(resolve_model_dir(str(gguf)))
    ids = tokenizer.encode(text)
    chats = [tokenizer.encode(tokenizer.apply_chat_template(p, add_generation_prompt=True)) for p in prompts]  # as LLM.chat
    stream = LlamaCppStream(gguf, args.threads or torch.get_num_threads(), n_ctx=max(len(ids), 1024) + 8)
    outputs = [stream.run(c, args.max_tokens, None) for c in chats]
    return {"system": f"llama.cpp {stream.version}", "gguf": gguf.name, "outputs": outputs,
            "perplexity": stream.perplexity(ids), "perplexity_tokens": len(ids) - 1}


def run(args: argparse.Namespace) -> int:
    from engine_service.core.sampling_params import SamplingParams
    from engine_service.llm import LLM

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes or modes[0] != "float32":
        raise SystemExit(f"--modes: float32 first, then any of {', '.join(MODES)}; got {args.modes!r}")
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS[: args.num_prompts]]
    text = args.heldout.read_text()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    results: list[dict] = []
    reference: list[list[int]] | None = None
    anchor = _anchor_row(args, prompts, text) if args.anchor else None
    for mode in modes:
        started = time.perf_counter()
        llm = LLM(mode_model(mode, args.model, args.gguf), **MODES[mode])
        load_s = time.perf_counter() - started
        dtype, quantization = MODES[mode]["dtype"], MODES[mode]["quantization"] or ("gguf" if mode in GGUF_MODES else None)
        kv_cache_dtype = MODES[mode].get("kv_cache_dtype", "auto")
        outs = [o.outputs[0].token_ids for o in llm.chat(prompts, params)]
        ppl, n_tokens = _perplexity(llm, text)
        row = {"mode": mode, "engine": describe_engine(llm.engine), "dtype": dtype, "quantization": quantization,
               "kv_cache_dtype": kv_cache_dtype,
               "perplexity": ppl, "perplexity_tokens": n_tokens, "load_s": load_s}
        if reference is None:
            reference = outs
            row |= {"agreement": 1.0, "mean_tokens_before_first_difference": float(args.max_tokens),
                    "identical_outputs": len(outs)}
        else:
            same = total = 0
            prefix = []
            for got, ref in zip(outs, reference, strict=True):
                same += sum(a == b for a, b in zip(got, ref, strict=False))
                total += len(ref)
                first = next((i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b), len(ref))
                prefix.append(first)
            row |= {"agreement": same / total, "mean_tokens_before_first_difference": sum(prefix) / len(prefix),
                    "identical_outputs": sum(p == args.max_tokens for p in prefix)}
        if anchor is not None:
            row["tokens_before_first_difference_from_llama_cpp"] = _first_differences(outs, anchor["outputs"])
        row["sample"] = llm.get_tokenizer().decode(outs[0])
        results.append(row)
        del llm
        gc.collect()

    print(f"\nsluice bench quality: {len(prompts)} chat prompts x {args.max_tokens} greedy tokens (EOS ignored) "
          f"against float32; perplexity of {args.heldout.name} ({results[0]['perplexity_tokens']} tokens)")
    print(f"{'mode':<24}{'agreement':>11}{'tokens to 1st diff':>20}{'identical':>11}{'perplexity':>12}"
          + (f"{'to 1st diff from llama.cpp':>28}" if anchor else ""))
    for r in results:
        beside = r.get("tokens_before_first_difference_from_llama_cpp")
        print(f"{r['mode']:<24}{r['agreement']:>10.1%}{r['mean_tokens_before_first_difference']:>20.1f}"
              f"{r['identical_outputs']:>7}/{len(prompts):<3}{r['perplexity']:>12.3f}"
              + (f"{sum(beside) / len(beside):>28.1f}" if beside else ""))
    if anchor is not None:
        print(f"{anchor['system']:<24}{'':>11}{'':>20}{'':>11}{anchor['perplexity']:>12.3f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "prompts": len(prompts), "max_tokens": args.max_tokens, "heldout": args.heldout.name,
        "machine": {"platform": platform.platform()}, "modes": results,
        "llama_cpp": None if anchor is None else {k: v for k, v in anchor.items() if k != "outputs"}}, indent=2))
    print(f"wrote {args.json}")
    return 0
