"""scripts/anchor_by_placement.py: stored `sluice bench anchor` runs, each iteration's share of its
bandwidth bound grouped by the placement the reading beside it says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.file_modules import load_file


def _script():
    return load_file("scripts/anchor_by_placement.py")


def _run(path: Path, rows: list[dict]) -> Path:
    path.write_text(json.dumps({"rows": rows}))
    return path


def test_iterations_are_pooled_by_the_reading_beside_them(tmp_path, capsys) -> None:
    script = _script()
    llama = {"system": "llama.cpp 0.3.36 (x.gguf)", "share_of_bandwidth_bound_runs": None,
             "read_bandwidth_beside_runs_gb_s": [33.0, 58.0]}
    a = _run(tmp_path / "a.json", [llama, {"system": "sluice bfloat16-native-steps",
                                           "share_of_bandwidth_bound_runs": [0.9, 0.7, 0.8],
                                           "read_bandwidth_beside_runs_gb_s": [33.0, 58.0, 44.0]}])
    b = _run(tmp_path / "b.json", [{"system": "sluice bfloat16-native-steps",
                                    "share_of_bandwidth_bound_runs": [0.85, 0.65],
                                    "read_bandwidth_beside_runs_gb_s": [36.0, 50.0]},
                                   {"system": "sluice int4-native", "share_of_bandwidth_bound_runs": [0.4],
                                    "read_bandwidth_beside_runs_gb_s": [31.0]}])
    pooled = script.pool([a, b], one_ccd=36.0, two_ccds=50.0)
    # the thresholds are inclusive; llama.cpp's row has no bound and is left out
    assert pooled == {"bfloat16-native-steps": {"one CCD": [0.9, 0.85], "two CCDs": [0.7, 0.65], "moved": [0.8]},
                      "int4-native": {"one CCD": [0.4]}}
    out_json = tmp_path / "out" / "pooled.json"
    assert script.main([str(a), str(b), "--json", str(out_json)]) == 0
    doc = json.loads(out_json.read_text())
    row = next(r for r in doc["rows"] if r["mode"] == "bfloat16-native-steps" and r["placement"] == "one CCD")
    assert row["at_least_0_8"] == 2 and row["median"] == pytest.approx(0.875)
    assert "bfloat16-native-steps" in capsys.readouterr().out


def test_thresholds_out_of_order_are_refused(tmp_path) -> None:
    with pytest.raises(SystemExit):
        _script().main([str(tmp_path / "a.json"), "--one-ccd", "50", "--two-ccds", "40"])
