"""Usage: what each tenant used, per model and UTC hour, in Redis (``contract.usage_key``).

The engines write it: each engine request that ends (finished, cancelled, failed or expired: the work
was done all the same) adds its prompt, completion and cached tokens and one request to its tenant's
hash of the hour, in the same pipelined round trip that publishes the step's events (no extra round
trip, and nothing is lost with a gateway). ``sluice usage`` reads it back over a period; any process
with the Redis URL can.

A hash field is ``<model>|<counter>``; the hashes expire ``RETENTION_S`` after their hour.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Iterable
from dataclasses import dataclass

from sluice.wire import contract

RETENTION_S = 35 * 24 * 3600
COUNTERS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens")
SEPARATOR = "|"


def hour_of(ts: float) -> str:
    """The UTC hour of a unix time, as a key part: ``YYYYMMDDHH``."""
    return time.strftime("%Y%m%d%H", time.gmtime(ts))


@dataclass
class Usage:
    """One engine request's use (``record``), or a sum of them (``read``)."""

    tenant: str
    model: str
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, other: Usage) -> None:
        for name in COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(other, name))


def record(pipe, used: Iterable[Usage], now: float | None = None) -> None:
    """Add ``used`` to a pipeline (summed per tenant and model first: one HINCRBY per counter)."""
    totals: dict[tuple[str, str], Usage] = {}
    for u in used:
        key = (u.tenant, u.model)
        if key not in totals:
            totals[key] = Usage(u.tenant, u.model)
        totals[key].add(u)
    if not totals:
        return
    hour = hour_of(time.time() if now is None else now)
    for (tenant, model), u in totals.items():
        key = contract.usage_key(tenant, hour)
        for name in COUNTERS:
            value = getattr(u, name)
            if value:
                pipe.hincrby(key, f"{model}{SEPARATOR}{name}", value)
        pipe.expire(key, RETENTION_S + 3600)
    pipe.sadd(contract.USAGE_TENANTS_KEY, *{tenant for tenant, _ in totals})


def hours(since: float, until: float) -> list[str]:
    """Every UTC hour from ``since``'s to ``until``'s."""
    start = int(since // 3600) * 3600
    return [hour_of(t) for t in range(start, int(until) + 1, 3600)]


def hour_start(hour: str) -> int:
    """The unix time an ``hour_of`` key part starts at."""
    return calendar.timegm(time.strptime(hour, "%Y%m%d%H"))


def parse(tenant: str, fields: dict) -> list[Usage]:
    """One usage hash (``HGETALL``) as a Usage per model; fields that are not ours are skipped."""
    per_model: dict[str, Usage] = {}
    for raw_field, raw_value in fields.items():
        name = raw_field.decode() if isinstance(raw_field, bytes) else raw_field
        model, _, counter = name.rpartition(SEPARATOR)
        if counter not in COUNTERS or not model:
            continue
        u = per_model.setdefault(model, Usage(tenant, model))
        setattr(u, counter, getattr(u, counter) + int(raw_value))
    return list(per_model.values())


def read(redis, since: float, until: float, tenant: str | None = None) -> list[Usage]:
    """Every tenant's (or one tenant's) use per model over the hours from ``since`` to ``until``."""
    tenants = [tenant] if tenant is not None else sorted(
        t.decode() if isinstance(t, bytes) else t for t in redis.smembers(contract.USAGE_TENANTS_KEY))
    span = hours(since, until)
    pipe = redis.pipeline(transaction=False)
    keys = [(t, contract.usage_key(t, h)) for t in tenants for h in span]
    for _, key in keys:
        pipe.hgetall(key)
    totals: dict[tuple[str, str], Usage] = {}
    for (t, _), fields in zip(keys, pipe.execute() if keys else [], strict=True):
        for u in parse(t, fields):
            totals.setdefault((t, u.model), Usage(t, u.model)).add(u)
    return sorted(totals.values(), key=lambda u: (u.tenant, u.model))
