"""The engine modes the benches name (``--mode``/``--modes``): one spelling for every bench."""

from __future__ import annotations

# mode name -> (dtype, quantization, enforce_eager)
MODES: dict[str, tuple[str, str | None, bool]] = {
    "float32": ("float32", None, True),
    "float32-compiled": ("float32", None, False),
    "bfloat16": ("bfloat16", None, True),
    "bfloat16-compiled": ("bfloat16", None, False),
    "int8-compiled": ("float32", "int8", False),
    "int4": ("float32", "int4", True),
    "int4-compiled": ("float32", "int4", False),
    "bfloat16-int4": ("bfloat16", "int4", True),
    "bfloat16-int4-compiled": ("bfloat16", "int4", False),
}
