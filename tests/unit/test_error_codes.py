"""The one table of error codes (``sluice.wire.error_codes``): it covers the proto's ``ErrorCode``,
the gateway builds every answer from it, and docs/api.md's error table says what it says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway import errors
from sluice.wire import codec
from sluice.wire.error_codes import TABLE, Code
from sluice.wire.messages_pb2 import ErrorCode

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def test_every_code_has_one_row_and_the_proto_enum_is_covered():
    assert set(TABLE) == set(Code)
    wire = {v for v in ErrorCode.values() if v}
    assert {c.wire for c in Code if c.wire is not None} == wire
    for value in wire:
        code = Code.from_wire(value)
        assert code.wire == value and code.value == codec.error_code_name(value)
    assert Code.from_wire(999) is Code.INTERNAL


@pytest.mark.parametrize("code", list(Code))
def test_answers_are_built_from_the_table(code):
    spec = TABLE[code]
    err = errors.error(code, retry_after_s=7)
    assert (err.status, err.type, err.code, err.message) == (spec.status, spec.type, code.value, spec.message)
    assert (err.headers == {"Retry-After": "7"}) if spec.retryable else err.headers is None
    if code.wire is not None:
        sent = errors.from_engine(code.wire, "why", retry_after_s=7)
        assert (sent.status, sent.type, sent.code, sent.message) == (spec.status, spec.type, code.value, "why")


def _doc_rows() -> list[tuple[int, list[str], str]]:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## Errors"):]
    section = section[: section.index("\n## ", 1)]
    rows = []
    for line in section.splitlines():
        m = re.match(r"^\| (\d{3}) \|(.*)\|(.*)\|$", line)
        if m:
            rows.append((int(m.group(1)), re.findall(r"`([a-z_]+)`", m.group(3)), m.group(2)))
    return rows


def test_docs_error_table_matches_the_code_table():
    rows = _doc_rows()
    documented: dict[str, int] = {}
    for status, codes, when in rows:
        assert codes, f"a row without codes: {status} {when}"
        for name in codes:
            code = Code(name)  # ValueError: the docs name a code the table does not have
            assert TABLE[code].status == status, f"{name}: docs say {status}, the table {TABLE[code].status}"
            documented[name] = status
        retryable = {TABLE[Code(n)].retryable for n in codes}
        assert len(retryable) == 1, f"row {status} mixes retryable and not: {codes}"
        assert ("Retry-After" in when) == retryable.pop(), f"row {status} {codes}: Retry-After"
    assert set(documented) == {c.value for c in Code}, set(Code) ^ set(documented)
