"""Removing what a model nobody serves any more left in Redis (``contract.served_key``).

Every engine's heartbeat refreshes its model's served key, with the engine's ``--model-grace-s`` as
TTL. When the key is gone nobody has served the model for that long, and any gateway removes the
model: first, in each queue shard, the entries nobody waits for (their deadline passed, their
gateway is gone or done with them, or, without either, they are older than the grace), then the
shard's streams that hold nothing (tenants' lanes and the lanes set with them:
``contract.SHARD_FORGET_SCRIPT``), and once every stream is gone, the card, the shard counts and
the model's name (``contract.MODEL_FORGET_SCRIPT``, which leaves them if an engine serves the model
again meanwhile), then the registry entries of its dead engines. A request its gateway still waits
for is left to that gateway, which answers it ``no_engine`` (``Broker.withdraw``) and deletes its
entry. Every step is idempotent: gateways may do it at once, and a failed round is done again.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from redis.exceptions import ResponseError

from sluice.wire import card as wire_card
from sluice.wire import contract, registry, shards, tenants
from sluice.wire.messages_pb2 import GenerateRequest

log = logging.getLogger("sluice.gateway.unserved")

# Entries looked at per stream and round (a queue left with more is finished in later rounds).
SCAN_ENTRIES = 200


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def unserved_models(redis: Any) -> list[str]:
    """The models with a name in the models set and no served key (two round trips)."""
    models = sorted(_s(m) for m in await redis.smembers(contract.MODELS_KEY))
    if not models:
        return []
    pipe = redis.pipeline(transaction=False)
    for model in models:
        pipe.exists(contract.served_key(model))
    return [m for m, served in zip(models, await pipe.execute(), strict=True) if not served]


async def _shard_count(redis: Any, model: str) -> int:
    pipe = redis.pipeline(transaction=False)  # both in the registry's slot
    pipe.smembers(contract.queue_shards_key(model))
    pipe.hget(contract.model_card_key(model), wire_card.F_QUEUE_SHARDS)
    counts, on_card = await pipe.execute()
    try:
        card_count = int(on_card) if on_card is not None else 0
    except ValueError:
        card_count = 0
    return max(shards.shard_count(counts, 1), min(card_count, contract.MAX_QUEUE_SHARDS), 1)


async def _nobody_waits(redis: Any, entries: list[tuple[Any, Any]], model: str, shard: int,
                        grace_s: float, now: float) -> list[Any]:
    """The ids of the entries nobody waits for (see the module's docstring)."""
    checks: list[tuple[Any, GenerateRequest]] = []
    dead: list[Any] = []
    for entry_id, fields in entries:
        raw = (fields or {}).get(contract.REQUEST_FIELD)
        request = GenerateRequest()
        try:
            request.ParseFromString(raw or b"")
        except Exception:  # noqa: BLE001 - nobody can run an unreadable entry
            dead.append(entry_id)
            continue
        if raw is None or (request.deadline and request.deadline < now):
            dead.append(entry_id)
        elif request.gateway_id:
            checks.append((entry_id, request))
        elif now - shards.entry_ms(entry_id) / 1000 > grace_s:
            dead.append(entry_id)
    if checks:
        pipe = redis.pipeline(transaction=False)  # single-key commands: a cluster pipeline routes each
        for _, request in checks:
            pipe.exists(contract.gateway_key(request.gateway_id))
            pipe.exists(contract.inflight_key(model, shard, request.request_id))
        flags = await pipe.execute()
        dead += [entry_id for i, (entry_id, _) in enumerate(checks) if not (flags[2 * i] and flags[2 * i + 1])]
    return dead


async def forget_model(redis: Any, model: str, *, grace_s: float = contract.DEFAULT_MODEL_GRACE_S,
                       now: float | None = None) -> bool:
    """One round of removing an unserved model's keys; True when the model is gone."""
    now = time.time() if now is None else now
    count = await _shard_count(redis, model)
    pipe = redis.pipeline(transaction=False)
    for shard in range(count):
        pipe.smembers(contract.lanes_key(model, shard))
    lanes = await pipe.execute(raise_on_error=False)
    shard_forget = redis.register_script(contract.SHARD_FORGET_SCRIPT)
    left = 0
    for shard in range(count):
        members = lanes[shard] if not isinstance(lanes[shard], Exception) else set()
        names = [""] + sorted({_s(t) for t in members if _s(t) and tenants.check_tenant_id(_s(t)) is None})
        streams = [contract.lane_stream(model, shard, t) for t in names]
        for stream in streams:
            try:
                entries = await redis.xrange(stream, count=SCAN_ENTRIES)
            except ResponseError:  # not a stream: leave it to the script (kept, counted)
                continue
            dead = await _nobody_waits(redis, entries, model, shard, grace_s, now) if entries else []
            if dead:
                await redis.xdel(stream, *dead)
                log.info("model %s: deleted %d queued requests nobody waits for (shard %d)", model, len(dead), shard)
        try:
            left += int(await shard_forget(keys=[contract.lanes_key(model, shard), *streams], args=names))
        except ResponseError as exc:  # e.g. WRONGTYPE: a key that is not ours; keep the model
            log.warning("model %s, shard %d: %s", model, shard, exc)
            left += 1
    if left:
        return False
    forgot = await redis.register_script(contract.MODEL_FORGET_SCRIPT)(
        keys=[contract.served_key(model), contract.model_card_key(model), contract.queue_shards_key(model),
              contract.MODELS_KEY], args=[model])
    if not forgot:
        return False
    await _prune_engines(redis, model)
    log.warning("model %s: no engine served it for its grace period; its card and queue are removed", model)
    return True


async def _prune_engines(redis: Any, model: str) -> None:
    """Remove the registry entries of the model's engines whose liveness key is gone."""
    entries = await redis.hgetall(contract.ENGINES_KEY)
    mine = [(_s(k), e) for k, v in entries.items() if (e := registry.decode(v)) is not None and e.model == model]
    if not mine:
        return
    pipe = redis.pipeline(transaction=False)
    for engine_id, _ in mine:
        pipe.exists(contract.engine_key(engine_id))
    gone = [engine_id for (engine_id, _), alive in zip(mine, await pipe.execute(), strict=True) if not alive]
    if gone:
        await redis.hdel(contract.ENGINES_KEY, *gone)
