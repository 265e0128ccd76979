"""``sluice bench responses-memory``, short: a real stack (redis-server, the stub engine, a gateway)
builds a chain and a conversation; each turn's stored memory stops growing once its ancestors'
window is full, while the whole-conversation copy it compares with keeps growing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.model, pytest.mark.redis]


@pytest.mark.parametrize("mode", ["chain", "conversation"])
def test_bench_responses_memory_is_flat_per_turn(tmp_path, mode):
    out = tmp_path / "memory.json"
    done = subprocess.run([sys.executable, "-m", "sluice_cli.cli", "bench", "responses-memory", "--turns", "14",
                           "--mode", mode, "--max-model-len", "2048", "--result-file", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "| last / first |" in done.stdout
    result = json.loads(out.read_text())
    turns = result["per_turn"]
    assert [t["turn"] for t in turns] == list(range(1, 15)) and result["mode"] == mode
    assert all(t["log_bytes"] > 0 and t["stored_bytes"] > 0 for t in turns)
    # past the window of ancestors (8), a turn costs what the one before did (hash encodings round a little)
    late = [t["stored_bytes"] for t in turns[9:]]
    assert max(late) <= 1.2 * turns[1]["stored_bytes"], turns
    assert turns[-1]["copy_bytes"] > 2 * turns[1]["copy_bytes"]  # the layout it replaces grows with the turns
