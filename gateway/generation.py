"""One HTTP request's generation: enqueue its engine requests, turn engine events into text deltas.

An OpenAI request becomes one engine request per prompt (``GenerateRequest`` with ``n``
completions); every completion becomes a :class:`Choice` with its own incremental detokenizer and
stop-string matcher. :meth:`Generation.deltas` yields, per engine event, the new text of a choice
(never a split character, never text past a stop string) with the logprobs of the tokens it
consumed, and a finish reason on a choice's last delta.

Cancellation: when a stop string ends a choice the engine keeps generating it, so once every
choice of an engine request is done at the gateway while the engine has not finished it, a
``Cancel`` is published. A generator closed early (client gone, deadline) cancels whatever the
engine still runs.

Resumable generations (``sluice.wire.event_log``): a logged generation's engine request
also goes to its event log, with a record any gateway can render it from. A generation can be
rebuilt from that record (:meth:`Generation.resumed`) and fed from the log instead of the broker's
channel (:meth:`Generation.follow`, holding the request's lease); the same events make the same
deltas, so the stream's chunks and their numbers are the same on any gateway. When the client of a
logged (not detached) generation goes away, the request is not cancelled at once: it keeps running
while someone holds its lease (a resumed client), and is cancelled once nobody has held it for
``contract.RESUME_WINDOW_S`` (:meth:`Generation._orphaned`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from gateway import errors
from gateway.broker import Broker, LoadedCard, Lost
from gateway.keyring import ANONYMOUS, Principal
from gateway.metrics import METRICS
from sluice.text.detokenizer import CONTEXT_TOKENS, token_text
from sluice.text.stream import TextStream
from sluice.wire import codec, contract, limits, policy
from sluice.wire.event_log import StreamRecord
from sluice.wire.messages_pb2 import Event, SamplingParams

if TYPE_CHECKING:
    from gateway.admission import Ticket
    from gateway.reasoning import ThinkParser

# With no event for this long, check that an engine for the model is still alive; with none alive,
# untouched work waits this long for one (the rule: ``sluice.wire.policy.engine_lost``).
LIVENESS_CHECK_S = policy.LIVENESS_CHECK_S
NO_ENGINE_WAIT_S = policy.NO_ENGINE_WAIT_S
# A follower of a log (a resumed stream) that has read all of it reads again after this long.
FOLLOW_POLL_S = 0.05


class _Tick:
    """Put on a generation's queue by its watchdog: nothing came for a while, or the deadline."""


_TICK = _Tick()


@dataclass
class TokenInfo:
    """One generated (or prompt) position: the chosen token and its top alternatives."""

    token_id: int
    text: str
    bytes: bytes
    logprob: float | None
    top: list[tuple[str, float, bytes]] = field(default_factory=list)


@dataclass
class Delta:
    index: int
    text: str
    logprobs: list[TokenInfo] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Choice:
    def __init__(self, index: int, sub: SubRequest, card: LoadedCard, opts: dict) -> None:
        self.index = index
        self.sub = sub
        self.tok = card.tokenizer
        self.stream = TextStream(card.tokenizer, sub.prompt_ids, stop=opts.get("stop"),
                                 include_stop_str_in_output=opts.get("include_stop_str", False),
                                 skip_special_tokens=opts.get("skip_special_tokens", True))
        self.want_logprobs = opts.get("logprobs") is not None
        self.num_top = opts.get("logprobs") or 0
        self.token_ids: list[int] = []
        self.text = ""
        # len(self.text) through each of token_ids, for the reasoning-token count; kept only for a
        # model with a reasoning parser (the only one whose usage counts them)
        self.text_ends: list[int] | None = [] if card.card.reasoning_parser is not None else None
        self.finished = False  # done as far as the client is concerned
        self.engine_done = False  # the engine sent its terminal event
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[TokenInfo] = []

    def consume(self, ev: Event) -> Delta | None:
        if self.finished:
            if ev.HasField("finished"):
                self.engine_done = True
            return None
        parts: list[str] = []
        lps: list[TokenInfo] | None = [] if self.want_logprobs else None
        emitted = len(self.text)
        for i, tid in enumerate(ev.token_ids):
            self.token_ids.append(tid)
            if lps is not None:
                lps.append(position_info(self.tok, tid, ev.logprobs[i] if i < len(ev.logprobs) else None,
                                         self.num_top))
            res = self.stream.add(tid)
            parts.append(res.text)
            if self.text_ends is not None:
                emitted += len(res.text)
                self.text_ends.append(emitted)
            if res.stopped:
                self.finished, self.finish_reason, self.stop_reason = True, "stop", res.stop
                break
        if ev.HasField("finished"):
            self.engine_done = True
            if not self.finished:
                res = self.stream.finish()
                parts.append(res.text)
                if res.stopped:
                    self.finish_reason, self.stop_reason = "stop", res.stop
                else:
                    self.finish_reason = codec.finish_reason_name(ev.finished.finish_reason) or "stop"
                    if ev.finished.HasField("stop_token_id"):
                        self.stop_reason = ev.finished.stop_token_id
                self.finished = True
        text = "".join(parts)
        self.text += text
        if self.text_ends:  # what the stream's end released belongs to the last token
            self.text_ends[-1] = len(self.text)
        if lps is not None:
            self.logprobs.extend(lps)
        if not text and not lps and not self.finished:
            return None
        return Delta(self.index, text, lps, self.finish_reason if self.finished else None, self.stop_reason)


def position_info(tokenizer, token_id: int, pos, num_top: int = 0) -> TokenInfo:
    """A position's logprobs from the engine's ``PositionLogprobs`` (chosen token first, then the
    alternatives). ``top`` holds the ``num_top`` most likely tokens by rank, the chosen one among
    them when it ranks there (OpenAI's top_logprobs)."""
    text, data = token_text(tokenizer, token_id)
    if pos is None or not pos.entries:
        return TokenInfo(token_id, text, data, None)
    chosen = pos.entries[0]
    ranked = sorted(enumerate(pos.entries), key=lambda ie: (ie[1].rank if ie[1].rank > 0 else 1 << 30, ie[0]))
    top, seen = [], set()
    for _, e in ranked:
        if len(top) >= num_top:
            break
        if e.token_id in seen:
            continue
        seen.add(e.token_id)
        t, b = (text, data) if e.token_id == token_id else token_text(tokenizer, e.token_id)
        top.append((t, float(e.logprob), b))
    return TokenInfo(token_id, text, data, float(chosen.logprob), top)


@dataclass
class SubRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    choices: list[Choice] = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    prompt_len: int | None = None  # a resumed request's (its record keeps only the prompt's tail)
    index: int = 0  # its place among the generation's engine requests
    started: bool = False  # its first token came (its admission's queued place was freed)
    cached_tokens: int = 0  # of its prompt, served from the engine's prefix cache (its first event says)

    @property
    def engine_active(self) -> bool:
        return any(not c.engine_done for c in self.choices)


class Generation:
    """Drives one OpenAI request's engine requests from enqueue to the last delta."""

    def __init__(
        self,
        broker: Broker,
        card: LoadedCard,
        prompts: list[list[int]],
        params: SamplingParams,
        opts: dict,
        *,
        deadline: float,
        endpoint: str,
        id_prefix: str,
        log_ttl_s: int | None = None,
        detached: bool = False,
        render: dict | None = None,
        principal: Principal = ANONYMOUS,
    ) -> None:
        self.broker = broker
        self.principal = principal  # whose request: its tenant, fair-share weight and limits
        self.ticket: Ticket | None = None  # what admission took for it (gateway.admission), given back at the end
        self._unseen_tokens = 0  # tokens generated after its client went away (an orphaned request's)
        self.card = card
        self.deadline = deadline
        self.endpoint = endpoint
        self.id = f"{id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.arrival = time.monotonic()
        # Logged (resumable): ``log_ttl_s`` given and one engine request (the log of several would
        # interleave differently than their live events did). Detached requests are always logged.
        self.logged = (log_ttl_s is not None or detached) and len(prompts) == 1
        self.log_ttl_s = log_ttl_s or 0
        self.detached = detached and self.logged
        # Detached at the engine (no gateway's loss aborts it), but cancelled by this gateway when
        # its own client goes away: a stored foreground response (``detach(..., client_owned=True)``).
        self.client_owned = False
        self.render = render or {}
        self.opts = opts
        self.reply_to: str | None = None  # whose requests to cancel: None, ours; a record's when resumed
        self.resumed = False
        self._follower: asyncio.Task | None = None
        self._lease_token = uuid.uuid4().hex
        self._leasing = False
        self.subs: list[SubRequest] = []
        n = params.n or 1
        for p_idx, ids in enumerate(prompts):
            rid = self.id if len(prompts) == 1 else f"{self.id}-{p_idx}"
            sub = SubRequest(rid, ids, params, index=p_idx)
            sub.choices = [Choice(p_idx * n + i, sub, card, opts) for i in range(n)]
            self.subs.append(sub)
        self._by_id = {s.request_id: s for s in self.subs}
        self.choices = [c for s in self.subs for c in s.choices]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._started = False
        self._closed = False
        self.first_token_time: float | None = None
        self._last_token_time: float | None = None
        self.enqueue_time: float | None = None
        self._no_engine_since: float | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._last_event = 0.0  # loop time of the last event (the watchdog's reference)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(s.prompt_ids) if s.prompt_len is None else s.prompt_len for s in self.subs)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        return sum(s.cached_tokens for s in self.subs)

    def usage(self, reasoning: ThinkParser | None = None, prompt: str = "", *, details: bool = False) -> dict:
        """The usage OpenAI reports. ``details``: with ``completion_tokens_details``, whose
        ``reasoning_tokens`` counts the tokens each choice's reasoning took as ``reasoning`` (the
        model's parser, None for none) splits it, given the rendered ``prompt`` (which may have
        opened the reasoning)."""
        p, c = self.prompt_tokens, self.completion_tokens
        out = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
               "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        if details:
            out["completion_tokens_details"] = {"reasoning_tokens": 0 if reasoning is None else sum(
                reasoning.reasoning_tokens(prompt, ch.text, ch.text_ends or []) for ch in self.choices)}
        return out

    def detach(self, log_ttl_s: int, endpoint: str, render: dict, *, client_owned: bool = False) -> None:
        """Make this generation (not started, one engine request) a detached, logged one, rendered
        from its log by any gateway: no gateway's loss stops it at the engine. Without
        ``client_owned`` (a background request) no client's loss stops it either; with it (a stored
        foreground response) closing it early (its client went away, its deadline) cancels it as
        a plain request's close does, while the death of this gateway leaves it to run and be
        finished by any other from its log."""
        if self._started or len(self.subs) != 1:
            raise ValueError("only a generation of one engine request, before its start, can be detached")
        self.logged = self.detached = True
        self.client_owned = client_owned
        self.log_ttl_s, self.endpoint, self.render = log_ttl_s, endpoint, render

    @classmethod
    def resumed(cls, broker: Broker, card: LoadedCard, record: StreamRecord, params: SamplingParams,
                opts: dict) -> Generation:
        """A logged generation rebuilt from its record, on any gateway: call :meth:`follow` to feed
        it from the log."""
        gen = cls(broker, card, record.prompt_ids, params, opts, deadline=record.deadline or time.time() + 3600,
                  endpoint=record.endpoint, id_prefix="", log_ttl_s=0, detached=record.detached,
                  render=record.render, principal=Principal(record.tenant))
        gen.id, gen.created, gen.reply_to, gen.resumed = record.id, record.created, record.reply_to, True
        for sub, rid, length in zip(gen.subs, record.request_ids, record.prompt_tokens, strict=True):
            sub.request_id, sub.prompt_len = rid, length
        gen._by_id = {s.request_id: s for s in gen.subs}
        return gen

    def record(self) -> StreamRecord:
        return StreamRecord(id=self.id, endpoint=self.endpoint, model=self.card.name, created=self.created,
                            reply_to=self.reply_to or self.broker.gateway_id,
                            request_ids=[s.request_id for s in self.subs],
                            prompt_ids=[s.prompt_ids if self.render.get("whole_prompt") else s.prompt_ids[-CONTEXT_TOKENS:]
                                        for s in self.subs],
                            prompt_tokens=[len(s.prompt_ids) for s in self.subs], deadline=self.deadline,
                            detached=self.detached, render=self.render, tenant=self.principal.tenant)

    def follow(self) -> None:
        """Feed this (resumed) generation from its log, holding the request's lease meanwhile."""
        self._started = True
        self._leasing = True
        self._follower = asyncio.get_running_loop().create_task(self._follow(), name=f"sluice-follow-{self.id}")

    async def _follow(self) -> None:
        rid = self.subs[0].request_id
        index, next_lease = 0, 0.0
        while True:
            try:
                now = time.monotonic()
                if self._leasing and now >= next_lease:
                    await self.broker.take_lease([rid], self._lease_token)
                    next_lease = now + contract.LEASE_REFRESH_S
                elements = await self.broker.read_log(rid, index)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - Redis away: the deadline and liveness checks still bound the wait
                await asyncio.sleep(0.2)
                continue
            index += len(elements)
            for events in elements:
                for ev in events:
                    self._queue.put_nowait(ev)
            if not elements:  # caught up: poll (a resumed stream adds at most this to its latency)
                await asyncio.sleep(FOLLOW_POLL_S)

    async def start(self) -> None:
        """Register every request's queue with the broker, then enqueue (in that order: events of
        an unregistered request are dropped)."""
        now = time.time()
        reqs = [codec.make_request(sub.request_id, self.card.name, sub.prompt_ids, sub.params,
                                   deadline=self.deadline, enqueue_time=now, reply_to=self.broker.gateway_id,
                                   gateway_id=self.broker.gateway_id, log_events=self.logged,
                                   detached=self.detached, log_ttl_s=self.log_ttl_s,
                                   tenant=self.principal.tenant, tenant_weight=self.principal.weight)
                for sub in self.subs]
        for req in reqs:  # the limits the engine enforces too (sluice.wire.limits): a 400 here, not there
            problem = limits.check_request(req, vocab_size=self.card.vocab_size, max_model_len=self.card.max_model_len)
            if problem is not None:
                raise errors.from_problem(problem)
        self.broker.register([s.request_id for s in self.subs], self._queue)
        self._started = True
        METRICS.running.inc()
        self.enqueue_time = time.monotonic()
        record = self.record() if self.logged else None
        for req in reqs:
            await self.broker.enqueue(req, record)

    async def deltas(self) -> AsyncIterator[list[Delta]]:
        """Yield the deltas of the engine events at hand (every event already queued, in order)
        until every choice has finished.

        Waiting costs one ``Queue.get`` per wake-up: no timeout is armed per event. A watchdog
        timer (re-armed only when it fires) puts ``_TICK`` on the queue when no event came for
        ``LIVENESS_CHECK_S`` or the deadline is reached; the liveness check runs then."""
        ok = gone = False
        loop = asyncio.get_running_loop()
        self._last_event = loop.time()
        self._arm_watchdog(loop)
        try:
            while not all(c.finished for c in self.choices):
                try:
                    data = self._queue.get_nowait()
                except asyncio.QueueEmpty:
                    data = await self._queue.get()
                if time.time() >= self.deadline:
                    raise errors.deadline_exceeded()
                if data is _TICK:
                    await self._check_engines()
                    self._last_event = loop.time()  # the next check a whole period later, as before
                    self._arm_watchdog(loop)
                    continue
                self._last_event = loop.time()
                out: list[Delta] = []
                while True:
                    if isinstance(data, Lost):
                        raise errors.error(data.code, data.message, retry_after_s=self.broker.retry_after_s)
                    if data is _TICK:  # events are flowing: no check needed, the timer goes on
                        self._arm_watchdog(loop)
                    else:
                        out += self._handle(data)
                    if self._queue.empty() or all(c.finished for c in self.choices):
                        break
                    data = self._queue.get_nowait()
                if out:
                    yield out
            ok = True
        except (asyncio.CancelledError, GeneratorExit):  # the consumer went away (its client did)
            gone = True
            raise
        finally:
            if self._watchdog is not None:
                self._watchdog.cancel()
                self._watchdog = None
            self._finish(ok, client_gone=gone)

    def _arm_watchdog(self, loop: asyncio.AbstractEventLoop) -> None:
        check = LIVENESS_CHECK_S if self._no_engine_since is None else min(LIVENESS_CHECK_S, 1.0)
        due = min(self._last_event + check, loop.time() + max(0.0, self.deadline - time.time()))
        self._watchdog = loop.call_at(due, self._on_watchdog, loop)

    def _on_watchdog(self, loop: asyncio.AbstractEventLoop) -> None:
        """Events came since the timer was armed: arm it again from the last one. Else wake the
        generator with ``_TICK`` (it re-arms the timer after its check)."""
        check = LIVENESS_CHECK_S if self._no_engine_since is None else min(LIVENESS_CHECK_S, 1.0)
        now = loop.time()
        if now < self._last_event + check and time.time() < self.deadline:
            self._arm_watchdog(loop)
            return
        self._watchdog = None
        self._queue.put_nowait(_TICK)

    async def _check_engines(self) -> None:
        """Silence for a while: decide with ``policy.engine_lost`` whether the request is lost
        (503 with Retry-After now, rather than at the deadline). A live engine may be busy, and
        untouched work waits a while for an engine that restarts (a drain of the only one)."""
        try:
            live = await self.broker.live_engines(fresh=True)
        except Exception:  # noqa: BLE001 - Redis hiccup: the deadline still bounds the wait
            return
        now = time.monotonic()
        alive = int(live.get(self.card.name) or 0)
        if alive:
            self._no_engine_since = None
            return
        if self._no_engine_since is None:
            self._no_engine_since = now
        emitted = any(c.token_ids for c in self.choices)
        if policy.engine_lost(live_engines=alive, emitted=emitted, no_engine_for_s=now - self._no_engine_since,
                              wait_s=NO_ENGINE_WAIT_S):
            if not emitted and not self.resumed:
                try:  # never taken by an engine: no engine serves the model; its entry goes
                    if await self.broker.withdraw([s.request_id for s in self.subs]):
                        raise errors.no_engine(self.card.name, self.broker.retry_after_s)
                except (RedisError, OSError):
                    pass
            raise errors.engine_lost(self.card.name, self.broker.retry_after_s)

    @property
    def done(self) -> bool:
        """Every choice has ended (as far as its client is concerned)."""
        return all(c.finished for c in self.choices)

    def feed(self, ev: Event) -> list[Delta]:
        """The deltas of one event, outside :meth:`deltas` (a replay of a log read at once);
        raises the request's OpenAIError for an error event."""
        return self._handle(ev)

    def _handle(self, ev: Event) -> list[Delta]:
        sub = self._by_id.get(ev.request_id)
        if sub is None:
            return []
        now = time.monotonic()
        if ev.HasField("error"):
            for c in sub.choices:
                c.engine_done = True
            if not self.resumed:
                self.broker.settled(sub.request_id)
            raise errors.from_engine(ev.error.code, ev.error.message, self.broker.retry_after_s)
        if ev.prompt_logprobs and not sub.prompt_logprobs:
            sub.prompt_logprobs = list(ev.prompt_logprobs)
        if ev.cached_tokens and not sub.cached_tokens:  # set on the first token's event only
            sub.cached_tokens = ev.cached_tokens
        if not 0 <= ev.index < len(sub.choices):
            return []
        if ev.token_ids and not self.resumed:  # latencies: observed by the gateway that started it
            if self.ticket is not None and not sub.started:
                sub.started = True
                self.ticket.started(sub.index)
            if self.first_token_time is None:
                self.first_token_time = now
                METRICS.ttft.observe(now - self.arrival)
                if self.enqueue_time is not None:
                    METRICS.queue_time.observe(now - self.enqueue_time)
            elif self._last_token_time is not None:
                METRICS.itl.observe(now - self._last_token_time)
            self._last_token_time = now
        d = sub.choices[ev.index].consume(ev)
        if not sub.engine_active and not self.resumed:
            self.broker.settled(sub.request_id)
        return [d] if d is not None else []

    def _finish(self, ok: bool, client_gone: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._started:
            self.broker.unregister([s.request_id for s in self.subs])
            return
        active = [s.request_id for s in self.subs if s.engine_active]
        if active and client_gone and self.logged and not self.detached:
            # It may be resumed (Last-Event-ID), on any gateway: see _orphaned.
            self.broker.spawn(self._orphaned(active))
        else:
            self._stop_following()
            if active and (not self.detached or self.client_owned):
                self.broker.cancel_nowait(active, give_up_at=self.deadline, reply_to=self.reply_to)
            self._forget()
            self._release()
        if self.resumed:
            return
        METRICS.running.dec()
        if ok:
            METRICS.e2e.observe(time.monotonic() - self.arrival)
            for c in self.choices:
                METRICS.finished.labels(finished_reason=c.finish_reason or "unknown").inc()
        METRICS.prompt_tokens.inc(self.prompt_tokens)
        METRICS.generation_tokens.inc(self.completion_tokens)

    def close_nowait(self, client_gone: bool = False) -> None:
        """Abandon the generation: cancel at the engine (``client_gone`` and logged: once nobody
        resumed it within the window)."""
        self._finish(False, client_gone)

    def _stop_following(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            self._follower = None
        if self._leasing:
            self._leasing = False
            self.broker.spawn(self._drop_lease())

    async def _drop_lease(self) -> None:
        try:
            await self.broker.drop_lease([s.request_id for s in self.subs])
        except Exception:  # noqa: BLE001 - it lapses after contract.LEASE_TTL_S anyway
            pass

    async def _orphaned(self, active: list[str]) -> None:
        """The client of a logged request went away: keep the request while a resumed client's
        gateway holds its lease; cancel it once nobody has held it for ``RESUME_WINDOW_S`` (the
        lost-gateway rule's window), or at its deadline. Its events keep coming (our channel, or
        the log we follow) and tell when the engine ends it."""
        if self._leasing:  # our own lease must not count as someone else's
            self._leasing = False
            await self._drop_lease()
        missing_since = time.monotonic()
        try:
            while time.time() < self.deadline:
                while not self._queue.empty():
                    item = self._queue.get_nowait()
                    if isinstance(item, Lost):
                        return
                    sub = self._by_id.get(item.request_id)
                    if sub is None:
                        continue
                    self._unseen_tokens += len(item.token_ids)  # generated for nobody, used all the same
                    if item.HasField("error"):
                        for c in sub.choices:
                            c.engine_done = True
                    elif item.HasField("finished") and 0 <= item.index < len(sub.choices):
                        sub.choices[item.index].engine_done = True
                active = [s.request_id for s in self.subs if s.engine_active]
                if not active:
                    return
                now = time.monotonic()
                try:
                    leased = await self.broker.leased(active)
                except Exception:  # noqa: BLE001 - Redis away: count it as not leased
                    leased = False
                if leased:
                    missing_since = now
                elif now - missing_since >= contract.RESUME_WINDOW_S:
                    break
                await asyncio.sleep(contract.LEASE_REFRESH_S)
            self.broker.cancel_nowait(active, give_up_at=self.deadline, reply_to=self.reply_to)
        finally:
            self._stop_following()
            self._forget()
            self._release()

    def _release(self) -> None:
        """Give back what admission took for this request (its places, the tokens it did not use)."""
        if self.ticket is not None:
            self.ticket.release(self.prompt_tokens + self.completion_tokens + self._unseen_tokens)

    def _forget(self) -> None:
        """Stop tracking and routing our requests' events, unless this is a resumed generation: it
        never registered them (the gateway that started them, maybe this one, still may)."""
        if not self.resumed:
            self.broker.release([s.request_id for s in self.subs])
            self.broker.unregister([s.request_id for s in self.subs])
