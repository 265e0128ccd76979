"""``sluice bench latency`` runs end to end on a tiny workload and writes its JSON (speed is never
asserted, only that the figures exist and are consistent)."""

from __future__ import annotations

import argparse
import json

import pytest

from sluice_bench import latency

pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]


def test_bench_latency_writes_table_and_json(model_dir, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    latency.add_arguments(parser)
    out = tmp_path / "latency.json"
    args = parser.parse_args(["--model", str(model_dir), "--input-len", "24", "--output-len", "4", "--num-iters", "2",
                              "--batch-size", "2", "--dtype", "float32", "--enforce-eager", "--json", str(out)])
    assert latency.run(args) == 0
    result = json.loads(out.read_text())
    assert [r["system"] for r in result["rows"]] == ["sluice (float32, eager, native attention)", "transformers generate"]
    sluice = result["raw"][0]
    assert len(sluice["ttft_ms"]) == 4 and len(sluice["tpot_ms"]) == 4  # 2 iterations x batch 2
    assert all(v > 0 for v in sluice["ttft_ms"] + sluice["tpot_ms"])
    assert result["peak_rss_mb"] > 100 and result["compile_warmup_s"] is None
    assert result["decode_speedup_vs_transformers"] > 0
    text = capsys.readouterr().out
    assert "TTFT" in text and "transformers generate" in text and "peak RSS" in text


def test_bench_latency_refuses_bad_sizes(capsys):
    parser = argparse.ArgumentParser()
    latency.add_arguments(parser)
    assert latency.run(parser.parse_args(["--output-len", "0"])) == 2
    assert "--output-len must be at least 1" in capsys.readouterr().err


def test_bench_latency_names_a_narrower_kv_cache(model_dir, tmp_path):
    parser = argparse.ArgumentParser()
    latency.add_arguments(parser)
    out = tmp_path / "latency.json"
    args = parser.parse_args(["--model", str(model_dir), "--input-len", "24", "--output-len", "2", "--num-iters", "1",
                              "--dtype", "float32", "--enforce-eager", "--kv-cache-dtype", "bfloat16", "--no-hf",
                              "--json", str(out)])
    assert latency.run(args) == 0
    result = json.loads(out.read_text())
    assert [r["system"] for r in result["rows"]] == ["sluice (float32, eager, native attention, bfloat16 cache)"]
