"""The one result format of the benches: a JSON document whose first keys say which bench made it,
with which command, on which machine and when; the bench's own figures follow. ``sluice bench
plot`` draws the documents that have a chart (``sluice_bench.plots``)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from sluice.cpuinfo import cpu_model


def machine() -> dict[str, Any]:
    """The machine a result was measured on (no torch import: a gateway bench has none)."""

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {"cpu": cpu_model(), "cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
            "platform": platform.platform(), "python": platform.python_version(), "torch": version("torch"),
            "sluice": version("sluice")}


def command(bench: str) -> str | None:
    """The ``sluice bench BENCH ...`` command line of this process, when it is one."""
    argv = sys.argv[1:]
    if argv[:2] == ["bench", bench]:
        return "sluice " + shlex.join(argv)
    return None


def document(bench: str, figures: dict[str, Any]) -> dict[str, Any]:
    """``figures`` under the common header; a bench's own ``machine`` keys add to the header's."""
    head = {"bench": bench, "command": command(bench), "machine": machine(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    doc = head | figures
    if isinstance(figures.get("machine"), dict):
        doc["machine"] = head["machine"] | figures["machine"]
    return doc


def write(path: str | Path | None, bench: str, figures: dict[str, Any]) -> Path | None:
    """Write ``document(bench, figures)`` to ``path`` (None or "-": nowhere); returns the path."""
    if path is None or str(path) == "-":
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document(bench, figures), indent=2, default=str) + "\n")
    return path
