"""The Makefile installs into the project's .venv and never into the system Python.

`make -n -B` prints every command `make install serve test test-fast` would run, without running any; each
one that calls python or pip must be the venv's, except the system python3 that creates the venv.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")

# A python, pip or sluice program (not a module after `-m`), with its directory if any.
_PY = re.compile(r"(?<!-m )(?<![\w/.=-])((?:/?[\w.-]+/)*(?:python3?(?:\.\d+)?|pip3?|sluice))(?=\s|$)")


def _dry_run(*targets: str, **variables: str) -> list[str]:
    args = [f"{k}={v}" for k, v in variables.items()]
    proc = subprocess.run(
        ["make", "-n", "-B", "--no-print-directory", *targets, *args],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=60,
    )
    return [line.strip() for line in proc.stdout.splitlines() if line.strip()]


def test_every_python_and_pip_call_is_the_venvs(tmp_path) -> None:
    venv = tmp_path / "venv"
    lines = _dry_run("install", "serve", "test", "test-fast", VENV=str(venv))
    commands = [line for line in lines if not line.startswith("#")]
    system_uses = []
    for line in commands:
        for program in _PY.findall(line):
            if not program.startswith(f"{venv}/bin/"):
                system_uses.append((program, line))
    # The system python3 only checks for and creates the venv; nothing else runs outside it.
    assert all(program == "python3" for program, _ in system_uses), system_uses
    assert sorted(line for _, line in system_uses) == sorted([
        "python3 -c 'import ensurepip, venv' 2>/dev/null \\",
        f"python3 -m venv {venv}",
    ]), system_uses
    installs = [line for line in commands if re.search(r"\bpip\b.*\binstall\b", line)]
    assert installs == [
        f"{venv}/bin/python -m pip install --quiet torch==2.13.0",
        f"{venv}/bin/python -m pip install --quiet -e '.[engine,gateway,test,bench]'",
    ]
    assert not any("--user" in line or "sudo pip" in line for line in commands)
    # serve and test run the venv's programs; make test hands the venv's python to the docker set-up
    assert f"{venv}/bin/sluice serve" in commands
    assert f"{venv}/bin/python -m pytest -q -p no:cacheprovider tests" in commands
    assert f"PYTHON={venv}/bin/python bash .ci/setup-docker.sh" in commands
    assert (f'SLUICE_TEST_TIER=fast {venv}/bin/python -m pytest -q -p no:cacheprovider tests/unit '
            '-m "not model and not redis and not slow"') in commands


def test_default_venv_is_dot_venv_in_the_repo() -> None:
    lines = _dry_run("install")
    assert "python3 -m venv .venv" in lines
    assert ".venv/bin/python -m pip install --quiet torch==2.13.0" in lines
    assert ".venv/" in (REPO / ".gitignore").read_text().splitlines()
    # never shipped into an image's build context (it holds the whole install)
    dockerignore = (REPO / ".dockerignore").read_text().splitlines()
    assert dockerignore[0].startswith("#") and "*" in dockerignore and "!.venv" not in dockerignore


@pytest.mark.slow  # creates a virtual environment
def test_make_venv_creates_an_isolated_environment(tmp_path) -> None:
    """`make venv` really creates a venv that does not see the system's site-packages."""
    venv = tmp_path / "v"
    subprocess.run(
        ["make", "--no-print-directory", "venv", f"VENV={venv}", f"SYSTEM_PYTHON={sys.executable}"],
        cwd=REPO, check=True, capture_output=True, timeout=300,
    )
    cfg = (venv / "pyvenv.cfg").read_text()
    assert re.search(r"^include-system-site-packages = false$", cfg, re.M), cfg
    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import sys, importlib.util; print(sys.prefix != sys.base_prefix, importlib.util.find_spec('fastapi') is None)"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.split()
    assert probe == ["True", "True"]  # a venv, and the system's packages (fastapi) are not visible
