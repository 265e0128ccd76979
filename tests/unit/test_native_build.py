"""The native operators' build: the torch it needs is the one pyproject.toml states, and an
architecture the kernels are not written for is refused before anything is compiled."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from engine_service.model import native

ROOT = Path(__file__).resolve().parents[2]


def _target(version: tuple[int, int]) -> str:
    return f"-DTORCH_TARGET_VERSION=0x{version[0]:02x}{version[1]:02x}000000000000"


def _compiles(src: Path, version: tuple[int, int]) -> subprocess.CompletedProcess:
    gxx = shutil.which("g++")
    assert gxx, "g++ is needed to build the native operators (a set-up step)"
    return subprocess.run([gxx, "-std=c++17", "-fsyntax-only", _target(version),
                           f"-I{Path(torch.__file__).parent / 'include'}", f"-I{native.KERNELS}", str(src)],
                          capture_output=True, text=True, check=False)


def test_pyproject_states_the_torch_the_bindings_need():
    text = (ROOT / "pyproject.toml").read_text()
    (low,) = re.findall(r'"torch>=(\d+)\.(\d+)"', text)
    assert tuple(map(int, low)) == native.MIN_TORCH
    assert _target(native.MIN_TORCH) in native.CXXFLAGS  # the build targets it: newer calls fail it


@pytest.mark.slow  # runs g++
def test_the_bindings_build_for_that_torch_and_not_the_one_before():
    """Against the installed headers, targeting the stated lower bound compiles every binding, and
    targeting the release before it does not: the bound is the real one."""
    major, minor = native.MIN_TORCH
    for src in native.CXX_SOURCES:
        ok = _compiles(src, native.MIN_TORCH)
        assert ok.returncode == 0, f"{src.name} needs a newer torch than {major}.{minor}:\n{ok.stderr[-2000:]}"
    older = [_compiles(src, (major, minor - 1)) for src in native.CXX_SOURCES]
    assert any(r.returncode != 0 for r in older), f"torch {major}.{minor - 1} would do: lower MIN_TORCH"


def test_another_architecture_is_refused_before_compiling(monkeypatch):
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native.platform, "machine", lambda: "aarch64")

    def no_build():
        raise AssertionError("the x86 sources were compiled on aarch64")

    monkeypatch.setattr(native, "_build", no_build)
    why = native.native_ops_unavailable()
    assert why is not None and "x86-64" in why and "aarch64" in why
    native.check_architecture("x86_64")  # no error
