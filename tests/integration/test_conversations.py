"""The Conversations API (``/v1/conversations``) and the ``conversation`` and ``truncation``
parameters of ``/v1/responses``, on the real gateway app with a real Redis and the contract-following
fake engine (its card's context is ``MAX_MODEL_LEN`` = 256 tokens): the openai SDK's
``conversations`` client against two gateways sharing one Redis, responses that continue a
conversation and append their turn to it, and the 400s and 404s of every route. Tenant isolation:
tests/integration/test_tenants.py."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI

from sluice.wire import contract
from tests.integration import test_gateway_support as support
from tests.integration.test_gateway_api import assert_error
from tests.integration.test_gateway_support import MAX_MODEL_LEN, MODEL, REPLY
from tests.waiting import wait_until

fake_engine = support.fake_engine
make_gateway = support.make_gateway
gateway = support.gateway

pytestmark = [pytest.mark.model, pytest.mark.redis]


def client(gw) -> OpenAI:
    return OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=30)


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": text}


def prompt_of(engine, i: int = -1) -> str:
    return engine.tokenizer.decode(engine.requests[i].prompt_token_ids)


def texts(items) -> list[str]:
    return [part.text for item in items for part in getattr(item, "content", None) or []]


def test_conversation_objects_and_items_across_gateways(make_gateway, fake_engine, redis_client):
    gw1, gw2 = make_gateway(), make_gateway()
    one, two = client(gw1), client(gw2)
    conv = one.conversations.create(items=[user("first"), {"type": "message", "role": "assistant",
                                                            "content": "an answer"}], metadata={"topic": "t"})
    assert conv.object == "conversation" and conv.id.startswith("conv_") and conv.metadata == {"topic": "t"}
    assert two.conversations.retrieve(conv.id).model_dump() == conv.model_dump()
    assert two.conversations.update(conv.id, metadata={"topic": "u"}).metadata == {"topic": "u"}
    assert one.conversations.retrieve(conv.id).metadata == {"topic": "u"}
    added = two.conversations.items.create(conv.id, items=[user("second"), user("third")])
    assert [i.type for i in added.data] == ["message", "message"] and added.has_more is False
    assert texts(added.data) == ["second", "third"] and all(i.id.startswith("msg_") for i in added.data)
    newest_first = one.conversations.items.list(conv.id)
    assert texts(newest_first.data) == ["third", "second", "an answer", "first"]
    page = one.conversations.items.list(conv.id, order="asc", limit=2)
    assert texts(page.data) == ["first", "an answer"] and page.has_more
    rest = httpx.get(f"{gw2.url}/v1/conversations/{conv.id}/items",
                     params={"order": "asc", "after": page.data[-1].id}).json()
    assert [i["content"][0]["text"] for i in rest["data"]] == ["second", "third"] and rest["has_more"] is False
    assert rest["first_id"] == added.data[0].id and rest["last_id"] == added.data[1].id
    second = added.data[0]
    assert two.conversations.items.retrieve(second.id, conversation_id=conv.id).model_dump() == second.model_dump()
    after_delete = one.conversations.items.delete(second.id, conversation_id=conv.id)
    assert after_delete.id == conv.id and after_delete.object == "conversation"
    assert texts(two.conversations.items.list(conv.id, order="asc").data) == ["first", "an answer", "third"]
    # one family of keys, one TTL (the responses' TTL) on all three
    keys = contract.conversation_keys(conv.id)
    assert all(0 < redis_client.ttl(k) <= gw1.config.responses_ttl_s for k in keys)
    deleted = httpx.delete(f"{gw2.url}/v1/conversations/{conv.id}").json()
    assert deleted == {"id": conv.id, "object": "conversation.deleted", "deleted": True}
    assert not any(redis_client.exists(k) for k in keys)
    for method, path, body in (("GET", "", None), ("POST", "", {"metadata": {}}), ("DELETE", "", None),
                               ("GET", "/items", None), ("POST", "/items", {"items": [user("x")]}),
                               ("GET", f"/items/{second.id}", None), ("DELETE", f"/items/{second.id}", None)):
        err = assert_error(httpx.request(method, f"{gw1.url}/v1/conversations/{conv.id}{path}", json=body), 404,
                           code="not_found")
        assert conv.id in err["message"]
    with pytest.raises(openai.NotFoundError):
        one.responses.create(model=MODEL, input="hi", conversation=conv.id)


def test_responses_continue_a_conversation_and_append_their_turn(make_gateway, fake_engine):
    gw1, gw2 = make_gateway(), make_gateway()
    conv = client(gw1).conversations.create(items=[user("Remember PELICAN.")])
    first = client(gw1).responses.create(model=MODEL, input="What did I ask?", conversation=conv.id,
                                         max_output_tokens=64)
    assert first.status == "completed" and first.conversation.id == conv.id and first.output_text == REPLY
    prompt = prompt_of(fake_engine)
    assert prompt.index("PELICAN") < prompt.index("What did I ask?")
    # the turn went in: the input, then the output (its ids as the response has them)
    items = client(gw2).conversations.items.list(conv.id, order="asc").data
    assert texts(items) == ["Remember PELICAN.", "What did I ask?", REPLY]
    assert items[-1].id == first.output[0].id
    # another gateway, another turn: the whole conversation is its prompt; streamed the same
    with client(gw2).responses.stream(model=MODEL, input=[user("And then?")], conversation={"id": conv.id},
                                      max_output_tokens=64) as stream:
        second = stream.get_final_response()
    prompt = prompt_of(fake_engine)
    assert prompt.index("PELICAN") < prompt.index("What did I ask?") < prompt.index(REPLY) < prompt.index("And then?")
    assert second.conversation.id == conv.id
    assert len(client(gw1).conversations.items.list(conv.id).data) == 5
    # a background response appends its turn too, when it ends (its follower, or a catch-up)
    queued = client(gw1).responses.create(model=MODEL, input="Last one.", conversation=conv.id, background=True,
                                          max_output_tokens=64)
    wait_until(lambda: client(gw2).responses.retrieve(queued.id).status == "completed", 20, "background ends")
    assert texts(client(gw2).conversations.items.list(conv.id, order="asc").data)[-2:] == ["Last one.", REPLY]
    # a response in a conversation is stored like any: its own input items only
    assert texts(client(gw2).responses.input_items.list(second.id).data) == ["And then?"]


BAD = [
    ({"conversation": "conv_nope"}, 404, "conversation", "conv_nope"),
    ({"conversation": {"id": "conv_nope"}}, 404, "conversation", "conv_nope"),
    ({"conversation": "conv_x", "previous_response_id": "resp_x"}, 400, "conversation", "previous_response_id"),
    ({"conversation": "conv_x", "store": False}, 400, "conversation", "store"),
    ({"conversation": 7}, 400, "conversation", "conversation"),
    ({"truncation": "sometimes"}, 400, "truncation", "truncation"),
]


@pytest.mark.parametrize(("extra", "status", "param", "needle"), BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_conversation_parameters(gateway, fake_engine, extra, status, param, needle):
    err = assert_error(httpx.post(f"{gateway.url}/v1/responses", json={"model": MODEL, "input": "hi", **extra}),
                       status, param=param)
    assert needle in err["message"], err
    assert fake_engine.requests == []


def test_bad_conversation_requests_name_the_item(gateway):
    url = f"{gateway.url}/v1/conversations"
    cases = [
        ({"items": [user("ok"), {"type": "item_reference", "id": "x"}]}, "items", "items[1] has type 'item_reference'"),
        ({"items": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "items",
         "items[0].content[0] has type 'input_image'"),
        ({"items": [{"type": "function_call_output", "output": "x"}]}, "items", "items[0].call_id is required"),
        ({"items": [user(str(i)) for i in range(21)]}, "items", "at most 20"),
        ({"items": [{**user("a"), "id": "m1"}, {**user("b"), "id": "m1"}]}, "items[1].id", "m1"),
        ({"metadata": {"k" * 65: "v"}}, "metadata", "64"),
        ({"items": "not a list"}, "items", "items"),
    ]
    for body, param, needle in cases:
        err = assert_error(httpx.post(url, json=body), 400, param=param)
        assert needle in err["message"], (body, err)
    conv = httpx.post(url, json={"items": [{**user("a"), "id": "m1"}]}).json()
    items_url = f"{url}/{conv['id']}/items"
    err = assert_error(httpx.post(items_url, json={"items": [user("b"), {**user("c"), "id": "m1"}]}), 400,
                       param="items[1].id")
    assert "already in the conversation" in err["message"]
    assert len(httpx.get(items_url).json()["data"]) == 1  # nothing of the refused request was added
    assert_error(httpx.post(items_url, json={"items": []}), 400, param="items")
    assert_error(httpx.post(f"{url}/{conv['id']}", json={}), 400, param="metadata")
    for params, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"order": "up"}, "order"),
                          ({"after": "nope"}, "after"), ({"include": "x"}, "include")):
        assert_error(httpx.get(items_url, params=params), 400, param=param)
    err = assert_error(httpx.get(f"{items_url}/nope"), 404, code="not_found")
    assert "nope" in err["message"]
    assert_error(httpx.delete(f"{items_url}/nope"), 404, code="not_found")


def test_a_history_over_the_context_is_refused_or_truncated(gateway, fake_engine):
    """The card's context is 256 tokens. A chain whose turns no longer fit is a 400
    ``context_length_exceeded``; ``truncation: "auto"`` drops its oldest items until it fits. A
    conversation holding more items than the context has tokens is refused before any is rendered."""
    c = client(gateway)
    long_turn = "PLOVER " * 40  # 121 tokens
    first = c.responses.create(model=MODEL, input=long_turn, max_output_tokens=8)
    second = c.responses.create(model=MODEL, input="EGRET " * 20, previous_response_id=first.id,
                                max_output_tokens=8)
    body = {"model": MODEL, "input": "Short question?", "previous_response_id": second.id, "max_output_tokens": 64}
    err = assert_error(httpx.post(f"{gateway.url}/v1/responses", json=body), 400, param="input")
    assert "maximum context length" in err["message"]
    n = len(fake_engine.requests)
    cut = c.responses.create(**body, truncation="auto")
    assert cut.status == "completed" and cut.truncation == "auto"
    prompt = prompt_of(fake_engine)
    assert len(fake_engine.requests) == n + 1 and "PLOVER" not in prompt and "Short question?" in prompt
    assert len(fake_engine.requests[-1].prompt_token_ids) + 64 <= MAX_MODEL_LEN
    # the input alone over the context: truncation cannot help
    err = assert_error(httpx.post(f"{gateway.url}/v1/responses", json={
        "model": MODEL, "input": long_turn * 3, "truncation": "auto", "previous_response_id": second.id}), 400,
        param="input")
    assert "maximum context length" in err["message"]
    # more items than the context has tokens: refused at the bound, without rendering them
    conv = c.conversations.create()
    starts = range(0, MAX_MODEL_LEN + 1, 20)
    for start in starts:
        c.conversations.items.create(conv.id, items=[user(f"m{i}") for i in range(start, start + 20)])
    last = starts[-1] + 19
    err = assert_error(httpx.post(f"{gateway.url}/v1/responses", json={"model": MODEL, "input": "hi",
                                                                       "conversation": conv.id}), 400, param="input")
    assert err["code"] == "context_length_exceeded" and f"more than {MAX_MODEL_LEN} items" in err["message"]
    assert len(fake_engine.requests) == n + 1
    fitted = c.responses.create(model=MODEL, input="hi", conversation=conv.id, truncation="auto",
                                max_output_tokens=16)
    prompt = prompt_of(fake_engine)
    assert fitted.status in ("completed", "incomplete") and fitted.output_text
    assert "\nm0<|im_end|>" not in prompt and f"\nm{last}<|im_end|>" in prompt
