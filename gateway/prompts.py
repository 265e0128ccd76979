"""The CPU part of preparing a request: from its validated body to the prompt texts its token ids
come from, each checked against the model's context by the characters-per-token bound before a
token is counted.

Every function here is a *job*: a plain function of the model (``ctx``, a :class:`CardContext`)
and of the request, with no I/O, so ``gateway.preparation`` runs it unchanged on the event loop (a
small request) or in a prepare-pool worker (a large one, ``gateway.prepare_pool``) and both give
the same prompts. A job returns :class:`Prompt` s without ids; the runner tokenizes them (on the
loop, or in the worker) with :func:`tokenized`.

- ``render_chat``: chat messages (and tools) through the model's chat template;
- ``completion_prompts``: ``/v1/completions``' prompts (text ones checked, token-id ones kept);
- ``response_prompt``: a Responses request and its stored history converted to the chat request
  (``gateway.responses.convert``), then rendered as a chat;
- ``tokenize_prompt``: ``/tokenize``'s prompt or messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from gateway import errors, tools
from gateway.chat_output import Dialects
from gateway.protocol import ChatCompletionRequest, ChatMessage, TokenizeRequest
from gateway.responses import convert
from gateway.responses.models import CreateResponseRequest
from sluice.text.chat_template import template_variables
from sluice.wire import limits
from sluice.wire.card import ModelCard


class CardContext(Protocol):
    """What a job reads of the model: ``gateway.broker.LoadedCard`` on the event loop, the worker's
    own card in a prepare-pool worker."""

    card: ModelCard
    tokenizer: Any

    @property
    def max_model_len(self) -> int: ...

    @property
    def max_chars_per_token(self) -> int | None: ...


@dataclass
class Prompt:
    """One text to tokenize: ``param`` is what a context-length error names, ``max_tokens`` the
    completion's requested tokens (None: up to the context); ``check_context`` false for /tokenize,
    which counts texts longer than the context. ``ids`` are filled by the runner."""

    text: str
    add_special_tokens: bool
    param: str
    max_tokens: int | None = None
    check_context: bool = True
    ids: list[int] | None = None


@dataclass
class ResponsePrompt:
    """``response_prompt``'s result: the input items (with their ids, as stored), the chat request
    serving the response, and its prompt."""

    items: list[dict[str, Any]]
    chat: ChatCompletionRequest
    prompt: Prompt


def _check(problem: limits.Problem | None) -> None:
    if problem is not None:
        raise errors.from_problem(problem)


def prompts_of(result: Any) -> list[Prompt]:
    """The prompts a job's result holds, in order."""
    if isinstance(result, Prompt):
        return [result]
    if isinstance(result, ResponsePrompt):
        return [result.prompt]
    if isinstance(result, list):
        return [p for p in result if isinstance(p, Prompt)]
    return []


def tokenized(ctx: CardContext, prompt: Prompt, ids: list[int]) -> None:
    """Give ``prompt`` its ids, refused at once (``context_length_exceeded``) when they cannot fit the
    context, before any further prompt of the request is tokenized."""
    prompt.ids = ids
    if prompt.check_context:
        _check(limits.check_context(len(ids), prompt.max_tokens, ctx.max_model_len, prompt.param))


# --- chat --------------------------------------------------------------------------------------


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


def render_chat(ctx: CardContext, body: ChatCompletionRequest, spec: tools.ToolSpec | None,
                chat_template: str | None, requested: int | None) -> Prompt:
    """The chat template over ``body``'s messages: tools go through the template's ``tools``
    variable when it reads one, else a system block (``gateway.tools.render``). ``chat_template``:
    the request's own template, already allowed; ``requested``: its max tokens."""
    dialects = Dialects.of(ctx.card)
    messages = template_messages(body.messages)
    try:
        template_tools = tools.template_tools(spec)
        template = ctx.tokenizer.get_chat_template(chat_template, tools=template_tools)
        reads_tools = "tools" in template_variables(template)
        messages = tools.render_messages(messages, spec, reads_tools, dialects.tool_parser)
        text = ctx.tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt, tokenize=False, chat_template=template,
            tools=template_tools if reads_tools else None, **(body.chat_template_kwargs or {}),
        )
    except (ValueError, TypeError) as exc:  # TypeError: chat_template_kwargs naming a parameter
        param = "chat_template" if chat_template is not None else "messages"
        raise errors.invalid(f"Invalid messages for the chat template: {exc}", param=param) from exc
    _check(limits.check_context_chars(len(text), ctx.max_chars_per_token, requested, ctx.max_model_len, "messages"))
    return Prompt(text, False, "messages", requested)


def response_prompt(ctx: CardContext, body: CreateResponseRequest, history: list[dict[str, Any]]) -> ResponsePrompt:
    """A Responses request continuing ``history`` (stored items): its input items with ids, the chat
    request that serves it, and that chat's prompt."""
    items = convert.input_items(body)
    chat = convert.chat_request(body, convert.parse_items(history + items))
    spec = tools.parse_tools(chat.tools, chat.tool_choice, chat.parallel_tool_calls)
    requested = chat.max_completion_tokens if chat.max_completion_tokens is not None else chat.max_tokens
    return ResponsePrompt(items, chat, render_chat(ctx, chat, spec, None, requested))


def items_chars(items: list[dict[str, Any]]) -> int:
    """About how many characters stored items put into a prompt (their texts), to choose where
    preparing them runs."""
    total = 0
    for item in items:
        for key in ("content", "output", "arguments"):
            value = item.get(key)
            if isinstance(value, str):
                total += len(value)
            elif isinstance(value, list):
                total += sum(len(p.get("text") or "") for p in value if isinstance(p, dict))
    return total


# --- completions and /tokenize -----------------------------------------------------------------


def completion_prompts(ctx: CardContext, prompts_in: list[Any], requested: int | None) -> list[Prompt | list[int]]:
    """``/v1/completions``' prompts: each text one checked against the context by its length
    first (all of them before any is tokenized), token-id prompts as they are."""
    out: list[Prompt | list[int]] = []
    for p in prompts_in:
        if isinstance(p, str):
            _check(limits.check_context_chars(len(p), ctx.max_chars_per_token, requested, ctx.max_model_len))
            out.append(Prompt(p, True, "prompt", requested))
        else:
            out.append(list(p))
    return out


def tokenize_prompt(ctx: CardContext, body: TokenizeRequest, chat_template: str | None) -> Prompt:
    """``/tokenize``'s text: the messages rendered as chat does, or the prompt. It may be longer than
    the context (the answer is a count), but not longer than any prompt of the model could be
    (``max_chars_per_token`` characters per token of the context): a 400 naming it."""
    if body.messages is not None:
        try:
            text = ctx.tokenizer.apply_chat_template(
                template_messages(body.messages), add_generation_prompt=body.add_generation_prompt,
                tokenize=False, continue_final_message=body.continue_final_message, tools=body.tools,
                chat_template=chat_template, **(body.chat_template_kwargs or {}),
            )
        except (ValueError, TypeError) as exc:  # TypeError: chat_template_kwargs naming a parameter
            param = "chat_template" if chat_template is not None else "messages"
            raise errors.invalid(f"Invalid messages for the chat template: {exc}", param=param) from exc
        prompt = Prompt(text, bool(body.add_special_tokens), "messages", check_context=False)
    else:
        prompt = Prompt(body.prompt or "", body.add_special_tokens is not False, "prompt", check_context=False)
    per_token = ctx.max_chars_per_token
    if per_token is not None and len(prompt.text) > (limit := ctx.max_model_len * per_token):
        raise errors.invalid(
            f"'{prompt.param}' is {len(prompt.text)} characters; /tokenize takes at most {limit} ({per_token} per "
            f"token of the model's {ctx.max_model_len}-token context): longer text could not be its prompt.",
            param=prompt.param)
    return prompt
