"""sluice bench redis-capacity's measurement on a real redis-server, for two seconds: real
engine I/O (RedisIO + Worker, fake engine) and real gateway Brokers in their own processes."""

from __future__ import annotations

import pytest

from sluice_bench import redis_capacity as bench
from sluice_cli.cli import main

pytestmark = pytest.mark.redis


@pytest.mark.parametrize("topology", ["standalone", "cluster"])
def test_measure_counts_requests_events_and_commands(topology):
    cfg = bench.BenchConfig(duration_s=2.0, warmup_s=0.5, engines=1, gateways=1, concurrency=8, tokens=5)
    with bench.Standalone() if topology == "standalone" else bench.Cluster(replicas=0) as started:
        result = bench.measure(started, cfg)
    check = result["check"]
    # every request of the whole run (those in flight at the stop finish) got all its events
    assert check["completed"] > 0 and check["bad"] == 0
    assert check["events_of_completed"] == check["expected_events"] == check["completed"] * cfg.tokens
    # the window
    assert result["requests"] > 0 and result["requests_per_s"] > 0
    assert result["token_events"] > 0
    in_flight = cfg.gateways * cfg.concurrency  # requests straddling either edge of the window
    assert abs(result["token_events"] - result["requests"] * cfg.tokens) <= 2 * in_flight * cfg.tokens
    # commandstats saw one enqueue script per request (within the requests straddling the edges)
    by_command = result["commands_per_request_by_command"]
    # two scripts per request: the gateway's enqueue (its XADD) and the engine's take
    assert abs(by_command["evalsha"] * result["requests"] - 2 * result["requests"]) <= 4 * in_flight
    assert by_command["xadd"] == pytest.approx(by_command["evalsha"] / 2, rel=0.05)  # run by the enqueue script
    assert result["commands_per_request"] >= 1
    assert "info" not in by_command  # the bench's own polling is not charged to requests
    assert result["client_commands_per_request"] < result["commands_per_request"]
    # every request costs at least its enqueue round trip; Redis used some CPU on one node
    assert result["round_trips_per_request_loadgens"] >= 1
    assert result["round_trips_per_request_engines"] > 0
    assert result["redis_cpu_s_per_1k_requests"] > 0 and result["requests_per_cpu_s"] > 0
    nodes = result["per_node"].values()
    assert sum(n["command_share"] for n in nodes) == pytest.approx(1.0)
    if topology == "standalone":
        assert result["masters"] == 1 and result["busiest_node_cpu_share"] == 1.0
    else:  # commands summed over the three masters; the queue's and the gateway's slots on some of them
        assert result["masters"] == 3 and result["busiest_node_cpu_share"] < 1.0
        assert sum(1 for n in nodes if n["commands"] > 0) >= 2


def test_cli_refuses_bad_options(capsys):
    assert main(["bench", "redis-capacity", "--concurrency", "0"]) == 2
    assert "--concurrency must be positive" in capsys.readouterr().err
    assert main(["bench", "redis-capacity", "--topologies", "sentinel"]) == 2
    assert "unknown" in capsys.readouterr().err


def test_cancels_reach_only_the_engine_that_holds_the_request():
    cfg = bench.BenchConfig(duration_s=2.0, warmup_s=0.5, engines=2, gateways=1, concurrency=8, tokens=4000,
                            cancel_after=2)  # cancelled long before their end: a stop string's cancel
    with bench.Standalone() as started:
        result = bench.measure(started, cfg)
    assert result["check"]["bad"] == 0
    sent, received = result["cancels_sent"], result["cancels_received_per_engine"]
    in_flight = cfg.gateways * cfg.concurrency  # cancels straddling the window's edges
    assert sent > in_flight
    assert abs(sum(received) - sent) <= in_flight  # each cancel heard once, not once per engine (2x sent)
