"""Stored responses in Redis (``sluice.wire.contract.response_key``, layout in
``sluice.wire.stored_response``), through the broker's one Redis client: any gateway reads what
another wrote. Every write sets the TTL (``GatewayConfig.responses_ttl_s``; a response still
running gets a short one, renewed with the full TTL when it ends, so one whose gateway died does
not linger)."""

from __future__ import annotations

from typing import Any

from redis.exceptions import RedisError

from gateway import errors
from sluice.wire import contract
from sluice.wire.stored_response import StoredResponse, encode_fields


class ResponseStore:
    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self._save = redis.register_script(contract.RESPONSE_SAVE_SCRIPT)

    async def save(self, response_id: str, ttl_s: float, *, create: bool = False, **fields: Any) -> bool:
        """Write ``fields`` (``stored_response.F_*`` names) and the TTL; with ``create`` false only
        while the response still exists (False: it was deleted or expired meanwhile)."""
        try:
            written = await self._save(keys=[contract.response_key(response_id)],
                                       args=[int(ttl_s * 1000), "create" if create else "update",
                                             *encode_fields(**fields)])
        except (RedisError, OSError) as exc:
            raise errors.redis_down(exc) from exc
        return bool(written)

    async def load(self, response_id: str) -> StoredResponse | None:
        try:
            raw = await self.redis.hgetall(contract.response_key(response_id))
        except (RedisError, OSError) as exc:
            raise errors.redis_down(exc) from exc
        return StoredResponse.decode(raw) if raw else None

    async def delete(self, response_id: str) -> bool:
        try:
            return bool(await self.redis.delete(contract.response_key(response_id)))
        except (RedisError, OSError) as exc:
            raise errors.redis_down(exc) from exc


def store_of(request: Any) -> ResponseStore:
    """The app's store (one per worker, over the broker's client)."""
    state = request.app.state
    store = getattr(state, "response_store", None)
    if store is None or store.redis is not state.broker.redis:
        store = state.response_store = ResponseStore(state.broker.redis)
    return store
