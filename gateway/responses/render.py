"""A response's events and final object, rendered from its record and its generation's deltas.

:class:`ResponseRenderer` is a pure state machine: given a :class:`ResponseRecord` (what was asked,
stored with the response) and the same per-choice :class:`~gateway.generation.Delta` sequence the
chat endpoint consumes, it yields the Responses stream events with their ``sequence_number`` and
builds the final :class:`ResponseObject`. Nothing in it reads a clock, a random source or Redis:
item ids, call ids and sequence numbers follow from the record and the deltas alone, so a
response rendered again from a replayed event log (another gateway, ``starting_after=N``) gets
the same events with the same numbers.

The text goes through the chat output parser (``gateway.chat_output``: the model's reasoning and
tool-call dialects, a forced ``tool_choice``) and becomes output items, in the order they start:

- reasoning → a ``reasoning`` item (``response.reasoning_text.delta`` events);
- content → a ``message`` item with one ``output_text`` part (``response.output_text.delta``);
- each tool call → a ``function_call`` item (``response.function_call_arguments.delta``).

An item opens with ``response.output_item.added`` (and ``response.content_part.added``) and is
closed (``.done`` events) when another item starts or the response ends. The stream starts with
``response.created`` and ``response.in_progress`` and ends with ``response.completed``,
``response.incomplete`` (``max_output_tokens`` reached: the items are ``incomplete``) or
``response.failed``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from gateway import reasoning, tool_parsers
from gateway.chat_output import ChatOutputStream, Dialects
from gateway.generation import Delta
from gateway.responses.models import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningDeltaEvent,
    ReasoningDoneEvent,
    ReasoningItem,
    ReasoningText,
    ResponseErrorInfo,
    ResponseLifecycleEvent,
    ResponseObject,
    ResponseUsage,
    TextDeltaEvent,
    TextDoneEvent,
)
from gateway.tools import parse_tools


def _finite(x: float | None) -> float:
    return -9999.0 if x is None or not math.isfinite(x) else x


def logprob_json(info: Any) -> dict[str, Any]:
    """A generated token's logprobs (``gateway.generation.TokenInfo``) as the Responses API gives
    them: its text, bytes and logprob, and its ``top_logprobs`` alternatives."""
    return {"token": info.text, "bytes": list(info.bytes), "logprob": _finite(info.logprob),
            "top_logprobs": [{"token": t, "bytes": list(b), "logprob": _finite(lp)} for t, lp, b in info.top]}


def response_usage(usage: dict[str, Any]) -> ResponseUsage:
    """A generation's usage (chat's names) as the Responses API names it."""
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    reasoning_tokens = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return ResponseUsage(input_tokens=prompt, input_tokens_details=InputTokensDetails(cached_tokens=cached),
                         output_tokens=completion, total_tokens=prompt + completion,
                         output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens))


@dataclass
class ResponseRecord:
    """What a response was asked, as stored with it: enough to render its events again.

    ``echo`` holds the ``Response`` fields that repeat the request (instructions, tools,
    tool_choice, text, temperature, ...); ``chat_tools`` / ``chat_tool_choice`` /
    ``parallel_tool_calls`` the converted chat tool fields the output parser follows; ``prompt``
    the end of the rendered prompt (whether it opened a reasoning block); the parsers are the
    model card's."""

    id: str
    request_id: str  # the engine request's id (the event log's key)
    created_at: int
    model: str
    prompt: str
    tool_parser: str
    reasoning_parser: str | None
    chat_tools: list[dict] | None = None
    chat_tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    echo: dict[str, Any] = field(default_factory=dict)
    conversation: str | None = None  # the conversation its turn is appended to when it ends
    logprobs: bool = False  # the output text's logprobs (include: message.output_text.logprobs)
    max_tool_calls: int | None = None  # the function calls the output keeps at most

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> ResponseRecord:
        data = json.loads(text)
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    @property
    def hex(self) -> str:
        return self.id.split("_", 1)[-1]

    def snapshot(self, status: str, **fields: Any) -> ResponseObject:
        """The response object with ``status`` and ``fields`` over the request's echo."""
        return ResponseObject(id=self.id, created_at=self.created_at, model=self.model, status=status,
                              **{**self.echo, **fields})


class ResponseRenderer:
    """One response's events; see the module doc. Call :meth:`start`, :meth:`on_delta` for each
    delta of the response's (single) choice, then :meth:`finish` or :meth:`fail`; each returns the
    events to send. :attr:`response` is the response as it stands."""

    def __init__(self, record: ResponseRecord) -> None:
        self.record = record
        spec = parse_tools(record.chat_tools, record.chat_tool_choice, record.parallel_tool_calls)
        if spec is not None:
            spec.limit = record.max_tool_calls
        dialects = Dialects(tool_parsers.get(record.tool_parser), reasoning.get(record.reasoning_parser))
        self.output = ChatOutputStream(dialects, spec, record.prompt)
        self.reasoning = dialects.reasoning
        self.items: list[Any] = []  # OutputMessage | FunctionCallItem | ReasoningItem, by output index
        self.open: int | None = None  # the output index of the item still receiving text
        self.seq = 0
        self.finish_reason: str | None = None
        self.pending_logprobs: list[dict[str, Any]] = []  # of tokens whose text the parser holds back
        self.response = record.snapshot("in_progress", output=[])

    # --- events -----------------------------------------------------------------------------

    def _ev(self, cls: type, **fields: Any) -> Any:
        ev = cls(sequence_number=self.seq, **fields)
        self.seq += 1
        return ev

    def _lifecycle(self, kind: str, response: ResponseObject) -> ResponseLifecycleEvent:
        return self._ev(ResponseLifecycleEvent, type=f"response.{kind}", response=response)

    def start(self) -> list[Any]:
        return [self._lifecycle("created", self.response), self._lifecycle("in_progress", self.response)]

    def _item_id(self, prefix: str, index: int) -> str:
        return f"{prefix}_{self.record.hex}_{index}"

    def _add(self, item: Any) -> list[Any]:
        index = len(self.items)
        self.items.append(item)
        self.open = index
        events = [self._ev(OutputItemEvent, type="response.output_item.added", output_index=index,
                           item=item.model_copy(deep=True))]
        if isinstance(item, OutputMessage):
            events.append(self._ev(ContentPartEvent, type="response.content_part.added", item_id=item.id,
                                   output_index=index, content_index=0, part=OutputText(text="")))
            item.content = [OutputText(text="")]
        elif isinstance(item, ReasoningItem):
            events.append(self._ev(ContentPartEvent, type="response.content_part.added", item_id=item.id,
                                   output_index=index, content_index=0, part=ReasoningText(text="")))
            item.content = [ReasoningText(text="")]
        return events

    def _close(self, status: str) -> list[Any]:
        if self.open is None:
            return []
        index, item = self.open, self.items[self.open]
        self.open = None
        item.status = status
        events: list[Any] = []
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events += [self._ev(TextDoneEvent, item_id=item.id, output_index=index, content_index=0, text=part.text,
                                logprobs=list(part.logprobs)),
                       self._ev(ContentPartEvent, type="response.content_part.done", item_id=item.id,
                                output_index=index, content_index=0, part=part.model_copy())]
        elif isinstance(item, ReasoningItem):
            part = item.content[0]
            events += [self._ev(ReasoningDoneEvent, item_id=item.id, output_index=index, content_index=0,
                                text=part.text),
                       self._ev(ContentPartEvent, type="response.content_part.done", item_id=item.id,
                                output_index=index, content_index=0, part=part.model_copy())]
        else:
            events.append(self._ev(ArgumentsDoneEvent, item_id=item.id, output_index=index, name=item.name,
                                   arguments=item.arguments))
        events.append(self._ev(OutputItemEvent, type="response.output_item.done", output_index=index,
                               item=item.model_copy(deep=True)))
        return events

    def _open_kind(self) -> type | None:
        return None if self.open is None else type(self.items[self.open])

    def _reasoning(self, text: str) -> list[Any]:
        events = []
        if self._open_kind() is not ReasoningItem:
            events += self._close("completed")
            index = len(self.items)
            events += self._add(ReasoningItem(id=self._item_id("rs", index), content=[], status="in_progress"))
        item = self.items[self.open]
        item.content[0].text += text
        events.append(self._ev(ReasoningDeltaEvent, item_id=item.id, output_index=self.open, content_index=0,
                               delta=text))
        return events

    def _content(self, text: str) -> list[Any]:
        events = []
        if self._open_kind() is not OutputMessage:
            events += self._close("completed")
            index = len(self.items)
            events += self._add(OutputMessage(id=self._item_id("msg", index), content=[], status="in_progress"))
        item = self.items[self.open]
        item.content[0].text += text
        events.append(self._ev(TextDeltaEvent, item_id=item.id, output_index=self.open, content_index=0, delta=text))
        return events

    def _call(self, delta: dict) -> list[Any]:
        events = []
        fn = delta.get("function") or {}
        arguments = fn.get("arguments") or ""
        if delta.get("id") is not None or self._open_kind() is not FunctionCallItem:
            events += self._close("completed")
            index = len(self.items)
            events += self._add(FunctionCallItem(id=self._item_id("fc", index), call_id=self._item_id("call", index),
                                                 name=fn.get("name") or "", arguments="", status="in_progress"))
        item = self.items[self.open]
        if arguments:
            item.arguments += arguments
            events.append(self._ev(ArgumentsDeltaEvent, item_id=item.id, output_index=self.open, delta=arguments))
        return events

    def on_delta(self, d: Delta) -> list[Any]:
        piece = self.output.feed(d.text)
        if d.finish_reason:
            piece += self.output.finish()
            self.finish_reason = d.finish_reason
        if self.record.logprobs and d.logprobs:
            self.pending_logprobs += [logprob_json(info) for info in d.logprobs]
        events: list[Any] = []
        if piece.reasoning:
            events += self._reasoning(piece.reasoning)
        if piece.content:
            events += self._content(piece.content)
            self._attach_logprobs(events[-1])
        elif piece.reasoning or piece.tool_calls:
            self.pending_logprobs = []  # those tokens were reasoning or a call: not the output text's
        for call in piece.tool_calls:
            events += self._call(call)
        return events

    def _attach_logprobs(self, delta: TextDeltaEvent) -> None:
        """The logprobs of the tokens whose text this delta event carries (a token's text the
        output parser held back goes with the text it released)."""
        if not self.record.logprobs:
            return
        delta.logprobs, self.pending_logprobs = self.pending_logprobs, []
        self.items[self.open].content[0].logprobs.extend(delta.logprobs)

    # --- the end ----------------------------------------------------------------------------

    def _final(self, status: str, **fields: Any) -> ResponseObject:
        self.response = self.record.snapshot(status, output=[i.model_copy(deep=True) for i in self.items],
                                             **fields)
        return self.response

    def usage_of(self, gen: Any) -> dict[str, Any]:
        """``gen``'s (a ``Generation``'s) usage, its reasoning tokens counted by the model's parser."""
        return gen.usage(self.reasoning, self.record.prompt, details=True)

    def finish(self, usage: dict[str, Any], completed_at: int | None = None) -> list[Any]:
        """The end of the generation: ``usage`` is the generation's (``prompt_tokens``,
        ``completion_tokens``, ``prompt_tokens_details``, ``completion_tokens_details``: see
        :meth:`usage_of`); ``completed_at`` a time the caller read (the renderer reads none)."""
        cut = self.finish_reason == "length"
        events: list[Any] = []
        if not self.items:  # nothing said (the model ended at once): an empty message, as OpenAI answers
            events += self._add(OutputMessage(id=self._item_id("msg", 0), content=[], status="in_progress"))
        status = "incomplete" if cut else "completed"
        events += self._close(status)
        extra: dict[str, Any] = {"usage": response_usage(usage)}
        if cut:
            extra["incomplete_details"] = IncompleteDetails(reason="max_output_tokens")
        else:
            extra["completed_at"] = completed_at
        response = self._final(status, **extra)
        events.append(self._lifecycle(status, response))
        return events

    def fail(self, code: str, message: str, usage: dict[str, Any] | None = None) -> list[Any]:
        """The generation failed (an engine error, a lost request, the deadline): the items said
        so far stay, ``incomplete``; ``response.failed`` carries the error."""
        events = self._close("incomplete")
        extra: dict[str, Any] = {"error": ResponseErrorInfo(code=code, message=message)}
        if usage is not None:
            extra["usage"] = response_usage(usage)
        events.append(self._lifecycle("failed", self._final("failed", **extra)))
        return events

    def cancelled(self) -> list[Any]:
        """The response was cancelled (a background response, by ``POST .../cancel``)."""
        events = self._close("incomplete")
        events.append(self._lifecycle("cancelled", self._final("cancelled")))
        return events
