"""Filesystem locations shared by every process."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """Root of Sluice's caches: ``$SLUICE_CACHE_DIR`` or ``~/.cache/sluice``."""
    env = os.environ.get("SLUICE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sluice"


def default_model_dir() -> Path:
    """Where ``sluice model prepare`` writes the default model's Hugging Face directory."""
    return cache_dir() / "models" / DEFAULT_MODEL_NAME
