"""The offline engine beside a process that takes a share of one core, under the scheduler's
knobs: what a served engine's neighbours (gateway, Redis, the load generator) cost it, in isolation.

    [OMP_PROC_BIND=true] python scripts/bench_cpu_sharing.py [--duty 0.12] [--rounds 3]
        [--conditions alone,hog,hog-own-session,hog-autogroup-19,engine-slice,both-slice]

One engine (bfloat16, the default model) runs `sluice bench serve`'s workload offline: 64 random
prompts of ~128 tokens, ~64 output tokens each, all at once (fresh prompts per pass, so no pass
finds another's in the prefix cache). Each round runs every condition once, starting one further
along the list each round; each pass's output tokens/s is printed over the round's ``alone`` pass. The "hog" busies one core for ``duty``
of every 10 ms:

* ``hog``: in this process's session (one autogroup with the engine);
* ``hog-own-session``: in a session of its own, as ``sluice serve`` starts the gateway and Redis
  (with autogroups on, a session is one scheduling entity of normal weight);
* ``hog-autogroup-19``: that, with its autogroup's nice at 19 (``/proc/PID/autogroup``);
* ``engine-slice`` / ``both-slice``: the engine's threads (and the hog's) asking EEVDF for 100 ms
  slices (``sched_setattr``'s ``sched_runtime``, Linux 6.12+), against the default.

Pinning is the caller's: run it once with ``OMP_PROC_BIND=true`` and once without.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import struct
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as a served engine waits

HOG = ("import sys, time\nduty = float(sys.argv[1])\nwhile True:\n    t = time.perf_counter()\n"
       "    while time.perf_counter() - t < duty * 0.01: pass\n    time.sleep(0.01 * (1 - duty))\n")
SYS_SCHED_SETATTR, SYS_SCHED_GETATTR = 314, 315  # x86-64
SCHED_ATTR = "IIQiIQQQII"  # struct sched_attr (size 56): size, policy, flags, nice, priority, runtime, ...
LONG_SLICE_NS = 100_000_000
_libc = ctypes.CDLL(None, use_errno=True)


def set_slice(tid: int, slice_ns: int) -> None:
    """SCHED_OTHER with a custom slice (0: the kernel's default), read back: a kernel before 6.12
    takes the call and ignores the slice."""
    if platform.machine() != "x86_64":
        raise SystemExit("the slice conditions call sched_setattr by its x86-64 number")
    attr = ctypes.create_string_buffer(struct.pack(SCHED_ATTR, 56, 0, 0, 0, 0, slice_ns, 0, 0, 0, 0), 56)
    if _libc.syscall(SYS_SCHED_SETATTR, tid, attr, 0) != 0:
        raise OSError(ctypes.get_errno(), f"sched_setattr: {os.strerror(ctypes.get_errno())}")
    got = ctypes.create_string_buffer(56)
    if _libc.syscall(SYS_SCHED_GETATTR, tid, got, 56, 0) != 0:
        raise OSError(ctypes.get_errno(), f"sched_getattr: {os.strerror(ctypes.get_errno())}")
    if slice_ns and struct.unpack(SCHED_ATTR, got.raw)[5] != slice_ns:
        raise SystemExit("this kernel does not keep a custom slice (EEVDF's, Linux 6.12+)")


def own_threads_slice(slice_ns: int) -> None:
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        set_slice(int(tid), slice_ns)


def start_hog(condition: str, duty: float) -> subprocess.Popen:
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(duty)], start_new_session=condition != "hog")
    if condition == "hog-autogroup-19":
        with open(f"/proc/{hog.pid}/autogroup", "w") as f:
            f.write("19")
    if condition == "both-slice":
        set_slice(hog.pid, LONG_SLICE_NS)
    return hog


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duty", type=float, default=0.12, help="the hog's busy share of every 10 ms")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conditions", default="alone,hog,hog-own-session,hog-autogroup-19,engine-slice,both-slice")
    args = ap.parse_args()
    conditions = args.conditions.split(",")
    known = {"alone", "hog", "hog-own-session", "hog-autogroup-19", "engine-slice", "both-slice"}
    if "alone" not in conditions or not set(conditions) <= known:
        ap.error(f"--conditions: 'alone' and any of {sorted(known)}")

    from engine_service import LLM, SamplingParams
    from sluice_cli.bench_serve import synthetic_dataset

    llm = LLM(None, dtype="bfloat16")

    def tokens_per_s(seed: str) -> float:
        reqs = synthetic_dataset(64, 128, 64, 0.5, (100, 10000), seed)
        params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
        start = time.perf_counter()
        outs = llm.generate([r.prompt for r in reqs], params)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)

    tokens_per_s("warm-up")
    print(f"OMP_PROC_BIND={os.environ.get('OMP_PROC_BIND', '(unset)')}, duty {args.duty}")
    slices = any(c.endswith("slice") for c in conditions)  # sched_setattr only where asked (Linux 6.12+)
    for rnd in range(args.rounds):
        got = {}
        # each round in another order, so that a drift within a round favours no condition
        for condition in conditions[rnd % len(conditions):] + conditions[:rnd % len(conditions)]:
            if slices:
                own_threads_slice(LONG_SLICE_NS if condition.endswith("slice") else 0)
            hog = start_hog(condition, args.duty) if condition != "alone" else None
            time.sleep(0.2)
            try:
                got[condition] = tokens_per_s(f"{rnd}-{condition}")
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
        print(f"round {rnd}: " + "  ".join(f"{c} {got[c]:.1f} ({got[c] / got['alone']:.3f})" for c in conditions),
              flush=True)
    if slices:
        own_threads_slice(0)


if __name__ == "__main__":
    main()
