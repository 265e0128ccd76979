"""Render Hugging Face chat templates with jinja2, the way ``transformers`` does.

Semantics follow ``transformers``' ``apply_chat_template``: an ``ImmutableSandboxedEnvironment``
with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}``
block tag, a ``tojson`` filter that does not HTML-escape, ``raise_exception``, ``strftime_now``,
and the variables ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the special
tokens (``bos_token``, ``eos_token``, ...) and any extra keyword arguments.

Templates are compiled once and cached. Any error (a syntax error, ``raise_exception`` from the
template, a message the template cannot handle) becomes a :class:`ChatTemplateError`, a
``ValueError`` the gateway turns into a 400 response. No torch here: the gateway uses it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """The chat template could not be compiled or rendered for these messages."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text in HF templates): render the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` inside templates, without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore attributes (as transformers does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same trick as jinja2.utils.Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


@lru_cache(maxsize=64)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile (once per distinct template text) with Hugging Face's environment."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template syntax error at line {exc.lineno}: {exc.message}") from exc


@lru_cache(maxsize=64)
def template_variables(template: str) -> frozenset[str]:
    """The variables a template reads from its context (e.g. whether it renders ``tools``)."""
    import jinja2.meta

    env = jinja2.Environment(extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template syntax error at line {exc.lineno}: {exc.message}") from exc


def _plain(value: Any) -> Any:
    """Deep copy into plain dicts/lists (pydantic models and dataclasses become dicts)."""
    if hasattr(value, "model_dump"):
        return _plain(value.model_dump(exclude_none=True))
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return copy.copy(value)


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    continue_final_message: bool = False,
    special_tokens: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> str:
    """Render ``messages`` with ``template``; raise :class:`ChatTemplateError` on any failure.

    ``special_tokens`` (``bos_token``, ``eos_token``, ...) are passed as template variables, as are
    the extra keyword arguments (which win over them). With ``continue_final_message`` the prompt
    ends right after the last message's content, so the model continues it.
    """
    if not template:
        raise ChatTemplateError("this model has no chat template")
    compiled = compile_chat_template(template)
    chat = _plain(list(messages))
    for message in chat:
        if not isinstance(message, dict):
            raise ChatTemplateError(f"chat messages must be objects, got {type(message).__name__}")
    final_text: str | None = None
    if continue_final_message:
        if not chat:
            raise ChatTemplateError("continue_final_message is set but there are no messages")
        if add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
        content = chat[-1].get("content")
        if isinstance(content, str):
            final_text = content
            chat[-1]["content"] = content + _CONTINUE_TAG
        elif isinstance(content, list):
            for block in reversed(content):
                if isinstance(block, dict) and "text" in block:
                    final_text = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
        if final_text is None:
            raise ChatTemplateError("continue_final_message is set but the last message has no text to continue")
    variables: dict[str, Any] = dict(special_tokens or {})
    variables.update(_plain(kwargs))
    try:
        rendered = compiled.render(
            messages=chat,
            tools=_plain(tools) if tools is not None else None,
            documents=_plain(documents) if documents is not None else None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc.message or type(exc).__name__}") from exc
    except (TypeError, KeyError, IndexError, AttributeError, ValueError, ZeroDivisionError) as exc:
        raise ChatTemplateError(f"chat template error: {type(exc).__name__}: {exc}") from exc
    if final_text is not None:
        tag = _CONTINUE_TAG.strip()
        if tag not in rendered or final_text.strip() not in rendered:
            raise ChatTemplateError("continue_final_message: the template dropped the last message's text")
        loc = rendered.rindex(tag)
        if rendered[loc : loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            rendered = rendered[:loc]
        else:
            rendered = rendered[:loc].rstrip()
    return rendered
