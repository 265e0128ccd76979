"""``sluice bench spec`` end to end on a tiny run: one engine, each workload with and without
speculation; the table and the JSON. Speed is not asserted (benchmarks measure it); what must
hold is: greedy outputs identical with and without speculation, drafts made on the grounded
workload, and ``disable_by_batch_size`` keeping the batched workload from drafting."""

from __future__ import annotations

import json

import pytest

from sluice.cpuinfo import cpu_model

pytestmark = pytest.mark.model


def _run(model_dir, path, spec: dict, grounded: int = 1) -> dict:
    from sluice_cli.cli import main

    argv = ["bench", "spec", "--model", str(model_dir), "--mode", "float32", "--num-grounded", str(grounded),
            "--output-len", "24", "--num-random", "2", "--random-prompt-len", "48", "--random-output-len", "24",
            "--speculative-config", json.dumps(spec), "--json", str(path)]
    assert main(argv) == 0
    return json.loads(path.read_text())


def test_bench_spec_writes_table_and_json_and_outputs_are_identical(model_dir, tmp_path, capsys) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    doc = _run(model_dir, tmp_path / "spec.json", spec)
    grounded, batched = doc["results"]["grounded, 1 stream"], doc["results"]["random, 2 at once"]
    # the engine's configuration: "auto" resolved (float32 eager's rows each cost their own products)
    assert doc["mode"] == "float32" and doc["speculative_config"] == {**spec, "backoff": "on"}
    assert doc["one_pass_rows"] == 1
    assert doc["processor"] == cpu_model() != ""
    for r in (grounded, batched):
        assert r["identical_outputs"] == r["requests"]
        assert r["plain"]["tokens"] == r["spec"]["tokens"] > 0
        for name in ("plain", "spec"):  # decoding alone: each request's tokens after its first
            run = r[name]
            assert run["decode_tokens"] == run["tokens"] - r["requests"]
            assert 0 < run["decode_seconds"] < run["seconds"]
            assert run["decode_tokens_per_s"] == pytest.approx(run["decode_tokens"] / run["decode_seconds"])
    assert grounded["num_drafts"] > 0 and grounded["num_accepted_tokens"] > 0
    assert batched["num_drafts"] > 0  # so that none below is the knob's doing
    out = capsys.readouterr().out
    assert "tok/verify" in out and "back-off on" in out

    doc = _run(model_dir, tmp_path / "off.json", {**spec, "disable_by_batch_size": 1}, grounded=0)
    off = doc["results"]["random, 2 at once"]
    assert off["num_drafts"] == 0 and off["identical_outputs"] == off["requests"]  # two running: above 1, no drafts


def test_bench_spec_refuses_an_unknown_mode(capsys) -> None:
    from sluice_cli.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "spec", "--mode", "fp8"])
    assert exc.value.code == 2
    assert "invalid choice: 'fp8'" in capsys.readouterr().err
