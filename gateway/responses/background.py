"""Logged responses on the per-request event log (issue 22): every stored response, background or
not, runs detached and logged (``Generation.detach``; ``sluice.wire.event_log``): the engine appends
its events to the request's log and never aborts it because a gateway is gone. A background
response (``background: true``) is stopped only by a cancel, its deadline or its own end; a
foreground one also by its own client going away (its creating gateway cancels it, as for chat).
Its event-log record carries the :class:`~gateway.responses.render.ResponseRecord`
(``render["response"]``), so any gateway renders it with the same :class:`ResponseRenderer`, the
same events with the same sequence numbers:

- the creating gateway of a background response answers the ``queued`` response at once (or
  streams it from the log) and follows the live events in a task of its own, which stores the
  final response when it ends; the creating gateway of a foreground one answers it as it runs
  (``gateway.responses.service``) and stores it at the end;
- ``GET /v1/responses/{id}`` on any gateway catches up from the log when the stored response still
  says it runs (its creating gateway may have died): a log that has ended is rendered and stored;
- ``GET /v1/responses/{id}?stream=true&starting_after=N`` replays the log through the renderer,
  leaves out the events up to sequence number N, then follows the live ones;
- ``POST /v1/responses/{id}/cancel`` from any gateway cancels a background response's engine
  request (the record names its ``reply_to``) and stores the response ``cancelled`` with the
  output said so far.

An ``abort`` at the engine ends a logged response only through a cancel: a background response's
(``response.cancelled``) or a foreground one's creating gateway's when its client went away (the
response ``failed`` with ``client_disconnected``, as that gateway stored it).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError
from sse_starlette.sse import EventSourceResponse

from gateway import errors, serving
from gateway.broker import Broker
from gateway.errors import OpenAIError
from gateway.generation import Generation
from gateway.responses.conversation_store import ConversationStore, conversations_of
from gateway.responses.render import ResponseRecord, ResponseRenderer
from gateway.responses.store import ResponseStore, store_of
from gateway.stream_chunks import keep_alive
from sluice.wire import stored_response as sr
from sluice.wire.event_log import StreamRecord
from sluice.wire.messages_pb2 import SamplingParams

ENDPOINT = "responses"  # the event-log record's endpoint
# A response still stored running, without a log, this long after its deadline is lost (LOST).
LOST_GRACE_S = 5.0
_TASKS: set[asyncio.Task] = set()  # the creating gateways' followers (kept from the garbage collector)


def _keep(task: asyncio.Task) -> None:
    _TASKS.add(task)
    task.add_done_callback(lambda t: (_TASKS.discard(t), t.cancelled() or t.exception()))


CLIENT_GONE = ("client_disconnected", "The client closed the connection before the response ended.")


def _end(renderer: ResponseRenderer, gen: Generation, failure: OpenAIError | None,
         completed_at: int | None = None) -> list[Any]:
    """The closing events: an abort (only a cancel aborts a detached request) is a background
    response's cancel or a foreground one's client gone; else failed, or completed/incomplete
    (``completed_at``: the stored one, when a replay renders an ended response again; else now)."""
    if failure is not None:
        return renderer.fail(failure.code or "server_error", failure.message, renderer.usage_of(gen))
    if any(c.finish_reason == "abort" for c in gen.choices):
        if renderer.record.echo.get("background"):
            return renderer.cancelled()
        return renderer.fail(*CLIENT_GONE, renderer.usage_of(gen))
    return renderer.finish(renderer.usage_of(gen), completed_at or int(time.time()))


async def store_final(store: ResponseStore, conversations: ConversationStore, ttl_s: float, response_id: str,
                      renderer: ResponseRenderer, *, only_running: bool = True) -> None:
    """Store the ended response, its turn (input and output) appended to its conversation first
    (an append of the same items again adds nothing, so a gateway that catches up after its
    creator appended and died completes it). ``only_running``: unless it was ended already (a
    cancel, another gateway); never a response deleted meanwhile."""
    stored = await store.load(response_id)
    if stored is None or (only_running and not stored.running):
        return
    response = renderer.response
    if renderer.record.conversation is not None:  # (one deleted meanwhile gets nothing)
        output = [item.model_dump(mode="json") for item in response.output]
        await conversations.add(renderer.record.conversation, (stored.input or []) + output, strict=False)
    await store.save(response_id, ttl_s, **{sr.F_STATUS: response.status,
                                            sr.F_RESPONSE: response.model_dump(mode="json")})


def render_of(prepared: Any) -> dict[str, Any]:
    """The event-log record's rendering parameters of a prepared response: its record and the
    detokenizer's options (the conversation is in the store, never in the record)."""
    return {"response": prepared.record.to_json(), "opts": prepared.chat.gen.opts}


def running_fields(prepared: Any, status: str) -> dict[str, Any]:
    """A stored response's fields while it runs (the end adds its status and final object)."""
    return {sr.F_STATUS: status, sr.F_RECORD: prepared.record.to_json(), sr.F_INPUT: prepared.items,
            sr.F_ANCESTORS: prepared.ancestors or None}


async def start(prepared: Any, request: Request, running_ttl_s: float) -> Response:
    """Queue the response detached and logged; answer the ``queued`` response (or its stream)."""
    cfg, store = serving.config_of(request), store_of(request)
    record: ResponseRecord = prepared.record
    gen: Generation = prepared.chat.gen
    gen.detach(cfg.event_log_ttl_s, ENDPOINT, render_of(prepared))
    await store.save(record.id, running_ttl_s, create=True, **running_fields(prepared, "queued"),
                     **{sr.F_BACKGROUND: True})
    try:
        await serving.start(gen, request, record.model)
    except OpenAIError:
        await store.delete(record.id)
        raise
    _keep(asyncio.ensure_future(_follow_live(gen, ResponseRenderer(record), store, conversations_of(request),
                                             cfg.responses_ttl_s, record.id)))
    if prepared.body.stream:
        return await stream(request, record.id, after=None)
    return JSONResponse(record.snapshot("queued", output=[]).model_dump(mode="json"))


async def _follow_live(gen: Generation, renderer: ResponseRenderer, store: ResponseStore,
                       conversations: ConversationStore, ttl_s: float, response_id: str) -> None:
    """The creating gateway's own follower: the live events, the final response stored at the end.
    (If this gateway dies first, a retrieve on any other catches up from the log.)"""
    renderer.start()
    failure: OpenAIError | None = None
    try:
        async for deltas in gen.deltas():
            for d in deltas:
                renderer.on_delta(d)
    except OpenAIError as exc:
        failure = exc
    _end(renderer, gen, failure)
    try:
        await store_final(store, conversations, ttl_s, response_id, renderer)
    except OpenAIError:  # Redis away: a later retrieve catches up from the log
        pass


async def _resumed(broker: Broker, record: ResponseRecord) -> tuple[Generation, StreamRecord] | None:
    """The response's generation rebuilt from its event-log record (None: the log has expired)."""
    try:
        log_record = await broker.load_record(record.request_id)
        card = await broker.card(log_record.model) if log_record is not None else None
    except (RedisError, OSError) as exc:
        raise errors.redis_down(exc) from exc
    if log_record is None or card is None or log_record.endpoint != ENDPOINT:
        return None
    return Generation.resumed(broker, card, log_record, SamplingParams(n=1), log_record.render["opts"]), log_record


async def _replay(broker: Broker, record: ResponseRecord) -> tuple[ResponseRenderer, Generation, StreamRecord,
                                                                   OpenAIError | None] | None:
    """The log as it stands, rendered at once (no waiting)."""
    resumed = await _resumed(broker, record)
    if resumed is None:
        return None
    gen, log_record = resumed
    renderer = ResponseRenderer(record)
    renderer.start()
    failure: OpenAIError | None = None
    start = 0
    try:
        while not gen.done and failure is None:
            elements = await broker.read_log(log_record.request_ids[0], start)
            if not elements:
                break
            start += len(elements)
            for events in elements:
                for ev in events:
                    try:
                        for d in gen.feed(ev):
                            renderer.on_delta(d)
                    except OpenAIError as exc:
                        failure = exc
                        break
    except (RedisError, OSError) as exc:
        raise errors.redis_down(exc) from exc
    return renderer, gen, log_record, failure


LOST = ("server_error", "The response ended while no gateway followed it, and its events expired before any "
        "gateway stored its end.")


async def catch_up(request: Request, stored: sr.StoredResponse, response_id: str) -> dict[str, Any]:
    """A logged response that still says it runs, as its log has it: stored when the log has
    ended (its creating gateway may be gone), else ``in_progress`` with the output so far. One
    whose log has expired although its deadline has passed (nobody stored its end in time) is
    stored ``failed``: nothing can finish it any more."""
    record = ResponseRecord.from_json(stored.record or "{}")
    replay = await _replay(serving.broker_of(request), record)
    cfg = serving.config_of(request)
    if replay is None:
        if time.time() < record.created_at + cfg.request_timeout_s + LOST_GRACE_S:
            return record.snapshot(stored.status or "in_progress", output=[]).model_dump(mode="json")
        renderer = ResponseRenderer(record)
        renderer.fail(*LOST)
        await store_final(store_of(request), conversations_of(request), cfg.responses_ttl_s, response_id, renderer)
        return renderer.response.model_dump(mode="json")
    renderer, gen, log_record, failure = replay
    if not gen.done and failure is None:
        return record.snapshot("in_progress", output=[i.model_copy(deep=True) for i in renderer.items]
                               ).model_dump(mode="json")
    _end(renderer, gen, failure)
    await store_final(store_of(request), conversations_of(request), serving.config_of(request).responses_ttl_s,
                      response_id, renderer)
    return renderer.response.model_dump(mode="json")


async def cancel(request: Request, stored: sr.StoredResponse, response_id: str) -> Response:
    """Cancel a background response from any gateway; the response as it stands, ``cancelled``."""
    if not stored.running:  # it has ended: as OpenAI, the response as it is
        return JSONResponse(stored.response or await catch_up(request, stored, response_id))
    broker = serving.broker_of(request)
    record = ResponseRecord.from_json(stored.record or "{}")
    replay = await _replay(broker, record)
    try:
        if replay is not None:
            await broker.cancel([record.request_id], reply_to=replay[2].reply_to)
    except (RedisError, OSError) as exc:
        raise errors.redis_down(exc) from exc
    renderer = replay[0] if replay is not None else ResponseRenderer(record)
    renderer.cancelled()
    await store_final(store_of(request), conversations_of(request), serving.config_of(request).responses_ttl_s,
                      response_id, renderer)
    return JSONResponse(renderer.response.model_dump(mode="json"))


async def stream(request: Request, response_id: str, after: int | None) -> Response:
    """``GET /v1/responses/{id}?stream=true&starting_after=N``: the events after N (all: None),
    replayed from the log and then followed live, from any gateway."""
    stored = await store_of(request).load(response_id)
    if stored is None:
        raise errors.error("not_found", f"Response with id '{response_id}' not found.")
    record = ResponseRecord.from_json(stored.record or "{}")
    resumed = await _resumed(serving.broker_of(request), record)
    if resumed is None:
        raise errors.error("not_found", f"The events of response '{response_id}' are no longer kept "
                           "(its event log has expired); retrieve it without 'stream'.", param="stream")
    gen, _ = resumed
    renderer = ResponseRenderer(record)
    gen.follow()

    def fresh(events: list[Any]) -> list[dict[str, str]]:
        return [{"event": ev.type, "data": ev.model_dump_json()} for ev in events
                if after is None or ev.sequence_number > after]

    async def events():
        ended = False
        try:
            for ev in fresh(renderer.start()):
                yield ev
            failure: OpenAIError | None = None
            try:
                async for deltas in gen.deltas():
                    for d in deltas:
                        for ev in fresh(renderer.on_delta(d)):
                            yield ev
            except OpenAIError as exc:
                failure = exc
            try:
                final = await store_of(request).load(response_id)
            except OpenAIError:
                final = None
            completed_at = ((final.response or {}).get("completed_at") if final is not None else None)
            for ev in fresh(_end(renderer, gen, failure, completed_at)):
                yield ev
            ended = True
        finally:
            gen.close_nowait(client_gone=not ended)  # detached: nothing is cancelled

    return EventSourceResponse(events(), sep="\n", ping=15, ping_message_factory=keep_alive)
