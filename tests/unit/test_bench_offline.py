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
    # FLOP utilisation: the workload's FLOPs at Sluice's pace over a GEMM's rate in the same run
    sluice = doc["rows"][0]
    assert doc["sluice_gflops"] == pytest.approx(doc["workload_flops"] / sluice["seconds"] / 1e9)
    assert doc["gemm_dtype"] == "float32" and doc["gemm_peak_gflops"] > 0
    assert doc["flop_utilisation"] == pytest.approx(doc["sluice_gflops"] / doc["gemm_peak_gflops"])
    assert "FLOP utilisation" in out


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

    from sluice_bench.offline import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).enforce_eager is None  # the engine's default
    assert parser.parse_args(["--enforce-eager"]).enforce_eager is True
    assert parser.parse_args(["--no-enforce-eager"]).enforce_eager is False
    assert parser.parse_args(["--compile"]).enforce_eager is False


def test_workload_flops_count_every_product_once() -> None:
    """A request's FLOPs, counted token by token: each token through the decoder multiplies every
    projection and attends over the keys up to itself; each sampled token multiplies the head."""
    from sluice_bench.flops import ModelShape

    shape = ModelShape(hidden=8, intermediate=12, layers=2, heads=4, kv_heads=2, head_dim=2, vocab=10)
    per_layer = 8 * 8 + 2 * (8 * 4) + 8 * 8 + 3 * 8 * 12  # q, k and v, o, gate/up/down
    assert shape.layer_weights == per_layer
    prompt, output = 5, 3
    want = 0
    for position in range(prompt + output - 1):  # the last output is never fed back
        want += 2 * 2 * per_layer + 2 * 2 * (2 * 4 * 2 * (position + 1))
    want += output * 2 * 8 * 10
    assert shape.request_flops(prompt, output) == want
