"""Stored responses in Redis (``sluice.wire.contract.response_key``, layout in
``sluice.wire.stored_response``), through the broker's one Redis client: any gateway reads what
another wrote. Every write sets the TTL (``GatewayConfig.responses_ttl_s``; a response still
running gets a short one, renewed with the full TTL when it ends, so one whose gateway died does
not linger).

A ``previous_response_id`` chain is read by :meth:`ResponseStore.chain`: a walk back along the
links, a window of ancestors per pipelined round trip, bounded by the number of items a prompt
can hold, renewing each response's TTL as it goes.

A store is the caller's tenant's view (:func:`store_of`): a response records its tenant when it is
created, and another tenant's response is, to every read and delete, one that does not exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from gateway import errors
from sluice.wire import contract
from sluice.wire import stored_response as sr
from sluice.wire.stored_response import StoredResponse, encode_fields

# What a chain walk reads of each response.
_CHAIN_FIELDS = (sr.F_TENANT, sr.F_STATUS, sr.F_INPUT, sr.F_RESPONSE, sr.F_ANCESTORS, sr.F_CONVERSATION)


def prompt_items(items: list[dict[str, Any]]) -> int:
    """How many of ``items`` the prompt renders (a reasoning item is left out): each takes a token
    of the context at least, which is what bounds a conversation."""
    return sum(1 for item in items if item.get("type") != "reasoning")


@dataclass
class Chain:
    """The conversation a ``previous_response_id`` continues, oldest item first. ``cut``: the walk
    stopped at its bound, and older items were left out."""

    items: list[dict[str, Any]]
    cut: bool = False


class MissingLink(Exception):
    """A response of the chain is gone (deleted, expired) or not the caller's tenant's."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


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

    async def chain(self, first_id: str, first: StoredResponse, ttl_s: float, most: int) -> Chain:
        """The conversation that ends with ``first`` (already loaded, ended): each response's input
        and output, back along the ancestors, at most ``most`` prompt items (then ``cut``). Every
        response read gets its TTL renewed to ``ttl_s`` (never shortened). Raises
        :class:`MissingLink` naming a response of the chain that is gone."""
        turns: list[list[dict[str, Any]]] = []
        count = 0

        def take(stored: StoredResponse) -> bool:
            """Keep a response's turn; False when the walk ends with it."""
            nonlocal count
            whole = stored.conversation is not None and not stored.ancestors  # written before links
            turn = stored.conversation if whole else (stored.input or []) + stored.output()
            turns.append(turn)
            count += prompt_items(turn)
            return not whole and count <= most

        ttl_ms = int(ttl_s * 1000)
        renew = [first_id]
        pending = first.ancestors if take(first) else []
        try:
            while pending or renew:
                pipe = self.redis.pipeline(transaction=False)
                for rid in renew:
                    pipe.pexpire(contract.response_key(rid), ttl_ms, gt=True)
                for rid in pending:
                    pipe.hmget(contract.response_key(rid), _CHAIN_FIELDS)
                    pipe.pexpire(contract.response_key(rid), ttl_ms, gt=True)
                results = await pipe.execute()
                read = results[len(renew)::2]
                renew, batch, pending = [], pending, []
                for rid, values in zip(batch, read, strict=True):
                    if values[1] is None:  # no status: no such response
                        raise MissingLink(rid)
                    stored = StoredResponse.decode(dict(zip(_CHAIN_FIELDS, values, strict=True)))
                    if stored.tenant != self.tenant:
                        raise MissingLink(rid)
                    if not take(stored):
                        pending = []
                        break
                    pending = stored.ancestors  # the last one read names the next window
        except (RedisError, OSError) as exc:
            raise errors.redis_down(exc) from exc
        items = [item for turn in reversed(turns) for item in turn]
        excess, start = prompt_items(items) - most, 0
        if excess <= 0:
            return Chain(items)
        while excess > 0:  # the newest items within the bound
            excess -= items[start].get("type") != "reasoning"
            start += 1
        return Chain(items[start:], cut=True)

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
