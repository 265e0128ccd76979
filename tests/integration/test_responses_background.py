"""Background responses (``background: true``) on the event log, with the real gateway app, a real
Redis and the contract-following fake engine (which logs a logged request's events as the engine
does): queued at once, finished and retrieved through another gateway, streamed again from any
gateway after any sequence number, cancelled from another gateway. A creating gateway that is
kill -9'd: tests/e2e/test_background_responses.py.
"""

from __future__ import annotations

import time

import httpx
import pytest
from openai import OpenAI

from sluice.wire import contract
from tests.integration import test_gateway_support as support
from tests.integration.test_gateway_api import assert_error
from tests.integration.test_gateway_support import MODEL, REPLY
from tests.waiting import wait_until

fake_engine = support.fake_engine
make_gateway = support.make_gateway
gateway = support.gateway

pytestmark = [pytest.mark.model, pytest.mark.redis]


def client(gw) -> OpenAI:
    return OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=30)


def wait_ended(c: OpenAI, response_id: str, timeout: float = 20.0):
    end = time.monotonic() + timeout
    while True:
        resp = c.responses.retrieve(response_id)
        if resp.status not in ("queued", "in_progress") or time.monotonic() > end:
            return resp
        time.sleep(0.05)


def events_of(gw, response_id: str, after: int | None = None) -> list[tuple[str, dict]]:
    import json

    params = {"stream": "true"} | ({"starting_after": str(after)} if after is not None else {})
    out = []
    with httpx.stream("GET", f"{gw.url}/v1/responses/{response_id}", params=params, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data:"):
                data = json.loads(line[5:])
                out.append((data["type"], data))
    return out


def test_background_response_runs_detached_and_streams_again_anywhere(make_gateway, fake_engine, redis_client):
    gw1, gw2 = make_gateway(), make_gateway()
    queued = client(gw1).responses.create(model=MODEL, input="Say hello", background=True, max_output_tokens=64)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    # answered at enqueue: the engine reads the entry in its own time
    [request] = wait_until(lambda: list(fake_engine.requests), 10, "the engine reads the background request")
    assert request.log_events and request.detached  # logged, and never aborted for its gateway's loss
    done = wait_ended(client(gw2), queued.id)
    assert done.status == "completed" and done.output_text == REPLY and done.background is True
    assert done.usage.output_tokens == len(fake_engine.reply_ids)
    # the whole event stream, from the log, on the other gateway: the same renderer's events
    events = events_of(gw2, queued.id)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert events[0][0] == "response.created" and events[-1][0] == "response.completed"
    assert "".join(d["delta"] for t, d in events if t == "response.output_text.delta") == REPLY
    # after any sequence number: exactly the rest, on either gateway
    for gw, n in ((gw1, 3), (gw2, len(events) - 2)):
        assert events_of(gw, queued.id, after=n) == events[n + 1:]
    assert events_of(gw1, queued.id, after=len(events) + 5) == []
    # the log is the engine request's, in its own family (its TTLs are the engine's:
    # tests/integration/test_event_log.py); the record a gateway wrote, with its TTL
    assert redis_client.llen(contract.log_key(request.request_id)) > 0
    assert 0 < redis_client.ttl(contract.record_key(request.request_id))


def test_a_gateway_catches_up_from_the_log_when_the_creator_is_gone(make_gateway, fake_engine):
    """The creating gateway stops before the response ends (its follower with it): a retrieve on
    another renders the log, stores the ended response and answers it."""
    fake_engine.token_delay = 0.05
    gw1, gw2 = make_gateway(), make_gateway()
    queued = client(gw1).responses.create(model=MODEL, input="Say hello", background=True)
    gw1.stop()
    running = client(gw2).responses.retrieve(queued.id)
    assert running.status in ("queued", "in_progress")
    done = wait_ended(client(gw2), queued.id)
    assert done.status == "completed" and done.output_text == REPLY, done
    assert fake_engine.requests[0].request_id not in fake_engine.cancels


def test_background_response_cancelled_from_another_gateway(make_gateway, fake_engine):
    fake_engine.token_delay = 0.5  # some 10 s for the reply: still running when cancelled
    gw1, gw2 = make_gateway(), make_gateway()
    queued = client(gw1).responses.create(model=MODEL, input="Say hello", background=True)
    end = time.monotonic() + 10
    while not fake_engine.requests and time.monotonic() < end:
        time.sleep(0.02)
    cancelled = client(gw2).responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    # the Cancel is on its way through Redis when the cancel answers: the engine reads it within seconds
    assert fake_engine.wait_cancel(fake_engine.requests[0].request_id), "no Cancel reached the engine"
    assert client(gw1).responses.retrieve(queued.id).status == "cancelled"
    # the creating gateway's follower sees the abort and leaves the cancelled response as it is
    time.sleep(1.0)
    assert client(gw2).responses.retrieve(queued.id).status == "cancelled"
    assert events_of(gw2, queued.id)[-1][0] == "response.cancelled"


def test_background_refusals(gateway, fake_engine):
    plain = client(gateway).responses.create(model=MODEL, input="Say hello")
    r = httpx.get(f"{gateway.url}/v1/responses/{plain.id}", params={"starting_after": "2"})
    assert_error(r, 400, param="starting_after")
    r = httpx.get(f"{gateway.url}/v1/responses/resp_0123456789abcdef", params={"stream": "true"})
    assert_error(r, 404, code="not_found")
    r = httpx.post(f"{gateway.url}/v1/responses", json={"model": MODEL, "input": "x", "background": True,
                                                          "store": False})
    assert_error(r, 400, param="background")
    err = assert_error(httpx.post(f"{gateway.url}/v1/responses/{plain.id}/cancel"), 400, param="response_id")
    assert "background" in err["message"]


def test_a_stored_foreground_response_is_logged_and_any_gateway_follows_it(make_gateway, fake_engine, redis_client):
    """A stored response that is not background runs logged and detached at the engine, like a
    background one: another gateway sees its output as it grows, streams its events after any
    number while it runs, and both agree with what its own client got. ``store: false`` stays a
    plain request. (Its creating gateway kill -9'd: tests/e2e/test_background_responses.py.)"""
    import threading

    fake_engine.token_delay = 0.1  # some 2 s for the reply
    gw1, gw2 = make_gateway(), make_gateway()
    got: list = []
    t = threading.Thread(target=lambda: got.append(client(gw1).responses.create(model=MODEL, input="Say hello")))
    t.start()
    try:
        [request] = wait_until(lambda: list(fake_engine.requests), 10, "the engine reads the request")
        assert request.log_events and request.detached
        rid = "resp_" + request.request_id.split("-", 1)[1]
        partial = wait_until(lambda: (r := client(gw2).responses.retrieve(rid)).output and r, 10, "output grows")
        assert partial.status == "in_progress" and REPLY.startswith(partial.output_text)
        live = events_of(gw2, rid, after=3)  # replayed from the log, then followed live to the end
    finally:
        t.join(30)
    [own] = got
    assert own.status == "completed" and own.output_text == REPLY
    assert live[0][1]["sequence_number"] == 4 and live[-1][0] == "response.completed"
    assert live[-1][1]["response"]["output"] == own.model_dump(mode="json", exclude_none=True)["output"]
    assert client(gw2).responses.retrieve(rid).model_dump() == own.model_dump()
    # the stored hash's running TTL covered the log's window; the final one is the full TTL
    assert redis_client.ttl(contract.response_key(rid)) > gw1.config.event_log_ttl_s
    # store: false: nothing logged, nothing detached
    client(gw1).responses.create(model=MODEL, input="Say hello", store=False)
    assert not fake_engine.requests[-1].log_events and not fake_engine.requests[-1].detached


def test_a_response_whose_log_expired_before_anyone_stored_its_end_is_failed(gateway, fake_engine, redis_client):
    """The one case nothing can finish: still stored running, its event log gone. Before its
    deadline it may still run (it is answered as it is stored); past it, it is stored failed."""
    import json

    from sluice.wire import stored_response as sr

    done = client(gateway).responses.create(model=MODEL, input="Say hello")
    key = contract.response_key(done.id)
    record = json.loads(redis_client.hget(key, sr.F_RECORD))
    redis_client.delete(contract.record_key(record["request_id"]), contract.log_key(record["request_id"]))
    redis_client.hdel(key, sr.F_RESPONSE)
    redis_client.hset(key, sr.F_STATUS, "in_progress")
    assert client(gateway).responses.retrieve(done.id).status == "in_progress"
    record["created_at"] -= int(gateway.config.request_timeout_s) + 10  # its deadline is past
    redis_client.hset(key, sr.F_RECORD, json.dumps(record))
    lost = client(gateway).responses.retrieve(done.id)
    assert lost.status == "failed" and lost.error.code == "server_error" and "expired" in lost.error.message
    assert redis_client.hget(key, sr.F_STATUS) == b"failed"
