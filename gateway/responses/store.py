"""Stored responses in Redis (``sluice.wire.contract.response_key``, layout in
``sluice.wire.stored_response``), through the broker's one Redis client: any gateway reads what
another wrote. Every write sets the TTL (``GatewayConfig.responses_ttl_s``; a response still
running gets a short one, renewed with the full TTL when it ends, so one whose gateway died does
not linger).

A store is the caller's tenant's view (:func:`store_of`): a response records its tenant when it is
created, and another tenant's response is, to every read and delete, one that does not exist.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import RedisError

from gateway import errors
from sluice.wire import contract
from sluice.wire import stored_response as sr
from sluice.wire.stored_response import StoredResponse, encode_fields


class _Scripts:
    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self.save = redis.register_script(contract.RESPONSE_SAVE_SCRIPT)
        self.delete = redis.register_script(contract.RESPONSE_DELETE_SCRIPT)


class ResponseStore:
    def __init__(self, redis: Any, tenant: str = "", scripts: _Scripts | None = None) -> None:
        self.redis = redis
        self.tenant = tenant
        self._scripts = scripts if scripts is not None and scripts.redis is redis else _Scripts(redis)

    async def save(self, response_id: str, ttl_s: float, *, create: bool = False, **fields: Any) -> bool:
        """Write ``fields`` (``stored_response.F_*`` names) and the TTL; with ``create`` false only
        while the response still exists (False: it was deleted or expired meanwhile). A response is
        created as this store's tenant's."""
        if create:
            fields[sr.F_TENANT] = self.tenant or None  # the default tenant's: no field, as before tenants
        try:
            written = await self._scripts.save(keys=[contract.response_key(response_id)],
                                               args=[int(ttl_s * 1000), "create" if create else "update",
                                                     *encode_fields(**fields)])
        except (RedisError, OSError) as exc:
            raise errors.redis_down(exc) from exc
        return bool(written)

    async def load(self, response_id: str) -> StoredResponse | None:
        """The response, None when unknown, expired, deleted or another tenant's."""
        try:
            raw = await self.redis.hgetall(contract.response_key(response_id))
        except (RedisError, OSError) as exc:
            raise errors.redis_down(exc) from exc
        if not raw:
            return None
        stored = StoredResponse.decode(raw)
        return stored if stored.tenant == self.tenant else None

    async def delete(self, response_id: str) -> bool:
        """Delete the response if it is this tenant's; False when there is none of its."""
        try:
            return bool(await self._scripts.delete(keys=[contract.response_key(response_id)], args=[self.tenant]))
        except (RedisError, OSError) as exc:
            raise errors.redis_down(exc) from exc


def store_of(request: Any) -> ResponseStore:
    """The caller's tenant's store (one set of scripts per worker, over the broker's client)."""
    state = request.app.state
    scripts = getattr(state, "response_scripts", None)
    if scripts is None or scripts.redis is not state.broker.redis:
        scripts = state.response_scripts = _Scripts(state.broker.redis)
    principal = getattr(request.state, "principal", None)
    return ResponseStore(state.broker.redis, principal.tenant if principal is not None else "", scripts)
