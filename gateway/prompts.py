"""The CPU part of preparing a request: from its validated body to the prompt texts its token ids
come from, each checked against the model's context by the characters-per-token bound before a
token is counted.

Every function here is a *job*: a plain function of the model (``ctx``, a :class:`CardContext`)
and of the request, with no I/O, so ``gateway.preparation`` runs it unchanged on the event loop (a
small request) or in a prepare-pool worker (a large one, ``gateway.prepare_pool``) and both give
the same prompts. A job returns :class:`Prompt` s without ids; the runner tokenizes them (on the
loop, or in the worker) with :func:`tokenized`.

- ``chat_prompt``: a chat request's tools and output constraint (compiling a constraint's grammar
  holds the GIL, for seconds with a schema of thousands of properties) and its messages through
  the model's chat template (``render_chat``);
- ``completion_prompts``: ``/v1/completions``' constraint and prompts (text ones checked, token-id
  ones kept);
- ``response_prompt``: a Responses request and its stored history converted to the chat request
  (``gateway.responses.convert``), then prepared as a chat;
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
from sluice.structured import StructuredOutputsParams
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
class ChatPrompt:
    """``chat_prompt``'s result: the request's tools, its output constraint (checked to compile;
    a forced tool choice's included) and its prompt."""

    spec: tools.ToolSpec | None
    constraint: StructuredOutputsParams | None
    prompt: Prompt


@dataclass
class CompletionPrompts:
    """``completion_prompts``' result: each prompt (text, or token ids as given) and the output
    constraint (checked to compile)."""

    prompts: list[Prompt | list[int]]
    constraint: StructuredOutputsParams | None


@dataclass
class ResponsePrompt:
    """``response_prompt``'s result: the input items (with their ids, as stored), the chat request
    serving the response, and its chat prompt."""

    items: list[dict[str, Any]]
    chat: ChatCompletionRequest
    chat_prompt: ChatPrompt


def _check(problem: limits.Problem | None) -> None:
    if problem is not None:
        raise errors.from_problem(problem)


def check_length(ctx: CardContext, text: str, param: str = "prompt") -> None:
    """``limits.check_context_chars`` on ``text``: refused by its length alone when even the fewest
    tokens it can be cannot fit the context. A text shorter than the context in characters always
    might (so the tokenizer's bound, computed once when first needed, is not asked for)."""
    if len(text) >= ctx.max_model_len:
        _check(limits.check_context_chars(len(text), ctx.max_chars_per_token, ctx.max_model_len, param))


def prompts_of(result: Any) -> list[Prompt]:
    """The prompts a job's result holds, in order."""
    if isinstance(result, Prompt):
        return [result]
    if isinstance(result, ChatPrompt):
        return [result.prompt]
    if isinstance(result, ResponsePrompt):
        return [result.chat_prompt.prompt]
    if isinstance(result, CompletionPrompts):
        return [p for p in result.prompts if isinstance(p, Prompt)]
    return []


def constrained(body: Any) -> bool:
    """Whether the request asks for an output constraint (``response_format`` / ``text.format``
    other than text, ``structured_outputs``, a forced ``tool_choice``): converting its schema or
    tools to a grammar is Python work, so its body counts heavier when choosing where it is
    prepared (``preparation.CONSTRAINT_WEIGHT``)."""
    if isinstance(body, CreateResponseRequest):
        fmt = body.text.format if body.text is not None else None
        kind = getattr(fmt, "type", "text")
    else:
        fmt = getattr(body, "response_format", None)
        kind = fmt.get("type", "text") if isinstance(fmt, dict) else "text"
    return (kind != "text" or getattr(body, "structured_outputs", None) is not None
            or getattr(body, "tool_choice", None) not in (None, "auto", "none"))


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
    check_length(ctx, text, "messages")
    return Prompt(text, False, "messages", requested)


def chat_prompt(ctx: CardContext, body: ChatCompletionRequest, chat_template: str | None) -> ChatPrompt:
    """A chat request's tools and output constraint (each a 400 naming its parameter when it is
    malformed or does not compile), and its prompt (:func:`render_chat`)."""
    spec = tools.parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    constraint = tools.constraint_for(body.response_format, body.structured_outputs)
    if spec is not None and spec.constrained:
        if constraint is not None:
            raise errors.invalid("A forced 'tool_choice' cannot be combined with 'response_format' or "
                                 "'structured_outputs'.", param="tool_choice")
        constraint = tools.tool_constraint(spec)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return ChatPrompt(spec, constraint, render_chat(ctx, body, spec, chat_template, requested))


def response_prompt(ctx: CardContext, body: CreateResponseRequest, history: list[dict[str, Any]]) -> ResponsePrompt:
    """A Responses request continuing ``history`` (stored items): its input items with ids, the chat
    request that serves it, and that chat's :func:`chat_prompt`."""
    items = convert.input_items(body)
    chat = convert.chat_request(body, convert.parse_items(history + items))
    return ResponsePrompt(items, chat, chat_prompt(ctx, chat, None))


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


def completion_prompts(ctx: CardContext, prompts_in: list[Any], requested: int | None, response_format: Any,
                       structured_outputs: Any) -> CompletionPrompts:
    """``/v1/completions``' output constraint (checked to compile) and prompts: each text one checked
    against the context by its length first (all of them before any is tokenized), token-id prompts
    as they are."""
    constraint = tools.constraint_for(response_format, structured_outputs)
    out: list[Prompt | list[int]] = []
    for p in prompts_in:
        if isinstance(p, str):
            check_length(ctx, p)
            out.append(Prompt(p, True, "prompt", requested))
        else:
            out.append(list(p))
    return CompletionPrompts(out, constraint)


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
    per_token = ctx.max_chars_per_token if len(prompt.text) > ctx.max_model_len else None
    if per_token is not None and len(prompt.text) > (limit := ctx.max_model_len * per_token):
        raise errors.invalid(
            f"'{prompt.param}' is {len(prompt.text)} characters; /tokenize takes at most {limit} ({per_token} per "
            f"token of the model's {ctx.max_model_len}-token context): longer text could not be its prompt.",
            param=prompt.param)
    return prompt
