"""Fixtures shared by every test layer."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The default model as a Hugging Face directory, prepared once (cached across runs)."""
    from engine_service.model.prepare import prepare_default_model

    return prepare_default_model(progress=False)
