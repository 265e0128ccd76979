"""``sluice bench fairness``'s figures from its runs (the processes it starts are exercised by
tests/e2e/test_fair_share.py): rounds merged, p50 over alone, a light request never served counted
as the timeout at least."""

from __future__ import annotations

import argparse

import pytest

from sluice_bench.fairness import Run, add_arguments, format_table, merge, summarize


def test_rounds_merge_and_the_ratio_is_over_the_same_engine_counts_alone_run():
    alone = merge([Run(1, "alone", [10.0, 20.0, 30.0], 0, 0, 1.0), Run(1, "alone", [40.0], 0, 0, 1.0)])
    assert alone.light_ttft_ms == [10.0, 20.0, 30.0, 40.0] and alone.seconds == 2.0
    fair = Run(1, "fair", [30.0, 60.0, 90.0], 7, 3, 2.0)
    other = Run(2, "alone", [100.0], 0, 0, 1.0)
    fifo = Run(1, "fifo", [None, None, 50.0], 9, 0, 5.0)
    runs = [alone, fair, other, fifo]
    summarize(runs)
    assert alone.p50_ms == 25.0 and fair.p50_ms == 60.0 and fair.ratio_to_alone == 2.4
    assert fifo.p50_ms == float("inf") and fifo.ratio_to_alone is None  # most never served
    table = format_table(runs, 15.0)
    assert "| 1 | fair | 60 | 90 | 2.40 | 3/3 | 7 | 3 |" in table
    assert "| 1 | fifo | > 15,000 | > 15,000 | - | 1/3 | 9 | 0 |" in table


def test_the_defaults_are_a_small_slot_budget_and_one_queue_shard():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert (args.max_num_seqs, args.queue_shards, args.engines, args.rounds) == (4, 1, "1,2", 2)
    assert args.flood_requests >= 100 and args.light_interval == pytest.approx(1.0)
