"""The engine's statistics: one type, from the step loop to the gRPC admin and the metrics.

``LLMEngine.get_stats()`` fills the scheduler's part; the service's worker adds its own (rates,
live requests, draining, identity) with ``dataclasses.replace``; ``GetStats`` sends it as the
``admin_pb2.EngineStats`` message, whose fields carry the same names (``to_proto``/``from_proto``;
tests/unit/test_stats.py keeps the two in step); the Prometheus collector reads its attributes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from sluice.wire.admin_pb2 import EngineStats as EngineStatsProto


@dataclass(frozen=True)
class EngineStats:
    # The engine loop's view (LLMEngine.get_stats()).
    running: int = 0
    waiting: int = 0  # preempted ones included
    preempted_waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    preemptions: int = 0
    iterations: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefix_cache_hit_rate: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0  # of those, tokens served from the cache
    finished_requests: int = 0
    # The service's additions (engine_service.service.worker).
    engine_id: str = ""
    model: str = ""
    generation_tokens_per_s: float = 0.0
    prompt_tokens_per_s: float = 0.0
    live_requests: int = 0  # read from the queue, not yet finished
    draining: bool = False

    @property
    def used_blocks(self) -> int:
        return max(0, self.total_blocks - self.free_blocks)

    @property
    def kv_cache_usage(self) -> float:
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0

    def to_proto(self) -> EngineStatsProto:
        return EngineStatsProto(**asdict(self))

    @classmethod
    def from_proto(cls, msg: EngineStatsProto) -> EngineStats:
        return cls(**{f.name: getattr(msg, f.name) for f in fields(cls)})

    def load(self) -> dict[str, Any]:
        """What the heartbeat publishes in the engine registry (``sluice:engines``)."""
        return {
            "running": self.running, "waiting": self.waiting, "free_blocks": self.free_blocks,
            "total_blocks": self.total_blocks, "live_requests": self.live_requests,
            "draining": self.draining, "generation_tokens_per_s": self.generation_tokens_per_s,
        }
