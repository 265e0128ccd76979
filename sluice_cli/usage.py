"""``sluice usage``: each tenant's use per model over a period, from Redis (``sluice.wire.usage``).

    sluice usage                      # the last 24 hours
    sluice usage --since 7d --tenant team-a
    sluice usage --since 2026-12-01 --until 2026-12-07T12:00 --json

Counted by the engines per UTC hour: requests, prompt, completion and cached (prefix-cache) tokens
of every engine request that ended, cancelled and failed ones included. A period is whole hours,
from the hour ``--since`` falls in to the hour ``--until`` falls in.
"""

from __future__ import annotations

import argparse
import calendar
import json
import re
import sys
import time

from sluice.config import add_arguments as add_knob_arguments
from sluice.config import from_args
from sluice.wire import tenants, usage
from sluice_cli import admin_redis

_AGO = re.compile(r"(\d+)([hdw])")
_UNITS = {"h": 3600, "d": 86400, "w": 7 * 86400}


def when(text: str, now: float) -> float:
    """A unix time from ``24h`` / ``7d`` / ``2w`` ago, or a UTC date ``YYYY-MM-DD[THH[:MM]]``;
    ValueError saying what is accepted."""
    m = _AGO.fullmatch(text.strip())
    if m:
        return now - int(m.group(1)) * _UNITS[m.group(2)]
    for fmt in ("%Y-%m-%d", "%Y-%m-%dT%H", "%Y-%m-%dT%H:%M"):
        try:
            return float(calendar.timegm(time.strptime(text.strip(), fmt)))
        except ValueError:
            continue
    raise ValueError(f"{text!r} is not a time: give an age (24h, 7d, 2w) or a UTC date (2026-12-01, "
                     "2026-12-01T13, 2026-12-01T13:30)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_knob_arguments(parser, admin_redis.knob_set("sluice usage"))
    parser.add_argument("--since", default="24h", help="start: an age (24h, 7d, 2w) or a UTC date (default: 24h)")
    parser.add_argument("--until", default=None, help="end: an age or a UTC date (default: now)")
    parser.add_argument("--tenant", default=None, help="only this tenant (the default tenant: --tenant default)")
    parser.add_argument("--json", action="store_true", help="JSON lines instead of a table")


def run(args: argparse.Namespace) -> int:
    from redis.exceptions import RedisError

    from sluice.wire.connection import RedisURLError, connect

    now = time.time()
    try:
        since = when(args.since, now)
        until = when(args.until, now) if args.until else now
    except ValueError as exc:
        print(f"sluice usage: {exc}", file=sys.stderr)
        return 2
    if until < since:
        print("sluice usage: --until is before --since", file=sys.stderr)
        return 2
    tenant = args.tenant
    if tenant == tenants.DEFAULT_TENANT_LABEL:
        tenant = tenants.DEFAULT_TENANT
    elif tenant is not None and (problem := tenants.check_tenant_id(tenant)):
        print(f"sluice usage: --tenant: {problem}", file=sys.stderr)
        return 2
    try:
        rows = usage.read(connect(from_args(admin_redis.AdminRedis, args).redis_url), since, until, tenant)
    except RedisURLError as exc:
        print(f"sluice usage: {exc}", file=sys.stderr)
        return 2
    except (RedisError, OSError) as exc:
        print(f"sluice usage: Redis unavailable: {exc}", file=sys.stderr)
        return 1
    if args.json:
        for u in rows:
            print(json.dumps({"tenant": tenants.label(u.tenant), "model": u.model,
                              **{name: getattr(u, name) for name in usage.COUNTERS}}))
        return 0
    period = (f"{time.strftime('%Y-%m-%d %H:00', time.gmtime(since))} to "
              f"{time.strftime('%Y-%m-%d %H:59', time.gmtime(until))} UTC")
    print(f"usage from {period}")
    table = [("TENANT", "MODEL", "REQUESTS", "PROMPT", "COMPLETION", "CACHED")]
    table += [(tenants.label(u.tenant), u.model, *(str(getattr(u, n)) for n in usage.COUNTERS)) for u in rows]
    if len(rows) > 1:
        total = usage.Usage("", "")
        for u in rows:
            total.add(u)
        table.append(("TOTAL", "", *(str(getattr(total, n)) for n in usage.COUNTERS)))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        print("  ".join(cells).rstrip())
    return 0
