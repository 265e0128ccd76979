"""The test tiers: a test that reaches the model or Redis carries the marker `make test-fast`
deselects it by, and the fast tier has no compiler (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests import conftest

pytest_plugins = ["pytester"]


def _collect(pytester) -> pytest.RunResult:
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    return pytester.runpytest("--collect-only", "-q", "-p", "no:cacheprovider")


def test_a_test_reaching_the_model_or_redis_without_its_marker_stops_the_collection(pytester):
    pytester.makeconftest("""
import pytest
from tests.conftest import pytest_collection_modifyitems  # noqa: F401

@pytest.fixture
def model_dir():
    return "model"

@pytest.fixture
def clean_redis():
    return "redis://"

@pytest.fixture
def engine(model_dir):  # reaches the model through another fixture
    return model_dir
""")
    pytester.makepyfile(test_tiers_case="""
import pytest

def test_unmarked_engine(engine):
    pass

@pytest.mark.model
def test_marked_engine(engine):
    pass

def test_unmarked_redis(clean_redis):
    pass

def test_neither():
    pass
""")
    result = _collect(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([
        "*test_tiers_case.py: mark pytest.mark.model on the tests that use model_dir*",
        "*test_tiers_case.py: mark pytest.mark.redis on the tests that use clean_redis*",
    ])


def test_marked_tests_collect(pytester):
    pytester.makeconftest("""
import pytest
from tests.conftest import pytest_collection_modifyitems  # noqa: F401

@pytest.fixture
def model_dir():
    return "model"
""")
    pytester.makepyfile(test_tiers_case="""
import pytest

pytestmark = pytest.mark.model

def test_model(model_dir):
    pass
""")
    assert _collect(pytester).ret == pytest.ExitCode.OK


def test_the_fast_tier_has_no_compiler(monkeypatch):
    for name in ("CC", "CXX", "SLUICE_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.setenv(name, os.environ.get(name, ""))  # restored after the test
    conftest._fast_tier_without_a_compiler()
    result = subprocess.run([os.environ["CC"], "-c", "x.c"], capture_output=True, text=True, check=False)
    assert result.returncode != 0 and "pytest.mark.slow" in result.stderr
    assert os.environ["CXX"] == os.environ["CC"]
    assert not os.path.exists(os.environ["SLUICE_CACHE_DIR"])  # a fresh cache: nothing built before
