"""One stats type end to end: the dataclass and its gRPC message carry the same fields."""

from __future__ import annotations

from dataclasses import fields

from sluice.wire.admin_pb2 import EngineStats as EngineStatsProto
from sluice.wire.stats import EngineStats


def test_dataclass_and_message_have_the_same_fields():
    assert {f.name for f in fields(EngineStats)} == set(EngineStatsProto.DESCRIPTOR.fields_by_name)


def test_round_trip_through_the_message():
    s = EngineStats(running=3, waiting=5, preempted_waiting=2, free_blocks=30, total_blocks=40, preemptions=7,
                    iterations=55, prompt_tokens_total=900, generation_tokens_total=321, prefix_cache_hit_rate=0.25,
                    prefix_cache_queries=640, prefix_cache_hits=160, finished_requests=12, engine_id="e1",
                    model="m", generation_tokens_per_s=12.5, prompt_tokens_per_s=40.0, live_requests=8, draining=True)
    back = EngineStats.from_proto(EngineStatsProto.FromString(s.to_proto().SerializeToString()))
    assert back == s
    assert (s.used_blocks, s.kv_cache_usage) == (10, 0.25)
    assert EngineStats().kv_cache_usage == 0.0  # an empty pool is not a division by zero


def test_registry_load_is_what_gateways_read():
    load = EngineStats(running=1, waiting=2, free_blocks=3, total_blocks=4, live_requests=5).load()
    assert load == {"running": 1, "waiting": 2, "free_blocks": 3, "total_blocks": 4, "live_requests": 5,
                    "draining": False, "generation_tokens_per_s": 0.0}
