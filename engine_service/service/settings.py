"""The service's own knobs (the engine's are in ``engine_service.config.EngineConfig``)."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field

from sluice.wire import contract

LOOPBACK = "127.0.0.1"
ADMIN_TOKEN_ENV = "SLUICE_ADMIN_TOKEN"


def default_engine_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class ServiceSettings:
    redis_url: str = "redis://localhost:6379/0"
    grpc_port: int = 0  # 0: no gRPC server (in-process tests)
    # loopback unless told otherwise: anyone who reaches the admin port can drain the engine
    grpc_host: str = LOOPBACK
    admin_token: str | None = None  # when set, EngineAdmin.Drain needs `authorization: Bearer TOKEN`
    metrics_port: int = 0  # Prometheus /metrics on this port; 0: no metrics server
    metrics_host: str = LOOPBACK
    engine_id: str = field(default_factory=default_engine_id)
    max_queue_wait: float = 0.0  # seconds a request may wait in the queue before it is refused; 0: no limit
    drain_grace_s: float = 30.0
    heartbeat_interval_s: float = contract.HEARTBEAT_INTERVAL_S
    heartbeat_ttl_s: float = contract.HEARTBEAT_TTL_S
    reclaim_interval_s: float = 0.5  # how often pending entries of dead engines are looked for
    reclaim_min_idle_ms: int = 1000  # XCLAIM's min-idle: two reclaimers never both win an entry
    read_block_ms: int = 100  # bounds a read's round trip (the socket timeout leaves room for it)
    # The sharded queue (sluice.wire.shards): shard count published on the card (engines serve the
    # largest count any engine published), leading full blocks that choose a shard, and stealing.
    queue_shards: int = contract.DEFAULT_QUEUE_SHARDS
    shard_prefix_blocks: int = contract.DEFAULT_SHARD_PREFIX_BLOCKS
    steal_after_ms: int = contract.DEFAULT_STEAL_AFTER_MS  # another shard's entry that waited this long is taken
    steal_probe_ms: int = 20  # at most one look at other shards per this many ms (when there is room)
    read_idle_ms: int = 10  # the longest pause between reads of an idle queue (the pause doubles from 1 ms)
    max_read_batch: int = 16  # at most this many entries per XREADGROUP: a replica takes a bite, not the queue
    trim_interval_s: float = 2.0  # how often acknowledged stream entries are trimmed, dead engines pruned
    orphan_check_s: float = 5.0  # how often our own pending entries are checked for lost acknowledgements
    orphan_idle_ms: int = 30_000  # an own pending entry idle this long and not held by the worker is an orphan
    gateway_check_s: float = 1.0  # how often the liveness keys of the gateways we serve are checked
    # a gateway whose key stays missing this long is gone and its requests are aborted; 0: never
    gateway_lost_after_s: float = contract.GATEWAY_LOST_AFTER_S
    publish_retry_s: float = 60.0  # how long events are retried while Redis is away
