"""The access log names paths, never the ids in them.

A stored response's id (``/v1/responses/resp_...``) is all a caller needs to name it, so it does not
belong in a log that many people read; the id is replaced by ``{id}``, and so are a conversation's
and its items' (``/v1/conversations/{id}/items/{id}``). (A tenant's objects are its
own whatever a log says: ``gateway.responses.store``. This keeps the ids out of the log anyway.)
"""

from __future__ import annotations

import logging
import re

# /v1/responses/<id>[/...], /v1/conversations/<id>[/items/<id>]: the segment after a collection is an id
_ID_PATHS = re.compile(r"^(/v1/(?:responses|conversations)/)[^/?]+")
_ITEM_PATHS = re.compile(r"^(/v1/conversations/\{id\}/items/)[^/?]+")


def redact(path: str) -> str:
    return _ITEM_PATHS.sub(r"\1{id}", _ID_PATHS.sub(r"\1{id}", path))


class RedactIds(logging.Filter):
    """Rewrites uvicorn's access record, whose args are ``(client, method, path, http_version, status)``."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            path = redact(args[2])
            if path != args[2]:
                record.args = (*args[:2], path, *args[3:])
        return True
