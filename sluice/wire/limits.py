"""The limits on a request, written once: :data:`TABLE` holds every bound a request's parameters
must keep, with the message that names the parameter, and the rules that need the model (token ids
inside the vocabulary, the context length) are the functions below. Everyone takes them from here:

- the gateway's pydantic models (``gateway/protocol.py``: the bounds in ``/openapi.json`` and the
  400 naming the field),
- the gateway's last check of the wire message before it queues it, and the engine's re-check of
  what it reads from the queue (:func:`check_request`; anything that can XADD can put an entry
  there), which the engine answers with an error event and an acknowledgement, never a stall,
- the offline API's ``SamplingParams`` (``ValueError`` naming the field) and the scheduler's door.

Changing a limit is editing its one line in :data:`TABLE`. A :class:`Bound` is a number's range; a
:class:`Size` a list's (or a mapping's) number of entries and, for strings, their total length.
``layers`` says where a limit can be broken: ``stop`` strings never cross the wire (the gateway and
the offline ``LLM`` match them on text), a ``seed`` outside int64 cannot be put on it.

Every check costs at most what its limit allows: a size is compared before any entry is read, and
the entries are then read only up to the limit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from sluice.wire import tenants
from sluice.wire.error_codes import Code
from sluice.wire.messages_pb2 import GenerateRequest

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

HTTP, OFFLINE, ENGINE = "http", "offline", "engine"
ALL_LAYERS = frozenset({HTTP, OFFLINE, ENGINE})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e18 else f"{x:g}"


@dataclass(frozen=True)
class Bound:
    """A number's range, ``[low, high]`` (``(low, high]`` when ``low_open``)."""

    param: str
    low: float
    high: float
    integer: bool = False
    low_open: bool = False
    note: str = ""  # what the message adds, e.g. "-1 or 0 disables"
    layers: frozenset[str] = ALL_LAYERS

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        rng = f"{'(' if self.low_open else '['}{_fmt(self.low)}, {_fmt(self.high)}]"
        return f"{kind} in {rng}" + (f" ({self.note})" if self.note else "")

    def problem(self, value: Any, param: str | None = None) -> str | None:
        """None when ``value`` keeps the bound, else the message (naming ``param``, or this bound's)."""
        ok_type = _is_int(value) if self.integer else _is_real(value) and math.isfinite(value)
        if ok_type and (self.low < value if self.low_open else self.low <= value) and value <= self.high:
            return None
        return f"{param or self.param} must be {self.describe()}, got {value!r}"

    def check(self, value: Any, param: str | None = None) -> Problem | None:
        """:meth:`problem` as a :class:`Problem` (``invalid_request`` naming the parameter)."""
        problem = self.problem(value, param)
        return None if problem is None else invalid(param or self.param, problem)


@dataclass(frozen=True)
class Size:
    """A list's (or a mapping's) number of entries, and for strings their total length."""

    param: str
    max_items: int
    max_chars: int | None = None
    layers: frozenset[str] = ALL_LAYERS
    unit: str = "entries"

    def problem(self, items: Any, param: str | None = None) -> str | None:
        """None when ``items`` (a sized collection) is within the limit, else the message. Reads at
        most ``max_items`` entries."""
        name = param or self.param
        if len(items) > self.max_items:
            return f"{name} may have at most {self.max_items} {self.unit}, got {len(items)}"
        if self.max_chars is not None:
            total = 0
            for s in items:
                total += len(s)
                if total > self.max_chars:
                    return f"{name} may have at most {self.max_chars} characters in all, got more"
        return None

    def check(self, items: Any, param: str | None = None) -> Problem | None:
        problem = self.problem(items, param)
        return None if problem is None else invalid(param or self.param, problem)

    def count_problem(self, count: int, param: str | None = None, *, at_least: bool = False) -> str | None:
        """:meth:`problem` for a number of entries counted apart (``at_least``: the count stopped at
        the first one over the limit)."""
        if count <= self.max_items:
            return None
        got = f"more than {self.max_items}" if at_least else str(count)
        return f"{param or self.param} may have at most {self.max_items} {self.unit}, got {got}"


@dataclass(frozen=True)
class Depth:
    """How deep a value may nest: objects and arrays inside one another, counted from the value
    itself (a flat object is 1, a string 0)."""

    param: str
    max_levels: int
    layers: frozenset[str] = ALL_LAYERS

    def problem(self, value: Any, param: str | None = None) -> tuple[str, str] | None:
        """None when ``value`` nests at most ``max_levels`` deep, else (the path of the first value
        found too deep, from ``param``; the message naming it). Reads each container once at most,
        and stops at the first one too deep: no recursion, whatever the depth."""
        name = param or self.param
        stack: list[tuple[Any, int, tuple]] = [(value, 0, ())]
        while stack:
            v, depth, path = stack.pop()
            if not isinstance(v, dict | list):
                continue
            depth += 1
            if depth > self.max_levels:
                where = name + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path[:_PATH_SHOWN])
                return where, (f"{where if len(path) <= _PATH_SHOWN else where + '...'} nests objects and arrays "
                               f"more than {self.max_levels} levels deep; at most {self.max_levels} are allowed")
            items = v.items() if isinstance(v, dict) else enumerate(v)
            stack.extend((child, depth, (*path, key)) for key, child in items if isinstance(child, dict | list))
        return None


_PATH_SHOWN = 3  # the path a Depth problem names: the parameter and its first steps (the rest is "...")


# --- the table ---------------------------------------------------------------------------------
# The sampling parameters' names are vLLM's SamplingParams' (and the wire's); the HTTP API names
# them the same (chat's ``top_logprobs`` and ``max_completion_tokens`` are ``logprobs`` and
# ``max_tokens`` under another name).

N = Bound("n", 1, 16, integer=True)  # completions per request: each is a sequence the engine runs
TEMPERATURE = Bound("temperature", 0.0, 2.0)
TOP_P = Bound("top_p", 0.0, 1.0, low_open=True)
TOP_K = Bound("top_k", -1, INT32_MAX, integer=True, note="-1 or 0 disables")
MIN_P = Bound("min_p", 0.0, 1.0)
PRESENCE_PENALTY = Bound("presence_penalty", -2.0, 2.0)
FREQUENCY_PENALTY = Bound("frequency_penalty", -2.0, 2.0)
REPETITION_PENALTY = Bound("repetition_penalty", 0.0, 100.0, low_open=True)
SEED = Bound("seed", INT64_MIN, INT64_MAX, integer=True, layers=frozenset({HTTP, OFFLINE}))  # int64 on the wire
# (/v1/completions also takes max_tokens 0 with echo: the prompt alone, scored, as vLLM answers a
# loglikelihood request; the engine runs one token, which the answer leaves out)
MAX_TOKENS = Bound("max_tokens", 1, INT32_MAX, integer=True)
MIN_TOKENS = Bound("min_tokens", 0, INT32_MAX, integer=True)  # and at most max_tokens
LOGPROBS = Bound("logprobs", 0, 20, integer=True)  # alternatives per generated position
PROMPT_LOGPROBS = Bound("prompt_logprobs", 0, 20, integer=True, layers=frozenset({OFFLINE, ENGINE}))
LOGIT_BIAS_VALUE = Bound("logit_bias", -100.0, 100.0)  # each bias
LOGIT_BIAS = Size("logit_bias", 1024)
STOP_TOKEN_IDS = Size("stop_token_ids", 256)
# Stop strings are matched on every text delta of every completion: their number and total length
# bound that work (they are text: never on the wire).
STOP = Size("stop", 64, max_chars=4096, layers=frozenset({HTTP, OFFLINE}))
PROMPTS = Size("prompt", 64, layers=frozenset({HTTP}))  # prompts in one /v1/completions request
REQUEST_ID = Size("request_id", 256, layers=frozenset({ENGINE}), unit="characters")  # a string

TABLE: tuple[Bound | Size, ...] = (
    N, TEMPERATURE, TOP_P, TOP_K, MIN_P, PRESENCE_PENALTY, FREQUENCY_PENALTY, REPETITION_PENALTY, SEED,
    MAX_TOKENS, MIN_TOKENS, LOGPROBS, PROMPT_LOGPROBS, LOGIT_BIAS_VALUE, LOGIT_BIAS, STOP_TOKEN_IDS, STOP,
    PROMPTS, REQUEST_ID,
)

# The Responses and Conversations APIs' own limits (OpenAI's): ``metadata`` pairs and their
# lengths, the page of ``GET /v1/responses/{id}/input_items`` and ``/v1/conversations/{id}/items``,
# the items one conversation request adds. Not in TABLE: no sampling parameter, HTTP only.
RESPONSE_METADATA = Size("metadata", 16, layers=frozenset({HTTP}))
RESPONSE_METADATA_KEY_CHARS = 64
RESPONSE_METADATA_VALUE_CHARS = 512
INPUT_ITEMS_PAGE = Bound("limit", 1, 100, integer=True, layers=frozenset({HTTP}))
CONVERSATION_ITEMS = Size("items", 20, layers=frozenset({HTTP}))
# A response's function calls (``max_tool_calls``): the output keeps the first ones.
MAX_TOOL_CALLS = Bound("max_tool_calls", 1, INT32_MAX, integer=True, layers=frozenset({HTTP}))

# How deep any request parameter's value may nest (a tool's parameters schema, a response format's
# schema, ``structured_outputs``, ``chat_template_kwargs``, a message's tool calls, input items):
# checked on the parsed body before anything else is done with it (``gateway/body_shape.py``; the
# request models check it again for a body that reaches them another way). The gateway serializes a request
# (its event-log record, a stored response) and compiles schemas by recursion, which a value nested
# some 250 levels breaks (a 500 where a 400 naming the parameter is due); 64 leaves a JSON schema
# some 30 levels of its own, three times OpenAI's limit for structured outputs.
NESTING = Depth("nesting", 64, layers=frozenset({HTTP}))

# The shape of a request body, checked on the parsed JSON before any model walks it or any work is
# spent on it (``gateway/body_shape.py``): what one body can make a gateway build, walk and send
# between processes, whatever the body size limit. The counts are per request (``content`` per
# message, input item or function output). HTTP only.
_BODY = frozenset({HTTP})
BODY_VALUES = Size("the request body", 262_144, layers=_BODY, unit="JSON values")
MESSAGES = Size("messages", 2048, layers=_BODY)  # chat messages (and /tokenize's)
INPUT_ITEMS = Size("input", 2048, layers=_BODY)  # Responses API input items
CONTENT_PARTS = Size("content", 256, layers=_BODY)  # parts of one message's content
TOOLS = Size("tools", 128, layers=_BODY)  # OpenAI's own limit on functions
BODY_SHAPE: tuple[Size, ...] = (BODY_VALUES, MESSAGES, INPUT_ITEMS, CONTENT_PARTS, TOOLS)  # and NESTING

# The scalar sampling parameters and their bounds, by name (logit_bias's values are checked apart).
SCALARS: dict[str, Bound] = {
    b.param: b for b in TABLE if isinstance(b, Bound) and b is not LOGIT_BIAS_VALUE
}

# The parameters a model's generation_config.json may default (vLLM's ``--generation-config auto``),
# with the neutral value used when neither the request nor the model sets them.
MODEL_DEFAULTS: dict[str, float | int] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
}


# --- the rules -----------------------------------------------------------------------------------

EMPTY_PROMPT = "the prompt is empty: at least one token is needed"


class Problem(NamedTuple):
    """Why a request is refused: the error code, the message, the parameter it names."""

    code: Code
    message: str
    param: str | None = None


def invalid(param: str | None, message: str) -> Problem:
    return Problem(Code.INVALID_REQUEST, message, param)


def check_sampling(values: Mapping[str, Any]) -> Problem | None:
    """The bounds of every sampling parameter ``values`` sets (None: unset), in the table's order,
    and ``min_tokens <= max_tokens``. ``stop`` is checked when present (offline and HTTP only)."""
    for name, bound in SCALARS.items():
        value = values.get(name)
        if value is not None and (problem := bound.problem(value)):
            return invalid(name, problem)
    max_tokens, min_tokens = values.get("max_tokens"), values.get("min_tokens") or 0
    if max_tokens is not None and min_tokens > max_tokens:
        return invalid("min_tokens", f"min_tokens must be at most max_tokens ({max_tokens}), got {min_tokens}")
    for size, name in ((LOGIT_BIAS, "logit_bias"), (STOP_TOKEN_IDS, "stop_token_ids"), (STOP, "stop")):
        items = values.get(name)
        if items is not None and (problem := size.problem(items)):
            return invalid(name, problem)
    for value in (values.get("logit_bias") or {}).values():
        if problem := LOGIT_BIAS_VALUE.problem(value):
            return invalid("logit_bias", problem)
    return None


def check_token_ids(param: str, ids: Iterable[int], vocab_size: int | None) -> Problem | None:
    """Every id of ``param`` inside the vocabulary ``[0, vocab_size)`` (not checked when unknown)."""
    if vocab_size is None:
        return None
    for t in ids:
        if not 0 <= t < vocab_size:
            return invalid(param, f"{param} token id {t} is out of the vocabulary [0, {vocab_size})")
    return None


def check_prompt(prompt_ids: Any, vocab_size: int | None, param: str = "prompt") -> Problem | None:
    """The prompt has a token and only ids of the vocabulary (when ``vocab_size`` is known)."""
    if not len(prompt_ids):
        return invalid(param, EMPTY_PROMPT)
    return check_token_ids(param, prompt_ids, vocab_size)


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int,
                  param: str = "prompt") -> Problem | None:
    """The context-length rule: the prompt plus ``max_tokens`` fits the model's context; with no
    ``max_tokens`` (up to the context) the prompt leaves room for one token at least. The message
    keeps OpenAI's words ("maximum context length"), which clients look for."""
    if max_tokens is None:
        if prompt_len < max_model_len:
            return None
        detail = f"your {param} has {prompt_len} tokens, which leaves no room for the completion"
    else:
        if prompt_len + max_tokens <= max_model_len:
            return None
        detail = (f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the {param}, "
                  f"{max_tokens} for the completion)")
    return Problem(Code.CONTEXT_LENGTH_EXCEEDED,
                   f"This model's maximum context length is {max_model_len} tokens. However, {detail}. "
                   f"Please reduce the length of the {param} or the completion.", param)


def check_context_chars(chars: int, max_chars_per_token: int | None, max_model_len: int,
                        param: str = "prompt") -> Problem | None:
    """The context-length rule on a text before it is tokenized: ``chars`` characters are at least
    ``ceil(chars / max_chars_per_token)`` tokens (``sluice.text.chars_per_token``), refused with
    ``context_length_exceeded`` when that many leave no room for a completion token; None when the
    text might fit (or no bound is known): it must then be tokenized, and :func:`check_context`
    decides with its ``max_tokens``. The text tokenized is at most ``max_chars_per_token`` characters
    per token of the context."""
    if not max_chars_per_token:
        return None
    at_least = -(-chars // max_chars_per_token)
    if at_least < max_model_len:
        return None
    return Problem(Code.CONTEXT_LENGTH_EXCEEDED,
                   f"This model's maximum context length is {max_model_len} tokens. However, your {param} "
                   f"is {chars} characters, which is at least {at_least} tokens (a token of this model covers "
                   f"at most {max_chars_per_token} characters), leaving no room for the completion. Please "
                   f"reduce the length of the {param}.", param)


def check_request(req: GenerateRequest, *, vocab_size: int | None, max_model_len: int | None) -> Problem | None:
    """The :class:`Problem` for which ``req`` (a wire message) must be refused, else None.

    Costs O(prompt + stop ids + bias), each bounded by the table before it is read, and nothing
    per completion: an entry with ``n = 2**32 - 1`` is refused at once."""
    if problem := REQUEST_ID.problem(req.request_id):
        return invalid("request_id", problem)
    if problem := tenants.check_tenant_id(req.tenant):
        return invalid("tenant", problem)
    if req.tenant_weight and (problem := tenants.check_weight(req.tenant_weight)):
        return invalid("tenant_weight", problem)
    p = req.params
    values: dict[str, Any] = {name: getattr(p, name) for name in SCALARS
                              if name != "min_tokens" and p.HasField(name)}
    values["min_tokens"] = p.min_tokens
    values["logit_bias"] = p.logit_bias
    values["stop_token_ids"] = p.stop_token_ids
    if problem := check_sampling(values):
        return problem
    if problem := check_prompt(req.prompt_token_ids, vocab_size):
        return problem
    for param, ids in (("stop_token_ids", p.stop_token_ids), ("logit_bias", p.logit_bias.keys())):
        if problem := check_token_ids(param, ids, vocab_size):
            return problem
    if max_model_len is not None:
        return check_context(len(req.prompt_token_ids), p.max_tokens if p.HasField("max_tokens") else None,
                             max_model_len)
    return None
