"""The engine registry entry (``contract.ENGINES_KEY``, one hash field per engine), written once.

The engine's heartbeat writes it (:meth:`EngineEntry.encode`); gateways, ``WireClient``, the
registry prune and tests read it (:func:`decode`). JSON, so an operator can read it with
``redis-cli HGETALL``; unknown keys are ignored and missing ones take their defaults, so a newer
engine's entry still decodes. An entry that is not a JSON object decodes to None (a reader skips
it; the prune removes it once its liveness key is gone).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class EngineEntry:
    engine_id: str
    model: str
    heartbeat: float = 0.0  # unix seconds of the last beat
    draining: bool = False
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    live_requests: int = 0
    generation_tokens_per_s: float = 0.0
    grpc_port: int = 0  # the admin service's port; 0: none
    free_slots: int = -1  # entries its reader may still take (its admission credit); -1: unknown
    # queue shard -> prompt tokens it took from that shard lately (a decayed sum, ``shards.ShardLoad``):
    # every engine sums them into the shards' loads that bound ownership (``shards.balanced_owners``)
    shard_load: dict[int, float] = field(default_factory=dict, hash=False)
    owned_shards: tuple[int, ...] = ()  # the queue shards it owns (its last view): where ownership holds still

    @property
    def saturated(self) -> bool:
        """No room for more work at its last beat: requests wait inside it, or its credit is spent.
        Peers take its queue shards' entries without waiting for the steal bound."""
        return self.waiting > 0 or self.free_slots == 0

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_load(cls, engine_id: str, model: str, heartbeat: float, load: dict[str, Any]) -> EngineEntry:
        """From the worker's load snapshot (``EngineStats.load()`` plus the service's additions)."""
        known = {f.name for f in fields(cls)}
        return cls(engine_id=engine_id, model=model, heartbeat=heartbeat,
                   **{k: v for k, v in load.items() if k in known and k not in ("engine_id", "model", "heartbeat")})


_TYPES = {f.name: f.type for f in fields(EngineEntry)}
_CASTS = {"str": str, "float": float, "int": int, "bool": bool}


def decode(raw: bytes | str | None) -> EngineEntry | None:
    """An entry from its hash field value; None when it is not a readable entry."""
    if raw is None:
        return None
    try:
        data = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or not data.get("engine_id") or not data.get("model"):
        return None
    values: dict[str, Any] = {}
    for name, kind in _TYPES.items():
        if name == "shard_load":
            values[name] = _shard_load(data.get(name))
        elif name == "owned_shards":
            raw_owned = data.get(name)
            values[name] = tuple(sorted({s for s in raw_owned if type(s) is int and 0 <= s < 1 << 16})) \
                if isinstance(raw_owned, list) else ()
        elif name in data:
            try:
                values[name] = _CASTS[str(kind)](data[name])
            except (TypeError, ValueError):
                return None
    return EngineEntry(**values)


def _shard_load(raw: Any) -> dict[int, float]:
    """The shard loads of an entry; what is not a shard number with a finite, positive load is
    dropped (a peer's junk must not move ownership, nor stop the reader from decoding the rest)."""
    out: dict[int, float] = {}
    if not isinstance(raw, dict):
        return out
    for key, value in raw.items():
        try:
            shard, load = int(key), float(value)
        except (TypeError, ValueError):
            continue
        if 0 <= shard and 0 < load < float("inf"):
            out[shard] = load
    return out
