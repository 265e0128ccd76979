"""The scheduler's counters. Per-request queue time and time to first token live on ``Request``
(``queue_time``, ``time_to_first_token``), stamped with the scheduler's clock."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class SchedulerStats:
    iterations: int = 0  # schedule() calls that scheduled at least one chunk
    schedule_calls: int = 0
    admissions: int = 0  # admissions from the waiting queue, re-admissions after preemption included
    preemptions: int = 0  # evictions by recompute
    thrashed_admissions: int = 0  # evicted before filling the block its admission bought
    forwarded_tokens: int = 0  # tokens the model computes (prefix-cache hits excluded)
    recomputed_tokens: int = 0  # forwarded again after a preemption
    prefix_cache_queries: int = 0  # tokens looked up at admission
    prefix_cache_hits: int = 0  # of those, served from the cache
    cached_block_evictions: int = 0  # cached block contents dropped to reuse the block
    requests_received: int = 0
    requests_rejected: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0

    @property
    def recompute_share(self) -> float:
        return self.recomputed_tokens / self.forwarded_tokens if self.forwarded_tokens else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["recompute_share"] = self.recompute_share
        d["prefix_cache_hit_rate"] = self.prefix_cache_hit_rate
        return d
