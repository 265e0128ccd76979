"""sluice.cpuinfo: the fields the native build key and the benches' JSON read from /proc/cpuinfo."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

import sluice.cpuinfo as cpuinfo

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx512f avx512_bf16 amx_tile
model name extended\t: not this one

processor\t: 1
model name\t: a second core's
"""


@pytest.fixture
def fake(tmp_path, monkeypatch):
    path = tmp_path / "cpuinfo"
    monkeypatch.setattr(cpuinfo, "Path", lambda p: path if p == "/proc/cpuinfo" else Path(p))
    return path


def test_a_field_is_the_first_cores_value_trimmed(fake):
    fake.write_text(CPUINFO)
    assert cpuinfo.cpuinfo_field("model name") == cpuinfo.cpu_model() == "Intel(R) Xeon(R) Processor"
    assert cpuinfo.cpuinfo_field("flags") == "fpu sse2 avx512f avx512_bf16 amx_tile"
    assert cpuinfo.cpuinfo_field("model") is None  # a key's prefix is not the key
    assert cpuinfo.cpuinfo_field("microcode") is None


def test_without_the_file_no_field_and_the_model_is_platforms(fake):
    assert not fake.exists()
    assert cpuinfo.cpuinfo_field("flags") is None
    assert cpuinfo.cpu_model() == platform.processor()


def test_the_native_build_key_reads_the_flags_through_it():
    from engine_service.model.native import _cpu_flags

    assert _cpu_flags() == (cpuinfo.cpuinfo_field("flags") or platform.processor())
