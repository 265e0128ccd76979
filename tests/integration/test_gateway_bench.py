"""``sluice bench serve`` against the gateway and the fake engine."""

from __future__ import annotations

import argparse
import json

import pytest

from sluice_bench import serve as bench_serve
from tests.integration import test_gateway_support as support

gateway = support.gateway
fake_engine = support.fake_engine
make_gateway = support.make_gateway

pytestmark = [pytest.mark.model, pytest.mark.redis]


def _args(argv: list[str]) -> argparse.Namespace:
    """``sluice bench serve``'s arguments, as its command line parses them."""
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    return parser.parse_args(argv)


def _baseline_argv(url: str, model_dir, out, prompts: int, warmups: int, *extra: str) -> list[str]:
    """A short random run against ``url`` with the offline baseline (the default model in float32),
    its result written to ``out``."""
    return ["--base-url", url, "--num-prompts", str(prompts), "--random-input-len", "16", "--random-output-len", "4",
            "--num-warmups", str(warmups), "--offline-baseline", "--offline-model", str(model_dir),
            "--offline-dtype", "float32", *extra, "--result-file", str(out), "--disable-tqdm", "--no-plot"]


def test_bench_serve_end_to_end(gateway, tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = _args([
        "--base-url", gateway.url, "--num-prompts", "12", "--random-input-len", "16", "--random-output-len", "8",
        "--request-rate", "50", "--max-concurrency", "4", "--goodput", "ttft:10000", "tpot:1000",
        "--result-file", str(out), "--disable-tqdm",
    ])
    assert bench_serve.run(args) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["total_output_tokens"] == 12 * 8
    assert result["total_input_tokens"] == 12 * 16
    assert result["model"] == support.MODEL
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert {"mean", "median", "p99"} <= set(result[key])
        assert result[key]["mean"] > 0
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    # every request's record, what the chart is drawn from
    records = result["requests"]
    assert len(records) == 12 and all(r["ok"] and r["error"] == "" for r in records)
    assert all(r["output_tokens"] == 8 and len(r["itl_s"]) >= 1 for r in records)
    assert all(0 < r["ttft_s"] <= r["latency_s"] for r in records)
    assert all(0 <= r["start_s"] < result["duration_s"] for r in records)
    assert max(r["start_s"] for r in records) > 0  # sent over time (50 req/s), not all at t=0
    out_text = capsys.readouterr().out
    assert "Serving Benchmark Result" in out_text
    chart = out.with_suffix(".png")
    assert f"chart written to {chart}" in out_text
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_offline_baseline_runs_the_warm_ups_first_and_compares_cache_hits(gateway, fake_engine, model_dir,
                                                                              tmp_path, capsys, monkeypatch):
    from engine_service.llm import LLM

    out = tmp_path / "bench.json"
    argv = _baseline_argv(gateway.url, model_dir, out, 6, 3)
    offline_runs: list[list[list[int]]] = []
    real = LLM.generate
    monkeypatch.setattr(LLM, "generate", lambda self, prompts, *a, **kw: offline_runs.append(list(prompts))
                        or real(self, prompts, *a, **kw))
    before = len(fake_engine.requests)
    assert bench_serve.run(_args(argv)) == 0
    result = json.loads(out.read_text())
    sent = [list(r.prompt_token_ids) for r in fake_engine.requests[before:]]
    warm, measured = sent[:3], sent[3:]
    # the warm-ups went first to both sides, and share no prompt with the measured requests
    assert len(sent) == 9 and result["completed"] == 6 and result["num_warmups"] == 3
    assert [len(run) for run in offline_runs] == [3, 6]
    assert sorted(offline_runs[0]) == sorted(warm) and sorted(offline_runs[1]) == sorted(measured)
    assert not set(map(tuple, warm)) & set(map(tuple, measured))
    base = result["offline_baseline"]
    assert base["total_output_tokens"] == 6 * 4 and base["total_cached_prompt_tokens"] == 0
    assert base["served_over_offline"] == pytest.approx(result["output_throughput"] / base["output_throughput"])
    assert "warning" not in capsys.readouterr().err
    # a served engine whose cache held the prompts (an earlier run's) did less work: said so
    monkeypatch.setattr(fake_engine, "cached_tokens", 16)
    assert bench_serve.run(_args([*argv, "--num-warmups", "0"])) == 0
    assert json.loads(out.read_text())["total_cached_prompt_tokens"] == 6 * 16
    assert "did not compute the same work" in capsys.readouterr().err


def test_rounds_alternate_served_and_offline_runs_on_fresh_prompts(gateway, fake_engine, model_dir, tmp_path,
                                                                    capsys, monkeypatch):
    import statistics

    from engine_service.llm import LLM

    out = tmp_path / "bench.json"
    offline_runs: list[list[list[int]]] = []
    order: list[tuple[str, int]] = []  # both sides' runs, as they happened
    real, real_benchmark = LLM.generate, bench_serve.benchmark

    def generate(self, prompts, *a, **kw):
        offline_runs.append(list(prompts))
        order.append(("offline", len(prompts)))
        return real(self, prompts, *a, **kw)

    async def benchmark(args, requests, warmups=()):
        order.append(("served", len(warmups) + len(requests)))
        return await real_benchmark(args, requests, warmups)

    monkeypatch.setattr(LLM, "generate", generate)
    monkeypatch.setattr(bench_serve, "benchmark", benchmark)
    before = len(fake_engine.requests)
    assert bench_serve.run(_args(_baseline_argv(gateway.url, model_dir, out, 4, 2, "--rounds", "3"))) == 0
    sent = [list(r.prompt_token_ids) for r in fake_engine.requests[before:]]
    # served: warm-ups and round 0, then each later round; the offline engine's warm-ups, then each
    # round's requests right after the served ones
    assert order == [("served", 6), ("offline", 2), ("offline", 4), ("served", 4), ("offline", 4), ("served", 4),
                     ("offline", 4)]
    assert len(sent) == 2 + 3 * 4
    rounds_sent = [sorted(sent[2 + 4 * i:6 + 4 * i]) for i in range(3)]
    assert [sorted(run) for run in offline_runs[1:]] == rounds_sent
    assert len({tuple(map(tuple, r)) for r in rounds_sent}) == 3  # fresh prompts each round
    base = json.loads(out.read_text())["offline_baseline"]
    ratios = [r["served_over_offline"] for r in base["rounds"]]
    assert len(ratios) == 3 and ratios[0] == base["served_over_offline"]
    assert all(r["served_over_offline"] == pytest.approx(r["served_output_throughput"] / r["output_throughput"])
               for r in base["rounds"])
    assert base["median_served_over_offline"] == statistics.median(ratios)
    assert "Served / offline throughput, median:" in capsys.readouterr().out


def test_offline_cpus_place_the_offline_engine_and_only_it(gateway, fake_engine, model_dir, tmp_path, monkeypatch):
    """--offline-cpus: every offline run on those CPUs with a compute thread each, as `sluice serve
    --reserved-cpus` places the served engine; the served runs (the client) on the CPUs the bench had."""
    import os

    import torch

    from engine_service.llm import LLM
    from sluice.cpu_placement import pin_process

    home = sorted(os.sched_getaffinity(0))
    if len(home) < 2:
        pytest.skip("an offline engine on one CPU of several needs two CPUs; this machine gives one")
    seen: list[tuple[str, list[int], int]] = []
    real, real_benchmark = LLM.generate, bench_serve.benchmark

    def generate(self, prompts, *a, **kw):
        seen.append(("offline", sorted(os.sched_getaffinity(0)), torch.get_num_threads()))
        return real(self, prompts, *a, **kw)

    async def benchmark(args, requests, warmups=()):
        seen.append(("served", sorted(os.sched_getaffinity(0)), 0))
        return await real_benchmark(args, requests, warmups)

    monkeypatch.setattr(LLM, "generate", generate)
    monkeypatch.setattr(bench_serve, "benchmark", benchmark)
    threads = torch.get_num_threads()
    out = tmp_path / "b.json"
    try:
        argv = _baseline_argv(gateway.url, model_dir, out, 2, 1, "--rounds", "2", "--offline-cpus", str(home[-1]))
        assert bench_serve.run(_args(argv)) == 0
        assert sorted(os.sched_getaffinity(0)) == home
    finally:  # whatever the bench did, every thread of the session runs where it did
        torch.set_num_threads(threads)
        pin_process(home)
    assert seen == [("served", home, 0), ("offline", [home[-1]], 1), ("offline", [home[-1]], 1),
                    ("served", home, 0), ("offline", [home[-1]], 1)]
    assert json.loads(out.read_text())["offline_baseline"]["cpus"] == str(home[-1])


@pytest.mark.parametrize(("extra", "says"), [
    (["--offline-baseline", "--offline-cpus", "0-x"], "--offline-cpus: '0-x' is not"),
    (["--offline-baseline", "--offline-cpus", "65535"], "--offline-cpus: CPU 65535 is not this process's to use"),
    (["--offline-cpus", "0"], "--offline-cpus places the --offline-baseline engine; there is none without it"),
])
def test_offline_cpus_that_cannot_work_are_refused(extra, says, capsys):
    args = _args(["--base-url", "http://127.0.0.1:9", "--no-plot", *extra])
    assert bench_serve.run(args) == 2  # before a request is sent: nothing listens on port 9
    assert says in capsys.readouterr().err


def test_an_offline_engine_that_refuses_its_settings_ends_the_bench_with_its_reason(gateway, model_dir, tmp_path,
                                                                                     capsys):
    """The served run done, an offline engine that cannot start (here a dtype it does not know; a
    cpuset that narrows --offline-cpus ends the same way) exits 2 with its reason, no traceback."""
    argv = _baseline_argv(gateway.url, model_dir, tmp_path / "b.json", 2, 0)
    argv[argv.index("--offline-dtype") + 1] = "float8"
    assert bench_serve.run(_args(argv)) == 2
    assert "--offline-baseline: dtype must be one of" in capsys.readouterr().err


def test_a_round_that_serves_nothing_fails_the_bench_and_is_named(gateway, fake_engine, model_dir, tmp_path,
                                                                  capsys, monkeypatch):
    out = tmp_path / "bench.json"
    real_benchmark = bench_serve.benchmark
    calls = 0

    async def benchmark(args, requests, warmups=()):
        nonlocal calls
        calls += 1
        if calls == 2:  # from round 1 on, the engine refuses every request
            monkeypatch.setattr(fake_engine, "error", ("invalid_request", "the fake engine refuses"))
        return await real_benchmark(args, requests, warmups)

    monkeypatch.setattr(bench_serve, "benchmark", benchmark)
    assert bench_serve.run(_args(_baseline_argv(gateway.url, model_dir, out, 3, 0, "--rounds", "3"))) == 1
    assert "served requests failed in round(s) 1, 2;" in capsys.readouterr().err
    rounds = json.loads(out.read_text())["offline_baseline"]["rounds"]
    assert [(r["served_completed"], r["served_failed"]) for r in rounds] == [(3, 0), (0, 3), (0, 3)]


@pytest.mark.parametrize("extra", [["--rounds", "0"], ["--rounds", "2"],
                                   ["--rounds", "2", "--offline-baseline", "--dataset", "jsonl",
                                    "--dataset-path", "x.jsonl"]])
def test_rounds_that_cannot_work_are_refused(extra, capsys):
    args = _args(["--base-url", "http://127.0.0.1:9", "--no-plot", *extra])
    assert bench_serve.run(args) == 2  # before a file is read or a request sent: nothing listens on port 9
    assert "--rounds" in capsys.readouterr().err


def test_dataset_and_arrivals_are_seeded():
    a = bench_serve.synthetic_dataset(5, 10, 4, 0.5, (100, 200), seed=3)
    b = bench_serve.synthetic_dataset(5, 10, 4, 0.5, (100, 200), seed=3)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert all(5 <= r.prompt_len <= 15 and len(r.prompt) == r.prompt_len for r in a)
    gaps = bench_serve.arrival_gaps(2000, 10.0, 1.0, False, seed=0)
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.1)
    assert bench_serve.arrival_gaps(3, float("inf"), 1.0, False, 0) == [0.0] * 3


def test_summarize_goodput():
    ok = bench_serve.RequestResult(ok=True, prompt_len=4, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1] * 4)
    slow = bench_serve.RequestResult(ok=True, prompt_len=4, output_tokens=5, ttft=2.0, latency=3.0, itl=[0.25] * 4)
    s = bench_serve.summarize([ok, slow, bench_serve.RequestResult(error="x")], 1.0, {"ttft": 500}, [50, 99])
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["request_goodput"] == 1.0
    assert s["tpot_ms"]["mean"] == pytest.approx((100 + 250) / 2)


def test_failed_requests_are_counted_with_their_error(gateway, fake_engine, tmp_path, monkeypatch, capsys):
    out = tmp_path / "bench.json"
    monkeypatch.setattr(fake_engine, "error", ("invalid_request", "the fake engine refuses"))
    args = _args(["--base-url", gateway.url, "--num-prompts", "3", "--random-input-len", "8",
                              "--random-output-len", "4", "--num-warmups", "2", "--result-file", str(out),
                              "--disable-tqdm", "--no-plot"])
    assert bench_serve.run(args) == 1  # nothing completed
    assert "warm-up: 2 requests, 2 failed (HTTP 400" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["completed"] == 0 and result["failed"] == 3
    (error,) = result["errors"]
    assert error.startswith("HTTP 400") and "the fake engine refuses" in error


def test_a_negative_warm_up_count_is_refused(capsys):
    args = _args(["--base-url", "http://127.0.0.1:9", "--num-warmups", "-1", "--no-plot"])
    assert bench_serve.run(args) == 2  # before any request is sent: nothing listens on port 9
    assert "--num-warmups must be at least 0" in capsys.readouterr().err


def test_a_gateway_that_does_not_answer_is_named():
    args = _args(["--base-url", "http://127.0.0.1:9", "--num-prompts", "1", "--no-plot"])
    with pytest.raises(SystemExit, match=r"cannot list the models at http://127.0.0.1:9/v1/models: Client"):
        bench_serve.run(args)
