"""Waiting on a condition, once for every test: poll until it holds or fail with what was awaited.

Tests wait on what they need (an endpoint answering, a key gone, a counter moved), never a fixed
sleep that hopes it has happened: a sleep is too short on a loaded machine and too long elsewhere.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import httpx

T = TypeVar("T")


def wait_until(cond: Callable[[], T], timeout: float, what: str, interval: float = 0.02) -> T:
    """``cond()``'s first truthy value, polled every ``interval`` s; ``AssertionError`` naming
    ``what`` after ``timeout`` s."""
    end = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(interval)


def wait_http(url: str, *, status: int = 200, timeout: float, procs: Sequence[subprocess.Popen] = (),
              log: Path | None = None, interval: float = 0.3) -> httpx.Response:
    """Poll ``GET url`` until it answers ``status`` (a health check, usually); fail at once when one
    of ``procs`` exited (with ``log``'s text, when given), or after ``timeout`` s."""
    last: str = "no answer"

    def answered() -> httpx.Response | None:
        nonlocal last
        for p in procs:
            if p.poll() is not None:
                tail = log.read_text(errors="replace")[-4000:] if log is not None and log.exists() else ""
                raise RuntimeError(f"{p.args} exited with {p.returncode} while waiting for {url}\n{tail}")
        try:
            r = httpx.get(url, timeout=2)
        except httpx.HTTPError as exc:
            last = type(exc).__name__
            return None
        last = f"{r.status_code} {r.text[:200]}"
        return r if r.status_code == status else None

    try:
        return wait_until(answered, timeout, f"GET {url} answering {status}", interval)
    except AssertionError as exc:
        raise AssertionError(f"{exc} (last: {last})") from None
