"""Structured outputs: the constraint a request's output must follow, and its grammar.

Torch-free and tokenizer-free, so the gateway and the engine share it: the gateway checks a
constraint compiles (a 400 naming the parameter before anything is queued), the engine checks
again (it never trusts the queue) and compiles the grammar against its vocabulary
(``engine_service.sampling.grammar``).

The library is llguidance (see docs/sampling.md, "Structured outputs", for the measurements
behind the choice): a JSON schema, "any JSON object", a regular expression, a Lark or GBNF
grammar, or a list of choices all become one llguidance grammar string.

Names follow vLLM's ``StructuredOutputsParams``: ``json`` (a schema, as a dict or a JSON string),
``json_object``, ``regex``, ``choice``, ``grammar``; exactly one is set.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

# JSON is generated without free whitespace: a small model offered "any whitespace" can emit
# newlines forever. Separators are the ones json.dumps writes by default.
JSON_DEFAULTS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


@dataclass(frozen=True)
class JsonObjectLimits:
    """The bounds of ``json_object`` ("any JSON object", OpenAI's JSON mode).

    An unbounded "any object" grammar never forces an end: a model caught in a loop (the same
    array item or member again and again, a string that repeats a fragment) is always allowed to
    go on, and stops only at ``max_tokens``, cut mid-document. With every container and string
    bounded, the grammar itself closes the loop: after ``max_items`` items it allows only ``]``,
    after ``max_members`` members only ``}``, after ``max_string_chars`` characters only ``"``,
    and past ``max_depth`` nested containers only scalars (and ``{}`` / ``[]``). A ``json_schema``
    (even ``{"type": "object"}``) is never bounded this way: it means what its author wrote.
    """

    max_depth: int = 5  # nested containers, the top-level object included
    max_members: int = 16  # members per object
    max_items: int = 32  # items per array
    max_string_chars: int = 256  # characters of a string value (an escape counts as one)
    max_key_chars: int = 64  # characters of a member name
    max_int_digits: int = 16  # digits before the point; as many after it; exponent: 3


JSON_OBJECT_LIMITS = JsonObjectLimits()  # read when the grammar is first compiled (then cached)


def json_object_grammar(limits: JsonObjectLimits | None = None) -> str:
    """The Lark grammar (llguidance's dialect) of a bounded JSON object (``JSON_OBJECT_LIMITS``
    unless ``limits`` is given), written the way ``JSON_DEFAULTS`` writes JSON: no free whitespace,
    ``", "`` and ``": "`` separators."""
    limits = limits or JSON_OBJECT_LIMITS
    if min(limits.max_depth, limits.max_members, limits.max_items, limits.max_string_chars,
           limits.max_key_chars, limits.max_int_digits) < 1:
        raise ValueError("every JsonObjectLimits bound must be at least 1")
    scalars = 'string | NUMBER | "true" | "false" | "null"'
    lines = ["start: object0"]
    for depth in range(limits.max_depth):
        inner = f"value{depth + 1}"
        if depth + 1 < limits.max_depth:
            lines.append(f"{inner}: object{depth + 1} | array{depth + 1} | {scalars}")
        else:  # the deepest level: only scalars and empty containers
            lines.append(f'{inner}: {scalars} | "{{}}" | "[]"')
        lines.append(f'object{depth}: "{{" [key ": " {inner} (", " key ": " {inner}){{0,{limits.max_members - 1}}}] "}}"')
        if depth > 0:
            lines.append(f'array{depth}: "[" [{inner} (", " {inner}){{0,{limits.max_items - 1}}}] "]"')
    digits = limits.max_int_digits
    lines += [
        f'string: %json {{"type": "string", "maxLength": {limits.max_string_chars}}}',
        f'key: %json {{"type": "string", "maxLength": {limits.max_key_chars}}}',
        f"NUMBER: /-?(0|[1-9][0-9]{{0,{digits - 1}}})(\\.[0-9]{{1,{digits}}})?([eE][+-]?[0-9]{{1,3}})?/",
    ]
    return "\n".join(lines) + "\n"


KINDS = ("json", "json_object", "regex", "choice", "grammar")
_MAX_SPEC_CHARS = 1 << 20


class StructuredOutputError(ValueError):
    """A constraint that is malformed or does not compile. ``param`` names the request field."""

    def __init__(self, message: str, param: str = "structured_outputs") -> None:
        super().__init__(message)
        self.param = param


@dataclass
class StructuredOutputsParams:
    """Exactly one of the fields is set. ``json`` may be a dict (a schema) or its JSON text."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        if self.json_object is False:
            self.json_object = None
        set_fields = [k for k in KINDS if getattr(self, k) is not None]
        if len(set_fields) != 1:
            raise StructuredOutputError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                f"got {', '.join(set_fields) or 'none'}"
            )
        kind = set_fields[0]
        if kind == "json":
            if isinstance(self.json, dict):
                self.json = _json.dumps(self.json)  # property order matters: it is the generation order
            elif isinstance(self.json, bool) or not isinstance(self.json, str):
                raise StructuredOutputError(
                    f"structured_outputs.json must be a JSON schema (object), got {type(self.json).__name__}"
                )
            else:
                try:
                    schema = _json.loads(self.json)
                except ValueError as exc:
                    raise StructuredOutputError(f"structured_outputs.json is not valid JSON: {exc}") from None
                if not isinstance(schema, dict | bool):
                    raise StructuredOutputError("structured_outputs.json must be a JSON schema (an object)")
        elif kind == "json_object":
            if self.json_object is not True:
                raise StructuredOutputError("structured_outputs.json_object must be true or false")
        elif kind == "choice":
            if (not isinstance(self.choice, list | tuple) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise StructuredOutputError("structured_outputs.choice must be a non-empty list of strings")
            self.choice = list(self.choice)
        else:
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise StructuredOutputError(f"structured_outputs.{kind} must be a non-empty string")
        if len(self.spec) > _MAX_SPEC_CHARS:
            raise StructuredOutputError(f"structured_outputs.{kind} is longer than {_MAX_SPEC_CHARS} characters")

    @classmethod
    def from_dict(cls, value: Any, param: str = "structured_outputs") -> StructuredOutputsParams:
        """From a request body's ``structured_outputs`` object (unknown keys are refused)."""
        if isinstance(value, StructuredOutputsParams):
            return value
        if not isinstance(value, dict):
            raise StructuredOutputError(f"{param} must be an object", param)
        unknown = sorted(set(value) - set(KINDS) - {"disable_any_whitespace", "whitespace_pattern"})
        if unknown:
            raise StructuredOutputError(
                f"{param} has unsupported key(s) {', '.join(unknown)}; supported: {', '.join(KINDS)}", param
            )
        try:
            return cls(**{k: value[k] for k in KINDS if k in value and value[k] is not None})
        except StructuredOutputError as exc:
            raise StructuredOutputError(str(exc).replace("structured_outputs", param), param) from None

    # --- views ---
    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def spec(self) -> str:
        """The constraint as one string (the wire form): schema JSON, regex, grammar, choices JSON."""
        kind = self.kind
        if kind == "json_object":
            return ""
        if kind == "choice":
            return _json.dumps(self.choice)
        return getattr(self, kind)

    @property
    def key(self) -> tuple[str, str]:
        """The compiled-grammar cache key."""
        return self.kind, self.spec

    @classmethod
    def from_kind(cls, kind: str, spec: str) -> StructuredOutputsParams:
        if kind not in KINDS:
            raise StructuredOutputError(f"unknown structured output kind {kind!r}")
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "choice":
            try:
                choices = _json.loads(spec)
            except ValueError:
                raise StructuredOutputError("structured_outputs.choice is not a JSON list") from None
            return cls(choice=choices)
        return cls(**{kind: spec})

    def to_grammar(self) -> str:
        """The llguidance grammar; raises ``StructuredOutputError`` when it does not compile."""
        return compile_grammar(self.kind, self.spec)


@lru_cache(maxsize=256)
def compile_grammar(kind: str, spec: str) -> str:
    """The llguidance grammar of a constraint, checked (tokenizer-free). Cached by (kind, spec)."""
    import llguidance

    param = f"structured_outputs.{kind}"
    try:
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_DEFAULTS)
        elif kind == "json_object":
            grammar = llguidance.grammar_from("lark", json_object_grammar())
        elif kind == "regex":
            grammar = llguidance.grammar_from("regex", spec)
        elif kind == "choice":
            grammar = llguidance.grammar_from("choice", spec)
        elif kind == "grammar":
            grammar = llguidance.grammar_from("grammar", spec)
        else:
            raise StructuredOutputError(f"unknown structured output kind {kind!r}")
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except StructuredOutputError:
        raise
    except Exception as exc:  # llguidance raises ValueError / RuntimeError with its own message
        raise StructuredOutputError(f"{param} does not compile: {exc}", param) from None
    if error:
        raise StructuredOutputError(f"{param} does not compile: {error.strip()}", param)
    return grammar
