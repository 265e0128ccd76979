"""Tenants: who a request is for, as the contract carries it.

A tenant is who an API key belongs to (the gateway's key table, ``gateway.auth``). Its id travels
with every request (``GenerateRequest.tenant``), names its queue lane, its fair share in the engine's
scheduler, its quota counters and its usage in Redis (the ``{t:<tenant>}`` family of
``sluice.wire.contract``), and is recorded on everything stored for it (stored responses, event-log
records), so another tenant finds none of it.

The id is part of Redis key names and of Prometheus labels, so it is held to a small alphabet; the
display name a key may carry is free text and is never part of a key or a label.
"""

from __future__ import annotations

import re

# A deployment without keys: every request is the default tenant's, and everything behaves as it
# did before tenants existed (no lane of its own, no quota, stored objects open to every caller).
DEFAULT_TENANT = ""
# How the default tenant is named where a name must not be empty (a metric label, a usage table).
DEFAULT_TENANT_LABEL = "default"

TENANT_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
_TENANT_ID = re.compile(TENANT_ID_PATTERN)

# Fair-share weights: a tenant of weight w gets w times the tokens of a tenant of weight 1 while both
# wait. Bounded so that no weight can starve another tenant for more than a bounded while.
DEFAULT_WEIGHT = 1
MAX_WEIGHT = 1000


def check_tenant_id(value: object) -> str | None:
    """None when ``value`` is a valid tenant id (the default tenant's empty id included), else why not."""
    if not isinstance(value, str):
        return f"a tenant id is a string, not {type(value).__name__}"
    if value == DEFAULT_TENANT:
        return None
    if not _TENANT_ID.fullmatch(value):
        return (f"tenant id {value[:80]!r} must be 1-64 characters of letters, digits, '_', '.' and '-', "
                "starting with a letter or digit")
    return None


def check_weight(value: object) -> str | None:
    """None when ``value`` is a valid fair-share weight, else why not."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"a tenant weight is an integer, not {type(value).__name__}"
    if not DEFAULT_WEIGHT <= value <= MAX_WEIGHT:
        return f"a tenant weight must be from {DEFAULT_WEIGHT} to {MAX_WEIGHT}, got {value}"
    return None


def label(tenant: str) -> str:
    """The tenant as a metric label or a table's row name (the default tenant's is not empty)."""
    return tenant or DEFAULT_TENANT_LABEL


def wire_weight(weight: int) -> int:
    """The weight a ``GenerateRequest.tenant_weight`` carries reads as this (0, unset: the default)."""
    return weight or DEFAULT_WEIGHT
