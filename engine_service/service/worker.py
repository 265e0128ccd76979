"""The step loop: owns the engine (main thread), talks to Redis only through queues.

Per iteration: take what the inbox holds (new entries, cancels, drain/stop), expire deadlines,
run one engine step, turn its outputs into wire Events, and hand the I/O threads ONE Batch
(events + emitted markers + XACKs) to send in one round trip. When the engine has nothing to do
the loop blocks on the inbox instead of spinning. After each step the reader learns the engine's
room (credit) and its fair share between tenants (``FairView``: the order it reads lanes in).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine_service.core.fair_share import EMPTY_VIEW, FairView
from engine_service.service.io_types import Batch, CancelNote, Entry
from engine_service.service.metrics import NULL_METRICS, NullMetrics
from sluice.wire import codec, contract, limits, policy, tenants
from sluice.wire.error_codes import Code
from sluice.wire.messages_pb2 import Event, GenerateRequest
from sluice.wire.stats import EngineStats
from sluice.wire.usage import Usage

log = logging.getLogger("sluice.engine.worker")


def new_inbox() -> queue.SimpleQueue:
    """The step loop's inbox. A SimpleQueue, not a Queue: the engine's signal handler puts a
    DrainNote into it, and Python runs that handler in the main thread, which is the step loop's,
    between any two of its bytecodes. A Queue's put takes the lock its get may hold at that moment
    (a plain Lock: the handler waits on its own thread forever, and the drain never starts);
    SimpleQueue's put is reentrant."""
    return queue.SimpleQueue()


@dataclass
class DrainNote:
    grace_s: float | None = None  # None: the configured default
    requested_at: float = field(default_factory=time.monotonic)  # the grace runs from the signal
    cause: str = "a drain request"  # for the log line the step loop writes when it takes the note


# seconds past a drain's grace after which a step loop still running logs every thread's stack
DRAIN_STACKS_AFTER_S = 5.0

# Of a drain's grace period, this share (at most SHUTDOWN_RESERVE_S) is kept for what follows the
# last step: flushing the final events, deregistering, stopping the threads and the gRPC server.
# The process exits within the grace period, not a few seconds after it (a kubelet's SIGKILL).
SHUTDOWN_RESERVE_S = 1.0
SHUTDOWN_RESERVE_SHARE = 0.2


@dataclass
class StopNote:
    """Leave at once (tests, a second Ctrl-C): nothing is handed back, pending entries stay pending."""

    cause: str = ""  # logged by the step loop when it takes the note


@dataclass(frozen=True)
class _Refusal:
    """Why an entry is not run: an error event with ``code``, abort events (``abort``: the
    ``request_aborts`` cause, its client is gone), or nothing at all (``duplicate`` of a live one)."""

    message: str
    code: Code | None = None
    abort: str | None = None
    duplicate: bool = False


@dataclass
class _Live:
    request: GenerateRequest
    entry_id: Any  # io_types.EntryRef: the shard's stream and the entry's id there
    open: set[int]
    emitted: bool = False
    cached_prompt: list[int] = field(default_factory=list)
    completion_tokens: int = 0  # of every completion, for the tenant's usage (sluice.wire.usage)
    cached_tokens: int = 0


class Worker:
    def __init__(self, engine: Any, io: Any, settings: Any, model: str) -> None:
        self.engine = engine
        self.io = io
        self.settings = settings
        self.model = model
        self.inbox: queue.SimpleQueue = io.inbox if io is not None else new_inbox()
        self.engine_id = settings.engine_id
        self.live: dict[str, _Live] = {}
        self.recent_cancels: dict[str, float] = {}  # cancels for ids not (yet) seen here
        self.consumed = 0
        self.draining = False
        self.drain_deadline: float | None = None  # when running requests are cut off
        self.drain_end: float | None = None
        self.running = False
        self.stopped = threading.Event()
        self.on_serving_change: list[Any] = []  # callables(bool)
        self._rates: deque[tuple[float, int, int]] = deque()
        self._snapshot = EngineStats()
        self._snapshot_lock = threading.Lock()
        self._fair: FairView = EMPTY_VIEW  # the engine's fair share after the last step (immutable)
        self.counters = {"invalid": 0, "cancelled": 0, "deadline": 0, "engine_lost": 0, "handed_back": 0,
                         "gateway_lost": 0}
        self.metrics: NullMetrics = NULL_METRICS
        self._update_snapshot()

    # ------------------------------------------------------------------ control (any thread)
    def request_drain(self, grace_s: float | None = None, cause: str = DrainNote.cause) -> None:
        # A drain must end within its grace. If the step loop has not ended well after it, every
        # thread's stack goes to stderr (the engine's log), so that what held the drain up can be
        # read; the loop's end cancels it. Armed here, in the asking thread (a signal handler, the
        # admin service), because a loop that is stuck never takes the DrainNote.
        faulthandler.dump_traceback_later(self._grace(grace_s) + DRAIN_STACKS_AFTER_S, exit=False)
        self.inbox.put(DrainNote(grace_s, cause=cause))

    def _grace(self, grace_s: float | None) -> float:
        """A drain's grace: the one asked for, else the configured default."""
        return self.settings.drain_grace_s if grace_s is None or grace_s <= 0 else grace_s

    def request_stop(self, cause: str = "") -> None:
        self.inbox.put(StopNote(cause))

    def snapshot(self) -> EngineStats:
        """The latest stats, refreshed after every step (immutable: safe to hand to other threads)."""
        with self._snapshot_lock:
            return self._snapshot

    def fair_view(self) -> FairView:
        """The engine's fair share between tenants after the last step (immutable, any thread)."""
        return self._fair

    # ------------------------------------------------------------------ the loop
    def run(self, on_start: Callable[[], None] | None = None) -> None:
        """The step loop, until stopped or drained. ``on_start`` runs once serving is reported and
        before the first step (the service starts its Redis I/O there)."""
        self.running = True
        self._set_serving(True)
        try:
            if on_start is not None:
                on_start()
            produced = True
            while True:
                batch = Batch()
                busy = self.engine.has_unfinished_requests()
                # Idle: block on the inbox. Busy but the last step produced nothing (nothing could be
                # scheduled): wait a little for news instead of spinning.
                timeout = 0.5 if not busy else (0.0 if produced else 0.01)
                stop = self._take_inbox(batch, timeout)
                if stop:
                    break
                self._expire(batch)
                produced = True
                if self.engine.has_unfinished_requests():
                    before = self._snapshot.iterations
                    produced = self._step(batch) > 0 or self.engine.get_stats().iterations != before
                if self.draining:
                    self._drain_progress(batch)
                self._send(batch)
                self._update_snapshot()
                self._report_credit()
                if self.draining and not self.live:
                    break
        finally:
            faulthandler.cancel_dump_traceback_later()  # request_drain's, if any
            self.running = False
            self._set_serving(False)
            self._update_snapshot()
            self.stopped.set()

    def _set_serving(self, serving: bool) -> None:
        for callback in self.on_serving_change:
            try:
                callback(serving)
            except Exception:
                log.exception("serving-state callback failed")

    def _report_credit(self) -> None:
        headroom = 0 if self.draining else max(0, int(self.engine.admission_headroom()))
        self.io.report_headroom(headroom, self.consumed, self._fair)

    def _take_inbox(self, batch: Batch, timeout: float) -> bool:
        """Handle what the inbox holds, waiting up to ``timeout`` for the first item. True: stop."""
        items = []
        if timeout > 0:
            self._report_credit()
            try:
                items.append(self.inbox.get(timeout=timeout))
            except queue.Empty:
                return False
        while True:
            try:
                items.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        for item in items:
            if isinstance(item, Entry):
                self.consumed += 1
                self._on_entry(item, batch)
            elif isinstance(item, CancelNote):
                self._on_cancel(item.request_ids, batch, item.cause)
            elif isinstance(item, DrainNote):
                self._start_drain(item, batch)
            elif isinstance(item, StopNote):
                if item.cause:
                    log.warning("%s: stopping without waiting (pending entries stay for reclaim)", item.cause)
                self._send(batch)
                return True
        return False

    def _send(self, batch: Batch) -> None:
        self.metrics.events(batch.events)
        self.io.send(batch)

    # ------------------------------------------------------------------ entries
    def _error(self, batch: Batch, request_id: str, code: Code, message: str) -> None:
        batch.events.append(codec.error_event(request_id, code.wire, message, self.engine_id))

    def _on_entry(self, entry: Entry, batch: Batch) -> None:
        """Admit an entry, or answer it in this same step. Every check (limits included) comes
        before anything done per completion: an entry's ``n`` is only trusted once it passed."""
        req = entry.request
        if req is None:
            log.warning("dropping malformed entry %s: %s", entry.entry_id, entry.problem)
            self.counters["invalid"] += 1
            batch.acks.append(entry.entry_id)
            return
        rid = req.request_id
        refusal = self._refusal(entry)
        if refusal is not None:
            # a request id names a stored response or a stream: never at INFO (the tenant, instead)
            log.info("refusing a request of tenant %s (%s): %s", tenants.label(req.tenant),
                     refusal.code or refusal.abort or "duplicate", refusal.message)
            log.debug("refused request: %s", rid)
            if refusal.duplicate:
                # A second copy of a running request. Acknowledge the copy only if it is another
                # entry: acknowledging the running entry itself would leave nothing pending for a
                # peer to reclaim if this engine died now.
                if entry.entry_id != self.live[rid].entry_id:
                    batch.acks.append(entry.entry_id)
                return  # the live request's channel must not hear about it
            batch.acks.append(entry.entry_id)
            if refusal.abort is not None:  # its client is gone: every completion ends "abort"
                self.counters["cancelled" if refusal.abort == "cancel" else refusal.abort] += 1
                self.metrics.aborted(refusal.abort)
                n = req.params.n if req.params.HasField("n") else 1  # within limits.N: checked first
                for index in range(n):
                    batch.events.append(
                        codec.finished_event(rid, index, "abort", prompt_tokens=len(req.prompt_token_ids), engine_id=self.engine_id)
                    )
                return
            assert refusal.code is not None
            self.counters["engine_lost" if refusal.code is Code.ENGINE_LOST else "invalid"] += 1
            self._error(batch, rid, refusal.code, refusal.message)
            return
        if self.draining:
            self._hand_back(req, entry.entry_id, batch)
            return
        try:
            from engine_service.core.sampling_params import SamplingParams

            params = SamplingParams(**codec.sampling_kwargs_from_proto(req.params))
            self.engine.add_request(rid, list(req.prompt_token_ids), params, tenant=req.tenant,
                                    tenant_weight=tenants.wire_weight(req.tenant_weight))
        except ValueError as exc:  # RequestRejected is a ValueError with a .code
            code = getattr(exc, "code", None)
            self.counters["invalid"] += 1
            batch.acks.append(entry.entry_id)
            self._error(batch, rid, code if isinstance(code, Code) else Code.INVALID_REQUEST, str(exc))
            return
        except Exception as exc:
            log.exception("add_request failed for %s", rid)
            batch.acks.append(entry.entry_id)
            self._error(batch, rid, Code.INTERNAL, f"{type(exc).__name__}: {exc}")
            return
        n = params.n
        self.live[rid] = _Live(req, entry.entry_id, set(range(n)), emitted=False)
        self.metrics.request_started(rid, n, req.enqueue_time)
        if entry.reclaimed:
            log.info("restarting a reclaimed request of tenant %s from queue shard %d (it had emitted nothing)",
                     tenants.label(req.tenant), entry.shard)
            log.debug("restarted request: %s", rid)
        else:
            log.debug("admitted %s from queue shard %d%s (%d prompt tokens)", rid, entry.shard,
                      " (stolen)" if entry.stolen else "", len(req.prompt_token_ids))

    def _refusal(self, entry: Entry) -> _Refusal | None:
        """Why this entry must not run, checked in an order whose every step costs O(1) or O(the
        entry's size within the limits): the limits come before the states whose answer is sent
        per completion (cancelled, gateway lost)."""
        req = entry.request
        rid = req.request_id
        now = time.time()
        if rid in self.live:
            return _Refusal(f"request id {rid!r} is already running here", duplicate=True)
        if req.version != contract.CONTRACT_VERSION:
            return _Refusal(
                f"the request speaks Sluice contract version {req.version}, this engine version "
                f"{contract.CONTRACT_VERSION}: run the same Sluice release on gateways and engines",
                Code.CONTRACT_MISMATCH)
        if req.model != self.model:
            return _Refusal(f"model {req.model!r} is not served here ({self.model!r})", Code.INVALID_REQUEST)
        # The gateway's limits, again: anything that can XADD can queue an entry (n=20000 would
        # stall every other request for seconds a step; n=2**32-1 would never end a loop over it).
        problem = limits.check_request(req, vocab_size=getattr(self.engine, "vocab_size", None),
                                       max_model_len=getattr(self.engine, "max_model_len", None))
        if problem is not None:
            return _Refusal(problem.message, problem.code)
        if entry.cancelled or self.recent_cancels.pop(rid, None) is not None:
            return _Refusal("cancelled before it ran", abort="cancel")
        if entry.gateway_lost:
            return _Refusal(f"the gateway that enqueued it ({req.gateway_id}) is gone", abort="gateway_lost")
        lost = policy.lost_on_delivery(emitted=entry.emitted, deliveries=entry.deliveries, attempt=req.attempt)
        if lost is not None:
            return _Refusal(lost, Code.ENGINE_LOST)
        if req.deadline and now > req.deadline:
            return _Refusal(f"the deadline passed {now - req.deadline:.3f}s before the request ran",
                            Code.DEADLINE_EXCEEDED)
        wait = self.settings.max_queue_wait
        if wait and req.enqueue_time and now - req.enqueue_time > wait:
            return _Refusal(f"waited {now - req.enqueue_time:.1f}s in the queue (limit {wait:g}s)",
                            Code.DEADLINE_EXCEEDED)
        return None

    def _finish(self, rid: str, batch: Batch) -> None:
        live = self.live.pop(rid, None)
        if live is not None:
            batch.acks.append(live.entry_id)
            req = live.request
            used = Usage(req.tenant, req.model, 1, len(req.prompt_token_ids), live.completion_tokens, live.cached_tokens)
            batch.usage.append(used)
            self.metrics.usage(used)
            self.metrics.request_done(rid)

    def _abort_silently(self, rid: str) -> None:
        try:
            self.engine.abort_request([rid])
        except Exception:
            log.exception("abort_request(%s) failed", rid)

    # ------------------------------------------------------------------ cancels and deadlines
    def _on_cancel(self, request_ids: list[str], batch: Batch, cause: str = "cancel") -> None:
        """Abort these requests: a client cancelled them (``cause`` "cancel"), or the gateway that
        waited for them is gone ("gateway_lost"; nobody reads their events, sent all the same)."""
        now = time.monotonic()
        for rid in request_ids:
            live = self.live.get(rid)
            if live is None:
                if cause == "cancel":  # may still come: remember it. A lost gateway's ids were all delivered
                    self.recent_cancels[rid] = now
                continue
            if cause == "gateway_lost":
                log.info("aborting a request of tenant %s: its gateway %s is gone", tenants.label(live.request.tenant),
                         live.request.gateway_id)
                log.debug("aborted request: %s", rid)
            self.counters["cancelled" if cause == "cancel" else cause] += 1
            self.metrics.aborted(cause)
            for out in self.engine.abort_request([rid]):
                if out.index in live.open:
                    live.open.discard(out.index)
                    batch.events.append(self._event(out, live, force_reason="abort"))
            for index in sorted(live.open):  # whatever the engine did not report
                batch.events.append(
                    codec.finished_event(rid, index, "abort", prompt_tokens=len(live.request.prompt_token_ids), engine_id=self.engine_id)
                )
            self._finish(rid, batch)
        # Forget cancels for ids that never showed up here (another engine ran them).
        if len(self.recent_cancels) > 1000 or any(now - t > 600 for t in self.recent_cancels.values()):
            self.recent_cancels = {k: t for k, t in self.recent_cancels.items() if now - t <= 600}

    def _expire(self, batch: Batch) -> None:
        now = time.time()
        for rid, live in list(self.live.items()):
            deadline = live.request.deadline
            if deadline and now > deadline:
                self.counters["deadline"] += 1
                self.metrics.aborted("deadline")
                self._abort_silently(rid)
                self._error(batch, rid, Code.DEADLINE_EXCEEDED, "the request's deadline passed while it ran")
                self._finish(rid, batch)

    # ------------------------------------------------------------------ the step
    def _step(self, batch: Batch) -> int:
        started = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("engine step failed; failing the requests it held")
            for rid in list(self.live):
                self._abort_silently(rid)
                self._error(batch, rid, Code.INTERNAL, f"engine step failed: {type(exc).__name__}: {exc}")
                self._finish(rid, batch)
            return 1
        self.metrics.step(time.perf_counter() - started, *getattr(self.engine, "last_batch", (0, 0)))
        self.metrics.outputs(outputs)
        for out in outputs:
            live = self.live.get(out.request_id)
            if live is None or out.index not in live.open:
                continue  # nothing after the terminal event
            reason = out.finish_reason.value if out.finish_reason is not None else None
            if reason == "error":
                self._abort_silently(out.request_id)
                self._error(batch, out.request_id, Code(out.error_code) if out.error_code else Code.INTERNAL,
                            out.error or "the engine failed the request")
                self._finish(out.request_id, batch)
                continue
            first = bool(out.new_token_ids) and not live.emitted
            if first:
                live.emitted = True
                batch.emitted.append(out.request_id)
                live.cached_tokens = out.num_cached_tokens or 0
            live.completion_tokens += len(out.new_token_ids)
            if out.finish_reason is not None:
                live.open.discard(out.index)
            if out.new_token_ids or out.finish_reason is not None or out.prompt_logprobs:
                event = self._event(out, live)
                if first and out.num_cached_tokens:
                    event.cached_tokens = out.num_cached_tokens
                batch.events.append(event)
            if not live.open:
                log.debug("finished %s", out.request_id)
                self._finish(out.request_id, batch)
        return len(outputs)

    def _event(self, out: Any, live: _Live, force_reason: str | None = None) -> Event:
        event = Event(request_id=out.request_id, index=out.index, token_ids=out.new_token_ids, engine_id=self.engine_id)
        if out.new_logprobs:
            for token_id, entries in zip(out.new_token_ids, out.new_logprobs, strict=False):
                event.logprobs.append(codec.position_logprobs(token_id, entries))
        if out.prompt_logprobs:
            prompt = live.request.prompt_token_ids
            for i, entries in enumerate(out.prompt_logprobs):
                event.prompt_logprobs.append(codec.position_logprobs(prompt[i] if i < len(prompt) else None, entries))
        reason = force_reason or (out.finish_reason.value if out.finish_reason is not None else None)
        if reason is not None:
            finished = codec.finished_event(
                out.request_id,
                out.index,
                reason,
                stop_token_id=out.stop_reason if isinstance(out.stop_reason, int) else None,
                prompt_tokens=out.num_prompt_tokens,
                completion_tokens=out.num_output_tokens,
                cached_tokens=out.num_cached_tokens,
            ).finished
            event.finished.CopyFrom(finished)
        return event

    # ------------------------------------------------------------------ drain
    def _start_drain(self, note: DrainNote, batch: Batch) -> None:
        if self.draining:
            return
        grace = self._grace(note.grace_s)
        log.info("draining (%s): %d live requests, grace %.1fs", note.cause, len(self.live), grace)
        self.draining = True
        self.drain_end = note.requested_at + grace  # when the process must be gone
        self.drain_deadline = self.drain_end - min(SHUTDOWN_RESERVE_S, SHUTDOWN_RESERVE_SHARE * grace)
        self.io.stop_reading()
        self._set_serving(False)
        # Requests that have emitted nothing go back to the queue now: another replica can start
        # them at once, and their clients never notice. The rest get the grace period to finish.
        for rid, live in list(self.live.items()):
            if not live.emitted:
                self._abort_silently(rid)
                del self.live[rid]
                self.metrics.request_done(rid, ended=False)
                self._hand_back(live.request, live.entry_id, batch)

    def _hand_back(self, req: GenerateRequest, entry_id: Any, batch: Batch) -> None:
        """Back to the queue, to the shard it came from (the I/O side finds it by ``entry_id``)."""
        again = GenerateRequest()
        again.CopyFrom(req)
        again.attempt = req.attempt + 1
        batch.requeue.append(again)
        batch.acks.append(entry_id)
        self.counters["handed_back"] += 1

    def _drain_progress(self, batch: Batch) -> None:
        if self.drain_deadline is not None and time.monotonic() >= self.drain_deadline:
            for rid in list(self.live):
                self.metrics.aborted("drain")
                self._abort_silently(rid)
                self._error(batch, rid, Code.DRAINING, "the engine shut down before the request finished")
                self._finish(rid, batch)

    # ------------------------------------------------------------------ stats
    def _update_snapshot(self) -> None:
        view = getattr(self.engine, "fair_view", None)  # an engine without tenants (a test's fake): none
        if view is not None:
            self._fair = view()
        stats = self.engine.get_stats()
        now = time.monotonic()
        self._rates.append((now, stats.generation_tokens_total, stats.prompt_tokens_total))
        while len(self._rates) > 2 and now - self._rates[0][0] > 10.0:
            self._rates.popleft()
        t0, g0, p0 = self._rates[0]
        span = now - t0
        snap = dataclasses.replace(
            stats,
            engine_id=self.engine_id,
            model=self.model,
            generation_tokens_per_s=(stats.generation_tokens_total - g0) / span if span > 0 else 0.0,
            prompt_tokens_per_s=(stats.prompt_tokens_total - p0) / span if span > 0 else 0.0,
            live_requests=len(self.live),
            draining=self.draining,
        )
        with self._snapshot_lock:
            self._snapshot = snap
