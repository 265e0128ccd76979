"""Structured outputs: the constraint a request's output must follow, and its grammar.

Torch-free, so the gateway and the engine share it. The grammar (``to_grammar``) is
tokenizer-free; ``Vocabulary`` compiles it against a model's vocabulary under the grammar
engine's resource limits (``GRAMMAR_LIMITS``) and walks its shortest completion. The gateway
runs that check before queueing (a 400 naming the parameter, or max_tokens when the shortest
completion does not fit), the engine runs it again (it never trusts the queue) and decodes with
the same compiled grammar (``engine_service.sampling.grammar``).

The library is llguidance (see docs/sampling.md, "Structured outputs", for the measurements
behind the choice): a JSON schema, "any JSON object", a regular expression, a Lark or GBNF
grammar, or a list of choices all become one llguidance grammar string.

Names follow vLLM's ``StructuredOutputsParams``: ``json`` (a schema, as a dict or a JSON string),
``json_object``, ``regex``, ``choice``, ``grammar``; exactly one is set.
"""

from __future__ import annotations

import json as _json
import threading
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


# --- the grammar engine's resource limits and the shortest completion --------------------------
#
# The gateway's check and the engine compile a constraint the same way: against the model's
# vocabulary, under these limits, and then walk its shortest completion from the start. What the
# grammar engine refuses (a grammar too big for its parser, a regex its lexer cannot build, a
# recursion with no finite document) fails there, before anything is queued, as a 400 naming the
# parameter; and the completion's length in tokens is what the constraint needs at the least, so a
# max_tokens below it is refused too. llguidance's error messages dump the parser's state unless
# verbose_errors is off; only their first line is ever shown.

GRAMMAR_LIMITS = {  # llguidance.LLParserLimits (its defaults, written down so both sides read one table)
    "max_items_in_row": 2000,  # alternatives in one grammar row
    "initial_lexer_fuel": 1_000_000,  # work building the lexer's regexes
    "step_lexer_fuel": 200_000,  # lexer work per token mask
    "step_max_items": 50_000,  # Earley items per token
    "max_lexer_states": 250_000,
    "max_grammar_size": 500_000,  # symbols in the grammar's productions
}
# The longest shortest completion searched for, in bytes: a constraint whose smallest document is
# longer is refused (no max_tokens on this server's models would fit it).
MAX_COMPLETION_BYTES = 4096


class GrammarEngineError(RuntimeError):
    """The grammar engine failed on a constraint (a resource limit); the message is its first line."""

    def __init__(self, message: str) -> None:
        super().__init__(_first_line(message))


class ConstraintBudgetError(StructuredOutputError):
    """The constraint cannot be completed within max_tokens (or the context)."""

    def __init__(self, message: str, param: str = "max_tokens") -> None:
        super().__init__(message, param)


def parser_limits():
    import llguidance

    return llguidance.LLParserLimits(**GRAMMAR_LIMITS, verbose_errors=False)


def _first_line(message: str) -> str:
    line = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return line[:300]


def _engine_refused(params: StructuredOutputsParams, message: str, limits: bool = True) -> StructuredOutputError:
    param = f"structured_outputs.{params.kind}"
    what = "exceeds the grammar engine's limits" if limits else "cannot be completed"
    return StructuredOutputError(f"{param} {what}: {_first_line(message)}", param)


# Bytes tried, in order, when walking the shortest completion. Inside a string (a quote and plain
# letters both allowed) the quote comes first: it closes the string. Elsewhere closers come first
# (an empty array or object is the shortest), then separators, the shortest scalars (0, null,
# true), the ends of free text, letters, everything else (a byte taken ``_MAX_RUN`` times in a
# row is passed over once); where none of the first ``_HEAD`` fits,
# the bytes the grammar forces (the rest of a member name) are taken in one go. The first order
# walks alone for ``_FIRST_REACH`` bytes (it ends nearly every walk); failing that, both walk side
# by side and the first to finish wins: each escapes loops the other falls into. The first puts
# separators before scalars and full stops (a number's "0" then "," where "0." would go on
# "0.000..."; free text "a b c" where "a" would go on "aaa..."), the second puts full stops and separators before any letter (free text "a." where "a" would go
# on "aaa...") and reverses the letter and digit runs (``(ab)*c``: "c", where "a" then "b" would).
_LOWER = b"abcdeghijklmopqrsuvwxyz"  # n, t, f come earlier
_UPPER = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _order(*runs: bytes) -> bytes:
    head = b"".join(runs)
    return head + bytes(b for b in range(256) if b not in head)


_ORDERS = (
    _order(b']})"', b",: ", b"0", b"ntf", b"123456789", b".!?\n", _LOWER, _UPPER),
    _order(b']})"0', b".!?\n", b",: ", b"ftn", b"987654321", _LOWER[::-1], _UPPER[::-1]),
)
# After a closer (below) the answer may start with whitespace without end: these orders take it last,
# and a document's opening brace or bracket before any other byte.
_AFTER_CLOSER = tuple(b"{[" + bytes(b for b in order if b not in b" \t\r\n{[") + b" \n" for order in _ORDERS)
_STRING_PROBES = b"aQ#"
_FIRST_REACH = 256  # bytes the first order walks alone before both orders walk side by side
_MAX_RUN = 8  # the same byte this many times in a row: the walk tries another
_CLOSERS = (b"</think>",)  # tags that end free text, tried when no greedy walk ends (see completion_bytes)
_HEAD = 16  # the first bytes of an order, tried before asking the grammar for its forced bytes


class _Walk:
    """One greedy walk over single bytes from a copy of a matcher, a byte per ``step``."""

    def __init__(self, matcher, order: bytes, byte_tokens: dict[int, int]) -> None:
        self.matcher = matcher
        self.order = order
        self.tokens = byte_tokens
        self.path = bytearray()
        self.failed = False

    def _fits(self, b: int) -> bool:
        t = self.tokens.get(b)
        if t is None or self.matcher.try_consume_tokens([t]) != 1:
            return False
        self.matcher.rollback(1)
        return True

    @property
    def done(self) -> bool:
        return self.matcher.is_accepting()

    def _take(self, candidates: bytes) -> bool:
        # a byte chosen _MAX_RUN times in a row is passed over once: a loop of one byte ends
        run = self.path[-_MAX_RUN:]
        repeated = run[-1] if len(run) == _MAX_RUN and run.count(run[-1]) == _MAX_RUN else None
        for b in candidates:
            if b == repeated:
                continue
            t = self.tokens.get(b)
            if t is not None and self.matcher.try_consume_tokens([t]) == 1:
                self.path.append(b)
                return True
        return False

    def _take_forced(self) -> bool:
        """Bytes the grammar forces from here (the rest of a member name, ``": "``) in one go:
        one llguidance call instead of scanning the order byte by byte."""
        forced = self.matcher.compute_ff_bytes()
        tokens = [self.tokens.get(b) for b in forced]
        if not forced or None in tokens:
            return False
        taken = self.matcher.try_consume_tokens(tokens)
        self.path += forced[:taken]
        return taken > 0

    def step(self) -> None:
        m = self.matcher
        if self._fits(34) and any(self._fits(p) for p in _STRING_PROBES):  # inside a string: close it
            done = self._take(b'"')
        else:  # the order's head (closers, scalars, separators), forced bytes, then the rest
            done = self._take(self.order[:_HEAD]) or self._take_forced() or self._take(self.order[_HEAD:])
        self.failed = not done  # no single byte continues here (a multi-byte character would)
        if m.is_error():
            raise GrammarEngineError(m.get_error())


class Vocabulary:
    """A model's vocabulary as the grammar engine sees it, built once per tokenizer (~1 s)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance

        self.eos_token_ids = list(eos_token_ids)
        self.lltokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                  eos_token=self.eos_token_ids or None)
        # the token of each byte that is a token by itself (byte-level BPE: nearly all 256)
        self.byte_tokens: dict[int, int] = {}
        for b in range(256):
            ids = self.lltokenizer.tokenize_bytes(bytes([b]))
            if len(ids) == 1:
                self.byte_tokens[b] = ids[0]
        self._min_tokens: dict[tuple[str, str], int | StructuredOutputError] = {}

    def matcher(self, params: StructuredOutputsParams):
        """A fresh matcher of ``params`` (``llguidance.LLMatcher``) under ``GRAMMAR_LIMITS``;
        raises ``StructuredOutputError`` naming the parameter."""
        import llguidance

        matcher = llguidance.LLMatcher(self.lltokenizer, params.to_grammar(), log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise _engine_refused(params, matcher.get_error())
        return matcher

    # ------------------------------------------------------------------ shortest completion
    def completion_bytes(self, matcher, max_bytes: int = MAX_COMPLETION_BYTES) -> tuple[bytes, bool] | None:
        """The bytes of the shortest completion found from ``matcher``'s state to the end of the
        constraint, and whether the grammar stops by itself there (else EOS must follow); None
        when none is found within ``max_bytes``; ``GrammarEngineError`` when the grammar engine
        fails on the way (a resource limit). ``matcher`` is left as it was (the walks run on
        copies).

        Greedy walks over single bytes in fixed orders of preference (``_ORDERS``): not a proof of
        minimality, but for JSON it closes the open
        string, empties every open array and object it may, and fills each required member with
        its shortest value."""
        found = self._greedy(matcher, max_bytes)
        if found is not None:
            return found
        # Free text that ends only at a tag (the reasoning block a reasoning parser wraps around a
        # constraint: any byte fits, so a greedy walk never spells the tag): close it, then walk.
        for closer in _CLOSERS:
            probe = matcher.deep_copy()
            tokens = [self.byte_tokens.get(b) for b in closer]
            if None in tokens or probe.try_consume_tokens(tokens) != len(tokens):
                continue
            found = self._greedy(probe, max_bytes - len(closer), _AFTER_CLOSER)
            if found is not None:
                return closer + found[0], found[1]
        return None

    def _greedy(self, matcher, max_bytes: int, all_orders: tuple[bytes, ...] = _ORDERS) -> tuple[bytes, bool] | None:
        # The first order alone (it ends most walks, at half the cost of two), within a short
        # reach; then both side by side, the first to end winning.
        for orders, reach in ((all_orders[:1], min(max_bytes, _FIRST_REACH)), (all_orders, max_bytes)):
            walks = [_Walk(matcher.deep_copy(), order, self.byte_tokens) for order in orders]
            while walks:
                for walk in walks:
                    if walk.done:
                        return bytes(walk.path), walk.matcher.is_stopped()
                if len(walks[0].path) >= reach:
                    break
                for walk in walks:
                    walk.step()
                walks = [w for w in walks if not w.failed]
        return None

    def shortest_completion(self, matcher, max_bytes: int = MAX_COMPLETION_BYTES) -> list[int] | None:
        """``completion_bytes`` as the model's tokens, EOS last when the grammar needs it."""
        found = self.completion_bytes(matcher, max_bytes)
        if found is None:
            return None
        path, stopped = found
        tokens = self.lltokenizer.tokenize_bytes(path) if path else []
        if matcher.validate_tokens(tokens) != len(tokens):  # a tokenization the grammar splits differently
            tokens = [self.byte_tokens[b] for b in path]
        if not stopped and self.eos_token_ids:
            tokens.append(self.eos_token_ids[0])
        return tokens

    def min_tokens(self, params: StructuredOutputsParams) -> int:
        """The length in tokens of ``params``'s shortest completion from the start (cached by
        constraint). Raises ``StructuredOutputError`` naming the constraint's parameter when the
        grammar engine refuses it or no completion exists within ``MAX_COMPLETION_BYTES``."""
        key = params.key
        cached = self._min_tokens.get(key)
        if cached is None:
            try:
                tokens = self.shortest_completion(self.matcher(params))
                cached = len(tokens) if tokens is not None else _engine_refused(
                    params, f"no completion within {MAX_COMPLETION_BYTES} bytes (a recursion without end, "
                            "or a smallest document longer than that)", limits=False)
            except GrammarEngineError as exc:
                cached = _engine_refused(params, str(exc))
            except StructuredOutputError as exc:
                cached = exc
            self._min_tokens[key] = cached
            while len(self._min_tokens) > 256:
                self._min_tokens.pop(next(iter(self._min_tokens)))
        if isinstance(cached, StructuredOutputError):
            raise cached
        return cached

    def check(self, params: StructuredOutputsParams, max_tokens: int | None) -> int:
        """The door's check of a constraint (gateway and engine alike): compiled under
        ``GRAMMAR_LIMITS`` and walked to its shortest completion. Returns that completion's
        length in tokens; raises ``StructuredOutputError`` naming the constraint's parameter
        (``min_tokens``), or ``ConstraintBudgetError`` naming max_tokens when the completion
        does not fit in ``max_tokens``."""
        need = self.min_tokens(params)
        if max_tokens is not None and need > max_tokens:
            raise ConstraintBudgetError(
                f"max_tokens ({max_tokens}) is too small for the output constraint: its shortest "
                f"completion takes {need} tokens")
        return need


_VOCABULARIES: dict[str, Vocabulary] = {}
_VOCABULARIES_LOCK = threading.Lock()


def vocabulary_for(key: str, tokenizer_json: Any, vocab_size: int, eos_token_ids: list[int]) -> Vocabulary:
    """The ``Vocabulary`` of a model, built once per ``key`` (a model card's fingerprint) and kept
    for the last four models. ``tokenizer_json``: the tokenizer's JSON, or a callable returning it
    (called only to build)."""
    with _VOCABULARIES_LOCK:
        vocab = _VOCABULARIES.get(key)
        if vocab is None:
            text = tokenizer_json() if callable(tokenizer_json) else tokenizer_json
            vocab = _VOCABULARIES[key] = Vocabulary(text, vocab_size, eos_token_ids)
            while len(_VOCABULARIES) > 4:
                _VOCABULARIES.pop(next(iter(_VOCABULARIES)))
        return vocab
