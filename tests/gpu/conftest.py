"""tests/gpu: the same code on CUDA. Every test here is marked ``cuda`` and skipped, with the
reason, where torch sees no GPU (``scripts/gpu-check.sh`` runs them on a GPU machine)."""

from __future__ import annotations

import pytest
import torch

NO_GPU = "no CUDA GPU: torch.cuda.is_available() is False" if not torch.cuda.is_available() else None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.cuda)
            if NO_GPU:
                item.add_marker(pytest.mark.skip(reason=NO_GPU))
