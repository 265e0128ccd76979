"""The sharded request queue seen from a test: every shard's stream, pending entries and lengths
summed over them (engines serve ``contract.DEFAULT_QUEUE_SHARDS`` unless a test says otherwise)."""

from __future__ import annotations

from typing import Any

import redis

from engine_service.service.io_types import EntryRef
from sluice.wire import contract


def streams(model: str, shards: int = contract.DEFAULT_QUEUE_SHARDS) -> list[str]:
    return contract.request_streams(model, shards)


def pending_refs(r: Any, model: str, consumer: str | None = None,
                 shards: int = contract.DEFAULT_QUEUE_SHARDS) -> set[EntryRef]:
    """Every pending entry of the model's queue (of ``consumer`` only, if given), by shard stream."""
    out: set[EntryRef] = set()
    for stream in streams(model, shards):
        try:
            rows = r.xpending_range(stream, contract.CONSUMER_GROUP, min="-", max="+", count=10_000,
                                    **({"consumername": consumer} if consumer else {}))
        except redis.ResponseError:
            continue
        out |= {EntryRef(stream, row["message_id"]) for row in rows}
    return out


def pending_count(r: Any, model: str, shards: int = contract.DEFAULT_QUEUE_SHARDS) -> int:
    return len(pending_refs(r, model, shards=shards))


def queue_length(r: Any, model: str, shards: int = contract.DEFAULT_QUEUE_SHARDS) -> int:
    """Entries in all the model's shard streams (XLEN summed)."""
    return sum(int(r.xlen(s)) for s in streams(model, shards))


def inflight_pattern(model: str) -> str:
    """A KEYS pattern of the gateway's in-flight markers of ``model``, on every shard."""
    return f"{contract.PREFIX}:{{q:{model}:*}}:inflight:*"


def engines_group(r: Any, stream: str) -> dict | None:
    """XINFO GROUPS' entry of the engines' consumer group on ``stream``; None while there is none
    (an engine's reader creates it) or no stream yet."""
    try:
        groups = r.xinfo_groups(stream)
    except redis.ResponseError:  # no such key yet
        return None
    return next((g for g in groups if g["name"] in (contract.CONSUMER_GROUP, contract.CONSUMER_GROUP.encode())),
                None)


def has_group(r: Any, stream: str) -> bool:
    return engines_group(r, stream) is not None


def lag(r: Any, model: str, shards: int = contract.DEFAULT_QUEUE_SHARDS) -> int:
    """Entries of the model's queue no engine has read yet (the group's lag, summed over shards)."""
    groups = (engines_group(r, stream) for stream in streams(model, shards))
    return sum(int(g["lag"] or 0) for g in groups if g is not None)
