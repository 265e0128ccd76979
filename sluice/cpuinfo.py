"""What /proc/cpuinfo says of this CPU: the native kernels' build key takes its flags
(engine_service/model/native.py), the benches' JSON its model name (a stored run has to say which
machine gave it: its figures are compared only within that run)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpuinfo_field(name: str) -> str | None:
    """The first value of ``name`` in /proc/cpuinfo ("flags", "model name"), or None where there
    is no such file or line (not Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name ("Intel(R) Xeon(R) Processor", "AMD EPYC 9R14 96-Core Processor"), else
    ``platform.processor()``, which is empty on Linux."""
    return cpuinfo_field("model name") or platform.processor()
