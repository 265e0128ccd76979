"""``POST /v1/chat/completions``: messages → chat template → engine request, engine events → the
response or its stream chunks (vLLM's ``serving_chat``)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from gateway import errors, preparation, prompts, serving, tools
from gateway.broker import LoadedCard
from gateway.chat_output import ChatOutputStream, Dialects, parse_chat_output
from gateway.config import GatewayConfig
from gateway.generation import Delta, Generation, TokenInfo
from gateway.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
    DeltaToolCall,
    ToolCall,
    TopLogprob,
)
from gateway.serving import envelope, finite, usage
from gateway.stream_chunks import ChunkTemplate


def request_chat_template(chat_template: str | None, cfg: GatewayConfig) -> str | None:
    """A request's own ``chat_template``, rendered only with ``--trust-request-chat-template`` (as
    vLLM); else a 400 naming it, never silently ignored."""
    if chat_template is not None and not cfg.trust_request_chat_template:
        raise errors.invalid("A chat template in the request is not accepted: this gateway renders the model's "
                             "own template (leave 'chat_template' out), unless started with "
                             "--trust-request-chat-template.", param="chat_template")
    return chat_template


@dataclass
class PreparedChat:
    """A validated chat request turned into its (not yet started) :class:`Generation`, with what
    parsing its output needs: the tool spec, the model's dialects and the rendered prompt."""

    gen: Generation
    card: LoadedCard
    spec: tools.ToolSpec | None
    dialects: Dialects
    prompt: str


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    if (last_event_id := request.headers.get(serving.LAST_EVENT_ID)) is not None:
        return await resume_chat_completion(request, last_event_id)
    chat = await prepare_chat(body, request)
    await serving.start(chat.gen, request, body.model)
    gen, card, spec, dialects, text = chat.gen, chat.card, chat.spec, chat.dialects, chat.prompt
    return await serving.respond(
        request, gen,
        stream=ChatStreamFormatter(gen, card, body, spec, dialects, text) if body.stream else None,
        build=lambda: chat_response(gen, body, spec, dialects, text),
    )


async def prepare_chat(body: ChatCompletionRequest, request: Request, *, id_prefix: str = "chatcmpl",
                       resumable: bool | None = None, prepared: prompts.ChatPrompt | None = None) -> PreparedChat:
    """Everything a chat request needs before it is queued (every 400 is raised here): the
    chat template, tools, constraints, sampling parameters. ``POST /v1/responses`` comes
    through here too (``gateway.responses``), with a chat request converted from its own and
    ``prepared`` already (``prompts.response_prompt``). Tools, constraints, the template and the
    tokenizer run where ``gateway.preparation`` says (the prepare pool for a large request).
    ``resumable``: log it as a resumable chat stream (None: when streamed and the gateway's
    ``--resumable-streams`` is on)."""
    broker, cfg = serving.broker_of(request), serving.config_of(request)
    arrival = time.time()
    card = await serving.card_for(broker, body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise errors.invalid("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
    if prepared is None:
        chat_template = request_chat_template(body.chat_template, cfg)
        prepared = await preparation.run(request, card, prompts.chat_prompt, body, chat_template,
                                         size=preparation.size_of(request, body))
    spec, constraint, prompt = prepared.spec, prepared.constraint, prepared.prompt
    dialects = Dialects.of(card.card)  # the model's tool-call and reasoning parsers, named on its card
    requested = prompt.max_tokens
    text, ids = prompt.text, prompt.ids
    serving.check_prompt(ids, card, "messages")
    max_tokens = serving.max_tokens_for(card, [len(ids)], requested, "messages")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = serving.sampling_params(body, card, max_tokens, logprobs)
    if constraint is not None and dialects.reasoning is not None:  # it constrains the answer, not the reasoning
        constraint = dialects.reasoning.answer_constraint(constraint, text)
    await serving.constrain(params, constraint, card, max_tokens,
                            "tool_choice" if spec is not None and spec.constrained
                            else serving.constraint_param(body.response_format))
    opts = {"stop": serving.stop_strings(body), "include_stop_str": body.include_stop_str_in_output,
            "skip_special_tokens": body.skip_special_tokens, "logprobs": logprobs}
    # What a gateway that resumes the stream needs to render it (the record, sluice.wire.event_log):
    # the body less its messages, the prompt text only where the reasoning parser reads it.
    render = {"body": body.model_dump(mode="json", exclude_unset=True, exclude={"messages"}),
              "prompt": text if dialects.reasoning is not None else "", "opts": opts, "n": params.n or 1}
    gen = Generation(broker, card, [ids], params, opts, deadline=arrival + cfg.request_timeout_s,
                     endpoint="chat", id_prefix=id_prefix,
                     log_ttl_s=cfg.event_log_ttl_s if (body.stream and cfg.resumable_streams if resumable is None
                                                       else resumable) else None,
                     render=render, principal=serving.principal_of(request))
    return PreparedChat(gen, card, spec, dialects, text)


async def resume_chat_completion(request: Request, last_event_id: str) -> Response:
    """A client resuming a chat completion stream (any gateway): the chunks after its
    Last-Event-ID, rendered from the request's record and event log."""
    broker = serving.broker_of(request)
    record, after = await serving.resumable_record(broker, last_event_id, "chat",
                                                   serving.principal_of(request))
    render = record.render
    body = ChatCompletionRequest.model_validate({**render["body"], "messages": [{"role": "user", "content": ""}]})

    def formatter(gen: Generation, card: LoadedCard) -> ChatStreamFormatter:
        spec = tools.parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        return ChatStreamFormatter(gen, card, body, spec, Dialects.of(card.card), render.get("prompt", ""))

    return await serving.resume(request, broker, record, after, formatter, render["opts"], render["n"])


def chat_logprobs(infos: list[TokenInfo]) -> ChatCompletionLogProbs:
    return ChatCompletionLogProbs(content=[
        ChatCompletionLogProb(
            token=info.text, logprob=finite(info.logprob), bytes=list(info.bytes),
            top_logprobs=[TopLogprob(token=t, logprob=finite(lp), bytes=list(b)) for t, lp, b in info.top],
        )
        for info in infos
    ])


def _parses(spec: tools.ToolSpec | None, dialects: Dialects | None) -> bool:
    """Whether a choice's text goes through the reasoning parser or the tool stream."""
    return dialects is not None and (dialects.reasoning is not None or (spec is not None and spec.parses_output))


def chat_response(gen: Generation, body: ChatCompletionRequest, spec: tools.ToolSpec | None = None,
                  dialects: Dialects | None = None, prompt: str = "") -> ChatCompletionResponse:
    choices = []
    for c in gen.choices:
        message = ChatResponseMessage(role="assistant", content=c.text)
        finish = c.finish_reason
        if _parses(spec, dialects):  # the same parse as a stream's (gateway.chat_output)
            stream = ChatOutputStream(dialects, spec, prompt)
            out = parse_chat_output(stream, c.text)
            message = ChatResponseMessage(role="assistant", content=out.content)
            if dialects.reasoning is not None:
                message.reasoning_content = out.reasoning_content
            if out.tool_calls:  # finish_reason "tool_calls" (or "length" for a forced call cut short)
                message.tool_calls = [ToolCall(**call) for call in out.tool_calls]
            finish = stream.finish_reason(finish)
        choices.append(ChatCompletionResponseChoice(
            index=c.index,
            message=message,
            logprobs=chat_logprobs(c.logprobs) if body.logprobs else None,
            finish_reason=finish,
            stop_reason=c.stop_reason,
        ))
    return envelope(ChatCompletionResponse, gen, choices=choices,
                    usage=usage(gen, dialects.reasoning if dialects else None, prompt, details=True))


class ChatStreamFormatter:
    def __init__(self, gen: Generation, card: LoadedCard, body: ChatCompletionRequest,
                 spec: tools.ToolSpec | None = None, dialects: Dialects | None = None, prompt: str = "") -> None:
        self.gen, self.card, self.body = gen, card, body
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.reasoning, self.prompt = (dialects.reasoning if dialects else None), prompt
        self.outputs = ({c.index: ChatOutputStream(dialects, spec, prompt) for c in gen.choices}
                        if _parses(spec, dialects) else None)
        # the plain chunks (no logprobs, nothing parsed) from a template: gateway.stream_chunks
        self.template = ChunkTemplate(gen.id, ChatCompletionStreamResponse.model_fields["object"].default,
                                      gen.created, gen.card.name, self.include_usage) \
            if self.outputs is None and not body.logprobs else None

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

    def on_delta(self, d: Delta) -> list[ChatCompletionStreamResponse | str]:
        if self.template is not None:
            out = [self.template.chat_content(d.index, d.text)] if d.text else []
            if d.finish_reason:
                out.append(self.template.chat_finish(d.index, d.finish_reason, d.stop_reason))
            return out
        out = []
        lp = chat_logprobs(d.logprobs) if self.body.logprobs and d.logprobs else None
        if self.outputs is not None:
            return self._on_parsed_delta(d, lp)
        if d.text or lp:
            out.append(self._chunk(d.index, DeltaMessage(content=d.text), lp))
        if d.finish_reason:
            out.append(self._chunk(d.index, DeltaMessage(), None, d.finish_reason, d.stop_reason))
        return out

    def _on_parsed_delta(self, d: Delta, lp: ChatCompletionLogProbs | None) -> list[ChatCompletionStreamResponse]:
        """Reasoning and surely-content text go out at once; calls as OpenAI's ``tool_calls``
        deltas, one entry per index in a chunk (``gateway.chat_output``)."""
        stream = self.outputs[d.index]
        out = []
        piece = stream.feed(d.text)
        if d.finish_reason:
            piece += stream.finish()
        if piece.reasoning or piece.content or lp:
            delta = DeltaMessage(content=piece.content) if piece.content or not piece.reasoning else DeltaMessage()
            if piece.reasoning:
                delta.reasoning_content = piece.reasoning
            out.append(self._chunk(d.index, delta, lp))
        if piece.tool_calls:
            out.append(self._chunk(d.index, DeltaMessage(tool_calls=[DeltaToolCall(**c) for c in piece.tool_calls])))
        if d.finish_reason:
            out.append(self._chunk(d.index, DeltaMessage(), None, stream.finish_reason(d.finish_reason),
                                   d.stop_reason))
        return out

    def end(self) -> list[ChatCompletionStreamResponse]:
        if not self.include_usage:
            return []
        return [envelope(ChatCompletionStreamResponse, self.gen, choices=[],
                         usage=usage(self.gen, self.reasoning, self.prompt, details=True))]
