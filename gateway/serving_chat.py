"""``POST /v1/chat/completions``: messages → chat template → engine request, engine events → the
response or its stream chunks (vLLM's ``serving_chat``)."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response

from gateway import errors, serving
from gateway.broker import ModelCard
from gateway.generation import Delta, Generation, TokenInfo
from gateway.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
    TopLogprob,
)
from gateway.serving import envelope, finite, usage


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template receives them (also what ``POST /tokenize`` renders)."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    broker, cfg = serving.broker_of(request), serving.config_of(request)
    arrival = time.time()
    card = await serving.card_for(broker, body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise errors.invalid("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
    try:
        text = card.tokenizer.apply_chat_template(
            template_messages(body.messages), add_generation_prompt=body.add_generation_prompt, tokenize=False
        )
    except ValueError as exc:
        raise errors.invalid(f"Invalid messages for the chat template: {exc}", param="messages") from exc
    ids = list(await serving.encode(card.tokenizer, text, add_special_tokens=False))
    if not ids:
        raise errors.invalid("'messages' produce an empty prompt.", param="messages")
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = requested if requested is not None else card.max_model_len - len(ids)
    if max_tokens < 1 or len(ids) + max_tokens > card.max_model_len:
        raise serving.context_error(card, len(ids), max(max_tokens, 0) if requested is None else max_tokens,
                                    chat=True)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = serving.sampling_params(body, card, cfg, max_tokens, logprobs)
    opts = {"stop": serving.stop_strings(body), "include_stop_str": body.include_stop_str_in_output,
            "skip_special_tokens": body.skip_special_tokens, "logprobs": logprobs}
    gen = Generation(broker, card, [ids], params, opts, deadline=arrival + cfg.request_timeout_s,
                     endpoint="chat", id_prefix="chatcmpl")
    await serving.start(gen, broker, cfg, body.model)
    return await serving.respond(
        request, gen,
        stream=ChatStreamFormatter(gen, card, body) if body.stream else None,
        build=lambda: chat_response(gen, body),
    )


def chat_logprobs(infos: list[TokenInfo]) -> ChatCompletionLogProbs:
    return ChatCompletionLogProbs(content=[
        ChatCompletionLogProb(
            token=info.text, logprob=finite(info.logprob), bytes=list(info.bytes),
            top_logprobs=[TopLogprob(token=t, logprob=finite(lp), bytes=list(b)) for t, lp, b in info.top],
        )
        for info in infos
    ])


def chat_response(gen: Generation, body: ChatCompletionRequest) -> ChatCompletionResponse:
    choices = [
        ChatCompletionResponseChoice(
            index=c.index,
            message=ChatResponseMessage(role="assistant", content=c.text),
            logprobs=chat_logprobs(c.logprobs) if body.logprobs else None,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in gen.choices
    ]
    return envelope(ChatCompletionResponse, gen, choices=choices, usage=usage(gen))


class ChatStreamFormatter:
    def __init__(self, gen: Generation, card: ModelCard, body: ChatCompletionRequest) -> None:
        self.gen, self.card, self.body = gen, card, body
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def _chunk(self, index: int, delta: DeltaMessage, logprobs: ChatCompletionLogProbs | None = None,
               finish: str | None = None, stop_reason: int | str | None = None) -> ChatCompletionStreamResponse:
        choice = ChatCompletionResponseStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish)
        if finish is not None:
            choice.stop_reason = stop_reason
        if self.include_usage:
            return envelope(ChatCompletionStreamResponse, self.gen, choices=[choice], usage=None)
        return envelope(ChatCompletionStreamResponse, self.gen, choices=[choice])

    def start(self) -> list[ChatCompletionStreamResponse]:
        return [self._chunk(c.index, DeltaMessage(role="assistant", content="")) for c in self.gen.choices]

    def on_delta(self, d: Delta) -> list[ChatCompletionStreamResponse]:
        out = []
        lp = chat_logprobs(d.logprobs) if self.body.logprobs and d.logprobs else None
        if d.text or lp:
            out.append(self._chunk(d.index, DeltaMessage(content=d.text), lp))
        if d.finish_reason:
            out.append(self._chunk(d.index, DeltaMessage(), None, d.finish_reason, d.stop_reason))
        return out

    def end(self) -> list[ChatCompletionStreamResponse]:
        if not self.include_usage:
            return []
        return [envelope(ChatCompletionStreamResponse, self.gen, choices=[], usage=usage(self.gen))]
