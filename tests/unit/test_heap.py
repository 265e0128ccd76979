"""A long-lived process freezes its start-up heap (``sluice.heap``): full collections then walk only
what serving allocated, and garbage made after start-up is still collected."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# a gateway process as uvicorn builds it (its factory), then a full collection's walk and a cycle
# dropped after start-up
GATEWAY_PROCESS = """
import gc, json
from gateway.app import app_factory
app_factory()
walked = len(gc.get_objects())
frozen = gc.get_freeze_count()
class Node: pass
a, b = Node(), Node()
a.other, b.other = b, a
del a, b
print(json.dumps({"frozen": frozen, "walked": walked, "collected": gc.collect()}))
"""


def _run(code: str) -> dict:
    env = {**os.environ, "SLUICE_REDIS_URL": "redis://127.0.0.1:1/0"}  # never dialled: no lifespan runs
    env.pop("SLUICE_GATEWAY_CONFIG", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_gateway_process_freezes_its_startup_heap_and_still_collects_new_garbage():
    seen = _run(GATEWAY_PROCESS)
    # FastAPI's, pydantic's and the app's own objects: tens of thousands, now out of every walk
    assert seen["frozen"] > 20_000, seen
    assert seen["walked"] < seen["frozen"] / 10, seen
    assert seen["collected"] >= 2, seen  # the two nodes of a cycle made after the freeze


def test_freeze_startup_heap_collects_first_and_reports_the_frozen_count():
    seen = _run("""
import gc, json, weakref
from sluice.heap import freeze_startup_heap
class Node: pass
a = Node(); a.me = a
alive = weakref.ref(a)
del a
before = gc.get_freeze_count()
frozen = freeze_startup_heap()
print(json.dumps({"before": before, "frozen": frozen, "count": gc.get_freeze_count(),
                  "cycle_alive": alive() is not None}))
""")
    assert seen["before"] == 0 and seen["frozen"] == seen["count"] > 0, seen
    # the cycle dropped before the call was collected, not frozen (frozen, it would live forever)
    assert not seen["cycle_alive"], seen
