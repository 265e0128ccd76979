"""Conversations in Redis (the ``{conv:<id>}`` family of ``sluice.wire.contract``), through the
broker's one Redis client, so that any gateway serves any conversation. Every operation is one of
the contract's scripts over the conversation's own slot: it checks the caller's tenant, reads or
writes, and sets the TTL of the conversation's keys together (``GatewayConfig.responses_ttl_s``
from its last write or use by a response).

A store is the caller's tenant's view (:func:`conversations_of`): another tenant's conversation
is, to every operation, one that does not exist (``None`` / ``False``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from gateway import errors
from sluice.wire import contract


@dataclass
class StoredConversation:
    id: str
    created_at: int
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass
class ItemPage:
    items: list[dict[str, Any]]
    has_more: bool


class ItemExists(Exception):
    def __init__(self, item_id: str) -> None:
        super().__init__(item_id)
        self.item_id = item_id


class NoSuchItem(Exception):
    """An item id the conversation does not hold."""


def _json(items: list[dict[str, Any]]) -> list[str]:
    out: list[str] = []
    for item in items:
        out += [item["id"], json.dumps(item, separators=(",", ":"))]
    return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Scripts:
    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self.create = redis.register_script(contract.CONVERSATION_CREATE_SCRIPT)
        self.add = redis.register_script(contract.CONVERSATION_ADD_SCRIPT)
        self.get = redis.register_script(contract.CONVERSATION_GET_SCRIPT)
        self.update = redis.register_script(contract.CONVERSATION_UPDATE_SCRIPT)
        self.delete = redis.register_script(contract.CONVERSATION_DELETE_SCRIPT)
        self.item = redis.register_script(contract.CONVERSATION_ITEM_SCRIPT)
        self.item_delete = redis.register_script(contract.CONVERSATION_ITEM_DELETE_SCRIPT)
        self.page = redis.register_script(contract.CONVERSATION_PAGE_SCRIPT)
        self.tail = redis.register_script(contract.CONVERSATION_TAIL_SCRIPT)


class ConversationStore:
    def __init__(self, redis: Any, tenant: str = "", ttl_s: float = 24 * 3600.0,
                 scripts: _Scripts | None = None) -> None:
        self.redis = redis
        self.tenant = tenant
        self.ttl_ms = int(ttl_s * 1000)
        self._scripts = scripts if scripts is not None and scripts.redis is redis else _Scripts(redis)

    async def _run(self, script: Any, conversation_id: str, *args: Any) -> Any:
        try:
            return await script(keys=contract.conversation_keys(conversation_id), args=list(args))
        except (RedisError, OSError) as exc:
            raise errors.redis_down(exc) from exc

    @staticmethod
    def _object(conversation_id: str, answer: list) -> StoredConversation | None:
        if int(answer[0]) < 0:
            return None
        return StoredConversation(conversation_id, int(_text(answer[1])), json.loads(_text(answer[2])))

    async def create(self, conversation_id: str, created_at: int, metadata: dict[str, str],
                     items: list[dict[str, Any]]) -> bool:
        """A new conversation holding ``items`` (each with its id); False when the id exists."""
        return bool(await self._run(self._scripts.create, conversation_id, self.ttl_ms, self.tenant, created_at,
                                    json.dumps(metadata), *_json(items)))

    async def get(self, conversation_id: str, *, renew: bool = False) -> StoredConversation | None:
        return self._object(conversation_id, await self._run(self._scripts.get, conversation_id, self.ttl_ms,
                                                             self.tenant, "1" if renew else "0"))

    async def update(self, conversation_id: str, metadata: dict[str, str]) -> StoredConversation | None:
        return self._object(conversation_id, await self._run(self._scripts.update, conversation_id, self.ttl_ms,
                                                             self.tenant, json.dumps(metadata)))

    async def delete(self, conversation_id: str) -> bool:
        return bool(await self._run(self._scripts.delete, conversation_id, self.tenant))

    async def add(self, conversation_id: str, items: list[dict[str, Any]], *, strict: bool) -> int | None:
        """Append ``items``; the number added, None when there is no such conversation. ``strict``:
        an id the conversation holds already raises :class:`ItemExists` and adds nothing; else such
        items are skipped (a response's turn appended twice is appended once)."""
        answer = await self._run(self._scripts.add, conversation_id, self.ttl_ms, self.tenant,
                                 "strict" if strict else "skip", *_json(items))
        code = int(answer[0])
        if code == -1:
            return None
        if code == -2:
            raise ItemExists(_text(answer[1]))
        return int(answer[1])

    async def item(self, conversation_id: str, item_id: str) -> dict[str, Any] | None:
        """The item; None for no such conversation; :class:`NoSuchItem` for no such item."""
        answer = await self._run(self._scripts.item, conversation_id, self.tenant, item_id)
        if int(answer[0]) == -1:
            return None
        if int(answer[0]) == -2:
            raise NoSuchItem(item_id)
        return json.loads(_text(answer[1]))

    async def delete_item(self, conversation_id: str, item_id: str) -> StoredConversation | None:
        """Delete an item; the conversation after it, None for no such conversation;
        :class:`NoSuchItem` for no such item."""
        answer = await self._run(self._scripts.item_delete, conversation_id, self.ttl_ms, self.tenant, item_id)
        if int(answer[0]) == -2:
            raise NoSuchItem(item_id)
        return self._object(conversation_id, answer)

    async def page(self, conversation_id: str, *, order: str, after: str | None, limit: int) -> ItemPage | None:
        """A page of items in ``order`` after the item ``after``; None for no such conversation;
        :class:`NoSuchItem` when ``after`` is not one of its items."""
        answer = await self._run(self._scripts.page, conversation_id, self.tenant, order, after or "", limit)
        if int(answer[0]) == -1:
            return None
        if int(answer[0]) == -2:
            raise NoSuchItem(after or "")
        return ItemPage([json.loads(_text(v)) for v in answer[2:] if v is not None], bool(int(answer[1])))

    async def tail(self, conversation_id: str, most: int) -> tuple[list[dict[str, Any]], bool] | None:
        """Its newest ``most`` items, oldest first, and whether older ones were left out; None for no
        such conversation. Renews its TTL (a response uses it)."""
        answer = await self._run(self._scripts.tail, conversation_id, self.ttl_ms, self.tenant, most)
        if int(answer[0]) == -1:
            return None
        items = [json.loads(_text(v)) for v in answer[2:] if v is not None]
        items.reverse()
        return items, bool(int(answer[1]))


def conversations_of(request: Any) -> ConversationStore:
    """The caller's tenant's conversations (one set of scripts per worker, over the broker's client)."""
    state = request.app.state
    scripts = getattr(state, "conversation_scripts", None)
    if scripts is None or scripts.redis is not state.broker.redis:
        scripts = state.conversation_scripts = _Scripts(state.broker.redis)
    principal = getattr(request.state, "principal", None)
    return ConversationStore(state.broker.redis, principal.tenant if principal is not None else "",
                             state.config.responses_ttl_s, scripts)
