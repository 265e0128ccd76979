"""``sluice bench offline`` end to end on a tiny workload: table, JSON and its bar chart."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.model


def test_bench_offline_writes_json_and_chart(model_dir, tmp_path, capsys) -> None:
    from sluice_cli.cli import main

    path = tmp_path / "offline.json"
    argv = ["bench", "offline", "--model", str(model_dir), "--num-requests", "3", "--prompt-len", "4-8",
            "--output-len", "2-4", "--hf-batch-sizes", "2", "--sampler-batch", "4", "--json", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert [r["system"] for r in doc["rows"]] == ["sluice (continuous batching)", "transformers generate, batch 2"]
    assert doc["rows"][0]["output_tokens"] == doc["rows"][1]["output_tokens"] > 0
    chart = path.with_suffix(".png")
    assert f"wrote {chart}" in out
    data = chart.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(data[16:20], "big") > 500


def test_bench_offline_modes_cycled_concurrency_and_peak_memory(model_dir, tmp_path, capsys) -> None:
    from sluice_cli.cli import main

    path = tmp_path / "offline.json"
    argv = ["bench", "offline", "--model", str(model_dir), "--num-requests", "3", "--prompt-len", "4-8",
            "--output-len", "2-4", "--hf-batch-sizes", "", "--sampler-batch", "4", "--quantization", "int8",
            "--enforce-eager", "--cycled-concurrency", "7", "--json", str(path), "--no-plot"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert doc["sluice_mode"] == "float32+int8, eager, native attention" and doc["workload"]["quantization"] == "int8"
    assert [r["system"] for r in doc["rows"]] == ["sluice (continuous batching)", "sluice, 7 at once"]
    base, cycled = doc["rows"]
    assert cycled["requests"] == 7 and cycled["output_tokens"] > base["output_tokens"]
    assert doc["peak_rss_mb"] > 100 and doc["compile_warmup_s"] is None
    assert "peak memory of the engine process" in out and "cycled to 7 at once" in out


def test_compile_flags_match_bench_latency() -> None:
    import argparse

    from engine_service.bench.offline import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).enforce_eager is None  # the engine's default
    assert parser.parse_args(["--enforce-eager"]).enforce_eager is True
    assert parser.parse_args(["--no-enforce-eager"]).enforce_eager is False
    assert parser.parse_args(["--compile"]).enforce_eager is False
