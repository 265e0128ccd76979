"""Who is calling: the gateway's table of API keys, and the :class:`Principal` a key stands for.

The table merges three sources (``sluice.wire.keys``): ``--api-key`` (each key a tenant of its own),
the keys file (``gateway.keys_file``) and, with ``--redis-keys``, the keys ``sluice keys`` keeps in
Redis. A key given on the command line or in the file wins over the same key in Redis. The Redis
part is re-read whenever its version counter moves (checked every ``REFRESH_S``), so a key created
or revoked with ``sluice keys`` takes effect on every gateway within about a second; while Redis is
away the last table read stays in force.

A lookup costs one SHA-256 and one dict lookup: a key is looked up before the body is read, so an
unknown key is a 401 at once. With no key configured anywhere, every caller is the default tenant
(:data:`ANONYMOUS`) and nothing is checked, as before tenants existed.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from sluice.wire import contract, tenants
from sluice.wire.keys import KeyRecord, Limits, flag_tenant, key_hash

log = logging.getLogger("sluice.gateway.keys")

REFRESH_S = 1.0


@dataclass(frozen=True)
class Principal:
    """The caller of one request: its tenant, fair-share weight and limits."""

    tenant: str
    weight: int = tenants.DEFAULT_WEIGHT
    limits: Limits = field(default_factory=Limits)

    @property
    def label(self) -> str:
        """The tenant as a metric label or a log field (never the key)."""
        return tenants.label(self.tenant)


ANONYMOUS = Principal(tenants.DEFAULT_TENANT)


def flag_records(keys: list[str]) -> list[KeyRecord]:
    """The records of ``--api-key`` keys: each a tenant of its own."""
    return [KeyRecord(key_hash=key_hash(k), tenant=flag_tenant(k), source="flag") for k in dict.fromkeys(keys)]


class Keyring:
    def __init__(self, records: list[KeyRecord], *, redis_keys: bool = False) -> None:
        self._static = {r.key_hash: r for r in records}
        self._redis: dict[str, KeyRecord] = {}
        self.redis_keys = redis_keys
        self.loaded = not redis_keys  # the Redis part has been read at least once
        self._version: bytes | None = None
        self._shadowed_logged: set[str] = set()

    @property
    def enabled(self) -> bool:
        """Keys are required (some are configured, or the Redis table is in use)."""
        return bool(self._static) or self.redis_keys

    def __len__(self) -> int:
        return len(self._static.keys() | self._redis.keys())

    def lookup(self, token: bytes | str) -> Principal | None:
        """The principal of a presented key, None for an unknown (or revoked) one."""
        if isinstance(token, bytes):
            try:
                token = token.decode()
            except UnicodeDecodeError:
                return None
        hashed = key_hash(token)
        record = self._static.get(hashed) or self._redis.get(hashed)
        if record is None:
            return None
        return Principal(record.tenant, record.weight, record.limits)

    def tenants(self) -> set[str]:
        return {r.tenant for r in (*self._static.values(), *self._redis.values())}

    async def refresh(self, redis) -> bool:
        """Re-read the Redis table if its version moved; True when it was (re)loaded."""
        version = await redis.get(contract.KEYS_VERSION)
        if self.loaded and version == self._version:
            return False
        raw = await redis.hgetall(contract.KEYS_TABLE)
        table: dict[str, KeyRecord] = {}
        for value in raw.values():
            try:
                record = KeyRecord.decode(value)
            except ValueError as exc:
                log.warning("ignoring an unreadable key record: %s", exc)
                continue
            if record.key_hash in self._static:
                if record.key_hash not in self._shadowed_logged:
                    self._shadowed_logged.add(record.key_hash)
                    log.warning("a key of tenant %s in Redis is also given to this gateway (flag or file); "
                                "the gateway's own entry wins", record.tenant)
                continue
            table[record.key_hash] = record
        self._redis, self._version, self.loaded = table, version, True
        return True

    async def follow(self, redis) -> None:
        """Keep the Redis part current (a task for the gateway's lifetime)."""
        while True:
            try:
                if await self.refresh(redis):
                    log.debug("key table: %d keys", len(self))
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                log.debug("key table: Redis unavailable (%s); keeping the last one", exc)
            await asyncio.sleep(REFRESH_S)
