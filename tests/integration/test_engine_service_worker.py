"""The step loop's bookkeeping against a fake engine and a fake I/O side: no Redis, no model, fast.

What it pins down: one terminal event per completion and nothing after it, idempotent cancels
(before, during, after), deadlines, hand-back on drain, XACK exactly once, the admission credit.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from engine_service.core.outputs import EngineOutput
from engine_service.core.request import FinishReason
from engine_service.service import worker as worker_module
from engine_service.service.io_types import Batch, CancelNote, Entry
from engine_service.service.settings import ServiceSettings
from engine_service.service.worker import DrainNote, Worker, new_inbox
from sluice.wire import codec, contract
from sluice.wire.messages_pb2 import FINISH_REASON_ABORT, FINISH_REASON_LENGTH
from sluice.wire.stats import EngineStats


class FakeEngine:
    """One token per request per step; finishes at max_tokens. ``slow`` adds a sleep per step."""

    vocab_size = 1000

    def __init__(self, slow: float = 0.0) -> None:
        self.reqs: dict[str, list] = {}  # id -> [params, generated]
        self.slow = slow
        self.iterations = 0

    def add_request(self, rid, prompt, params, arrival_time=None, *, tenant="", tenant_weight=1):
        if not prompt:
            raise ValueError("the prompt is empty")
        self.reqs[rid] = [params, 0]

    def abort_request(self, ids):
        out = []
        for rid in ids:
            if rid in self.reqs:
                del self.reqs[rid]
                out.append(EngineOutput(rid, [], finish_reason=FinishReason.ABORT))
        return out

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def admission_headroom(self):
        return max(0, 4 - len(self.reqs))

    def step(self):
        time.sleep(self.slow)
        self.iterations += 1
        outs = []
        for rid, state in list(self.reqs.items()):
            state[1] += 1
            done = state[1] >= (state[0].max_tokens or 4)
            outs.append(EngineOutput(rid, [state[1]], finish_reason=FinishReason.LENGTH if done else None,
                                     num_output_tokens=state[1]))
            if done:
                del self.reqs[rid]
        return outs

    def get_stats(self):
        return EngineStats(running=len(self.reqs), iterations=self.iterations, free_blocks=10, total_blocks=10)


class FakeIO:
    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue = new_inbox()
        self.batches: list[Batch] = []
        self.credit: list[tuple[int, int]] = []
        self.reading = True
        self.lock = threading.Lock()

    def send(self, batch: Batch) -> None:
        if batch:
            with self.lock:
                self.batches.append(batch)

    def report_headroom(self, headroom: int, consumed: int, fair=None) -> None:
        self.credit.append((headroom, consumed))

    def stop_reading(self) -> None:
        self.reading = False

    def events(self, rid: str | None = None):
        with self.lock:
            return [e for b in self.batches for e in b.events if rid is None or e.request_id == rid]

    def acks(self):
        with self.lock:
            return [a for b in self.batches for a in b.acks]

    def requeued(self):
        with self.lock:
            return [r for b in self.batches for r in b.requeue]


def entry(rid: str, max_tokens: int = 4, **kw) -> Entry:
    req = codec.make_request(rid, "m", [1, 2, 3], {"temperature": 0.0, "max_tokens": max_tokens},
                             **{"reply_to": "g", **kw})
    return Entry(f"{rid}-entry".encode(), req)


def start(engine=None):
    io = FakeIO()
    worker = Worker(engine or FakeEngine(), io, ServiceSettings(engine_id="w", drain_grace_s=5.0), "m")
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return worker, io, thread


def wait_for(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met"
        time.sleep(0.01)


def stop(worker, thread) -> None:
    worker.request_stop()
    thread.join(5)
    assert not thread.is_alive()


def terminal(events):
    return [e for e in events if codec.is_terminal(e)]


def test_run_to_completion_acks_once():
    worker, io, thread = start()
    io.inbox.put(entry("a", max_tokens=3))
    wait_for(lambda: terminal(io.events("a")))
    time.sleep(0.05)
    stop(worker, thread)
    events = io.events("a")
    assert [t for e in events for t in e.token_ids] == [1, 2, 3]
    assert events[-1].finished.finish_reason == FINISH_REASON_LENGTH and len(terminal(events)) == 1
    assert io.acks() == [b"a-entry"]
    assert any(headroom == 4 for headroom, _ in io.credit)


def test_cancel_before_during_after_is_idempotent():
    worker, io, thread = start(FakeEngine(slow=0.02))
    io.inbox.put(CancelNote(["early"]))  # before: the id is not known yet
    io.inbox.put(entry("early"))
    io.inbox.put(entry("mid", max_tokens=1000))
    wait_for(lambda: len(io.events("mid")) >= 2)
    io.inbox.put(CancelNote(["mid"]))
    io.inbox.put(CancelNote(["mid", "nobody"]))
    wait_for(lambda: terminal(io.events("mid")))
    time.sleep(0.1)
    io.inbox.put(CancelNote(["mid"]))  # after
    time.sleep(0.1)
    stop(worker, thread)
    early = io.events("early")
    assert len(early) == 1 and early[0].finished.finish_reason == FINISH_REASON_ABORT and not early[0].token_ids
    mid = io.events("mid")
    assert mid[-1].finished.finish_reason == FINISH_REASON_ABORT and len(terminal(mid)) == 1
    assert sorted(io.acks()) == [b"early-entry", b"mid-entry"]
    assert not worker.engine.reqs and not worker.live


def test_deadline_on_read_and_while_running():
    worker, io, thread = start(FakeEngine(slow=0.02))
    io.inbox.put(entry("late", deadline=time.time() - 1))
    io.inbox.put(entry("slow", max_tokens=10_000, deadline=time.time() + 0.3))
    wait_for(lambda: terminal(io.events("slow")))
    time.sleep(0.1)
    stop(worker, thread)
    assert io.events("late")[0].error.code == contract.ERR_DEADLINE
    slow = io.events("slow")
    assert slow[-1].error.code == contract.ERR_DEADLINE and len(terminal(slow)) == 1
    assert not worker.engine.reqs


def test_bad_entries_are_answered_or_dropped():
    worker, io, thread = start()
    io.inbox.put(Entry(b"junk", None, problem="garbage"))
    io.inbox.put(_with(entry("v"), version=7))
    io.inbox.put(_with(entry("empty"), prompt=[]))
    io.inbox.put(entry("ok", max_tokens=2))
    wait_for(lambda: terminal(io.events("ok")))
    stop(worker, thread)
    assert io.events("v")[0].error.code == contract.ERR_CONTRACT_MISMATCH
    assert "contract version 7" in io.events("v")[0].error.message
    assert io.events("empty")[0].error.code == contract.ERR_INVALID_REQUEST
    assert sorted(io.acks()) == [b"empty-entry", b"junk", b"ok-entry", b"v-entry"]


def _with(e: Entry, version: int | None = None, prompt: list[int] | None = None) -> Entry:
    if version is not None:
        e.request.version = version
    if prompt is not None:
        del e.request.prompt_token_ids[:]
        e.request.prompt_token_ids.extend(prompt)
    return e


def test_drain_finishes_streaming_and_hands_back_the_rest():
    worker, io, thread = start(FakeEngine(slow=0.02))
    io.inbox.put(entry("streaming", max_tokens=20))
    wait_for(lambda: io.events("streaming"))
    io.inbox.put(DrainNote(5.0))
    io.inbox.put(entry("fresh"))
    thread.join(10)
    assert not thread.is_alive(), "the drain did not end the loop"
    streaming = io.events("streaming")
    assert streaming[-1].finished.finish_reason == FINISH_REASON_LENGTH and sum(len(e.token_ids) for e in streaming) == 20
    assert io.events("fresh") == []
    [again] = io.requeued()
    assert again.request_id == "fresh" and again.attempt == 1
    assert sorted(io.acks()) == [b"fresh-entry", b"streaming-entry"]
    assert io.reading is False and io.credit[-1][0] == 0


def test_drain_grace_errors_what_is_left():
    io = FakeIO()
    worker = Worker(FakeEngine(slow=0.02), io, ServiceSettings(engine_id="w", drain_grace_s=0.2), "m")
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    io.inbox.put(entry("forever", max_tokens=100_000))
    wait_for(lambda: io.events("forever"))
    worker.request_drain()
    thread.join(5)
    assert not thread.is_alive()
    events = io.events("forever")
    assert events[-1].error.code == contract.ERR_DRAINING and len(terminal(events)) == 1


class StuckEngine(FakeEngine):
    """An engine whose step blocks until ``release`` is set: a step loop that cannot reach its drain."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def step(self):
        self.entered.set()
        self.release.wait(30)
        return super().step()


STACKS = "most recent call first"  # faulthandler's header of each thread's stack


def test_a_drain_held_up_by_a_stuck_step_writes_every_threads_stack(monkeypatch, capfd):
    monkeypatch.setattr(worker_module, "DRAIN_STACKS_AFTER_S", 0.3)
    engine = StuckEngine()
    io = FakeIO()
    worker = Worker(engine, io, ServiceSettings(engine_id="w", drain_grace_s=0.2), "m")
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        io.inbox.put(entry("held", max_tokens=100))
        assert engine.entered.wait(5)
        worker.request_drain()  # from this thread, as a signal handler or the admin service asks
        err = ""
        end = time.monotonic() + 5
        while STACKS not in err and time.monotonic() < end:
            time.sleep(0.05)
            err += capfd.readouterr().err
        # the stuck frame is named, in the step loop's thread, within grace + DRAIN_STACKS_AFTER_S
        assert STACKS in err and "in step" in err and "in run" in err, err
    finally:
        engine.release.set()
        thread.join(5)
    assert not thread.is_alive()


def test_a_drain_that_ends_in_time_writes_no_stacks(monkeypatch, capfd):
    monkeypatch.setattr(worker_module, "DRAIN_STACKS_AFTER_S", 0.3)
    io = FakeIO()
    worker = Worker(FakeEngine(slow=0.01), io, ServiceSettings(engine_id="w", drain_grace_s=0.2), "m")
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    io.inbox.put(entry("short", max_tokens=3))
    wait_for(lambda: terminal(io.events("short")))
    worker.request_drain()
    thread.join(5)
    assert not thread.is_alive()
    time.sleep(1.0)  # past grace + DRAIN_STACKS_AFTER_S: the loop's end cancelled the dump
    assert STACKS not in capfd.readouterr().err


# The engine's own signal handler and a step loop in the main thread, as `sluice engine` runs them,
# under a storm of SIGTERMs: Python runs the handler in the main thread between any two bytecodes,
# so some land while the loop is inside the inbox's get, holding whatever lock it takes.
SIGNAL_STORM = r"""
import logging, os, signal, threading, time
logging.basicConfig(level=logging.INFO)  # to stderr, as `sluice engine` logs
from engine_service.service.main import install_drain_signals
from engine_service.service.settings import ServiceSettings
from engine_service.service.worker import Worker
from sluice.wire import contract
from tests.integration.test_engine_service_worker import FakeEngine, FakeIO, entry

io = FakeIO()
worker = Worker(FakeEngine(), io, ServiceSettings(engine_id="w", drain_grace_s=3.0), "m")
install_drain_signals(worker)
io.inbox.put(entry("long", max_tokens=10**9))  # still running when the grace ends

def storm():
    while worker.engine.iterations < 100:
        time.sleep(0.01)
    for _ in range(400):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.002)

threading.Thread(target=storm, daemon=True).start()
worker.run()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
events = io.events("long")
print("drained", worker.engine.iterations, events[-1].error.code == contract.ERR_DRAINING, flush=True)
"""


def test_a_drain_signal_that_lands_inside_the_inbox_still_drains():
    """The hang the chaos test met once (docs/operations.md, draining): with a queue.Queue inbox, a SIGTERM
    that lands while the step loop holds the queue's lock made the handler's put wait on its own
    thread forever, and the engine never drained. The inbox's put must be reentrant."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", SIGNAL_STORM], cwd=root, capture_output=True, text=True,
                          timeout=30, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("drained") and proc.stdout.split()[2] == "True", proc.stdout
    # the loop logs the drain once, with its cause; the handler itself writes nothing
    assert proc.stderr.count("draining (signal 15)") == 1 and "Logging error" not in proc.stderr, proc.stderr[-3000:]
