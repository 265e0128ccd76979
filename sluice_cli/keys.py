"""``sluice keys``: create, list and revoke the API keys gateways read from Redis (``--redis-keys``).

    sluice keys create --tenant team-a --name ci-bot --rpm 600 --tpm 200000 --concurrent 8
    sluice keys list [--tenant team-a] [--json]
    sluice keys revoke KEY_ID          # or --tenant team-a: every key of the tenant

A new key is printed once, on stdout, and never stored: Redis keeps its SHA-256 with its record
(``sluice.wire.keys``). Every write raises the table's version in the same script, and gateways
re-read the table when it moves, so a revocation takes effect on every gateway within about a
second. The key's short id (the start of its hash) names it in ``list`` and ``revoke``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from sluice.config import add_arguments as add_knob_arguments
from sluice.config import from_args
from sluice.wire import contract, tenants
from sluice.wire.keys import KEYS_WRITE_SCRIPT, KeyRecord, Limits, generate_key, key_hash
from sluice_cli import admin_redis

ACTIONS = ("create", "list", "revoke")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_knob_arguments(parser, admin_redis.knob_set("sluice keys"))
    parser.add_argument("action", choices=ACTIONS, help="create a key, list the keys, or revoke keys")
    parser.add_argument("key_id", nargs="?", default=None, help="revoke: the key's id (from `list`)")
    parser.add_argument("--tenant", default=None,
                        help="create: the key's tenant (required); list: only its keys; revoke: all its keys")
    parser.add_argument("--name", default="", help="create: the key's display name")
    parser.add_argument("--weight", type=int, default=tenants.DEFAULT_WEIGHT,
                        help=f"create: the tenant's fair-share weight (1-{tenants.MAX_WEIGHT}; default: 1)")
    parser.add_argument("--rpm", type=int, default=None, help="create: requests per minute")
    parser.add_argument("--tpm", type=int, default=None,
                        help="create: tokens per minute (prompt plus max_tokens reserved, corrected at the end)")
    parser.add_argument("--concurrent", type=int, default=None, help="create: requests running at once")
    parser.add_argument("--queued", type=int, default=None, help="create: requests waiting for an engine at once")
    parser.add_argument("--json", action="store_true", help="list: JSON lines instead of a table")


def _client(url: str):
    from sluice.wire.connection import connect

    return connect(url)


def _records(redis) -> list[KeyRecord]:
    out = []
    for value in redis.hgetall(contract.KEYS_TABLE).values():
        try:
            out.append(KeyRecord.decode(value))
        except ValueError as exc:
            print(f"sluice keys: skipping an unreadable record: {exc}", file=sys.stderr)
    return sorted(out, key=lambda r: (r.tenant, r.created, r.key_hash))


def _limits_text(limits: Limits) -> str:
    short = {v: k for k, v in Limits.ALIASES.items()}
    return " ".join(f"{short[k]}={v}" for k, v in limits.as_dict().items()) or "-"


def _create(args: argparse.Namespace, redis) -> int:
    if not args.tenant:
        print("sluice keys create: --tenant is required", file=sys.stderr)
        return 2
    try:
        limits = Limits.parse({k: v for k, v in (("rpm", args.rpm), ("tpm", args.tpm), ("concurrent", args.concurrent),
                                                 ("queued", args.queued)) if v is not None})
        key = generate_key()
        record = KeyRecord(key_hash=key_hash(key), tenant=args.tenant, name=args.name, weight=args.weight,
                           limits=limits, created=int(time.time()))
    except ValueError as exc:
        print(f"sluice keys create: {exc}", file=sys.stderr)
        return 2
    redis.register_script(KEYS_WRITE_SCRIPT)(keys=[contract.KEYS_TABLE, contract.KEYS_VERSION],
                                             args=["set", record.key_hash, record.encode()])
    print(key)
    print(f"sluice keys: created key {record.id} for tenant {record.tenant} (the key is shown once; "
          "only its hash is kept)", file=sys.stderr)
    return 0


def _list(args: argparse.Namespace, redis) -> int:
    records = [r for r in _records(redis) if args.tenant is None or r.tenant == args.tenant]
    if args.json:
        for r in records:
            print(json.dumps({"id": r.id, "tenant": r.tenant, "name": r.name, "weight": r.weight,
                              "limits": r.limits.as_dict(), "created": r.created}))
        return 0
    rows = [("ID", "TENANT", "NAME", "WEIGHT", "LIMITS", "CREATED")]
    rows += [(r.id, r.tenant, r.name or "-", str(r.weight), _limits_text(r.limits),
              time.strftime("%Y-%m-%d %H:%M", time.gmtime(r.created)) if r.created else "-") for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def _revoke(args: argparse.Namespace, redis) -> int:
    if (args.key_id is None) == (args.tenant is None):
        print("sluice keys revoke: give a key id or --tenant, one of them", file=sys.stderr)
        return 2
    records = _records(redis)
    if args.tenant is not None:
        doomed = [r for r in records if r.tenant == args.tenant]
    else:
        if len(args.key_id) < 8:
            print("sluice keys revoke: a key id has at least 8 characters (see `sluice keys list`)", file=sys.stderr)
            return 2
        doomed = [r for r in records if r.key_hash.startswith(args.key_id.lower())]
        if len(doomed) > 1:
            print(f"sluice keys revoke: {args.key_id!r} names {len(doomed)} keys; give more of the id", file=sys.stderr)
            return 2
    if not doomed:
        print("sluice keys revoke: no such key", file=sys.stderr)
        return 1
    redis.register_script(KEYS_WRITE_SCRIPT)(keys=[contract.KEYS_TABLE, contract.KEYS_VERSION],
                                             args=["del", *(r.key_hash for r in doomed)])
    for r in doomed:
        print(f"sluice keys: revoked key {r.id} of tenant {r.tenant}", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    from redis.exceptions import RedisError

    from sluice.wire.connection import RedisURLError

    try:
        redis = _client(from_args(admin_redis.AdminRedis, args).redis_url)
        return {"create": _create, "list": _list, "revoke": _revoke}[args.action](args, redis)
    except RedisURLError as exc:
        print(f"sluice keys: {exc}", file=sys.stderr)
        return 2
    except (RedisError, OSError) as exc:
        print(f"sluice keys: Redis unavailable: {exc}", file=sys.stderr)
        return 1
