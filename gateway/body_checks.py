"""Checks on a request's raw body, made by the middleware before FastAPI parses it.

- **Content-Type.** A body must be sent as ``Content-Type: application/json`` (or a ``+json``
  type). Without it FastAPI does not parse the body at all and the client was told that "the
  request body must be a JSON object" — true of what it sent, but not why. We refuse it with a 400
  that names the header, as vLLM does ("Unsupported Media Type: Only 'application/json' is
  allowed", also a 400) rather than guessing: the OpenAI SDKs always send the header, and a
  hand-written client that forgot it (``curl -d`` sends ``application/x-www-form-urlencoded``) is
  better told than silently parsed.
- **Valid Unicode.** JSON allows ``"\\ud800"`` — a lone UTF-16 surrogate, which Python's ``json``
  decodes into a ``str`` that cannot be encoded as UTF-8: used as a Redis key (``model``) or fed
  to the tokenizer (``content``) it raised deep inside the gateway (a 500). Bytes that are not
  UTF-8 at all are refused too (RFC 8259: JSON exchanged between systems is UTF-8). Any string in
  the body, keys included, is checked, so fields added later are covered without knowing them.
  Cost: one UTF-8 validation of the body (C speed); the body is parsed a second time only when it
  contains a ``\\uD800``–``\\uDFFF`` escape (a valid escaped pair, e.g. an emoji from
  ``json.dumps``, passes).
- **Depth.** JSON nested deeper than Python's parser recurses raises ``RecursionError`` (not a
  ``ValueError``) wherever the body is parsed, here or in FastAPI: both answer the same 400
  (``errors.body_too_deep``), whatever the body's encoding.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gateway import errors
from gateway.errors import OpenAIError

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def check_content_type(headers: list[tuple[bytes, bytes]]) -> OpenAIError | None:
    """A 400 unless the request declares a JSON body."""
    value = next((v for k, v in headers if k == b"content-type"), None)
    if value is not None:
        media = value.split(b";", 1)[0].strip().lower()
        if media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json")):
            return None
    got = "no Content-Type header" if value is None else f"Content-Type: {value.decode('latin-1')}"
    return errors.invalid(
        f"Unsupported Media Type: the request body must be JSON, sent with the header "
        f"`Content-Type: application/json` (got {got}).",
        code="unsupported_media_type",
    )


def check_body(body: bytes) -> OpenAIError | None:
    """A 400 when the body is not UTF-8 or a string in it holds a lone surrogate."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return errors.invalid(
            f"The request body is not valid UTF-8 (byte {exc.start}); JSON must be sent as UTF-8.",
            code="invalid_json",
        )
    if not _SURROGATE_ESCAPE.search(body):
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None  # malformed JSON: FastAPI's parser answers it (invalid_json)
    except RecursionError:  # nested deeper than the parser recurses: the same 400 as FastAPI's parse
        return errors.body_too_deep()
    found = _lone_surrogate(data, ())
    if found is None:
        return None
    path, text = found
    param = _param(path)
    where = f"'{param}'" if param else "the request body"
    return errors.invalid(
        f"Invalid value for {where}: the string contains a lone UTF-16 surrogate "
        f"({_surrogate_of(text)}), which is not valid Unicode text. Send text as UTF-8, or escape "
        f"characters outside the Basic Multilingual Plane as a surrogate pair.",
        param=param,
        code="invalid_value",
    )


def _has_surrogate(s: str) -> bool:
    if s.isascii():
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _surrogate_of(s: str) -> str:
    ch = next(c for c in s if 0xD800 <= ord(c) <= 0xDFFF)
    return f"\\u{ord(ch):04x}"


def _lone_surrogate(value: Any, path: tuple) -> tuple[tuple, str] | None:
    """(path, offending string) of the first string holding a lone surrogate, depth first."""
    stack: list[tuple[Any, tuple]] = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, str):
            if _has_surrogate(v):
                return p, v
        elif isinstance(v, dict):
            items = list(v.items())
            for k, item in reversed(items):
                if _has_surrogate(k):
                    return p, k
                stack.append((item, (*p, k)))
        elif isinstance(v, list):
            for i in range(len(v) - 1, -1, -1):
                stack.append((v[i], (*p, i)))
    return None


def _param(path: tuple) -> str | None:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or None
