"""The prepare pool: worker processes that do the CPU-heavy part of preparing a large request
(parsing its JSON, the chat template, tokenizing), so that it never holds the gateway's event loop.

Why processes: that work holds Python's GIL (``json``, pydantic, Jinja, most ``tokenizers``
calls), so a thread running it stalls the event loop, and with it every stream and ``/health`` of
the process, as surely as running it on the loop does.

- ``workers`` processes (``spawn``: nothing of the gateway's state, threads or sockets is
  inherited), each fed by one thread of the gateway that sends it a job and waits for the answer,
  so a worker runs one job at a time. A process is started for its first job (a gateway that never
  sees a large request starts none; the first one waits about a second for it). The workers run
  at a lower CPU priority (``WORKER_NICE``): when the cores are short, the event loop (streams,
  probes) goes first.
- A job is a module-level function ``fn(ctx, *args)`` (pickled by reference) with ``ctx`` the
  worker's copy of the model card (``WorkerCard``: the tokenizer built once per card fingerprint
  from the card's ``tokenizer.json`` text, at most ``CARDS_PER_WORKER`` kept), or None. The card is
  sent to a worker only the first time that worker needs it.
- **Bounded**: at most ``workers + queue`` jobs are admitted (running or waiting); past that,
  :meth:`PreparePool.run` refuses at once with ``gateway_busy`` (429, ``Retry-After``). A waiting
  job whose client went away is dropped before it runs.
- A job that raises ``OpenAIError`` (a 400 of the request) comes back as that error; one that
  crashes its worker, or runs past ``JOB_TIMEOUT_S`` (its worker is killed), is a 500, and the
  worker is replaced.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import queue
import signal
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from gateway import errors
from gateway.errors import OpenAIError
from gateway.metrics import METRICS
from sluice.wire.card import ModelCard
from sluice.wire.error_codes import Code

log = logging.getLogger("sluice.gateway.prepare_pool")

WORKER_NICE = 10  # added to the workers' nice value: the event loop wins the CPU
JOB_TIMEOUT_S = 60.0  # a job running longer is stopped with its worker (far above any bounded job)
CARDS_PER_WORKER = 4  # model cards (tokenizers) a worker keeps, least recently used dropped


@dataclass
class WorkerCard:
    """A model card as a job reads it in a worker (``gateway.prompts.CardContext``)."""

    card: ModelCard
    tokenizer: Any

    @classmethod
    def build(cls, card: ModelCard) -> WorkerCard:
        return cls(card, card.tokenizer())

    @property
    def max_model_len(self) -> int:
        return self.card.max_model_len

    @property
    def max_chars_per_token(self) -> int | None:
        return self.tokenizer.max_chars_per_token


# --- the worker process ------------------------------------------------------------------------


def _worker_main(conn) -> None:
    """A worker: answers ``(fn, fingerprint, card, args)`` with ``(status, payload, fingerprints)``
    until its pipe closes (the gateway stopped or died)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the gateway's Ctrl-C reaches the whole group
    cards: OrderedDict[str, WorkerCard] = OrderedDict()
    while True:
        try:
            fn, fingerprint, card, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            ctx = None
            if fingerprint is not None:
                if fingerprint not in cards:
                    cards[fingerprint] = WorkerCard.build(card)
                    while len(cards) > CARDS_PER_WORKER:
                        cards.popitem(last=False)
                cards.move_to_end(fingerprint)
                ctx = cards[fingerprint]
            reply: tuple = ("ok", fn(ctx, *args))
        except OpenAIError as exc:
            reply = ("refused", (exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers))
        except Exception as exc:  # noqa: BLE001 - answered as a 500, the worker lives on
            reply = ("error", f"{type(exc).__name__}: {exc}")
        try:
            conn.send((*reply, list(cards)))
        except (BrokenPipeError, EOFError, OSError):
            return
        except Exception as exc:  # noqa: BLE001 - a result that cannot be pickled
            conn.send(("error", f"unpicklable result: {type(exc).__name__}: {exc}", list(cards)))


# --- the gateway's side --------------------------------------------------------------------------


@dataclass
class _Job:
    fn: Callable[..., Any]
    args: tuple
    card: Any  # a LoadedCard (its ``card``, ``fingerprint``), or None
    future: Future


class _WorkerDied(Exception):
    pass


class _Worker:
    """One worker process and the gateway thread that feeds it."""

    def __init__(self, pool: PreparePool, index: int) -> None:
        self.pool, self.index = pool, index
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.conn = None
        self.cards: set[str] = set()  # fingerprints the process holds (it says so in every answer)
        self.thread = threading.Thread(target=self._serve, name=f"sluice-prepare-{index}", daemon=True)

    def start(self) -> None:
        self.thread.start()  # the process itself is started for the first job

    def _spawn(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), name=f"sluice-prepare-{self.index}",
                                daemon=True)
        self.proc.start()
        child.close()
        self.conn, self.cards = parent, set()
        try:  # from here, before the child has imported anything
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, os.getpriority(os.PRIO_PROCESS, 0) + WORKER_NICE)
        except OSError:
            pass

    def stop(self) -> None:
        if self.conn is not None:
            self.conn.close()  # the worker's recv ends: it exits
        if self.proc is not None:
            self.proc.join(2)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(2)

    def _replace(self, why: str) -> None:
        """Kill the process (if alive) and start another; OSError when it cannot be started (the
        next job tries again)."""
        if self.pool.closed:
            return
        log.warning("prepare worker %d %s; starting another", self.index, why)
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        if self.conn is not None:
            self.conn.close()
        self.proc, self.conn = None, None
        self._spawn()

    def _serve(self) -> None:
        while True:
            job = self.pool._jobs.get()
            if job is None:
                return
            if not job.future.set_running_or_notify_cancel():
                continue  # its client went away while it waited
            try:
                result = self._run(job)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting request
                job.future.set_exception(exc)
            else:
                job.future.set_result(result)

    def _run(self, job: _Job) -> tuple:
        fingerprint = job.card.fingerprint if job.card is not None else None
        if self.pool.closed:
            raise _WorkerDied("the gateway is stopping")
        try:
            if self.proc is None:
                self._spawn()
            elif not self.proc.is_alive():
                self._replace("is gone")
            card = job.card.card if fingerprint is not None and fingerprint not in self.cards else None
            self.conn.send((job.fn, fingerprint, card, job.args))
            if not self.conn.poll(JOB_TIMEOUT_S):
                self._replace(f"ran a job past {JOB_TIMEOUT_S:.0f} s")
                raise _WorkerDied(f"the preparation ran past {JOB_TIMEOUT_S:.0f} s")
            status, payload, held = self.conn.recv()
        except (EOFError, OSError) as exc:
            self._replace(f"died ({type(exc).__name__})")
            raise _WorkerDied("the process preparing it died") from None
        self.cards = set(held)
        return status, payload


class PreparePool:
    """``workers`` prepare processes and room for ``waiting`` more jobs; ``retry_after_s``: the
    ``Retry-After`` of a refusal. :meth:`start` on the event loop that will call :meth:`run`."""

    def __init__(self, workers: int, waiting: int, retry_after_s: int = 1) -> None:
        if workers < 1:
            raise ValueError("a prepare pool needs at least one worker")
        self.capacity = workers + max(0, waiting)
        self.retry_after_s = retry_after_s
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._workers = [_Worker(self, i) for i in range(workers)]
        self._admitted = 0
        self.completed = 0  # jobs run to their end (answered, refused or failed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed = False

    @property
    def admitted(self) -> int:
        """Jobs running or waiting now."""
        return self._admitted

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for w in self._workers:
            w.start()

    def close(self) -> None:
        self.closed = True
        while True:  # jobs still waiting: their requests are being cancelled with the server
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.future.cancel()
        for _ in self._workers:
            self._jobs.put(None)
        for w in self._workers:
            w.stop()

    def _released(self, future: Future) -> None:
        try:
            self._loop.call_soon_threadsafe(self._release, not future.cancelled())
        except RuntimeError:  # the loop is closed: the gateway is gone
            pass

    def _release(self, ran: bool) -> None:
        self._admitted -= 1
        METRICS.prepare_jobs.dec()
        self.completed += ran

    async def run(self, fn: Callable[..., Any], card: Any, *args: Any) -> Any:
        """``fn(ctx, *args)`` in a worker, ``ctx`` the worker's copy of ``card`` (a LoadedCard, or
        None); its result, or the OpenAIError it raised. 429 ``gateway_busy`` when ``capacity`` jobs
        are already admitted."""
        if self._admitted >= self.capacity:
            METRICS.prepare_refused.inc()
            raise errors.gateway_busy(self.retry_after_s)
        self._admitted += 1
        METRICS.prepare_jobs.inc()
        future: Future = Future()
        # released when the job is done or dropped, not when its waiter goes: a job still running
        # for a client that left keeps its place
        future.add_done_callback(self._released)
        self._jobs.put(_Job(fn, args, card, future))
        try:
            status, payload = await asyncio.wrap_future(future)
        except _WorkerDied as exc:
            raise errors.error(Code.INTERNAL, f"The request could not be prepared: {exc}.") from None
        except OSError as exc:  # no worker process could be started
            log.error("no prepare worker: %s", exc)
            raise errors.error(Code.INTERNAL, "The request could not be prepared: no worker process.") from None
        if status == "ok":
            return payload
        if status == "refused":
            http_status, message, type_, param, code, headers = payload
            raise OpenAIError(http_status, message, type=type_, param=param, code=code, headers=headers)
        log.error("a prepare job failed: %s", payload)
        raise errors.error(Code.INTERNAL, "Internal error while preparing the request.")

