"""``POST /v1/responses`` and the stored-response routes' logic.

A request is validated and converted into a chat request (``convert``), prepared by the chat
pipeline (``serving_chat.prepare_chat``: template, tools, constraints, limits; its 400s renamed
to the Responses parameters), stored as ``in_progress`` (``store``: true), then run through the
same :class:`~gateway.generation.Generation` the chat endpoint uses. Its deltas go through a
:class:`~gateway.responses.render.ResponseRenderer`, streamed as events or collected into the
response object; at the end the final object is stored with the full TTL (and its turn appended
to its conversation). What it continues (a ``previous_response_id`` chain, a conversation) is read
by ``gateway.responses.history``: a response stores its own turn once and links to its ancestors.

A stored response runs logged and detached at the engine (``gateway.responses.background``): if its
creating gateway dies, the engine runs it to its end and any gateway finishes it from its log (a
retrieve, a stream again, a ``previous_response_id``); its own client going away still cancels it.
``store: false`` runs as a plain chat request does, unlogged.

``background: true`` goes to :func:`start_background` (see its doc); ``POST .../cancel`` of a
background response to :func:`cancel_background`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from sse_starlette.sse import EventSourceResponse

from gateway import errors, preparation, prompts, serving
from gateway.errors import OpenAIError
from gateway.responses import background, convert
from gateway.responses import history as history_module
from gateway.responses.conversation_store import conversations_of
from gateway.responses.models import CreateResponseRequest, DeletedResponse, InputItemList, ResponseObject
from gateway.responses.render import ResponseRecord, ResponseRenderer
from gateway.responses.store import ResponseStore, store_of
from gateway.serving_chat import PreparedChat, prepare_chat
from gateway.stream_chunks import keep_alive
from sluice.wire import limits
from sluice.wire import stored_response as sr
from sluice.wire.error_codes import Code

# A response still running is stored for its deadline, plus the event log's TTL (a gateway that
# catches it up after its creator died reads the log up to then), plus this.
RUNNING_TTL_MARGIN_S = 60.0
# The end of the rendered prompt a record keeps: what the reasoning parser reads (whether the
# template opened a reasoning block), not the whole prompt (the conversation is stored apart).
PROMPT_TAIL_CHARS = 256
# Kept so that a store write scheduled from a cancelled stream is not garbage-collected.
_PENDING: set[asyncio.Task] = set()


@dataclass
class PreparedResponse:
    """A validated ``POST /v1/responses``: its record, its chat generation (not started), its input
    items (with ids) and its ancestors (the chain it continues, nearest first)."""

    body: CreateResponseRequest
    record: ResponseRecord
    chat: PreparedChat
    items: list[dict[str, Any]]
    ancestors: list[str] = field(default_factory=list)


not_found = history_module.not_found


def _echo(body: CreateResponseRequest) -> dict[str, Any]:
    """The Response fields that repeat the request."""
    tool_choice: Any = body.tool_choice if body.tool_choice is not None else "auto"
    if isinstance(tool_choice, BaseModel):
        tool_choice = tool_choice.model_dump()
    text = body.text.model_dump(mode="json", by_alias=True, exclude_none=True) if body.text else {}
    text.setdefault("format", {"type": "text"})
    conversation = body.conversation_id
    return {
        "background": bool(body.background),
        "conversation": {"id": conversation} if conversation is not None else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "store": body.store is not False,
        "temperature": body.temperature,
        "text": text,
        "tool_choice": tool_choice,
        "tools": [t.model_dump(mode="json", exclude_none=True) for t in body.tools or []],
        "top_p": body.top_p,
        "truncation": body.truncation or "disabled",
        "user": body.user,
        "max_tool_calls": body.max_tool_calls,
        "top_logprobs": body.top_logprobs,
    }


def running_ttl_s(cfg: Any) -> float:
    """The TTL of a stored response while it runs (``RUNNING_TTL_MARGIN_S``)."""
    return cfg.request_timeout_s + cfg.event_log_ttl_s + RUNNING_TTL_MARGIN_S


def _check(body: CreateResponseRequest) -> None:
    """The refusals that need nothing but the body."""
    if body.background and body.store is False:
        raise errors.invalid("A background response must be stored: 'background': true needs 'store' to be true "
                             "(or left out).", param="background")
    if body.top_logprobs is not None and not body.wants_logprobs:
        raise errors.invalid("'top_logprobs' needs 'include' to ask for the logprobs: "
                             "\"include\": [\"message.output_text.logprobs\"].", param="top_logprobs")
    if body.conversation is not None:
        if body.previous_response_id is not None:
            raise errors.invalid("'previous_response_id' and 'conversation' cannot be used together: a response "
                                 "continues either one.", param="conversation")
        if body.store is False:
            raise errors.invalid("A response in a conversation is stored: 'conversation' needs 'store' to be true "
                                 "(or left out).", param="conversation")


async def _prepare_chat(body: CreateResponseRequest, request: Request, card: Any,
                        history: list[dict[str, Any]]) -> tuple[PreparedChat, list[dict[str, Any]]]:
    """The chat request of ``history`` and the body's input items (with their ids); with
    ``truncation: "auto"``, of the fewest history items dropped (the oldest first) that let the
    prompt fit the context. The conversion and the chat template run in the prepare pool for a large
    request (``gateway.preparation``)."""

    async def attempt(drop: int) -> tuple[PreparedChat, list[dict[str, Any]]]:
        kept = history[drop:]
        converted = await preparation.run(request, card, prompts.response_prompt, body, kept,
                                          size=preparation.size_of(request, body, prompts.items_chars(kept)))
        chat = await prepare_chat(converted.chat, request, id_prefix="resp", resumable=False,
                                  prepared=converted.chat_prompt)
        return chat, converted.items

    try:
        return await attempt(0)
    except OpenAIError as exc:
        if exc.code != Code.CONTEXT_LENGTH_EXCEEDED.value or body.truncation != "auto" or not history:
            raise convert.rename_error(exc) from None
    # The fewest dropped: a binary search (a prompt only shrinks as items are dropped).
    low, high = 1, len(history)
    try:
        best = await attempt(high)
    except OpenAIError as exc:  # the input alone does not fit
        raise convert.rename_error(exc) from None
    while low < high:
        mid = (low + high) // 2
        try:
            best, high = await attempt(mid), mid
        except OpenAIError as exc:
            if exc.code != Code.CONTEXT_LENGTH_EXCEEDED.value:
                raise convert.rename_error(exc) from None
            low = mid + 1
    return best


async def prepare_response(body: CreateResponseRequest, request: Request) -> PreparedResponse:
    """Every check and the conversion; nothing is stored or queued yet."""
    _check(body)
    card = await serving.card_for(serving.broker_of(request), body.model)  # its context bounds the history
    history = await history_module.history_of(body, request, body.conversation_id, card.max_model_len)
    if history.cut and body.truncation != "auto":
        what = "conversation" if body.conversation is not None else "conversation 'previous_response_id' continues"
        raise history_module.too_long(card.max_model_len, what)
    chat, items = await _prepare_chat(body, request, card, history.items)
    chat_body_tools, chat_tool_choice = convert.chat_tools(body)
    record = ResponseRecord(
        id="resp_" + chat.gen.id.split("-", 1)[1], request_id=chat.gen.id, created_at=chat.gen.created,
        model=body.model, prompt=chat.prompt[-PROMPT_TAIL_CHARS:], tool_parser=chat.card.card.tool_call_parser,
        reasoning_parser=chat.card.card.reasoning_parser, chat_tools=chat_body_tools,
        chat_tool_choice=chat_tool_choice, parallel_tool_calls=body.parallel_tool_calls, echo=_echo(body),
        conversation=body.conversation_id, logprobs=body.wants_logprobs, max_tool_calls=body.max_tool_calls)
    return PreparedResponse(body, record, chat, items, history.ancestors)


async def create_response(body: CreateResponseRequest, request: Request) -> Response:
    prepared = await prepare_response(body, request)
    if body.background:
        return await start_background(prepared, request)
    cfg, store = serving.config_of(request), store_of(request)
    if prepared.record.echo["store"]:  # logged, so that any gateway can finish it (see the module doc)
        gen = prepared.chat.gen
        gen.detach(cfg.event_log_ttl_s, background.ENDPOINT, background.render_of(prepared), client_owned=True)
        await store.save(prepared.record.id, running_ttl_s(cfg), create=True,
                         **background.running_fields(prepared, "in_progress"))
    try:
        await serving.start(prepared.chat.gen, request, body.model)
    except OpenAIError as exc:
        await _forget(store, prepared)
        raise convert.rename_error(exc) from None
    renderer = ResponseRenderer(prepared.record)
    if body.stream:
        return await _stream(request, prepared, renderer)
    return await _collect(request, prepared, renderer)


async def start_background(prepared: PreparedResponse, request: Request) -> Response:
    """``background: true``: a response that runs detached from this request and this gateway, on
    the event log (``gateway.responses.background``)."""
    cfg = serving.config_of(request)
    try:
        return await background.start(prepared, request, running_ttl_s(cfg))
    except OpenAIError as exc:
        raise convert.rename_error(exc) from None


async def cancel_background(stored: sr.StoredResponse, response_id: str, request: Request) -> Response:
    """``POST /v1/responses/{id}/cancel`` of a background response, from any gateway."""
    return await background.cancel(request, stored, response_id)


# --- running one response --------------------------------------------------------------------


async def _forget(store: ResponseStore, prepared: PreparedResponse) -> None:
    """The request was refused before it ran (queue full, no engine): nothing to keep."""
    if prepared.record.echo["store"]:
        try:
            await store.delete(prepared.record.id)
        except OpenAIError:
            pass


async def finalize(request: Request, prepared: PreparedResponse, renderer: ResponseRenderer) -> None:
    """Store the final response (full TTL), its turn appended to its conversation."""
    if not prepared.record.echo["store"]:
        return
    await background.store_final(store_of(request), conversations_of(request),
                                 serving.config_of(request).responses_ttl_s, prepared.record.id, renderer,
                                 only_running=False)


def finalize_later(request: Request, prepared: PreparedResponse, renderer: ResponseRenderer) -> None:
    task = asyncio.ensure_future(finalize(request, prepared, renderer))
    _PENDING.add(task)
    task.add_done_callback(lambda t: (_PENDING.discard(t), t.cancelled() or t.exception()))


def to_json(response: ResponseObject) -> dict[str, Any]:
    return response.model_dump(mode="json")


def _end(renderer: ResponseRenderer, gen: Any, exc: OpenAIError | None) -> list[Any]:
    if exc is None:
        return renderer.finish(renderer.usage_of(gen), int(time.time()))
    return renderer.fail(exc.code or "server_error", exc.message, renderer.usage_of(gen))


async def _collect(request: Request, prepared: PreparedResponse, renderer: ResponseRenderer) -> Response:
    gen = prepared.chat.gen
    renderer.start()

    async def run() -> None:
        async for deltas in gen.deltas():
            for d in deltas:
                renderer.on_delta(d)

    task = asyncio.create_task(run())
    try:
        await serving._watch(request, task)  # noqa: SLF001 - the chat endpoint's disconnect watch
    except serving.ClientGone:
        gen.close_nowait()
        renderer.fail(*background.CLIENT_GONE, renderer.usage_of(gen))
        finalize_later(request, prepared, renderer)
        return Response(status_code=499)
    except OpenAIError as exc:
        _end(renderer, gen, exc)
        await finalize(request, prepared, renderer)
        raise convert.rename_error(exc) from None
    except asyncio.CancelledError:
        task.cancel()
        gen.close_nowait()
        raise
    _end(renderer, gen, None)
    await finalize(request, prepared, renderer)
    return JSONResponse(to_json(renderer.response))


def _sse(event: BaseModel) -> dict[str, str]:
    """One event: ``event:`` its type, ``data:`` the event. No ``id:`` line (the sequence number is in
    the data): the openai SDK's SSE decoder keeps the last id, as the SSE spec says, and then turns
    the blank line after each keep-alive comment (``: ping``) into an event with empty data, which it
    fails to parse as JSON."""
    return {"event": event.type, "data": event.model_dump_json()}


async def _stream(request: Request, prepared: PreparedResponse, renderer: ResponseRenderer) -> Response:
    """The event stream. As the chat stream does, the first deltas are awaited before the answer
    starts, so a request refused before its first token gets its HTTP error status."""
    gen = prepared.chat.gen
    agen = gen.deltas()
    first_task = asyncio.ensure_future(agen.__anext__())
    first: list = []
    early: OpenAIError | None = None
    try:
        first = await serving._watch(request, first_task)  # noqa: SLF001
    except serving.ClientGone:
        gen.close_nowait()
        finalize_later(request, prepared, renderer)
        return Response(status_code=499)
    except StopAsyncIteration:
        pass
    except OpenAIError as exc:
        early = exc
    except asyncio.CancelledError:
        first_task.cancel()
        gen.close_nowait()
        raise
    if early is not None:
        renderer.start()
        _end(renderer, gen, early)
        await finalize(request, prepared, renderer)
        raise convert.rename_error(early)

    async def events():
        done = False
        try:
            for ev in renderer.start():
                yield _sse(ev)
            for d in first:
                for ev in renderer.on_delta(d):
                    yield _sse(ev)
            failure: OpenAIError | None = None
            try:
                async for deltas in agen:
                    for d in deltas:
                        for ev in renderer.on_delta(d):
                            yield _sse(ev)
            except OpenAIError as exc:
                failure = exc
            end = _end(renderer, gen, failure)
            done = True
            await finalize(request, prepared, renderer)
            for ev in end:
                yield _sse(ev)
        finally:
            gen.close_nowait()
            if not done:  # the client went away mid-stream
                renderer.fail(*background.CLIENT_GONE, renderer.usage_of(gen))
                finalize_later(request, prepared, renderer)

    return EventSourceResponse(events(), sep="\n", ping=15, ping_message_factory=keep_alive)


# --- stored responses --------------------------------------------------------------------------


async def _stored(request: Request, response_id: str) -> sr.StoredResponse:
    stored = await store_of(request).load(response_id)
    if stored is None:
        raise not_found(response_id)
    return stored


def _current(stored: sr.StoredResponse) -> dict[str, Any]:
    """The response object as it stands: the final one, or the record's in-progress snapshot."""
    if stored.response is not None:
        return stored.response
    record = ResponseRecord.from_json(stored.record or "{}")
    return to_json(record.snapshot(stored.status or "in_progress", output=[]))


async def retrieve(request: Request, response_id: str, *, stream: bool = False,
                   starting_after: int | None = None) -> Response:
    """The response as it stands; one that still runs is caught up from its event log (its
    creating gateway may be gone). ``stream``: its events after ``starting_after``, then the live
    ones."""
    if stream:
        return await background.stream(request, response_id, starting_after)
    if starting_after is not None:
        raise errors.invalid("'starting_after' is only allowed with 'stream=true'.", param="starting_after")
    stored = await _stored(request, response_id)
    if stored.running:
        return JSONResponse(await background.catch_up(request, stored, response_id))
    return JSONResponse(_current(stored))


async def delete(request: Request, response_id: str) -> Response:
    if not await store_of(request).delete(response_id):
        raise not_found(response_id)
    return JSONResponse(DeletedResponse(id=response_id).model_dump(mode="json"))


async def cancel(request: Request, response_id: str) -> Response:
    stored = await _stored(request, response_id)
    if not stored.background:
        raise errors.invalid("Only responses created with 'background': true can be cancelled; "
                             f"response '{response_id}' was not.", param="response_id")
    return await cancel_background(stored, response_id, request)


async def list_input_items(request: Request, response_id: str, *, after: str | None, limit: int,
                           order: str) -> Response:
    """A page of the response's input items, newest first unless ``order`` is ``asc``."""
    serving.check(limits.INPUT_ITEMS_PAGE.check(limit))
    if order not in ("asc", "desc"):
        raise errors.invalid(f"'order' must be 'asc' or 'desc', got {order!r}.", param="order")
    items = list((await _stored(request, response_id)).input or [])
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise errors.invalid(f"No input item with id '{after}' in response '{response_id}'.", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    body = InputItemList(data=page, first_id=page[0]["id"] if page else None,
                         last_id=page[-1]["id"] if page else None, has_more=len(items) > limit)
    return JSONResponse(json.loads(body.model_dump_json()))
