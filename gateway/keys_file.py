"""The keys file (``--keys-file``): tenants, their weights and limits, and their keys, in YAML.

::

    tenants:
      team-a:
        name: Team A                 # a display name (optional)
        weight: 2                    # its fair share in the engines' scheduler (1-1000, default 1)
        limits: {rpm: 600, tpm: 200000, concurrent: 8, queued: 32}   # defaults for its keys (optional)
        keys:
          - sk-the-key-itself        # a key, as clients send it
          - sha256: 9f86d081884c7d65...   # or only its SHA-256, so the file holds no secret
            name: ci-bot
            limits: {rpm: 60}        # overrides the tenant's, limit by limit

Limit names: ``requests_per_minute`` (``rpm``), ``tokens_per_minute`` (``tpm``), ``max_concurrent``
(``concurrent``), ``max_queued`` (``queued``). Anything wrong (a file that does not parse, an
unknown field, a limit of 0 or below, a key given twice) stops the gateway at start with
``FILE:LINE: what is wrong``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from sluice.wire import tenants
from sluice.wire.keys import KeyRecord, Limits, key_hash

TENANT_FIELDS = {"name", "weight", "limits", "keys"}
KEY_FIELDS = {"key", "sha256", "name", "limits"}


class KeysFileError(ValueError):
    """A keys file that cannot be used; the message starts with ``FILE:LINE:``."""


def load_keys_file(path: str | Path) -> list[KeyRecord]:
    """Every key of the file as a record (source "file"); raises :class:`KeysFileError`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KeysFileError(f"{path}: cannot read the keys file: {exc}") from None
    return parse_keys(text, str(path))


def parse_keys(text: str, name: str = "<keys file>") -> list[KeyRecord]:
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{name}:{mark.line + 1}" if mark is not None else name
        raise KeysFileError(f"{where}: not valid YAML: {getattr(exc, 'problem', None) or exc}") from None
    finally:
        loader.dispose()

    def fail(node: yaml.Node | None, message: str) -> KeysFileError:
        line = f":{node.start_mark.line + 1}" if node is not None else ""
        return KeysFileError(f"{name}{line}: {message}")

    def value(node: yaml.Node) -> Any:
        try:
            return yaml.SafeLoader("").construct_object(node, deep=True)
        except yaml.YAMLError as exc:
            raise fail(node, f"cannot read this value: {exc}") from None

    def mapping(node: yaml.Node, what: str) -> list[tuple[str, yaml.Node, yaml.Node]]:
        if not isinstance(node, yaml.MappingNode):
            raise fail(node, f"{what} must be a mapping")
        out, seen = [], set()
        for k, v in node.value:
            key = value(k)
            if not isinstance(key, str):
                raise fail(k, f"{what}: keys are names, got {key!r}")
            if key in seen:
                raise fail(k, f"{what}: {key!r} is given twice")
            seen.add(key)
            out.append((key, k, v))
        return out

    if root is None:
        return []
    top = mapping(root, "the keys file")
    for key, knode, _ in top:
        if key != "tenants":
            raise fail(knode, f"unknown field {key!r}: the file has one field, 'tenants'")
    records: list[KeyRecord] = []
    lines: dict[str, int] = {}
    for _, _, tenants_node in top:
        for tenant, tnode, body in mapping(tenants_node, "tenants"):
            if problem := tenants.check_tenant_id(tenant) or (None if tenant else "a tenant id cannot be empty"):
                raise fail(tnode, problem)
            fields = dict((k, (kn, v)) for k, kn, v in mapping(body, f"tenant {tenant!r}"))
            for field_name, (fnode, _) in fields.items():
                if field_name not in TENANT_FIELDS:
                    raise fail(fnode, f"tenant {tenant!r}: unknown field {field_name!r}; a tenant has "
                                      f"{', '.join(sorted(TENANT_FIELDS))}")
            display = value(fields["name"][1]) if "name" in fields else ""
            weight = value(fields["weight"][1]) if "weight" in fields else tenants.DEFAULT_WEIGHT
            if problem := tenants.check_weight(weight):
                raise fail(fields["weight"][1], f"tenant {tenant!r}: {problem}")
            base = _limits(fields["limits"][1], value, fail, f"tenant {tenant!r}") if "limits" in fields else Limits()
            if "keys" not in fields:
                raise fail(tnode, f"tenant {tenant!r} has no keys")
            keys_node = fields["keys"][1]
            if not isinstance(keys_node, yaml.SequenceNode) or not keys_node.value:
                raise fail(keys_node, f"tenant {tenant!r}: keys is a list of at least one key")
            for entry in keys_node.value:
                hashed, key_name, limits = _key_entry(entry, value, mapping, fail, tenant, base)
                if hashed in lines:
                    raise fail(entry, f"this key is already given on line {lines[hashed]}")
                lines[hashed] = entry.start_mark.line + 1
                records.append(KeyRecord(key_hash=hashed, tenant=tenant, name=str(key_name or display or ""),
                                         weight=weight, limits=limits, source="file"))
    return records


def _limits(node: yaml.Node, value, fail, where: str) -> Limits:
    try:
        return Limits.parse(value(node))
    except ValueError as exc:
        raise fail(node, f"{where}: {exc}") from None


def _key_entry(entry: yaml.Node, value, mapping, fail, tenant: str, base: Limits) -> tuple[str, str, Limits]:
    if isinstance(entry, yaml.ScalarNode):
        key = value(entry)
        if not isinstance(key, str) or not key.strip():
            raise fail(entry, f"tenant {tenant!r}: a key is a non-empty string")
        return key_hash(key), "", base
    fields = dict((k, (kn, v)) for k, kn, v in mapping(entry, f"a key of tenant {tenant!r}"))
    for field_name, (fnode, _) in fields.items():
        if field_name not in KEY_FIELDS:
            raise fail(fnode, f"tenant {tenant!r}: unknown key field {field_name!r}; a key has "
                              f"{', '.join(sorted(KEY_FIELDS))}")
    if ("key" in fields) == ("sha256" in fields):
        raise fail(entry, f"tenant {tenant!r}: give a key either as 'key' or as 'sha256', one of them")
    if "key" in fields:
        key = value(fields["key"][1])
        if not isinstance(key, str) or not key.strip():
            raise fail(fields["key"][1], f"tenant {tenant!r}: a key is a non-empty string")
        hashed = key_hash(key)
    else:
        hashed = str(value(fields["sha256"][1])).strip().lower()
        if len(hashed) != 64 or any(c not in "0123456789abcdef" for c in hashed):
            raise fail(fields["sha256"][1], f"tenant {tenant!r}: sha256 is the key's SHA-256 in 64 hex digits")
    name = value(fields["name"][1]) if "name" in fields else ""
    limits = _limits(fields["limits"][1], value, fail, f"tenant {tenant!r}").over(base) if "limits" in fields else base
    return hashed, name, limits
