"""``sluice bench quality`` end to end on a tiny run: the table and the JSON (numbers are not
asserted beyond what must hold: float32 agrees with itself, perplexities are finite)."""

from __future__ import annotations

import json
import math

import pytest

pytestmark = pytest.mark.model


def test_bench_quality_writes_table_and_json(model_dir, tmp_path, capsys) -> None:
    from sluice_cli.cli import main

    path = tmp_path / "quality.json"
    argv = ["bench", "quality", "--model", str(model_dir), "--modes", "float32,int8,float32-bf16-cache",
            "--num-prompts", "2", "--max-tokens", "4", "--json", str(path)]
    assert main(argv) == 0
    doc = json.loads(path.read_text())
    ref, q, cache = doc["modes"]
    assert (ref["mode"], q["mode"], cache["mode"]) == ("float32", "int8", "float32-bf16-cache")
    assert (ref["kv_cache_dtype"], cache["kv_cache_dtype"]) == ("auto", "bfloat16")
    assert ref["agreement"] == 1.0 and 0.0 <= q["agreement"] <= 1.0
    # the cache's rounding moves the prompt's log-probabilities, a little
    assert cache["perplexity"] != ref["perplexity"] and abs(cache["perplexity"] / ref["perplexity"] - 1) < 0.05
    assert all(math.isfinite(r["perplexity"]) and r["perplexity"] > 1 for r in doc["modes"])
    assert ref["perplexity_tokens"] > 300
    assert "perplexity" in capsys.readouterr().out


def test_bench_quality_refuses_a_reference_other_than_float32() -> None:
    from sluice_cli.cli import main

    with pytest.raises(SystemExit, match="float32 first"):
        main(["bench", "quality", "--modes", "int8,int4"])
