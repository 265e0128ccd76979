"""Per-step cost of llguidance and xgrammar on this CPU with the default model's vocabulary.

Not part of the product (xgrammar is not a dependency): ``pip install xgrammar transformers``, then
``python docs/bench/grammar_libs.py [MODEL_DIR]``. For each library: tokenizer set-up, compiling
one JSON schema, then 3 x 120 steps of "fill the bitmask, mask random logits, take the argmax,
advance the matcher" (the engine's loop, without the model). Prints a table, writes
docs/bench/grammar_libs.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

torch.set_num_threads(1)
MODEL = Path(sys.argv[1] if len(sys.argv) > 1 else Path.home() / ".cache/sluice/models/SmolLM2-135M-Instruct")
TOKENIZER_JSON = (MODEL / "tokenizer.json").read_text()
V = 49152
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]},
    "score": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["name", "age", "tags", "address", "score"], "additionalProperties": False}


def apply(logits: np.ndarray, bitmask: torch.Tensor) -> None:
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :V]
    np.putmask(logits, bits == 0, -np.inf)


def steps(new_matcher, fill, accept, done, n=120, reps=3) -> dict:
    gen = np.random.default_rng(0)
    fills, accepts = [], []
    for _ in range(reps):
        m = new_matcher()
        bm = torch.full((1, (V + 31) // 32), -1, dtype=torch.int32)
        for _ in range(n):
            if done(m):
                break
            logits = gen.standard_normal((1, V)).astype(np.float32)
            t = time.perf_counter()
            fill(m, bm)
            fills.append(time.perf_counter() - t)
            apply(logits, bm)
            token = int(logits.argmax())
            t = time.perf_counter()
            assert accept(m, token)
            accepts.append(time.perf_counter() - t)
    ms = lambda xs: round(1e3 * xs, 4)  # noqa: E731
    return {"steps": len(fills), "fill_ms_median": ms(statistics.median(fills)), "fill_ms_mean": ms(statistics.mean(fills)),
            "fill_ms_max": ms(max(fills)), "accept_ms_mean": ms(statistics.mean(accepts))}


def main() -> None:
    rows = {}
    t = time.perf_counter()
    import llguidance
    import_s = time.perf_counter() - t  # the core alone: what the torch-free gateway imports
    import llguidance.torch as lgt
    t = time.perf_counter()
    lt = llguidance.LLTokenizer(TOKENIZER_JSON, n_vocab=V, eos_token=2)
    init = time.perf_counter() - t
    defaults = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
    t = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults=defaults)
    llguidance.LLMatcher(lt, grammar)
    compile_s = time.perf_counter() - t
    from importlib.metadata import version

    rows[f"llguidance {version('llguidance')}"] = {
        "import_s": round(import_s, 3), "tokenizer_init_ms": round(1e3 * init, 1),
        "compile_ms": round(1e3 * compile_s, 2), "imports_torch": False,  # `import llguidance` is torch-free
        **steps(lambda: llguidance.LLMatcher(lt, grammar), lambda m, bm: lgt.fill_next_token_bitmask(m, bm, 0),
                lambda m, tok: m.consume_token(tok), lambda m: m.is_stopped())}

    t = time.perf_counter()
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast
    import_s = time.perf_counter() - t
    hf = PreTrainedTokenizerFast(tokenizer_file=str(MODEL / "tokenizer.json"))
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=V, stop_token_ids=[2])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    init = time.perf_counter() - t
    t = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - t
    rows[f"xgrammar {version('xgrammar')}"] = {
        "import_s": round(import_s, 3), "tokenizer_init_ms": round(1e3 * init, 1),
        "compile_ms": round(1e3 * compile_s, 2), "imports_torch": True,
        **steps(lambda: xgr.GrammarMatcher(compiled), lambda m, bm: m.fill_next_token_bitmask(bm, 0),
                lambda m, tok: m.accept_token(tok), lambda m: m.is_terminated())}

    cols = ["import_s", "tokenizer_init_ms", "compile_ms", "fill_ms_median", "fill_ms_mean", "fill_ms_max",
            "accept_ms_mean", "steps"]
    print(f"{'library':<22}" + "".join(f"{c:>18}" for c in cols))
    for name, row in rows.items():
        print(f"{name:<22}" + "".join(f"{row[c]!s:>18}" for c in cols))
    out = Path(__file__).with_suffix(".json")
    out.write_text(json.dumps({"vocab": V, "schema": SCHEMA, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
