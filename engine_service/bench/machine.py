"""What a bench's JSON says of the machine it ran on."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("Intel(R) Xeon(R) Processor", "AMD EPYC 9R14 ..."),
    else ``platform.processor()``. Why: figures are compared only within one run, and a stored
    run has to say which machine gave it; ``platform.processor()`` is empty on Linux."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
