"""The OpenAI-compatible routes: completions, chat completions, models, health, metrics."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError
from sse_starlette.sse import EventSourceResponse

from gateway import errors
from gateway.broker import Broker, ModelCard
from gateway.config import GatewayConfig
from gateway.errors import OpenAIError
from gateway.generation import Delta, Generation, TokenInfo, position_info
from gateway.metrics import METRICS, render
from gateway.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from sluice.wire.messages_pb2 import SamplingParams

router = APIRouter()

DISCONNECT_POLL_S = 0.2


class ClientGone(Exception):
    pass


def _broker(request: Request) -> Broker:
    return request.app.state.broker


def _config(request: Request) -> GatewayConfig:
    return request.app.state.config


def _redis_down(exc: Exception) -> OpenAIError:
    return OpenAIError(
        503, f"The queue (Redis) is unavailable: {type(exc).__name__}", type="service_unavailable_error",
        code="redis_unavailable",
    )


# --- health, metrics, models -------------------------------------------------------------------


@router.get("/health")
async def health(request: Request) -> Response:
    broker = _broker(request)
    if not await broker.ping():
        return errors.OpenAIError(503, "Redis is not answering.", type="service_unavailable_error",
                                  code="redis_unavailable").response()
    try:
        live = await broker.live_engines(fresh=True)
    except (RedisError, OSError) as exc:
        return _redis_down(exc).response()
    if not any(live.values()):
        return errors.OpenAIError(503, "No engine is alive.", type="service_unavailable_error",
                                  code="no_engine").response()
    return JSONResponse({"status": "ok", "engines": live})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    broker = _broker(request)
    try:
        async with asyncio.timeout(1.0):
            for model in await broker.model_names():
                METRICS.queue_depth.labels(model=model).set(await broker.queue_depth(model))
    except (RedisError, OSError, TimeoutError):
        pass
    body, content_type = render()
    return Response(body, media_type=content_type)


def _model_entry(card: ModelCard | None, name: str) -> dict:
    entry: dict[str, Any] = {"id": name, "object": "model", "created": card.created if card else 0,
                             "owned_by": "sluice", "root": name, "parent": None}
    if card is not None:
        entry["max_model_len"] = card.max_model_len
    return entry


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    broker = _broker(request)
    try:
        live = await broker.live_engines()
        data = []
        for name in await broker.model_names():
            if live.get(name):
                data.append(_model_entry(await broker.card(name), name))
    except (RedisError, OSError) as exc:
        raise _redis_down(exc) from exc
    return JSONResponse({"object": "list", "data": data})


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> Response:
    broker = _broker(request)
    try:
        live = await broker.live_engines()
        card = await broker.card(model_id) if live.get(model_id) else None
    except (RedisError, OSError) as exc:
        raise _redis_down(exc) from exc
    if card is None:
        raise errors.model_not_found(model_id)
    return JSONResponse(_model_entry(card, model_id))


# --- shared request preparation ----------------------------------------------------------------


async def _card_for(broker: Broker, model: str) -> ModelCard:
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
        raise _redis_down(exc) from exc
    return card


def _check_ids(ids: list[int], card: ModelCard, param: str) -> None:
    if card.vocab_size is None:
        return
    for t in ids:
        if not 0 <= t < card.vocab_size:
            raise errors.invalid(f"Token id {t} in '{param}' is out of the vocabulary (size {card.vocab_size}).",
                                 param=param, code="invalid_value")


def _sampling(req: SamplingFields, card: ModelCard, cfg: GatewayConfig, max_tokens: int,
              logprobs: int | None) -> SamplingParams:
    if req.n > cfg.max_n:
        raise errors.invalid(f"'n' must be at most {cfg.max_n}.", param="n", code="invalid_value")
    if req.min_tokens > max_tokens:
        raise errors.invalid("'min_tokens' must not exceed 'max_tokens'.", param="min_tokens", code="invalid_value")
    if req.stream_options is not None and not req.stream:
        raise errors.invalid("'stream_options' is only allowed when 'stream' is true.", param="stream_options",
                             code="invalid_value")
    p = SamplingParams(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if not req.top_k else req.top_k,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
    )
    if req.seed is not None:
        p.seed = req.seed
    if req.stop_token_ids:
        _check_ids(req.stop_token_ids, card, "stop_token_ids")
        p.stop_token_ids.extend(req.stop_token_ids)
    if req.logit_bias:
        for key, bias in req.logit_bias.items():
            try:
                tid = int(key)
            except ValueError:
                raise errors.invalid(f"Invalid key {key!r} in 'logit_bias': keys are token ids.",
                                     param="logit_bias", code="invalid_value") from None
            if tid < 0 or (card.vocab_size is not None and tid >= card.vocab_size) or tid > 2**31 - 1:
                raise errors.invalid(f"Token id {tid} in 'logit_bias' is out of the vocabulary.",
                                     param="logit_bias", code="invalid_value")
            p.logit_bias[tid] = bias
    if logprobs is not None:
        if logprobs > cfg.max_logprobs:
            raise errors.invalid(f"At most {cfg.max_logprobs} logprobs may be requested.", param="logprobs")
        p.logprobs = logprobs
    return p


def _stops(req: SamplingFields) -> list[str]:
    if req.stop is None:
        return []
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    return [s for s in stops if s]


def _context_error(card: ModelCard, prompt_len: int, max_tokens: int, chat: bool) -> OpenAIError:
    total = prompt_len + max_tokens
    if chat:
        msg = (f"This model's maximum context length is {card.max_model_len} tokens. However, you requested "
               f"{total} tokens ({prompt_len} in the messages, {max_tokens} in the completion). "
               "Please reduce the length of the messages or completion.")
    else:
        msg = (f"This model's maximum context length is {card.max_model_len} tokens, however you requested "
               f"{total} tokens ({prompt_len} in your prompt; {max_tokens} for the completion). "
               "Please reduce your prompt; or completion length.")
    return errors.invalid(msg, param="messages" if chat else "prompt", code="context_length_exceeded")


async def _admit(broker: Broker, cfg: GatewayConfig, model: str, num_requests: int) -> None:
    if cfg.max_queue_len is None:
        return
    depth = await broker.queue_depth(model)
    METRICS.queue_depth.labels(model=model).set(depth)
    if depth + num_requests > cfg.max_queue_len:
        raise errors.queue_full(model, cfg.retry_after_s)


async def _watch(request: Request, task: asyncio.Task) -> Any:
    """Await ``task`` unless the client goes away first (then cancel it and raise ClientGone)."""
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientGone()


async def _start(gen: Generation, broker: Broker, cfg: GatewayConfig, model: str) -> None:
    try:
        await _admit(broker, cfg, model, len(gen.subs))
        await gen.start()
    except OpenAIError:
        gen.close_nowait()
        raise
    except (TimeoutError, RedisError, OSError) as exc:
        gen.close_nowait()
        raise _redis_down(exc) from exc


async def _encode(tok, text: str, *, add_special_tokens: bool) -> list[int]:
    """Tokenize; long texts in a thread so that one big prompt does not stall every stream."""
    if len(text) < 8192:
        return tok.encode(text, add_special_tokens=add_special_tokens)
    return await asyncio.to_thread(tok.encode, text, add_special_tokens=add_special_tokens)


def _finite(x: float | None) -> float:
    if x is None or not math.isfinite(x):
        return -9999.0
    return x


# --- /v1/completions ---------------------------------------------------------------------------


class CompletionLogprobs:
    """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, start_offset: int = 0) -> None:
        self.offset = start_offset

    def build(self, infos: list[TokenInfo], first_is_none: bool = False) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, info in enumerate(infos):
            out["tokens"].append(info.text)
            none = first_is_none and i == 0
            out["token_logprobs"].append(None if none or info.logprob is None else _finite(info.logprob))
            if none or info.logprob is None:
                out["top_logprobs"].append(None)
            else:
                top = {info.text: _finite(info.logprob)}
                for t, lp, _ in info.top:
                    top.setdefault(t, _finite(lp))
                out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(info.text)
        return out


def _prompt_infos(gen: Generation, sub, card: ModelCard, num_top: int) -> list[TokenInfo]:
    infos = []
    for i, tid in enumerate(sub.prompt_ids):
        pos = sub.prompt_logprobs[i] if i < len(sub.prompt_logprobs) else None
        infos.append(position_info(card.tokenizer, tid, pos, num_top))
    return infos


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    broker, cfg = _broker(request), _config(request)
    arrival = time.time()
    card = await _card_for(broker, body.model)
    tok = card.tokenizer
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts_in: list = [prompt]
    elif prompt and all(isinstance(x, int) for x in prompt):
        prompts_in = [list(prompt)]
    else:
        prompts_in = list(prompt)
    if not prompts_in:
        raise errors.invalid("'prompt' must not be empty.", param="prompt")
    if len(prompts_in) > cfg.max_prompts:
        raise errors.invalid(f"At most {cfg.max_prompts} prompts per request.", param="prompt")
    prompts: list[list[int]] = []
    for p in prompts_in:
        ids = await _encode(tok, p, add_special_tokens=True) if isinstance(p, str) else list(p)
        if not ids:
            raise errors.invalid("'prompt' must not be empty.", param="prompt")
        _check_ids(ids, card, "prompt")
        prompts.append(list(ids))
    max_tokens = body.max_tokens if body.max_tokens is not None else card.max_model_len - max(map(len, prompts))
    for ids in prompts:
        if len(ids) + max(max_tokens, 0) > card.max_model_len or max_tokens < 1:
            raise _context_error(card, len(ids), max_tokens, chat=False)
    echo = bool(body.echo)
    params = _sampling(body, card, cfg, max_tokens, body.logprobs)
    if echo and body.logprobs is not None:
        params.prompt_logprobs = body.logprobs
    opts = {"stop": _stops(body), "include_stop_str": body.include_stop_str_in_output,
            "skip_special_tokens": body.skip_special_tokens, "logprobs": body.logprobs}
    gen = Generation(broker, card, prompts, params, opts, deadline=arrival + cfg.request_timeout_s,
                     endpoint="completions", id_prefix="cmpl")
    await _start(gen, broker, cfg, body.model)
    echo_text = {s.request_id: tok.decode(s.prompt_ids, skip_special_tokens=False) for s in gen.subs} if echo else {}
    if body.stream:
        return await _stream(request, gen, _CompletionStream(gen, card, body, echo_text))
    return await _collect(request, gen, lambda: _completion_response(gen, card, body, echo_text))


def _completion_response(gen: Generation, card: ModelCard, body: CompletionRequest, echo_text: dict) -> dict:
    choices = []
    for c in gen.choices:
        prefix = echo_text.get(c.sub.request_id, "")
        lp = None
        if body.logprobs is not None:
            builder = CompletionLogprobs()
            infos = _prompt_infos(gen, c.sub, card, body.logprobs) + c.logprobs if prefix else c.logprobs
            lp = builder.build(infos, first_is_none=bool(prefix))
        choices.append({"index": c.index, "text": prefix + c.text, "logprobs": lp,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return {"id": gen.id, "object": "text_completion", "created": gen.created, "model": card.name,
            "choices": choices, "usage": gen.usage()}


class _CompletionStream:
    def __init__(self, gen: Generation, card: ModelCard, body: CompletionRequest, echo_text: dict) -> None:
        self.gen, self.card, self.body, self.echo_text = gen, card, body, echo_text
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.builders: dict[int, CompletionLogprobs] = {}
        self.echoed: set[int] = set()

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {"id": self.gen.id, "object": "text_completion", "created": self.gen.created,
                 "model": self.card.name, "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def start(self) -> list[dict]:
        return []

    def on_delta(self, d: Delta) -> list[dict]:
        choice = self.gen.choices[d.index]
        prefix = ""
        infos: list[TokenInfo] | None = d.logprobs
        first_is_none = False
        if d.index not in self.echoed:
            self.echoed.add(d.index)
            prefix = self.echo_text.get(choice.sub.request_id, "")
            if prefix and self.body.logprobs is not None:
                infos = _prompt_infos(self.gen, choice.sub, self.card, self.body.logprobs) + (infos or [])
                first_is_none = True
        lp = None
        if self.body.logprobs is not None:
            builder = self.builders.setdefault(d.index, CompletionLogprobs())
            lp = builder.build(infos or [], first_is_none=first_is_none)
        out = []
        text = prefix + d.text
        if text or lp and lp["tokens"] or not d.finish_reason:
            out.append(self._chunk([{"index": d.index, "text": text, "logprobs": lp, "finish_reason": None,
                                     "stop_reason": None}]))
        if d.finish_reason:
            out.append(self._chunk([{"index": d.index, "text": "", "logprobs": None,
                                     "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}]))
        return out

    def end(self) -> list[dict]:
        if not self.include_usage:
            return []
        return [{"id": self.gen.id, "object": "text_completion", "created": self.gen.created,
                 "model": self.card.name, "choices": [], "usage": self.gen.usage()}]


# --- /v1/chat/completions ----------------------------------------------------------------------


def _chat_logprobs(infos: list[TokenInfo]) -> dict:
    content = []
    for info in infos:
        content.append({
            "token": info.text, "logprob": _finite(info.logprob), "bytes": list(info.bytes),
            "top_logprobs": [{"token": t, "logprob": _finite(lp), "bytes": list(b)} for t, lp, b in info.top],
        })
    return {"content": content}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    broker, cfg = _broker(request), _config(request)
    arrival = time.time()
    card = await _card_for(broker, body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise errors.invalid("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in body.messages]
    try:
        text = card.tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt, tokenize=False
        )
    except ValueError as exc:
        raise errors.invalid(f"Invalid messages for the chat template: {exc}", param="messages") from exc
    ids = list(await _encode(card.tokenizer, text, add_special_tokens=False))
    if not ids:
        raise errors.invalid("'messages' produce an empty prompt.", param="messages")
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = requested if requested is not None else card.max_model_len - len(ids)
    if max_tokens < 1 or len(ids) + max_tokens > card.max_model_len:
        raise _context_error(card, len(ids), max(max_tokens, 0) if requested is None else max_tokens, chat=True)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = _sampling(body, card, cfg, max_tokens, logprobs)
    opts = {"stop": _stops(body), "include_stop_str": body.include_stop_str_in_output,
            "skip_special_tokens": body.skip_special_tokens, "logprobs": logprobs}
    gen = Generation(broker, card, [ids], params, opts, deadline=arrival + cfg.request_timeout_s,
                     endpoint="chat", id_prefix="chatcmpl")
    await _start(gen, broker, cfg, body.model)
    if body.stream:
        return await _stream(request, gen, _ChatStream(gen, card, body))
    return await _collect(request, gen, lambda: _chat_response(gen, card, body))


def _chat_response(gen: Generation, card: ModelCard, body: ChatCompletionRequest) -> dict:
    choices = []
    for c in gen.choices:
        choices.append({
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": _chat_logprobs(c.logprobs) if body.logprobs else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        })
    return {"id": gen.id, "object": "chat.completion", "created": gen.created, "model": card.name,
            "choices": choices, "usage": gen.usage()}


class _ChatStream:
    def __init__(self, gen: Generation, card: ModelCard, body: ChatCompletionRequest) -> None:
        self.gen, self.card, self.body = gen, card, body
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def _chunk(self, index: int, delta: dict, logprobs: dict | None = None, finish: str | None = None,
               stop_reason: Any = None) -> dict:
        chunk = {"id": self.gen.id, "object": "chat.completion.chunk", "created": self.gen.created,
                 "model": self.card.name,
                 "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if finish is not None:
            chunk["choices"][0]["stop_reason"] = stop_reason
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def start(self) -> list[dict]:
        return [self._chunk(c.index, {"role": "assistant", "content": ""}) for c in self.gen.choices]

    def on_delta(self, d: Delta) -> list[dict]:
        out = []
        lp = _chat_logprobs(d.logprobs) if self.body.logprobs and d.logprobs else None
        if d.text or lp:
            out.append(self._chunk(d.index, {"content": d.text}, lp))
        if d.finish_reason:
            out.append(self._chunk(d.index, {}, None, d.finish_reason, d.stop_reason))
        return out

    def end(self) -> list[dict]:
        if not self.include_usage:
            return []
        return [{"id": self.gen.id, "object": "chat.completion.chunk", "created": self.gen.created,
                 "model": self.card.name, "choices": [], "usage": self.gen.usage()}]


# --- response assembly -------------------------------------------------------------------------


async def _collect(request: Request, gen: Generation, build) -> Response:
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
    return JSONResponse(build())


def _sse(data: Any) -> dict:
    return {"data": data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))}


async def _stream(request: Request, gen: Generation, fmt) -> Response:
    agen = gen.deltas()
    first_task = asyncio.ensure_future(agen.__anext__())
    try:
        first = await _watch(request, first_task)
    except ClientGone:
        gen.close_nowait()
        return Response(status_code=499)
    except StopAsyncIteration:
        first = []
    except asyncio.CancelledError:
        first_task.cancel()
        gen.close_nowait()
        raise

    async def events() -> AsyncIterator[dict]:
        try:
            for chunk in fmt.start():
                yield _sse(chunk)
            for d in first:
                for chunk in fmt.on_delta(d):
                    yield _sse(chunk)
            async for deltas in agen:
                for d in deltas:
                    for chunk in fmt.on_delta(d):
                        yield _sse(chunk)
            for chunk in fmt.end():
                yield _sse(chunk)
        except OpenAIError as exc:
            yield _sse(exc.body())
        finally:
            gen.close_nowait()
        yield _sse("[DONE]")

    return EventSourceResponse(events(), sep="\n", ping=15)
