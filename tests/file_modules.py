"""Load a Python file that is not in a package (scripts/, deploy/) as a module, for its tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_file(relative: str) -> ModuleType:
    """The module at ROOT / relative (e.g. "scripts/random_weights_model.py"), executed fresh."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
