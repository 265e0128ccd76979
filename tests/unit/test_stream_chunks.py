"""The stream chunks made from templates (gateway.stream_chunks) are byte for byte the pydantic
models' JSON, and the formatters give the same stream with and without them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sse_starlette.event import ensure_bytes

from gateway.generation import Delta
from gateway.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaMessage,
)
from gateway.serving import _sse
from gateway.serving_chat import ChatStreamFormatter
from gateway.serving_completion import CompletionStreamFormatter
from gateway.stream_chunks import ChunkTemplate, sse_event

TEXTS = ["", "hello", " world", 'a "quoted" \\ back', "line\nbreak\ttab\r", "é — ½ 😀 日本",
         "".join(chr(i) for i in range(32)) + "\x7f\u2028\u2029", "</script>&<>'"]
ENVELOPES = [("cmpl-abc", "m"), ('id "quoted"', "modèle/ü\\x")]


def _completion(id_: str, model: str, usage: bool, choice: CompletionResponseChoice) -> str:
    fields = {"usage": None} if usage else {}
    return CompletionStreamResponse(id=id_, object="text_completion", created=1700000000, model=model,
                                    choices=[choice], **fields).model_dump_json(exclude_unset=True)


def _chat(id_: str, model: str, usage: bool, choice: ChatCompletionResponseStreamChoice) -> str:
    fields = {"usage": None} if usage else {}
    return ChatCompletionStreamResponse(id=id_, object="chat.completion.chunk", created=1700000000, model=model,
                                        choices=[choice], **fields).model_dump_json(exclude_unset=True)


@pytest.mark.parametrize("usage", [False, True])
@pytest.mark.parametrize(("id_", "model"), ENVELOPES)
def test_templates_equal_the_models_json(id_: str, model: str, usage: bool) -> None:
    comp = ChunkTemplate(id_, "text_completion", 1700000000, model, usage)
    chat = ChunkTemplate(id_, "chat.completion.chunk", 1700000000, model, usage)
    for index in (0, 3):
        for text in TEXTS:
            assert comp.completion_text(index, text) == _completion(id_, model, usage, CompletionResponseChoice(
                index=index, text=text, logprobs=None, finish_reason=None, stop_reason=None))
            if text:
                assert chat.chat_content(index, text) == _chat(id_, model, usage, ChatCompletionResponseStreamChoice(
                    index=index, delta=DeltaMessage(content=text), logprobs=None, finish_reason=None))
        for finish, stop in (("length", None), ("stop", 2), ("stop", "</end \"x\">"), ("abort", None)):
            assert comp.completion_finish(index, finish, stop) == _completion(id_, model, usage, CompletionResponseChoice(
                index=index, text="", logprobs=None, finish_reason=finish, stop_reason=stop))
            choice = ChatCompletionResponseStreamChoice(index=index, delta=DeltaMessage(), logprobs=None,
                                                        finish_reason=finish)
            choice.stop_reason = stop
            assert chat.chat_finish(index, finish, stop) == _chat(id_, model, usage, choice)


def test_sse_event_is_sse_starlettes_framing() -> None:
    for data in ['{"a":1}', "[DONE]", '{"text":"é"}']:
        assert sse_event(data) == ensure_bytes({"data": data}, "\n")
    model = CompletionStreamResponse(id="x", object="text_completion", created=1, model="m", choices=[])
    assert _sse(model) == ensure_bytes({"data": model.model_dump_json(exclude_unset=True)}, "\n")


def _gen(n: int):
    card = SimpleNamespace(name="the-model", tokenizer=None)
    sub = SimpleNamespace(request_id="cmpl-1", prompt_ids=[1, 2], prompt_logprobs=[])
    choices = [SimpleNamespace(index=i, sub=sub) for i in range(n)]
    return SimpleNamespace(id="cmpl-1", created=1700000000, card=card, choices=choices,
                           usage=lambda *_, **__: {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5})


DELTAS = [Delta(0, "Hello", None), Delta(1, " é", None), Delta(0, "", None), Delta(1, "x", None, "length"),
          Delta(0, ' "q"', None, "stop", "</s>"), ]


def _stream(fmt, deltas) -> bytes:
    chunks = list(fmt.start())
    for d in deltas:
        chunks += fmt.on_delta(d)
    chunks += fmt.end()
    return b"".join(_sse(c) for c in chunks)


@pytest.mark.parametrize("usage", [False, True])
@pytest.mark.parametrize("echo", [False, True])
def test_completion_formatter_same_stream_with_and_without_templates(usage: bool, echo: bool) -> None:
    body = CompletionRequest(model="the-model", prompt="hi", stream=True, echo=echo,
                             stream_options={"include_usage": True} if usage else None)
    gen = _gen(2)
    echo_text = {"cmpl-1": "the prompt"} if echo else {}
    fast = CompletionStreamFormatter(gen, gen.card, body, echo_text)
    assert fast.template is not None
    slow = CompletionStreamFormatter(gen, gen.card, body, echo_text)
    slow.template = None
    assert _stream(fast, DELTAS) == _stream(slow, DELTAS)
    assert b"the prompt" in _stream(CompletionStreamFormatter(gen, gen.card, body, echo_text), DELTAS) or not echo


@pytest.mark.parametrize("usage", [False, True])
def test_chat_formatter_same_stream_with_and_without_templates(usage: bool) -> None:
    body = ChatCompletionRequest(model="the-model", messages=[{"role": "user", "content": "hi"}], stream=True,
                                 stream_options={"include_usage": True} if usage else None)
    gen = _gen(2)
    fast = ChatStreamFormatter(gen, gen.card, body)
    assert fast.template is not None
    slow = ChatStreamFormatter(gen, gen.card, body)
    slow.template = None
    assert _stream(fast, DELTAS) == _stream(slow, DELTAS)
    # with logprobs the models are used
    assert ChatStreamFormatter(gen, gen.card, body.model_copy(update={"logprobs": True})).template is None


def _decoded(stream: bytes) -> list:
    from openai._streaming import SSEDecoder  # the SDK's own parser: what its clients see

    return list(SSEDecoder().iter_bytes(iter([stream])))


def test_keep_alive_between_numbered_events_is_no_event_to_the_openai_sdk() -> None:
    """A resumable stream's events carry ``id:``; the openai SDK's decoder keeps the last id and
    dispatches an event at every later blank line, so a keep-alive that ends with a blank line
    reaches the SDK as an event with empty data, which it fails to parse as JSON."""
    from sse_starlette import ServerSentEvent

    from gateway.stream_chunks import keep_alive

    first, second = '{"n":1}', '{"n":2}'
    stream = (sse_event(first, "chatcmpl-x:1") + ensure_bytes(keep_alive(), "\n")
              + sse_event(second, "chatcmpl-x:2") + ensure_bytes(keep_alive(), "\n") + sse_event("[DONE]"))
    events = _decoded(stream)
    assert [e.data for e in events] == [first, second, "[DONE]"]
    assert [e.id for e in events][:2] == ["chatcmpl-x:1", "chatcmpl-x:2"]
    # sse-starlette's default ping (a comment and a blank line) is the case this guards against
    default_ping = ServerSentEvent(comment="ping", sep="\n").encode()
    assert "" in [e.data for e in _decoded(sse_event(first, "chatcmpl-x:1") + default_ping + sse_event("[DONE]"))]
