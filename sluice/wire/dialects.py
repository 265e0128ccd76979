"""A model's dialects: which tool-call parser and which reasoning parser read its output.

Names are vLLM's (``--tool-call-parser``, ``--reasoning-parser``). The engine names both on the
model card (``sluice.wire.card``): from its flags, else detected here from the chat template, so a
gateway needs no model files to read a model's tool calls or ``<think>`` blocks. The parsers
themselves live in the gateway (``gateway.tool_parsers``, ``gateway.reasoning``), whose
registries hold exactly these names (a unit test checks it). Torch-free and tokenizer-free.
"""

from __future__ import annotations

from collections.abc import Mapping

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
# The format the gateway's default tools prompt teaches a template that does not read `tools`.
DEFAULT_TOOL_CALL_PARSER = "hermes"
REASONING_PARSERS = ("deepseek_r1", "qwen3")
NO_REASONING = "none"  # --reasoning-parser none: no reasoning parser even if the template thinks


def _template_text(chat_template: str | Mapping[str, str] | None) -> str:
    if chat_template is None:
        return ""
    if isinstance(chat_template, str):
        return chat_template
    return "\n".join(chat_template.values())


def detect_tool_call_parser(chat_template: str | Mapping[str, str] | None) -> str | None:
    """The parser a chat template's tool-call format calls for, or None when it shows none.

    The markers are the ones each family's template writes: Mistral ``[TOOL_CALLS]``, Hermes /
    Qwen ``<tool_call>``, Llama 3.2 / 4 pythonic lists (their templates spell out
    ``[func_name1(params_name1=params_value1...``), Llama 3.1 / 3.2 JSON (``<|python_tag|>`` or
    the "parameters" JSON they ask for)."""
    text = _template_text(chat_template)
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<tool_call>" in text:
        return "hermes"
    if "[func_name1(" in text:
        return "pythonic"
    if "<|python_tag|>" in text or ("<|start_header_id|>" in text and '"parameters"' in text):
        return "llama3_json"
    return None


def detect_reasoning_parser(chat_template: str | Mapping[str, str] | None) -> str | None:
    """``deepseek_r1`` for a DeepSeek-R1 (distill) template, ``qwen3`` for another that writes
    ``<think>`` (Qwen3, QwQ), else None."""
    text = _template_text(chat_template)
    if "<think>" not in text and "</think>" not in text:
        return None
    if "<｜Assistant｜>" in text:  # DeepSeek's full-width bars
        return "deepseek_r1"
    return "qwen3"


def check_tool_call_parser(name: str) -> str:
    """``name`` if it is a known tool-call parser, else ``ValueError`` listing the known ones."""
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(TOOL_CALL_PARSERS)}")
    return name


def check_reasoning_parser(name: str) -> str:
    """``name`` if it is a known reasoning parser (or ``none``), else ``ValueError`` listing them."""
    if name != NO_REASONING and name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}, "
                         f"{NO_REASONING}")
    return name


def resolve(chat_template: str | Mapping[str, str] | None, tool_call_parser: str | None = None,
            reasoning_parser: str | None = None) -> tuple[str, str | None]:
    """(tool-call parser, reasoning parser or None) for a model: the names given (checked), else
    what the chat template shows, else Hermes and no reasoning."""
    tools = check_tool_call_parser(tool_call_parser) if tool_call_parser else (
        detect_tool_call_parser(chat_template) or DEFAULT_TOOL_CALL_PARSER)
    if reasoning_parser:
        reasoning = None if check_reasoning_parser(reasoning_parser) == NO_REASONING else reasoning_parser
    else:
        reasoning = detect_reasoning_parser(chat_template)
    return tools, reasoning
