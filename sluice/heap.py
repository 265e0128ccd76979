"""A long-lived process's start-up heap, kept out of the cyclic garbage collector's walks."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect once, then move every surviving object into the permanent generation
    (``gc.freeze``); returns how many objects that froze.

    Why: a full collection walks every object the collector tracks, and it stops the process while
    it does. After start-up an engine tracks the model's modules, torch's and the tokenizer's
    objects; a gateway, FastAPI's and pydantic's. They live as long as the process, yet each full
    collection walked all of them again: a stall of every stream the process serves
    (docs/performance.md, "Start-up heap"). Frozen, they are never walked again, and a full
    collection walks only what serving allocated since.

    Call it once, where start-up ends, from a process's entry point only: frozen objects are never
    collected, so a library or a test that builds and drops engines must not.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
