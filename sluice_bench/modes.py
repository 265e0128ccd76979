"""The engine modes the benches name (``--mode``/``--modes``): one spelling for every bench."""

from __future__ import annotations

from typing import Any


def _mode(dtype: str, quantization: str | None = None, *, eager: bool = True, native: bool = False,
          steps: int = 1, kv_cache_dtype: str = "auto") -> dict[str, Any]:
    mode = {"dtype": dtype, "quantization": quantization, "enforce_eager": eager, "native_decode": native}
    return (mode | ({"num_scheduler_steps": steps} if steps > 1 else {})
            | ({"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype != "auto" else {}))


# the engine flags `sluice bench latency` and `offline` pass through to their engine, generated from
# EngineConfig (engine_service.config.add_engine_arguments) with its choices, defaults and help
BENCH_ENGINE_FLAGS = ("quantization", "kv_cache_dtype", "attention_backend", "cuda_graphs", "deterministic")

# the decode steps a "-steps" mode runs a scheduling step (--num-scheduler-steps)
MODE_SCHEDULER_STEPS = 8


# mode name -> the LLM keywords that make it. "-compiled": torch.compile's decode step; "-native":
# the decode step as one native call (engine_service.model.native_decode: int4, and bfloat16's
# steps of up to 64 rows with AMX, 16 without); "-steps": the native step, MODE_SCHEDULER_STEPS
# greedy decode steps a scheduling step; "-bf16-cache"/"-fp16-cache": a 16-bit KV cache under the float32 activations
# (kv_cache_dtype). Without a suffix a mode is eager, asked for: the reference, with no native step,
# which CPU's default engine (enforce_eager left unset) does not take; no mode names that default.
MODES: dict[str, dict[str, Any]] = {
    "float32": _mode("float32"),
    "float32-compiled": _mode("float32", eager=False),
    "bfloat16": _mode("bfloat16"),
    "bfloat16-compiled": _mode("bfloat16", eager=False),
    "bfloat16-native": _mode("bfloat16", eager=False, native=True),
    "bfloat16-native-steps": _mode("bfloat16", eager=False, native=True, steps=MODE_SCHEDULER_STEPS),
    "int8": _mode("float32", "int8"),
    "int8-compiled": _mode("float32", "int8", eager=False),
    "int4": _mode("float32", "int4"),
    "int4-compiled": _mode("float32", "int4", eager=False),
    "int4-native": _mode("float32", "int4", eager=False, native=True),
    "int4-native-steps": _mode("float32", "int4", eager=False, native=True, steps=MODE_SCHEDULER_STEPS),
    "int4-native-bf16-cache": _mode("float32", "int4", eager=False, native=True, kv_cache_dtype="bfloat16"),
    "int4-bf16-cache": _mode("float32", "int4", kv_cache_dtype="bfloat16"),
    "float32-bf16-cache": _mode("float32", kv_cache_dtype="bfloat16"),
    "float32-fp16-cache": _mode("float32", kv_cache_dtype="float16"),
    "bfloat16-int8": _mode("bfloat16", "int8"),
    "bfloat16-int4": _mode("bfloat16", "int4"),
    "bfloat16-int4-compiled": _mode("bfloat16", "int4", eager=False),
}
# "gguf": the default model's GGUF file (or a bench's --gguf) served as it is, its Q4_1 and Q8_0
# blocks read in place (engine_service.model.gguf_model), float32 activations, the native step
# with its head; "gguf-steps": MODE_SCHEDULER_STEPS greedy decode steps a scheduling step
GGUF_MODES = {"gguf": _mode("float32", eager=False, native=True),
              "gguf-steps": _mode("float32", eager=False, native=True, steps=MODE_SCHEDULER_STEPS)}
MODES.update(GGUF_MODES)


def mode_model(mode: str, model: str | None, gguf: Any = None) -> str | None:
    """The model a mode's engine loads: a GGUF mode's file (``gguf``, else the default model's GGUF),
    else ``model``."""
    if mode not in GGUF_MODES:
        return model
    if gguf is None:
        from sluice_bench.anchor import find_gguf

        gguf = find_gguf(None)
    return str(gguf)


def describe_engine(engine: Any) -> str:
    """What an engine runs, for a bench's row: ``float32+int4, native step, native attention``, the
    KV cache's dtype where it is not the model's, and ``deterministic`` where the engine is."""
    def name(dtype: Any) -> str:
        return str(dtype).removeprefix("torch.")

    quant = f"+{engine.quantization}" if engine.quantization else ("+gguf" if getattr(engine, "gguf", None) else "")
    cache = "" if engine.kv_cache_dtype == engine.dtype else f", {name(engine.kv_cache_dtype)} cache"
    deterministic = ", deterministic" if getattr(engine, "deterministic", False) else ""
    return f"{name(engine.dtype)}{quant}, {engine.decode_mode}, {engine.attention_backend} attention{cache}{deterministic}"
