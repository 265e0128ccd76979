"""The JSON of a stream's common chunks, from templates: one text delta, one finish.

A streamed choice's plain chunks (no logprobs, no tool calls, no reasoning) are nearly all alike:
only the index, the text and the finish differ. :class:`ChunkTemplate` fills them into text made
once per response, instead of building pydantic models and serializing them for every token. The
output is byte for byte what ``model_dump_json(exclude_unset=True)`` of the same
``CompletionStreamResponse`` / ``ChatCompletionStreamResponse`` gives (tested); any other chunk
still goes through the models. :func:`sse_event` frames a chunk as one server-sent event, as
sse-starlette would (``data: ...`` and a blank line; the JSON is compact, one line).
"""

from __future__ import annotations

import json

from sse_starlette import ServerSentEvent

_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def dumps(value: object) -> str:
    """Compact JSON with non-ASCII characters as they are: pydantic's (serde's) form."""
    return _encode(value)


def sse_event(data: str, event_id: str | None = None) -> bytes:
    """One server-sent event carrying ``data`` (a single line), and ``id:`` when given."""
    if event_id is None:
        return b"data: " + data.encode() + b"\n\n"
    return b"id: " + event_id.encode() + b"\ndata: " + data.encode() + b"\n\n"


class _KeepAlive(ServerSentEvent):
    """A keep-alive comment line WITHOUT the blank line that ends an event. A blank line after a
    stream's ``id:`` would be an event of its own to clients that keep the last id for the next
    dispatch, as the openai SDK's decoder does (it then fails to parse the empty data as JSON); a
    lone comment line is ignored by every SSE parser, and the next event's blank line ends it."""

    def encode(self) -> bytes:
        return b": ping\n"


def keep_alive() -> ServerSentEvent:
    """sse-starlette's ``ping_message_factory`` for every Sluice stream."""
    return _KeepAlive()


class ChunkTemplate:
    """The chunks of one streamed response: ``id``, ``object``, ``created``, ``model`` and
    (``include_usage``) ``"usage":null`` fixed, the choice filled in per chunk."""

    def __init__(self, id: str, object: str, created: int, model: str, include_usage: bool) -> None:
        self._head = (f'{{"id":{dumps(id)},"object":{dumps(object)},"created":{int(created)},'
                      f'"model":{dumps(model)},"choices":[')
        self._tail = '],"usage":null}' if include_usage else "]}"

    def completion_text(self, index: int, text: str) -> str:
        """A completion choice's text delta (no logprobs, not finished)."""
        return (f'{self._head}{{"index":{index},"text":{dumps(text)},"logprobs":null,"finish_reason":null,'
                f'"stop_reason":null}}{self._tail}')

    def completion_finish(self, index: int, finish_reason: str, stop_reason: int | str | None) -> str:
        """A completion choice's last chunk: no text, its finish and stop reasons."""
        return (f'{self._head}{{"index":{index},"text":"","logprobs":null,"finish_reason":{dumps(finish_reason)},'
                f'"stop_reason":{dumps(stop_reason)}}}{self._tail}')

    def chat_content(self, index: int, content: str) -> str:
        """A chat choice's content delta (no logprobs, not finished)."""
        return (f'{self._head}{{"index":{index},"delta":{{"content":{dumps(content)}}},"logprobs":null,'
                f'"finish_reason":null}}{self._tail}')

    def chat_finish(self, index: int, finish_reason: str, stop_reason: int | str | None) -> str:
        """A chat choice's last chunk: an empty delta, its finish and stop reasons."""
        return (f'{self._head}{{"index":{index},"delta":{{}},"logprobs":null,"finish_reason":{dumps(finish_reason)},'
                f'"stop_reason":{dumps(stop_reason)}}}{self._tail}')
