"""What both generation endpoints share (vLLM's ``serving_engine``): the model card lookup, the
OpenAI → wire sampling mapping, admission, and turning a :class:`Generation` into a JSON response
or an SSE stream through an endpoint's formatter.

An endpoint module (``serving_completion``, ``serving_chat``) validates its request, builds a
``Generation`` and hands it to :func:`respond` with a :class:`StreamFormatter` (stream) or a
builder of the whole response (not streamed). :func:`envelope` is the one place that fills the
``id / object / created / model`` every response and chunk carries.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from redis.exceptions import RedisError
from sse_starlette.sse import EventSourceResponse

from gateway import admission, errors
from gateway.broker import Broker, LoadedCard
from gateway.config import GatewayConfig
from gateway.errors import OpenAIError
from gateway.generation import Delta, Generation
from gateway.keyring import ANONYMOUS, Principal
from gateway.protocol import ResponseEnvelope, SamplingFields, UsageInfo
from gateway.reasoning import ThinkParser
from gateway.stream_chunks import keep_alive, sse_event
from sluice.structured import StructuredOutputError, vocabulary_for
from sluice.wire import codec, event_log, limits
from sluice.wire.card import CardError
from sluice.wire.error_codes import Code
from sluice.wire.event_log import StreamRecord
from sluice.wire.messages_pb2 import SamplingParams

DISCONNECT_POLL_S = 0.2

E = TypeVar("E", bound=ResponseEnvelope)


class ClientGone(Exception):
    pass


def broker_of(request: Request) -> Broker:
    return request.app.state.broker


def config_of(request: Request) -> GatewayConfig:
    return request.app.state.config


redis_down = errors.redis_down


# --- the response envelope ---------------------------------------------------------------------


def envelope(cls: type[E], gen: Generation, **fields: Any) -> E:
    """A response or chunk of ``cls`` for ``gen``: its id, object name, creation time and model."""
    return cls(id=gen.id, object=cls.model_fields["object"].default, created=gen.created,
               model=gen.card.name, **fields)


def usage(gen: Generation, reasoning: ThinkParser | None = None, prompt: str = "", *,
          details: bool = False) -> UsageInfo:
    """``gen``'s usage; ``details`` (chat) adds ``completion_tokens_details`` (``Generation.usage``)."""
    return UsageInfo(**gen.usage(reasoning, prompt, details=details))


def to_json(model: BaseModel) -> dict:
    """A response model as the JSON object the client gets: the fields the code set, nulls included."""
    return model.model_dump(mode="json", exclude_unset=True)


def finite(x: float | None) -> float:
    if x is None or not math.isfinite(x):
        return -9999.0
    return x


# --- request preparation -----------------------------------------------------------------------


async def card_for(broker: Broker, model: str) -> LoadedCard:
    """The model's card, or the OpenAI error that explains why there is none to use
    (404 unknown model, 503 no live engine or Redis unreachable)."""
    try:
        card = await broker.card(model)
        if card is None:
            raise errors.model_not_found(model)
        live = await broker.live_engines()
        if not live.get(model):
            live = await broker.live_engines(fresh=True)
            if not live.get(model):
                raise errors.no_engine(model)
    except (RedisError, OSError) as exc:
        raise redis_down(exc) from exc
    except CardError as exc:
        raise errors.from_card_error(model, exc) from exc
    return card


def check(problem: limits.Problem | None) -> None:
    """Raise the 400 for a rule of ``sluice.wire.limits`` the request breaks."""
    if problem is not None:
        raise errors.from_problem(problem)


def check_prompt(ids: list[int], card: LoadedCard, param: str = "prompt") -> None:
    """A prompt has a token, only ids of the vocabulary (``sluice.wire.limits``)."""
    check(limits.check_prompt(ids, card.vocab_size, param))


def sampling_params(req: SamplingFields, card: LoadedCard, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """The wire's sampling parameters. The limits (``sluice.wire.limits``) are checked on the whole
    wire request by ``Generation.start``; the pydantic models already kept each field's bounds."""
    if req.stream_options is not None and not req.stream:
        raise errors.invalid("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        try:
            tid = int(key)
        except ValueError:
            raise errors.invalid(f"Invalid key {key!r} in 'logit_bias': keys are token ids.",
                                 param="logit_bias") from None
        # the wire's keys are int32: an id past the vocabulary must not get as far as the wire
        check(limits.check_token_ids("logit_bias", [tid], card.vocab_size or limits.INT32_MAX + 1))
        bias[tid] = value
    # What the client left unset stays unset on the wire: the engine applies the model's
    # generation_config.json defaults to it (``--generation-config auto``), else vLLM's.
    return codec.sampling_params_to_proto({
        "n": req.n,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": None if req.top_k is None else (req.top_k or -1),  # 0 disables, as -1
        "min_p": req.min_p,
        "seed": req.seed,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "max_tokens": max_tokens,
        "min_tokens": req.min_tokens,
        "ignore_eos": req.ignore_eos,
        "logprobs": logprobs,
        "stop_token_ids": req.stop_token_ids,
        "logit_bias": bias,
    })


def constraint_param(response_format: Any) -> str | None:
    """The request field a ``response_format`` constraint's errors name (None: not one)."""
    if response_format is None:
        return None
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        return "response_format.json_schema.schema"
    return "response_format"


async def constrain(params: SamplingParams, constraint: Any, card: LoadedCard, max_tokens: int,
                    param: str | None = None) -> None:
    """Put a checked output constraint (``gateway.tools``) on the wire, once it has passed the
    engine's own check (``sluice.structured.Vocabulary.check``: compiled against the model's
    vocabulary under the grammar engine's limits, walked to its shortest completion, which must
    fit in ``max_tokens``): a 400 naming ``param`` (else the constraint's own parameter) or
    max_tokens, before anything is queued. In a thread: the first call builds the vocabulary."""
    if constraint is None:
        return
    vocab = await asyncio.to_thread(vocabulary_for, card.fingerprint, card.tokenizer.backend.to_str,
                                    card.vocab_size, card.eos_token_ids)
    try:
        await asyncio.to_thread(vocab.check, constraint, max_tokens)
    except StructuredOutputError as exc:
        name = exc.param if param is None or exc.param == "max_tokens" else param
        raise errors.invalid(str(exc).replace(exc.param, name, 1), param=name, code="invalid_value") from None
    params.structured_outputs.CopyFrom(codec.structured_outputs_to_proto(constraint))


def stop_strings(req: SamplingFields) -> list[str]:
    if req.stop is None:
        return []
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    return [s for s in stops if s]


def max_tokens_for(card: LoadedCard, prompt_lens: list[int], requested: int | None, param: str) -> int:
    """``requested``, or up to the context for the longest prompt; a 400 ``context_length_exceeded``
    when a prompt does not fit (the one rule, ``limits.check_context``)."""
    for n in prompt_lens:
        check(limits.check_context(n, requested, card.max_model_len, param))
    return requested if requested is not None else card.max_model_len - max(prompt_lens)


async def encode(tok, text: str, *, add_special_tokens: bool) -> list[int]:
    """Tokenize; long texts in a thread, with the GIL released while the tokenizer works
    (``Tokenizer.encode_unlocked``), so that one long prompt does not stall every stream."""
    if len(text) < 8192:
        return tok.encode(text, add_special_tokens=add_special_tokens)
    return await asyncio.to_thread(tok.encode_unlocked, text, add_special_tokens=add_special_tokens)


def principal_of(request: Request) -> Principal:
    """Who is calling (set by the middleware from the API key; the default tenant without keys)."""
    return getattr(request.state, "principal", ANONYMOUS)


def reserved_tokens(gen: Generation) -> int:
    """What a request may use at most, reserved against its tenant's tokens per minute: each prompt,
    plus max_tokens for each of its completions."""
    total = 0
    for sub in gen.subs:
        n = sub.params.n or 1
        max_tokens = sub.params.max_tokens if sub.params.HasField("max_tokens") else gen.card.max_model_len
        total += len(sub.prompt_ids) + n * max_tokens
    return total


async def start(gen: Generation, request: Request, model: str) -> None:
    """Admission (the tenant's quotas, the model's queue limit: ``gateway.admission``), then
    subscribe and enqueue. The quota headers go on the response (the middleware adds them)."""
    broker, cfg = broker_of(request), config_of(request)
    try:
        gen.ticket = await admission.admit(
            broker, gen.principal, member=gen.id, model=model, tokens=reserved_tokens(gen),
            num_requests=len(gen.subs), max_queue_len=cfg.max_queue_len,
            place_ttl_s=admission.deadline_ttl(gen.deadline), retry_after_s=cfg.retry_after_s)
        if gen.ticket is not None and gen.ticket.verdict is not None:
            request.state.ratelimit_headers = admission.headers(gen.principal.limits, gen.ticket.verdict)
        await gen.start()
    except OpenAIError:
        if gen.ticket is not None:
            gen.ticket.release(refused=True)
        gen.close_nowait()
        raise
    except (TimeoutError, RedisError, OSError) as exc:
        if gen.ticket is not None:
            gen.ticket.release(refused=True)
        gen.close_nowait()
        raise redis_down(exc) from exc


# --- response assembly -------------------------------------------------------------------------


class StreamFormatter(Protocol):
    """An endpoint's stream format: the chunks to send first, per delta, and last (models, or the
    JSON text of one from ``gateway.stream_chunks``)."""

    def start(self) -> list[BaseModel | str]: ...

    def on_delta(self, d: Delta) -> list[BaseModel | str]: ...

    def end(self) -> list[BaseModel | str]: ...


async def respond(request: Request, gen: Generation, *, stream: StreamFormatter | None,
                  build: Callable[[], BaseModel]) -> Response:
    """Stream ``gen`` through ``stream``, or collect it and answer ``build()``."""
    if stream is not None:
        return await _stream(request, gen, stream)
    return await _collect(request, gen, build)


async def _watch(request: Request, task: asyncio.Future) -> Any:
    """Await ``task`` unless the client goes away first (then cancel it and raise ClientGone)."""
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientGone()


async def _collect(request: Request, gen: Generation, build: Callable[[], BaseModel]) -> Response:
    async def run() -> None:
        async for _ in gen.deltas():
            pass

    task = asyncio.create_task(run())
    try:
        await _watch(request, task)
    except ClientGone:
        gen.close_nowait()
        return Response(status_code=499)
    except asyncio.CancelledError:
        task.cancel()
        gen.close_nowait()
        raise
    return JSONResponse(to_json(build()))


def _sse(data: BaseModel | dict | str, event_id: str | None = None) -> bytes:
    """One server-sent event: a model (its set fields), a dict, or JSON text already made
    (``gateway.stream_chunks``; also ``[DONE]``), with its ``id:`` when given."""
    if isinstance(data, BaseModel):
        return sse_event(data.model_dump_json(exclude_unset=True), event_id)
    if isinstance(data, dict):
        return sse_event(json.dumps(data, separators=(",", ":")), event_id)
    return sse_event(data, event_id)


async def _stream(request: Request, gen: Generation, fmt: StreamFormatter, resume_after: int | None = None) -> Response:
    """The SSE stream of ``gen``. A logged generation's chunks carry ``id: <id>:<n>`` (n counts
    them from 1: the same chunks in the same order on every gateway, ``sluice.wire.event_log``);
    ``resume_after``: leave out chunks up to that number (a client resuming with Last-Event-ID)."""
    agen = gen.deltas()
    first_task = asyncio.ensure_future(agen.__anext__())
    try:
        first = await _watch(request, first_task)
    except ClientGone:
        gen.close_nowait(client_gone=True)
        return Response(status_code=499)
    except StopAsyncIteration:
        first = []
    except asyncio.CancelledError:
        first_task.cancel()
        gen.close_nowait(client_gone=True)
        raise

    seq = 0

    def numbered(chunks: list) -> list[bytes]:
        nonlocal seq
        out = []
        for chunk in chunks:
            seq += 1
            if resume_after is not None and seq <= resume_after:
                continue
            out.append(_sse(chunk, event_log.event_id(gen.id, seq) if gen.logged else None))
        return out

    async def events() -> AsyncIterator[bytes]:
        # The chunks of the deltas at hand go out as one write (one ASGI send, not one per chunk).
        ended = False  # the stream ran to its end (or an error): not a client that went away
        try:
            head = numbered(fmt.start())
            for d in first:
                head += numbered(fmt.on_delta(d))
            if head:
                yield b"".join(head)
            async for deltas in agen:
                out = [event for d in deltas for event in numbered(fmt.on_delta(d))]
                if out:
                    yield out[0] if len(out) == 1 else b"".join(out)
            tail = numbered(fmt.end())
            if tail:
                yield b"".join(tail)
            ended = True
        except OpenAIError as exc:
            ended = True
            yield _sse(exc.body())
        finally:
            gen.close_nowait(client_gone=not ended)
        yield _sse("[DONE]")

    return EventSourceResponse(events(), sep="\n", ping=15, ping_message_factory=keep_alive)


# --- resumed streams (Last-Event-ID) -------------------------------------------------------------

LAST_EVENT_ID = "last-event-id"


def stream_not_found(record_id: str) -> OpenAIError:
    return errors.error(Code.NOT_FOUND, f"No stream '{record_id}' to resume: the id is unknown, or its event log "
                        "has expired.", param="Last-Event-ID")


async def resumable_record(broker: Broker, last_event_id: str, endpoint: str,
                           principal: Principal) -> tuple[StreamRecord, int]:
    """The record a ``Last-Event-ID`` names and the number of the last chunk the client has: a 400
    for a malformed id, a 404 for one unknown (or expired, or another endpoint's, or another
    tenant's: exactly as if it did not exist)."""
    try:
        record_id, seq = event_log.parse_event_id(last_event_id)
    except ValueError as exc:
        raise errors.invalid(f"Invalid 'Last-Event-ID' header: {exc}.", param="Last-Event-ID") from None
    try:
        record = await broker.load_record(record_id)
    except (RedisError, OSError) as exc:
        raise redis_down(exc) from exc
    if record is None or record.endpoint != endpoint or record.tenant != principal.tenant:
        raise stream_not_found(record_id)
    return record, seq


async def resume(request: Request, broker: Broker, record: StreamRecord, after: int,
                 formatter: Callable[[Generation, LoadedCard], StreamFormatter], opts: dict, n: int) -> Response:
    """Replay a logged request's stream from its log through ``formatter`` (rebuilt from the record),
    leave out the chunks up to ``after``, then follow the live entries (holding its lease)."""
    try:
        card = await broker.card(record.model)
    except (RedisError, OSError) as exc:
        raise redis_down(exc) from exc
    except CardError as exc:
        raise errors.from_card_error(record.model, exc) from exc
    if card is None:
        raise stream_not_found(record.id)
    gen = Generation.resumed(broker, card, record, SamplingParams(n=n), opts)
    fmt = formatter(gen, card)
    gen.follow()
    return await _stream(request, gen, fmt, resume_after=after)
