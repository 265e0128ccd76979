"""The engine service's knobs (the engine's own are ``engine_service.config.EngineConfig``).

The fields made with ``knob(...)`` are ``sluice engine``'s flags and ``--config`` keys (and
``sluice serve``'s, which forwards them); the plain fields below them are internal tunables a
program or a test may set, not the command line.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass

from sluice.config import knob, shared
from sluice.wire import contract

LOOPBACK = "127.0.0.1"
ADMIN_TOKEN_ENV = "SLUICE_ADMIN_TOKEN"
DEFAULT_GRPC_PORT = 50051


def default_engine_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class ServiceSettings:
    knob_title = "engine service"  # its --help group and docs section (a class attribute, not a knob)

    redis_url: str = shared.redis_url()
    grpc_port: int = knob(DEFAULT_GRPC_PORT, "port of gRPC health and EngineAdmin (0: none)", bounds=(0, 65535),
                          field_default=0)  # ServiceSettings() in a process (tests, benches): no gRPC server
    # loopback unless told otherwise: anyone who reaches the admin port can drain the engine
    grpc_host: str = knob(LOOPBACK, "address of the gRPC server (0.0.0.0 for all interfaces, e.g. for "
                                    "Kubernetes' gRPC probes)")
    admin_token: str | None = knob(
        None, "require `authorization: Bearer TOKEN` metadata on EngineAdmin.Drain (unset: Drain is open to "
        "whoever reaches the gRPC port; `sluice serve` generates one)", env=ADMIN_TOKEN_ENV, secret=True,
        metavar="TOKEN")
    metrics_port: int = knob(0, "serve Prometheus metrics on http://HOST:PORT/metrics (0: off)", bounds=(0, 65535))
    metrics_host: str = knob(LOOPBACK, "address of the metrics server (0.0.0.0 for all interfaces)")
    engine_id: str | None = knob(None, "consumer name and registry id (default: host-pid-random)")
    max_queue_wait: float = knob(0.0, "refuse requests that waited longer than this many seconds in the queue "
                                      "(0: no limit)", bounds=(0, None))
    drain_grace_s: float = knob(30.0, "on SIGTERM or Drain, how long running requests may take to finish",
                                bounds=(0, None))
    heartbeat_ttl_s: float = knob(contract.HEARTBEAT_TTL_S, "liveness key TTL in seconds; other engines reclaim "
                                  "this one's requests after it lapses", flag="heartbeat-ttl", bounds=(0.1, None))
    # a gateway whose key stays missing this long is gone and its requests are aborted; 0: never
    gateway_lost_after_s: float = knob(
        contract.GATEWAY_LOST_AFTER_S, "abort the requests of a gateway whose liveness key has been missing this "
        "many seconds (it crashed; 0: never)", flag="gateway-lost-after", bounds=(0, None))
    # The sharded queue (sluice.wire.shards): shard count published on the card (engines serve the
    # largest count any engine published), leading full blocks that choose a shard, and stealing.
    queue_shards: int = knob(contract.DEFAULT_QUEUE_SHARDS, "streams the model's request queue is sharded into, "
                             "published on the model card (gateways follow the card; engines serve every shard any "
                             "engine published)", bounds=(1, contract.MAX_QUEUE_SHARDS))
    shard_prefix_blocks: int = knob(contract.DEFAULT_SHARD_PREFIX_BLOCKS, "full KV blocks at the start of a prompt "
                                    "whose tokens choose its queue shard (published on the model card)",
                                    bounds=(0, 1 << 16))
    steal_after_ms: int = knob(contract.DEFAULT_STEAL_AFTER_MS, "take another shard's entries once the oldest has "
                               "waited this long (ms), when this engine has room", bounds=(0, 3_600_000))
    shard_load_slack: float = knob(
        contract.DEFAULT_SHARD_LOAD_SLACK, "how far above its fair share (by KV capacity) of the queue's recent prompt "
        "tokens an engine's owned shards may go before a shard goes to the next engine in its hash order "
        "(bounded-load ownership; a large value such as 100: ownership by the hash alone)", bounds=(0, None))
    model_grace_s: float = knob(contract.DEFAULT_MODEL_GRACE_S, "how long the model's card and queue stay in Redis "
                                "after its last engine is gone; then gateways remove them (the model is unknown)",
                                bounds=(1, None))
    log_level: str = shared.log_level()

    # --- internal tunables (not knobs) ---
    heartbeat_interval_s: float = contract.HEARTBEAT_INTERVAL_S
    reclaim_interval_s: float = 0.5  # how often pending entries of dead engines are looked for
    reclaim_min_idle_ms: int = 1000  # XCLAIM's min-idle: two reclaimers never both win an entry
    read_block_ms: int = 100  # bounds a read's round trip (the socket timeout leaves room for it)
    steal_probe_ms: int = 20  # at most one look at other shards per this many ms (when there is room)
    read_idle_ms: int = 10  # the longest pause between reads of an idle queue (the pause doubles from 1 ms)
    max_read_batch: int = 16  # at most this many entries per XREADGROUP: a replica takes a bite, not the queue
    trim_interval_s: float = 2.0  # how often acknowledged stream entries are trimmed, dead engines pruned
    orphan_check_s: float = 5.0  # how often our own pending entries are checked for lost acknowledgements
    orphan_idle_ms: int = 30_000  # an own pending entry idle this long and not held by the worker is an orphan
    gateway_check_s: float = 1.0  # how often the liveness keys of the gateways we serve are checked
    shard_load_half_life_s: float = contract.SHARD_LOAD_HALF_LIFE_S  # the shard loads' decay
    publish_retry_s: float = 60.0  # how long events are retried while Redis is away

    def __post_init__(self) -> None:
        if not self.engine_id:
            self.engine_id = default_engine_id()
