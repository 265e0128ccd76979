"""A stored Responses API response in Redis (``contract.response_key``): the hash's fields and
their codec. The values are JSON text the gateway writes and reads (``gateway.responses.store``);
this module only fixes the layout, so any gateway (and a future writer elsewhere) agrees on it.

A response keeps its own turn once: its input items and its output (in the final response).
A ``previous_response_id`` chain is linked, not copied: each response names its nearest
:data:`ANCESTOR_WINDOW` ancestors (``ancestors``, the previous response first), so a reader walks
the chain back in round trips of that many pipelined reads, and a conversation of N turns costs N
turns of memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

F_STATUS = "status"  # the response's status: in_progress, completed, incomplete, failed, cancelled, queued
F_RECORD = "record"  # what was asked: gateway.responses.render.ResponseRecord as JSON
F_INPUT = "input"  # this request's input items (each with its id), JSON list
F_RESPONSE = "response"  # the final response object, JSON
F_ANCESTORS = "ancestors"  # JSON list: the ids of the nearest ANCESTOR_WINDOW ancestors, the previous one first
# Written by gateways before the chain was linked: the response's whole conversation (history, input,
# output). Still read, so that a chain that reaches such a response ends there.
F_CONVERSATION = "conversation"
F_BACKGROUND = "background"  # "1" for a background response
F_TENANT = "tenant"  # whose response (sluice.wire.tenants); absent: the default tenant's

# The ancestors a response names: a chain walk reads this many responses per round trip.
ANCESTOR_WINDOW = 8

# Statuses of a response that is still running: it cannot be continued (previous_response_id).
RUNNING = frozenset({"queued", "in_progress"})


@dataclass
class StoredResponse:
    status: str
    record: str | None = None
    input: list[dict[str, Any]] | None = None
    response: dict[str, Any] | None = None
    conversation: list[dict[str, Any]] | None = None
    background: bool = False
    tenant: str = ""
    ancestors: list[str] = field(default_factory=list)

    @property
    def running(self) -> bool:
        return self.status in RUNNING

    @classmethod
    def decode(cls, raw: dict) -> StoredResponse:
        def text(name: str) -> str | None:
            value = raw.get(name.encode(), raw.get(name))
            return value.decode() if isinstance(value, bytes) else value

        def parsed(name: str) -> Any:
            value = text(name)
            return None if value is None else json.loads(value)

        return cls(status=text(F_STATUS) or "", record=text(F_RECORD), input=parsed(F_INPUT),
                   response=parsed(F_RESPONSE), conversation=parsed(F_CONVERSATION),
                   background=text(F_BACKGROUND) == "1", tenant=text(F_TENANT) or "",
                   ancestors=parsed(F_ANCESTORS) or [])

    def output(self) -> list[dict[str, Any]]:
        """The output items of its final response (none while it runs)."""
        return list((self.response or {}).get("output") or [])


def encode_fields(**fields: Any) -> list[str]:
    """Field/value pairs for ``RESPONSE_SAVE_SCRIPT``: strings as they are, anything else as JSON,
    None left out."""
    out: list[str] = []
    for name, value in fields.items():
        if value is None:
            continue
        if isinstance(value, bool):
            value = "1" if value else "0"
        out += [name, value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))]
    return out
