"""The Responses API's bodies as pydantic models, in the openai SDK's shapes (field names of
``openai.types.responses``; our own models, only the fields Sluice fills or reads).

Requests: :class:`CreateResponseRequest` and its input items. Each list of the request (``input``,
``tools``) is checked item by item by a *before* validator that dispatches on ``type`` and says
what is wrong with the item in one message (a hosted tool names its type; an image part names
the part), instead of pydantic's one-error-per-union-branch list; the typed item models still
document the shapes in ``/openapi.json``.

Responses: :class:`ResponseObject` (``object: "response"``), its output items, the stream events
(:data:`ResponseStreamEvent`), the input-item list and the deletion answer. The gateway builds
them in ``gateway.responses.render`` and serializes them with ``exclude_none=False``: every field
the SDK's ``Response`` requires is always present.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from gateway.errors import PARAM_CTX, json_type
from gateway.protocol import (
    REQUEST_CONFIG,
    RequestBody,
    Temperature,
    TopP,
    check_service_tier,
    limited,
    refuse,
)
from sluice.wire import limits

MaxOutputTokens = limited(int, limits.MAX_TOKENS, "max_output_tokens")

# Tool types the Responses API defines that OpenAI runs on its side (web search, file search, a
# computer, a code sandbox, MCP servers, image generation, a shell): Sluice runs none of them.
HOSTED_TOOL_TYPES = frozenset({
    "web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26",
    "file_search", "computer", "computer_use", "computer_use_preview", "code_interpreter", "mcp",
    "image_generation", "local_shell", "shell", "apply_patch", "custom", "tool_search", "namespace",
})


# --- request: input items ------------------------------------------------------------------------


class InputText(BaseModel):
    model_config = REQUEST_CONFIG
    type: Literal["input_text"]
    text: str


class OutputTextPart(BaseModel):
    """An assistant message's text, as a previous response's output carries it."""

    model_config = REQUEST_CONFIG
    type: Literal["output_text"]
    text: str
    annotations: list[Any] = Field(default_factory=list)


class RefusalPart(BaseModel):
    model_config = REQUEST_CONFIG
    type: Literal["refusal"]
    refusal: str


ContentPart = InputText | OutputTextPart | RefusalPart


class InputMessage(BaseModel):
    """A message: ``content`` a string or text parts (``input_text``; ``output_text`` /
    ``refusal`` in assistant turns). ``type`` may be left out (the SDK's ``EasyInputMessage``)."""

    model_config = REQUEST_CONFIG
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.refusal if isinstance(p, RefusalPart) else p.text for p in self.content)


class FunctionCallInput(BaseModel):
    """A function call the model made earlier (a previous response's output item)."""

    model_config = REQUEST_CONFIG
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputInput(BaseModel):
    """The result of a function call, sent back by the client."""

    model_config = REQUEST_CONFIG
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningInput(BaseModel):
    """A reasoning item of a previous response, sent back by a client (the Agents SDK does):
    accepted and left out of the prompt (a model's template drops past reasoning too)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None


InputItem = InputMessage | FunctionCallInput | FunctionCallOutputInput | ReasoningInput
_INPUT_MODELS: dict[str, type[BaseModel]] = {
    "message": InputMessage, "function_call": FunctionCallInput,
    "function_call_output": FunctionCallOutputInput, "reasoning": ReasoningInput,
}


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]
                    if not (isinstance(p, str) and any(c in p for c in "[]-")))
    if err["type"] == "missing":
        return f"{where.lstrip('.')} is required"
    return f"{where.lstrip('.') or 'the item'}: {err['msg']}"


def parse_input_item(i: int, item: Any, where: str = "input") -> BaseModel:
    """The ``i``-th item of the list ``where`` (``input``; a conversation's ``items``) as its model,
    or an error naming it."""
    if isinstance(item, BaseModel):
        return item
    if not isinstance(item, dict):
        raise PydanticCustomError("invalid_input_item", "{where}[{i}] must be an object, got {got}",
                                  {"where": where, "i": i, "got": json_type(item)})
    kind = item.get("type", "message")
    model = _INPUT_MODELS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise PydanticCustomError(
            "unsupported_input_item",
            "{where}[{i}] has type {kind}, which Sluice does not accept; supported: 'message' (text parts), "
            "'function_call', 'function_call_output' and 'reasoning'", {"where": where, "i": i, "kind": repr(kind)})
    if model is InputMessage and isinstance(item.get("content"), list):
        for j, part in enumerate(item["content"]):
            ptype = part.get("type") if isinstance(part, dict) else None
            if ptype not in ("input_text", "output_text", "refusal"):
                raise PydanticCustomError(
                    "unsupported_content_part",
                    "only text content parts are supported; {where}[{i}].content[{j}] has type {kind}",
                    {"where": where, "i": i, "j": j,
                     "kind": repr(ptype) if isinstance(ptype, str) else json_type(ptype)})
    try:
        return model.model_validate(item)
    except ValidationError as exc:
        raise PydanticCustomError("invalid_input_item", "{where}[{i}].{detail}",
                                  {"where": where, "i": i, "detail": _first_error(exc)}) from None


# --- request: tools, text format ----------------------------------------------------------------


class FunctionTool(BaseModel):
    """A function the model may call (the Responses API's flat shape: no nested ``function``)."""

    model_config = REQUEST_CONFIG
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


def _parse_tool(i: int, tool: Any) -> FunctionTool:
    if isinstance(tool, FunctionTool):
        return tool
    if not isinstance(tool, dict):
        raise PydanticCustomError("invalid_tool", "tools[{i}] must be an object, got {got}",
                                  {"i": i, "got": json_type(tool)})
    kind = tool.get("type")
    if kind != "function":
        what = "a hosted tool OpenAI runs" if isinstance(kind, str) and kind in HOSTED_TOOL_TYPES else "a tool type"
        raise PydanticCustomError(
            "unsupported_tool",
            "tools[{i}] has type {kind}, {what} that Sluice does not run; only 'function' tools are supported",
            {"i": i, "kind": repr(kind) if isinstance(kind, str) else json_type(kind), "what": what})
    try:
        return FunctionTool.model_validate(tool)
    except ValidationError as exc:
        raise PydanticCustomError("invalid_tool", "tools[{i}].{detail}", {"i": i, "detail": _first_error(exc)}) \
            from None


class ToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    name: str


class TextFormatText(BaseModel):
    model_config = REQUEST_CONFIG
    type: Literal["text"]


class TextFormatJSONObject(BaseModel):
    model_config = REQUEST_CONFIG
    type: Literal["json_object"]


class TextFormatJSONSchema(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[TextFormatText | TextFormatJSONObject | TextFormatJSONSchema, Field(discriminator="type")]


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    @field_validator("verbosity")
    @classmethod
    def _no_verbosity(cls, v: str | None) -> str | None:
        if v is not None:
            raise refuse("verbosity is not supported: the length of the answer is the model's (bound it with "
                         "'max_output_tokens')")
        return v


class ResponseStreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_obfuscation: bool | None = None

    @field_validator("include_obfuscation")
    @classmethod
    def _no_obfuscation(cls, v: bool | None) -> bool | None:
        if v:
            raise refuse("Sluice does not obfuscate its streams; only false is accepted")
        return v


# What ``include`` may ask: the one extra Sluice has (the output's logprobs, with ``top_logprobs``).
OUTPUT_LOGPROBS = "message.output_text.logprobs"
_NO_CACHE_KEY = ("is not supported: the engines' prefix cache needs no key (a prompt reuses the cached blocks of "
                 "any earlier prompt it shares a beginning with)")


Metadata = limited(dict[str, str], limits.RESPONSE_METADATA)


def check_metadata(v: dict[str, str] | None) -> dict[str, str] | None:
    for key, value in (v or {}).items():  # OpenAI's limits on metadata
        if len(key) > limits.RESPONSE_METADATA_KEY_CHARS or len(value) > limits.RESPONSE_METADATA_VALUE_CHARS:
            raise PydanticCustomError(
                "invalid_metadata", "metadata keys are at most {k} characters and values at most {v}",
                {"k": limits.RESPONSE_METADATA_KEY_CHARS, "v": limits.RESPONSE_METADATA_VALUE_CHARS})
    return v


class ConversationParam(BaseModel):
    """``conversation: {"id": ...}`` (or the id alone)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str


class CreateResponseRequest(RequestBody):
    """``POST /v1/responses``: every parameter of OpenAI's is served here or refused in
    ``UNSUPPORTED`` (a 400 saying why); one it does not have is a 400 too."""

    UNSUPPORTED: ClassVar[dict[str, str]] = {
        "context_management": "is not supported: a conversation is kept whole (see 'truncation')",
        "moderation": "is not supported: Sluice runs no moderation",
        "prompt": "is not supported: Sluice has no stored prompt templates; send 'instructions' and 'input'",
        "prompt_cache_key": _NO_CACHE_KEY,
        "prompt_cache_options": _NO_CACHE_KEY,
        "prompt_cache_retention": _NO_CACHE_KEY,
        "reasoning": "is not supported: a model's reasoning is its own (a model with a reasoning parser returns "
                     "it as 'reasoning' items)",
        "safety_identifier": "is not supported: Sluice runs no safety or abuse monitoring ('user' names the end "
                             "user)",
    }

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: MaxOutputTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: Metadata | None = None
    background: bool | None = False
    stream: bool | None = False
    user: str | None = None
    conversation: str | ConversationParam | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    top_logprobs: limited(int, limits.LOGPROBS, "top_logprobs") | None = None
    max_tool_calls: limited(int, limits.MAX_TOOL_CALLS) | None = None
    service_tier: str | None = None
    stream_options: ResponseStreamOptions | None = None

    @field_validator("conversation", mode="before")
    @classmethod
    def _conversation(cls, v: Any) -> Any:
        if isinstance(v, dict):  # its own errors, not the union's (a string was not expected)
            try:
                return ConversationParam.model_validate(v)
            except ValidationError as exc:
                err = exc.errors()[0]
                where = "conversation" + "".join(f".{p}" for p in err["loc"])
                raise PydanticCustomError(err["type"], "{msg}", {"msg": err["msg"], PARAM_CTX: where}) from None
        return v

    @field_validator("include")
    @classmethod
    def _include(cls, v: list[str] | None) -> list[str] | None:
        for i, what in enumerate(v or []):
            if what != OUTPUT_LOGPROBS:
                raise PydanticCustomError(
                    "unsupported_value", "include[{i}] is {what}, which Sluice does not return; the one value "
                    "supported is {ok}", {"i": i, "what": repr(what), "ok": repr(OUTPUT_LOGPROBS)})
        return v

    @field_validator("service_tier")
    @classmethod
    def _tier(cls, v: str | None) -> str | None:
        return check_service_tier(v)

    @property
    def wants_logprobs(self) -> bool:
        return OUTPUT_LOGPROBS in (self.include or [])

    @field_validator("input", mode="before")
    @classmethod
    def _input_items(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [parse_input_item(i, item) for i, item in enumerate(v)]
        return v

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [_parse_tool(i, tool) for i, tool in enumerate(v)]
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("type") != "function":
            kind = v.get("type")
            raise PydanticCustomError(
                "unsupported_tool_choice",
                "tool_choice of type {kind} is not supported; use 'none', 'auto', 'required' or {named}",
                {"kind": repr(kind) if isinstance(kind, str) else json_type(kind),
                 "named": '{"type": "function", "name": ...}'})
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(v)

    @property
    def conversation_id(self) -> str | None:
        c = self.conversation
        return c.id if isinstance(c, ConversationParam) else c


# --- response objects ---------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class ReasoningItem(BaseModel):
    """The model's reasoning (a model with a reasoning parser: ``<think>`` text)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = Annotated[OutputMessage | FunctionCallItem | ReasoningItem, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseErrorInfo(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


ResponseStatus = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]


class ConversationRef(BaseModel):
    id: str


class ResponseObject(BaseModel):
    """OpenAI's ``Response``."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: ResponseStatus
    background: bool = False
    error: ResponseErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    conversation: ConversationRef | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


class InputItemList(BaseModel):
    """``GET /v1/responses/{id}/input_items``: a page of the response's input items (each with its id)."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


# --- conversations (/v1/conversations) ---------------------------------------------------------

ConversationItems = limited(list[InputItem], limits.CONVERSATION_ITEMS)


def _conversation_items(v: Any) -> Any:
    if isinstance(v, list):
        return [parse_input_item(i, item, "items") for i, item in enumerate(v)]
    return v


class CreateConversationRequest(RequestBody):
    """``POST /v1/conversations``: its first items (as a response's input items), its metadata."""

    items: ConversationItems | None = None
    metadata: Metadata | None = None

    @field_validator("items", mode="before")
    @classmethod
    def _items(cls, v: Any) -> Any:
        return _conversation_items(v)

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(v)


class UpdateConversationRequest(RequestBody):
    """``POST /v1/conversations/{id}``: its metadata, replaced."""

    metadata: Metadata

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(v)


class AddItemsRequest(RequestBody):
    """``POST /v1/conversations/{id}/items``."""

    items: ConversationItems = Field(min_length=1)

    @field_validator("items", mode="before")
    @classmethod
    def _items(cls, v: Any) -> Any:
        return _conversation_items(v)


class ConversationObject(BaseModel):
    id: str
    object: Literal["conversation"] = "conversation"
    created_at: int
    metadata: dict[str, str] = Field(default_factory=dict)


class DeletedConversation(BaseModel):
    id: str
    object: Literal["conversation.deleted"] = "conversation.deleted"
    deleted: Literal[True] = True


class ConversationItemList(BaseModel):
    """A page of a conversation's items (each with its id), or the items just added."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


# --- stream events ------------------------------------------------------------------------------


class _Event(BaseModel):
    sequence_number: int


class ResponseLifecycleEvent(_Event):
    """``response.created`` / ``in_progress`` / ``completed`` / ``incomplete`` / ``failed`` /
    ``cancelled`` / ``queued``: the response as it stands."""

    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete",
                  "response.failed", "response.cancelled", "response.queued"]
    response: ResponseObject


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class TextDeltaEvent(_Event):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class TextDoneEvent(_Event):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningDeltaEvent(_Event):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningDoneEvent(_Event):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str


class ArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(_Event):
    type: Literal["error"] = "error"
    code: str | None = None
    message: str
    param: str | None = None


ResponseStreamEvent = (ResponseLifecycleEvent | OutputItemEvent | ContentPartEvent | TextDeltaEvent | TextDoneEvent
                       | ReasoningDeltaEvent | ReasoningDoneEvent | ArgumentsDeltaEvent | ArgumentsDoneEvent
                       | ErrorEvent)

# The models /openapi.json documents beyond those FastAPI finds (the events of a stream).
STREAM_EVENT_MODELS: tuple[type[BaseModel], ...] = (
    ResponseLifecycleEvent, OutputItemEvent, ContentPartEvent, TextDeltaEvent, TextDoneEvent, ReasoningDeltaEvent,
    ReasoningDoneEvent, ArgumentsDeltaEvent, ArgumentsDoneEvent, ErrorEvent)
