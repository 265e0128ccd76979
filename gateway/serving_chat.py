"""``POST /v1/chat/completions``: messages → chat template → engine request, engine events → the
response or its stream chunks (vLLM's ``serving_chat``)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from gateway import errors, serving, tools
from gateway.broker import LoadedCard
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
    DeltaToolCall,
    ToolCall,
    TopLogprob,
)
from gateway.serving import envelope, finite, usage
from sluice.text.chat_template import template_variables


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template receives them (also what ``POST /tokenize`` renders):
    assistant ``tool_calls`` and ``tool`` results kept; a 400 naming the message for a bad one."""
    out = []
    for i, m in enumerate(messages):
        try:
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        except ValueError as exc:
            raise errors.invalid(f"messages[{i}]: {exc}.", param=f"messages[{i}].content") from None
        if m.tool_calls:
            for j, call in enumerate(m.tool_calls):
                fn = call.get("function")
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise errors.invalid(f"messages[{i}].tool_calls[{j}] needs a function with a name.",
                                         param=f"messages[{i}].tool_calls")
            msg["tool_calls"] = m.tool_calls
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id or ""
            if m.name:
                msg["name"] = m.name
        out.append(msg)
    return out


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    broker, cfg = serving.broker_of(request), serving.config_of(request)
    arrival = time.time()
    card = await serving.card_for(broker, body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise errors.invalid("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
    spec = tools.parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    constraint = tools.constraint_for(body.response_format, body.structured_outputs)
    if spec is not None and spec.constrained:
        if constraint is not None:
            raise errors.invalid("A forced 'tool_choice' cannot be combined with 'response_format' or "
                                 "'structured_outputs'.", param="tool_choice")
        constraint = tools.tool_constraint(spec)
    messages = template_messages(body.messages)
    try:
        # tools go through the template's `tools` variable when it reads one, else a system block
        template_tools = tools.template_tools(spec)
        reads_tools = "tools" in template_variables(card.tokenizer.get_chat_template(tools=template_tools))
        messages = tools.render_messages(messages, spec, reads_tools)
        text = card.tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt, tokenize=False,
            tools=template_tools if reads_tools else None,
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
    await serving.constrain(params, constraint, card, max_tokens,
                            "tool_choice" if spec is not None and spec.constrained
                            else serving.constraint_param(body.response_format))
    opts = {"stop": serving.stop_strings(body), "include_stop_str": body.include_stop_str_in_output,
            "skip_special_tokens": body.skip_special_tokens, "logprobs": logprobs}
    gen = Generation(broker, card, [ids], params, opts, deadline=arrival + cfg.request_timeout_s,
                     endpoint="chat", id_prefix="chatcmpl")
    await serving.start(gen, broker, cfg, body.model)
    return await serving.respond(
        request, gen,
        stream=ChatStreamFormatter(gen, card, body, spec) if body.stream else None,
        build=lambda: chat_response(gen, body, spec),
    )


def chat_logprobs(infos: list[TokenInfo]) -> ChatCompletionLogProbs:
    return ChatCompletionLogProbs(content=[
        ChatCompletionLogProb(
            token=info.text, logprob=finite(info.logprob), bytes=list(info.bytes),
            top_logprobs=[TopLogprob(token=t, logprob=finite(lp), bytes=list(b)) for t, lp, b in info.top],
        )
        for info in infos
    ])


def chat_response(gen: Generation, body: ChatCompletionRequest,
                  spec: tools.ToolSpec | None = None) -> ChatCompletionResponse:
    choices = []
    for c in gen.choices:
        message = ChatResponseMessage(role="assistant", content=c.text)
        finish = c.finish_reason
        if spec is not None and spec.parses_output:
            content, calls = tools.extract_tool_calls(spec, c.text)
            if calls:  # finish_reason "tool_calls" (a call cut short by max_tokens stays text, "length")
                message = ChatResponseMessage(role="assistant", content=content,
                                              tool_calls=[ToolCall(**call) for call in calls])
                finish = "tool_calls" if finish == "stop" else finish
        choices.append(ChatCompletionResponseChoice(
            index=c.index,
            message=message,
            logprobs=chat_logprobs(c.logprobs) if body.logprobs else None,
            finish_reason=finish,
            stop_reason=c.stop_reason,
        ))
    return envelope(ChatCompletionResponse, gen, choices=choices, usage=usage(gen))


class ChatStreamFormatter:
    def __init__(self, gen: Generation, card: LoadedCard, body: ChatCompletionRequest,
                 spec: tools.ToolSpec | None = None) -> None:
        self.gen, self.card, self.body = gen, card, body
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.tool_streams = ({c.index: tools.ToolStream(spec) for c in gen.choices}
                             if spec is not None and spec.parses_output else None)
        self.called: set[int] = set()

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
        if self.tool_streams is not None:
            return self._on_tool_delta(d, lp)
        if d.text or lp:
            out.append(self._chunk(d.index, DeltaMessage(content=d.text), lp))
        if d.finish_reason:
            out.append(self._chunk(d.index, DeltaMessage(), None, d.finish_reason, d.stop_reason))
        return out

    def _on_tool_delta(self, d: Delta, lp: ChatCompletionLogProbs | None) -> list[ChatCompletionStreamResponse]:
        """Text that is surely content goes out at once; calls as OpenAI's ``tool_calls`` deltas."""
        stream = self.tool_streams[d.index]
        out = []
        content, calls = stream.feed(d.text)
        if d.finish_reason:
            rest, more = stream.finish()
            content += rest
            calls += more
        if content or lp:
            out.append(self._chunk(d.index, DeltaMessage(content=content), lp))
        if calls:
            self.called.add(d.index)
            out.append(self._chunk(d.index, DeltaMessage(tool_calls=[DeltaToolCall(**c) for c in calls])))
        if d.finish_reason:
            finish = "tool_calls" if d.index in self.called and d.finish_reason == "stop" else d.finish_reason
            out.append(self._chunk(d.index, DeltaMessage(), None, finish, d.stop_reason))
        return out

    def end(self) -> list[ChatCompletionStreamResponse]:
        if not self.include_usage:
            return []
        return [envelope(ChatCompletionStreamResponse, self.gen, choices=[], usage=usage(self.gen))]
