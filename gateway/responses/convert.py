"""A Responses request → the chat request the gateway already serves.

``POST /v1/responses`` has no generation path of its own: its items become chat messages
(``instructions`` a system message first; a ``function_call`` an assistant turn's ``tool_calls``,
consecutive calls in one turn; a ``function_call_output`` a ``tool`` message), its function tools
chat ``tools``, ``tool_choice`` the chat one, ``text.format`` a ``response_format``, and
``max_output_tokens`` ``max_completion_tokens``, ``include: ["message.output_text.logprobs"]``
with ``top_logprobs`` chat's ``logprobs`` and ``top_logprobs``. The chat pipeline (template, tool dialects,
reasoning, constraints, limits) then does the rest, and its 400s are renamed to the Responses
parameter names (:func:`rename_error`).

Every input item gets an id here (its own when the client sent one), the id under which
``input_items`` lists it.
"""

from __future__ import annotations

import secrets
from typing import Any

from pydantic import BaseModel, ValidationError

from gateway import errors
from gateway.errors import OpenAIError
from gateway.protocol import ChatCompletionRequest
from gateway.responses.models import (
    CreateResponseRequest,
    FunctionCallInput,
    FunctionCallOutputInput,
    InputItem,
    InputMessage,
    ReasoningInput,
    TextFormatJSONObject,
    TextFormatJSONSchema,
    parse_input_item,
)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items(body: CreateResponseRequest) -> list[dict[str, Any]]:
    """The request's input as items (a string is one user message), each with an id, in the
    JSON shape ``input_items`` lists and the store keeps."""
    if isinstance(body.input, str):
        return [{"type": "message", "id": new_id("msg"), "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": body.input}]}]
    return item_dicts(body.input)


def item_dicts(items: list[InputItem]) -> list[dict[str, Any]]:
    """Items as the JSON the store keeps, each with an id (its own when the client gave one)."""
    out = []
    for item in items:
        data = item.model_dump(mode="json", by_alias=True, exclude_none=True)
        if isinstance(item, InputMessage) and isinstance(item.content, str):
            part = "output_text" if item.role == "assistant" else "input_text"
            data["content"] = [{"type": part, "text": item.content}]
        data.setdefault("id", None)
        data["id"] = data["id"] or new_id(_ID_PREFIX[item.type])
        out.append(data)
    return out


def parse_items(items: list[dict[str, Any]]) -> list[BaseModel]:
    """Stored item dicts (a previous conversation, this input) as the request's item models."""
    return [parse_input_item(i, item) for i, item in enumerate(items)]


def chat_messages(items: list[InputItem], instructions: str | None) -> list[dict[str, Any]]:
    """The conversation as chat messages (see the module doc)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    names: dict[str, str] = {}  # call_id -> function name, for the tool messages
    for item in items:
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallInput):
            names[item.call_id] = item.name
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not last.get("_closed"):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputInput):
            if messages and messages[-1]["role"] == "assistant":
                messages[-1]["_closed"] = True
            msg = {"role": "tool", "tool_call_id": item.call_id, "content": item.text()}
            if item.call_id in names:
                msg["name"] = names[item.call_id]
            messages.append(msg)
        elif isinstance(item, ReasoningInput):
            continue  # past reasoning is not part of the prompt
    for m in messages:
        m.pop("_closed", None)
    return messages


def _response_format(body: CreateResponseRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if isinstance(fmt, TextFormatJSONObject):
        return {"type": "json_object"}
    if isinstance(fmt, TextFormatJSONSchema):
        spec: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_}
        if fmt.strict is not None:
            spec["strict"] = fmt.strict
        return {"type": "json_schema", "json_schema": spec}
    return None


def chat_tools(body: CreateResponseRequest) -> tuple[list[dict] | None, Any]:
    """(chat ``tools``, chat ``tool_choice``)."""
    tools = None
    if body.tools:
        tools = []
        for t in body.tools:
            fn: dict[str, Any] = {"name": t.name, "description": t.description or ""}
            if t.parameters is not None:
                fn["parameters"] = t.parameters
            tools.append({"type": "function", "function": fn})
    choice: Any = body.tool_choice
    if isinstance(choice, BaseModel):
        choice = {"type": "function", "function": {"name": choice.name}}
    if not body.tools and choice in ("auto", "none"):
        choice = None  # what the SDKs send with no tools: nothing to choose
    return tools, choice


def chat_request(body: CreateResponseRequest, conversation: list[InputItem]) -> ChatCompletionRequest:
    """The chat request that serves ``body`` given its whole ``conversation`` (stored history
    plus this input)."""
    tools, tool_choice = chat_tools(body)
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages(conversation, body.instructions),
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "response_format": _response_format(body),
        "tools": tools,
        "tool_choice": tool_choice,
        # one call at most: the constraint of a forced call allows one too
        "parallel_tool_calls": False if body.max_tool_calls == 1 else body.parallel_tool_calls,
        "user": body.user,
        "logprobs": True if body.wants_logprobs else None,
        "top_logprobs": body.top_logprobs if body.wants_logprobs else None,
    }
    if not fields["messages"]:
        raise errors.invalid("'input' must hold at least one message.", param="input")
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:  # a stored or converted item the chat model refuses: name it
        raise errors.invalid(f"Invalid input: {exc.errors()[0]['msg']}.", param="input") from None


# Chat parameter names → the Responses request's (the chat pipeline names its own in a 400).
_RENAMES = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("messages", "input"),
    (".function.name", ".name"),
    (".function.parameters", ".parameters"),
)


def rename_error(exc: OpenAIError) -> OpenAIError:
    """``exc`` (a chat pipeline error) speaking of the Responses request's parameters."""
    for old, new in _RENAMES:
        if exc.param is not None and old in exc.param:
            exc.param = exc.param.replace(old, new)
        if old == "messages":  # the word, not only the parameter: only where it is quoted
            exc.message = exc.message.replace(f"'{old}", f"'{new}")
        else:
            exc.message = exc.message.replace(old, new)
    return exc
