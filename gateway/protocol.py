"""OpenAI request bodies as pydantic models (plus vLLM's sampling extensions).

The request models come first, then the response and stream-chunk models.

Field ranges are checked here so that FastAPI's validation (answered as a 400 naming the
parameter, see ``errors.py``) refuses them; checks that need the model card (vocabulary size,
context length) happen in ``serving*.py``. Unknown fields are ignored, as vLLM does.

Validation is STRICT (``ConfigDict(strict=True)``): an integer field takes a JSON integer only, not
``true`` (pydantic's lax mode read it as 1), ``"5"`` or ``5.0``; a number field takes integers and
floats but not booleans or strings; a boolean takes ``true``/``false`` only. Where a union's first
branch would produce a misleading message ("Input should be a valid string" for a prompt ``[-1]``
or an ``image_url`` content part), a wrap validator says what is wrong.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from gateway.errors import PARAM_CTX, json_type
from sluice.wire import limits
from sluice.wire.limits import INT32_MAX

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


def limited(tp: Any, bound: limits.Bound | limits.Size, param: str | None = None) -> Any:
    """``tp`` kept within a bound of ``sluice.wire.limits``' table: refused with the table's message
    (a 400 naming the field, see ``errors.py``), and documented in ``/openapi.json``."""

    def check(value: Any) -> Any:
        if value is not None:
            items = [value] if isinstance(bound, limits.Size) and isinstance(value, str) else value
            problem = bound.problem(items, param)
            if problem is not None:
                raise PydanticCustomError("limit", problem)
        return value

    if isinstance(bound, limits.Bound):
        schema = {"exclusiveMinimum" if bound.low_open else "minimum": bound.low, "maximum": bound.high}
    else:
        key = {list: "maxItems", dict: "maxProperties"}.get(get_origin(tp))
        schema = {key: bound.max_items} if key else {}
    return Annotated[tp, AfterValidator(check), Field(json_schema_extra=schema)]


# The sampling fields' types, bounded by the table (chat's names for two of them).
N = limited(int, limits.N)
Temperature = limited(float, limits.TEMPERATURE)
TopP = limited(float, limits.TOP_P)
TopK = limited(int, limits.TOP_K)
MinP = limited(float, limits.MIN_P)
PresencePenalty = limited(float, limits.PRESENCE_PENALTY)
FrequencyPenalty = limited(float, limits.FREQUENCY_PENALTY)
RepetitionPenalty = limited(float, limits.REPETITION_PENALTY)
Seed = limited(int, limits.SEED)
MaxTokens = limited(int, limits.MAX_TOKENS)


def _max_tokens_or_0(value: int) -> int:
    """``limits.MAX_TOKENS``, or 0 (completions with echo: checked with the body)."""
    if value != 0 and (problem := limits.MAX_TOKENS.problem(value)) is not None:
        raise PydanticCustomError("limit", problem)
    return value


CompletionMaxTokens = Annotated[int, AfterValidator(_max_tokens_or_0),
                                Field(json_schema_extra={"minimum": 0, "maximum": limits.MAX_TOKENS.high})]
MaxCompletionTokens = limited(int, limits.MAX_TOKENS, "max_completion_tokens")
MinTokens = limited(int, limits.MIN_TOKENS)
Logprobs = limited(int, limits.LOGPROBS)
TopLogprobs = limited(int, limits.LOGPROBS, "top_logprobs")
LogitBias = limited(dict[str, limited(float, limits.LOGIT_BIAS_VALUE)], limits.LOGIT_BIAS)
StopTokenIds = limited(list[TokenId], limits.STOP_TOKEN_IDS)
Stop = limited(str | list[str], limits.STOP)

# Every request model: unknown fields ignored (as vLLM), no type coercion (see the module doc).
REQUEST_CONFIG = ConfigDict(extra="ignore", strict=True)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _prompt_problem(v: Any) -> str | None:
    """What is wrong with a ``prompt`` that matched none of its forms (None: no better words)."""
    shape = ("'prompt' must be a string, a list of strings, a list of token ids (integers) or a list of "
             "lists of token ids")
    if not isinstance(v, list):
        return shape
    lists = v if v and all(isinstance(x, list) for x in v) else [v]
    for i, ids in enumerate(lists):
        if any(isinstance(x, str) for x in ids) and len(lists) == 1:
            return None if all(isinstance(x, str) for x in ids) else shape
        for j, t in enumerate(ids):
            where = f"prompt[{i}][{j}]" if lists is v else f"prompt[{j}]"
            if not _is_int(t):
                return f"{shape}; {where} is {json_type(t)}"
            if not 0 <= t <= INT32_MAX:
                return f"token ids must be between 0 and {INT32_MAX}; {where} is {t}"
    return None


def refuse(why: str) -> PydanticCustomError:
    """A value Sluice does not serve, and why (a 400 naming the field)."""
    return PydanticCustomError("unsupported_value", "{why}", {"why": why})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = False
    include_obfuscation: bool | None = None

    @field_validator("include_obfuscation")
    @classmethod
    def _no_obfuscation(cls, v: bool | None) -> bool | None:
        if v:
            raise refuse("Sluice does not obfuscate its streams; only false is accepted")
        return v


def check_service_tier(v: str | None) -> str | None:
    if v not in (None, "auto", "default"):
        raise refuse(f"Sluice serves every request in one tier; only 'auto' and 'default' are accepted, got {v!r}")
    return v


def check_nesting(data: Any) -> Any:
    """Each parameter of a request body within ``limits.NESTING``, checked before any field is
    validated or used (a 400 naming the path where it nests too deep)."""
    if isinstance(data, dict):
        for name, value in data.items():
            found = limits.NESTING.problem(value, str(name))
            if found is not None:
                raise PydanticCustomError("nesting", "{message}", {"message": found[1], PARAM_CTX: found[0]})
    return data


# A request body's own parameters: one it does not have is refused (OpenAI's "Unknown parameter");
# the objects inside it keep REQUEST_CONFIG (a message a client sends back may carry more fields).
BODY_CONFIG = ConfigDict(extra="forbid", strict=True)


class RequestBody(BaseModel):
    """A request body. Nothing in it is silently ignored: a parameter it does not have is a 400
    ``unknown_parameter``, one of OpenAI's it does not serve (``UNSUPPORTED``: name -> why) a 400
    ``unsupported_parameter`` saying why (a null is the default: accepted). Each parameter nests at
    most ``limits.NESTING`` deep. All checked before any field is validated or used."""

    model_config = BODY_CONFIG
    UNSUPPORTED: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _body(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, why in cls.UNSUPPORTED.items():
                if data.get(name) is not None:
                    raise PydanticCustomError("unsupported_parameter", "{why}", {"why": why, PARAM_CTX: name})
        return check_nesting(data)


class SamplingFields(RequestBody):
    """Parameters /v1/completions and /v1/chat/completions share."""

    model: str
    n: N = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    seed: Seed | None = None
    presence_penalty: PresencePenalty | None = None
    frequency_penalty: FrequencyPenalty | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None
    max_tokens: MaxTokens | None = None
    # vLLM extensions
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: MinTokens = 0
    ignore_eos: bool = False
    stop_token_ids: StopTokenIds | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured outputs: OpenAI's response_format and vLLM's structured_outputs (checked in
    # gateway/tools.py, so that an unknown type is a 400 with our own message)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    UNSUPPORTED: ClassVar[dict[str, str]] = {
        "suffix": "is not supported: Sluice completes a prompt, it does not insert between a prefix and a suffix",
    }

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    # 0 with echo: the prompt alone, scored (its logprobs), as vLLM answers a loglikelihood request
    max_tokens: CompletionMaxTokens | None = 16
    logprobs: Logprobs | None = None
    echo: bool | None = False
    best_of: limited(int, limits.N, "best_of") | None = None

    @model_validator(mode="after")
    def _combinations(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise PydanticCustomError("invalid_value", "{why}", {
                "why": f"best_of ({self.best_of}) must equal n ({self.n}): Sluice returns every completion it "
                       "generates", PARAM_CTX: "best_of"})
        if self.max_tokens == 0 and not self.echo:
            raise PydanticCustomError("invalid_value", "{why}", {
                "why": f"{limits.MAX_TOKENS.problem(0)} (0 only with echo: true, which scores the prompt alone)",
                PARAM_CTX: "max_tokens"})
        return self

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _clear_prompt_errors(cls, v: Any, handler):
        try:
            return handler(v)
        except ValidationError:
            problem = _prompt_problem(v)
            if problem is None:
                raise
            raise PydanticCustomError("invalid_prompt", problem) from None


class ChatMessage(BaseModel):
    model_config = REQUEST_CONFIG
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # only text parts; anything else is refused at validation with a clear message (an image part
    # used to be told "Input should be a valid string"); text() joins them
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # a tool result's call

    @field_validator("content")
    @classmethod
    def _only_text_parts(cls, v: Any) -> Any:
        if isinstance(v, list):
            for i, part in enumerate(v):
                kind = part.get("type")
                if kind != "text":
                    raise PydanticCustomError(
                        "unsupported_content_part",
                        "only text content parts are supported; content[{i}] has type {kind}",
                        {"i": i, "kind": repr(kind) if isinstance(kind, str) else json_type(kind)})
                if not isinstance(part.get("text"), str):
                    raise PydanticCustomError(
                        "invalid_content_part",
                        'a text part is {shape}; content[{i}] has no string "text"',
                        {"i": i, "shape": '{"type": "text", "text": "..."}'})
        return v

    def text(self) -> str:
        """The text content; ``ValueError`` for a part that is not text."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got a {part.get('type')!r} part")
            texts.append(part["text"])
        return "".join(texts)


_NO_CACHE_KEY = ("is not supported: the engines' prefix cache needs no key (a prompt reuses the cached blocks of "
                 "any earlier prompt it shares a beginning with)")
_NO_SAFETY = "is not supported: Sluice runs no safety or abuse monitoring ('user' names the end user)"


class ChatCompletionRequest(SamplingFields):
    UNSUPPORTED: ClassVar[dict[str, str]] = {
        "audio": "is not supported: Sluice generates text only",
        "function_call": "is not supported: it is the legacy form of 'tool_choice'; use 'tools' and 'tool_choice'",
        "functions": "is not supported: it is the legacy form of 'tools'; use 'tools' and 'tool_choice'",
        "metadata": "is not supported: chat completions are not stored ('metadata' tags stored completions)",
        "moderation": "is not supported: Sluice runs no moderation",
        "prediction": "is not supported: Sluice has no predicted outputs",
        "prompt_cache_key": _NO_CACHE_KEY,
        "prompt_cache_options": _NO_CACHE_KEY,
        "prompt_cache_retention": _NO_CACHE_KEY,
        "reasoning_effort": "is not supported: a model's template options go in 'chat_template_kwargs'",
        "safety_identifier": _NO_SAFETY,
        "verbosity": "is not supported: the length of the answer is the model's (bound it with 'max_tokens')",
        "web_search_options": "is not supported: Sluice runs no web search",
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxCompletionTokens | None = None
    logprobs: bool | None = False
    top_logprobs: TopLogprobs | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template: str | None = None  # vLLM's; rendered only with --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the template
    # OpenAI's, accepted with the one value Sluice serves (anything else: a 400 saying why)
    store: bool | None = None
    modalities: list[str] | None = None
    service_tier: str | None = None

    @field_validator("store")
    @classmethod
    def _not_stored(cls, v: bool | None) -> bool | None:
        if v:
            raise refuse("Sluice does not store chat completions; only false is accepted (the Responses API "
                         "stores its responses)")
        return v

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and v != ["text"]:
            raise refuse('Sluice generates text only; only ["text"] is accepted')
        return v

    @field_validator("service_tier")
    @classmethod
    def _one_tier(cls, v: str | None) -> str | None:
        return check_service_tier(v)


class TokenizeRequest(RequestBody):
    """vLLM's ``TokenizeCompletionRequest`` or ``TokenizeChatRequest`` in one: ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        if self.continue_final_message and self.add_generation_prompt and self.messages is not None:
            raise ValueError("'continue_final_message' and 'add_generation_prompt' cannot both be true "
                             "(set 'add_generation_prompt' to false to continue the final message)")
        return self


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]


# --- responses ---------------------------------------------------------------------------------
# OpenAI's response and stream-chunk bodies (with vLLM's ``stop_reason``). The gateway builds them
# in ``serving_completion`` / ``serving_chat`` and serializes them with ``exclude_unset``, so a
# field is in the JSON exactly when the code set it (``null`` included); ``/openapi.json``
# documents them (see ``gateway.routes``).


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens the engine served from its prefix cache


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # output tokens up to the end of the reasoning (gateway.reasoning)


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class ResponseEnvelope(BaseModel):
    """The fields every generation response and chunk carries; filled in one place,
    ``gateway.serving.envelope``."""

    id: str
    object: str
    created: int
    model: str


class CompletionLogProbs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or stop token that ended the choice


class CompletionResponse(ResponseEnvelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(ResponseEnvelope):
    """One ``data:`` event of a streamed completion; the last one (with
    ``stream_options.include_usage``) has no choices and the usage."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProb(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProb] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed piece of a tool call: the first carries id, type and name; later ones arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    reasoning_content: str | None = None  # vLLM's: the <think> text, for a model with a reasoning parser
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseEnvelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # present on a choice's last chunk


class ChatCompletionStreamResponse(ResponseEnvelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


class ModelInfo(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sluice"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelInfo]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
