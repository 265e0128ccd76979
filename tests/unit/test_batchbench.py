"""batchbench: the model-free simulator drives the real scheduler; the watermark sweep of the issue."""

from __future__ import annotations

import json

from engine_service.config import SchedulerConfig
from sluice_bench.scheduler import (
    WorkloadSpec,
    aggregate,
    make_workload,
    measure_step_cost,
    simulate,
    sweep_watermarks,
)
from sluice_cli.cli import main

RESERVES = [0, 1, 2, 3]


def tight(num_blocks: int = 8) -> SchedulerConfig:
    """The issue's setting: 3 slots, 8 blocks of 4 tokens, a budget of 10 tokens."""
    return SchedulerConfig(
        num_blocks=num_blocks, block_size=4, max_num_seqs=3, max_num_batched_tokens=10, max_model_len=33
    )


def workload(seed: int = 0):
    return make_workload(WorkloadSpec(num_requests=8, seed=seed), max_kv_tokens=32)


def test_workload_is_seeded_and_passes_the_door():
    a, b = workload(3), workload(3)
    assert [(r.arrival, r.prompt_token_ids, r.output_len) for r in a] == [
        (r.arrival, r.prompt_token_ids, r.output_len) for r in b
    ]
    assert workload(4)[0].prompt_token_ids != a[0].prompt_token_ids
    assert all(len(r.prompt_token_ids) + r.output_len - 1 <= 32 for r in a)
    timed = make_workload(WorkloadSpec(num_requests=20, arrival_rate=0.5, seed=1))
    arrivals = [r.arrival for r in timed]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0


def test_evictions_fall_as_the_reserve_grows():
    results = sweep_watermarks(tight(), workload(0), RESERVES, check_invariants=True)
    evictions = [r.evictions for r in results]
    assert all(r.finished == 8 for r in results)
    assert evictions == sorted(evictions, reverse=True) and evictions[0] > evictions[-1]
    assert results[0].thrashed_admissions > results[-1].thrashed_admissions
    assert results[0].recompute_share > results[-1].recompute_share
    # the price: a larger reserve delays admissions, so the work takes more iterations
    assert results[-1].iterations >= results[0].iterations
    # over several workloads, the sums fall at every step of the reserve
    per_seed = [sweep_watermarks(tight(), workload(seed), RESERVES) for seed in range(8)]
    sums = [aggregate([runs[i] for runs in per_seed]).evictions for i in range(len(RESERVES))]
    assert all(x > y for x, y in zip(sums, sums[1:], strict=False)), sums


def test_on_a_roomy_pool_the_reserve_changes_nothing():
    for seed in range(3):
        results = sweep_watermarks(tight(num_blocks=64), workload(seed), RESERVES, check_invariants=True)
        assert all(r.evictions == 0 and r.recomputed_tokens == 0 for r in results)
        keys = {
            (r.iterations, r.forwarded_tokens, r.queue_time_mean_steps, r.ttft_mean_steps) for r in results
        }
        assert len(keys) == 1


def test_simulate_with_arrivals_and_shared_prefix():
    cfg = SchedulerConfig(
        num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=129
    )
    wl = make_workload(
        WorkloadSpec(num_requests=12, seed=2, arrival_rate=0.3, prompt_len=(1, 6), shared_prefix_len=16),
        max_kv_tokens=128,
    )
    r = simulate(cfg, wl, watermark_blocks=1, check_invariants=True)
    assert r.finished == 12 and r.prefix_cache_hit_rate > 0.3
    assert r.queue_time_mean_steps is not None and r.ttft_mean_steps >= r.queue_time_mean_steps


def test_step_cost_measurement_runs():
    cost = measure_step_cost(num_running=8, num_waiting=20, steps=5, prompt_len=16)
    assert cost["num_running"] == 8 and cost["num_waiting"] == 20
    assert cost["step_us_mean"] > 0 and cost["step_us_p99"] >= cost["step_us_p50"] > 0


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    path = tmp_path / "bb.json"
    argv = ["bench", "scheduler", "--sweep-watermarks", "0,1,2,3", "--json", str(path), "--check-invariants"]
    argv += ["--cost-running", "8", "--cost-waiting", "16", "--cost-steps", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "reserve" in out and "evictions" in out and "thrash" in out and "recompute" in out
    assert "us/step" in out
    doc = json.loads(path.read_text())
    assert [r["watermark_blocks"] for r in doc["results"]] == RESERVES
    assert doc["cost"]["num_running"] == 8
    assert main(["bench", "scheduler", "--num-seeds", "2", "--no-cost"]) == 0
    assert "seeds 0..1, summed" in capsys.readouterr().out


def test_tenants_workload_shows_the_light_tenant_served_ahead_of_the_flood(tmp_path, capsys):
    """``--tenants``: behind a flood, the light tenant's TTFT stays within 3x of its TTFT alone with
    fair share, and is far beyond it first come first served; weights split the tokens."""
    path = tmp_path / "tenants.json"
    argv = ["bench", "scheduler", "--tenants", "--flood-requests", "60", "--light-requests", "8",
            "--light-every", "30", "--check-invariants", "--json", str(path),
            "--cost-running", "8", "--cost-waiting", "16", "--cost-steps", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "light TTFT p50" in out and "weights 3:1" in out and "of 2 tenant(s)" in out
    doc = json.loads(path.read_text())
    runs = {r["name"]: r for r in doc["runs"]}
    assert set(runs) == {"alone", "fifo (one tenant)", "fair, no slot moves", "fair"}
    assert runs["fair"]["ratio_to_alone"] <= 3.0
    assert runs["fifo (one tenant)"]["ratio_to_alone"] > 10.0
    assert runs["fair, no slot moves"]["light_ttft_p50"] < runs["fifo (one tenant)"]["light_ttft_p50"]
    assert abs(doc["weights"]["share"] / doc["weights"]["expected"] - 1) < 0.15
    assert [c["tenants"] for c in doc["cost"]] == [1, 2]
