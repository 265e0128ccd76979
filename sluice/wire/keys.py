"""API keys and what each carries: its tenant, a display name, a fair-share weight and its limits.

A key is never stored: only its SHA-256 (:func:`key_hash`). Keys come from three places, all
decoded into the same :class:`KeyRecord` (the gateway's ``gateway.keyring`` merges them):

- ``--api-key KEY`` (repeatable): a tenant of its own, named by :func:`flag_tenant` (a slow hash of
  the key, so a name in a log or a metric gives nothing to brute-force a short key with);
- a keys file (``gateway.keys_file``): tenants with names, weights, limits and their keys;
- Redis, written by ``sluice keys create`` / ``revoke`` (``sluice_cli.keys``): one hash
  (``contract.KEYS_TABLE``: key hash -> the record as JSON) and a version counter every write raises
  in the same script, so a gateway re-reads the table only when it changed (within a second).

The limits are the tenant's quotas as checked at admission (``sluice.wire.quota``): requests and
tokens per minute, concurrent requests, queued requests. A tenant's counters are shared by all its
keys; a request is held to the limits of the key it came with.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from sluice.wire import tenants

# The prefix of a key ``sluice keys create`` makes (32 random bytes follow, URL-safe base64).
GENERATED_PREFIX = "sk-sluice-"
# How many hex digits of a key's hash name it in ``sluice keys list`` and ``revoke``.
KEY_ID_LEN = 12
RECORD_VERSION = 1


def key_hash(key: str) -> str:
    """The only form a key is kept in: its SHA-256, hex."""
    return hashlib.sha256(key.encode()).hexdigest()


def key_id(hashed: str) -> str:
    """A key's short id (the start of its hash), shown by ``sluice keys list``."""
    return hashed[:KEY_ID_LEN]


def generate_key() -> str:
    return GENERATED_PREFIX + secrets.token_urlsafe(32)


def flag_tenant(key: str) -> str:
    """The tenant of a key given with ``--api-key``: the same on every gateway given the same key,
    and slow to invert (PBKDF2, 100,000 rounds, 48 bits shown)."""
    digest = hashlib.pbkdf2_hmac("sha256", key.encode(), b"sluice-tenant", 100_000, dklen=6)
    return "key-" + digest.hex()


@dataclass(frozen=True)
class Limits:
    """A tenant's quotas; None: no limit. Every limit is a positive integer."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None  # prompt + max_tokens reserved at admission, corrected at the end
    max_concurrent: int | None = None  # requests admitted and not ended
    max_queued: int | None = None  # requests admitted and not started by an engine

    # the short names a keys file and `sluice keys create` accept, with the field each sets
    ALIASES = {"rpm": "requests_per_minute", "tpm": "tokens_per_minute", "concurrent": "max_concurrent",
               "queued": "max_queued"}

    @property
    def any(self) -> bool:
        return any(getattr(self, f.name) is not None for f in fields(self))

    def over(self, base: Limits) -> Limits:
        """These limits, each unset one taken from ``base``."""
        return Limits(**{f.name: getattr(self, f.name) if getattr(self, f.name) is not None
                         else getattr(base, f.name) for f in fields(self)})

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def parse(cls, values: Any) -> Limits:
        """From a mapping of limit names (long or short) to positive integers; ValueError naming the
        limit that is wrong."""
        if values is None:
            return cls()
        if not isinstance(values, dict):
            raise ValueError(f"limits must be a mapping of limit names to integers, not {type(values).__name__}")
        names = {f.name for f in fields(cls)}
        out: dict[str, int] = {}
        for raw_name, value in values.items():
            name = cls.ALIASES.get(raw_name, raw_name)
            if name not in names:
                known = ", ".join(sorted(names | set(cls.ALIASES)))
                raise ValueError(f"unknown limit {raw_name!r}; the limits are: {known}")
            if name in out:
                raise ValueError(f"limit {name!r} is given twice")
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"limit {raw_name!r} must be a positive integer, got {value!r}")
            if value <= 0:
                raise ValueError(f"limit {raw_name!r} must be a positive integer (leave it out for no limit), "
                                 f"got {value}")
            out[name] = value
        return cls(**out)


@dataclass(frozen=True)
class KeyRecord:
    """What a key (known by its hash) stands for."""

    key_hash: str
    tenant: str
    name: str = ""  # the key's display name (free text: never a metric label nor part of a Redis key)
    weight: int = tenants.DEFAULT_WEIGHT
    limits: Limits = field(default_factory=Limits)
    created: int = 0  # unix seconds (keys made by `sluice keys create`)
    source: str = "redis"  # "flag" | "file" | "redis": where the gateway found it

    def __post_init__(self) -> None:
        if problem := tenants.check_tenant_id(self.tenant):
            raise ValueError(problem)
        if not self.tenant:
            raise ValueError("a key must name its tenant")
        if problem := tenants.check_weight(self.weight):
            raise ValueError(problem)
        if len(self.key_hash) != 64 or any(c not in "0123456789abcdef" for c in self.key_hash):
            raise ValueError("a key hash is 64 lowercase hex digits (SHA-256)")

    @property
    def id(self) -> str:
        return key_id(self.key_hash)

    def encode(self) -> str:
        data = asdict(self)
        data["limits"] = self.limits.as_dict()
        data.pop("source")
        data["version"] = RECORD_VERSION
        return json.dumps(data, separators=(",", ":"), sort_keys=True)

    @classmethod
    def decode(cls, raw: bytes | str) -> KeyRecord:
        """Raises ValueError for a record this code cannot read."""
        try:
            data = json.loads(raw)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"undecodable key record: {exc}") from None
        if not isinstance(data, dict) or data.get("version") != RECORD_VERSION:
            raise ValueError("key record of an unknown version")
        try:
            return cls(key_hash=data["key_hash"], tenant=data["tenant"], name=str(data.get("name", "")),
                       weight=data.get("weight", tenants.DEFAULT_WEIGHT), limits=Limits.parse(data.get("limits")),
                       created=int(data.get("created", 0)), source="redis")
        except (KeyError, TypeError) as exc:
            raise ValueError(f"key record lacks a field: {exc}") from None


# The one write of the Redis key table: set or delete records, and raise the version that gateways
# watch, in one script (one slot: the {keys} family). KEYS: contract.KEYS_TABLE, contract.KEYS_VERSION.
# ARGV: "set" then hash, record pairs; or "del" then hashes. Returns the records set or deleted.
KEYS_WRITE_SCRIPT = """
local n = 0
if ARGV[1] == 'set' then
  for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]); n = n + 1 end
else
  for i = 2, #ARGV do n = n + redis.call('HDEL', KEYS[1], ARGV[i]) end
end
if n > 0 then redis.call('INCR', KEYS[2]) end
return n
"""
