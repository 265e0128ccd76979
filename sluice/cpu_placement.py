"""Which CPUs a process runs on: Linux CPU lists ("0-3,8") read and written, CPUs grouped by
physical core, and a whole process pinned to a list.

Why an engine wants CPUs of its own: its compute threads meet at a barrier many times a step, so a
thread that loses its core to a neighbour (the gateway, Redis, a client) stalls the others until
it runs again; a small neighbour costs the engine several times its own share of the CPUs
(docs/performance.md, "The engine on CPUs of its own"). `sluice serve --reserved-cpus N` gives Redis and
the gateway whole cores holding at least N CPUs and the engine the rest, as vLLM's CPU backend
reserves CPUs for its front end.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MAX_CPU = 1 << 16  # a bound on what a list may name, far above any machine's CPU count
CPU_TOPOLOGY = Path("/sys/devices/system/cpu")
_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?")


def parse_cpu_list(text: str) -> list[int]:
    """The CPUs a Linux CPU list names ("0-3,8,10-11"), sorted, each once; ValueError saying what
    is wrong with the text otherwise."""
    if not isinstance(text, str):
        raise ValueError(f"a CPU list is text such as '0-3,8', not {type(text).__name__} {text!r}")
    if not text.strip():
        raise ValueError("an empty CPU list (write them as 0-3,8)")
    cpus: set[int] = set()
    for part in text.split(","):
        item = _ITEM.fullmatch(part.strip())
        if item is None:
            raise ValueError(f"{part.strip()!r} is not a CPU number or a range of them (write 0-3,8)")
        lo = int(item.group(1))
        hi = int(item.group(2)) if item.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"{part.strip()!r} is not a range of CPUs (the lower number first)")
        if hi >= MAX_CPU:
            raise ValueError(f"{part.strip()!r} names a CPU above {MAX_CPU - 1}")
        cpus.update(range(lo, hi + 1))
    return sorted(cpus)


def format_cpu_list(cpus: list[int] | set[int]) -> str:
    """The shortest Linux CPU list for ``cpus``: [0, 1, 2, 5] -> "0-2,5"."""
    out: list[str] = []
    ordered = sorted(cpus)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def usable_cpus() -> list[int]:
    """The CPUs this process runs on now (its affinity: a container's cpuset, a `taskset`)."""
    return sorted(os.sched_getaffinity(0))


def allowed_cpus() -> list[int]:
    """The CPUs any thread of this process may be given, whatever its affinity now: its cgroup's
    cpuset where cgroup v2 says, else every online CPU. (A process started under `taskset -c 0`
    may still move a thread to CPU 1; one in a container's cpuset may not leave it.)"""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                effective = Path("/sys/fs/cgroup", line[3:].lstrip("/"), "cpuset.cpus.effective")
                return parse_cpu_list(effective.read_text())
    except (OSError, ValueError):
        pass
    try:
        return parse_cpu_list((CPU_TOPOLOGY / "online").read_text())
    except (OSError, ValueError):
        return list(range(os.cpu_count() or 1))


def physical_cores(cpus: list[int], topology: Path = CPU_TOPOLOGY) -> list[list[int]]:
    """``cpus`` grouped by physical core (a core's SMT siblings together), the groups in the order
    of their first CPU. A core is what Linux lists as the CPUs sharing it (``core_cpus_list``, or
    ``thread_siblings_list`` on kernels before 5.7); a CPU it shows no topology for is a core of
    its own."""
    groups: dict[tuple, list[int]] = {}
    for cpu in sorted(cpus):
        key: tuple = ("cpu", cpu)
        for name in ("core_cpus_list", "thread_siblings_list"):
            try:
                key = tuple(parse_cpu_list((topology / f"cpu{cpu}" / "topology" / name).read_text()))
                break
            except (OSError, ValueError):
                continue
        groups.setdefault(key, []).append(cpu)
    return sorted(groups.values(), key=lambda group: group[0])


def check_cpus(text: str, knob: str) -> list[int]:
    """``text`` parsed, every CPU one this process may be given; ValueError naming ``knob``
    otherwise."""
    try:
        cpus = parse_cpu_list(text)
    except ValueError as exc:
        raise ValueError(f"{knob}: {exc}") from None
    allowed = allowed_cpus()
    outside = sorted(set(cpus) - set(allowed))
    if outside:
        which = f"CPU {outside[0]} is" if len(outside) == 1 else f"CPUs {format_cpu_list(outside)} are"
        raise ValueError(f"{knob}: {which} not this process's to use (it may use {format_cpu_list(allowed)})")
    return cpus


def _threads() -> list[int]:
    return [int(task.name) for task in Path(f"/proc/{os.getpid()}/task").iterdir()]


def _set_all(masks: dict[int, list[int]]) -> None:
    for tid, mask in masks.items():
        try:
            os.sched_setaffinity(tid, mask)
        except OSError:  # a thread that ended meanwhile; the others still go back
            pass


def pin_process(cpus: list[int]) -> None:
    """Every thread of this process, and so every thread it starts from now on, on ``cpus``.
    Why every thread: Linux sets one thread's affinity at a time, and threads already started
    (torch's OpenMP team, gRPC's, the Redis I/O threads) keep theirs. On failure (a cpuset the
    list falls outside, or one that narrows it) every thread is put back and ValueError says why;
    a thread that a moved thread started during the pass keeps the new CPUs."""
    before: dict[int, list[int]] = {}
    try:
        seen: set[int] = set()
        while True:  # again while threads appear: one started during a pass took the old mask
            fresh = [tid for tid in _threads() if tid not in seen]
            if not fresh:
                break
            for tid in fresh:
                seen.add(tid)
                try:
                    before[tid] = sorted(os.sched_getaffinity(tid))
                    os.sched_setaffinity(tid, cpus)
                except ProcessLookupError:
                    before.pop(tid, None)
        got = sorted(os.sched_getaffinity(0))
        if got != sorted(set(cpus)):  # a cpuset the kernel intersected the list with
            raise ValueError(f"the kernel gave CPUs {format_cpu_list(got)} of the {format_cpu_list(cpus)} asked "
                             "for (a cpuset narrower than the list?)")
    except OSError as exc:
        _set_all(before)
        raise ValueError(f"CPUs {format_cpu_list(cpus)}: the kernel refused them ({exc.strerror}; a cpuset "
                         "without them?)") from None
    except BaseException:  # a narrowed list, or an interrupt half way: every thread back
        _set_all(before)
        raise


@contextmanager
def pinned(cpus: list[int]) -> Iterator[None]:
    """The whole process on ``cpus`` for the block, then every thread back on the CPUs the calling
    thread had (a bench's offline engine placed as a served one, its client elsewhere)."""
    home = usable_cpus()
    try:
        pin_process(cpus)
        yield
    finally:
        pin_process(home)
