"""Tenants on the real gateway app, a real Redis and the contract-following fake engine.

- Isolation: with two keys, the second tenant gets a 404 for everything of the first's — read,
  input items, stream again (``starting_after``), resume (``Last-Event-ID``), continue
  (``previous_response_id``), cancel, delete; a conversation, its items and a response's
  ``conversation`` — exactly the answer an unknown id gets; the owner still can. Without keys, nothing changes (the rest of the suite).
- Quotas: counted in Redis, so two gateways share them; 429s in OpenAI's shape with ``Retry-After``
  and the ``x-ratelimit-*`` headers on every response of a limited tenant; one tenant over its
  limits never touches another's.
- Keys: an unknown key is a 401 before the body is read; keys in Redis (``sluice keys``) work on
  every gateway, and a revoked one stops within seconds on every gateway.
- Redis down: a limited tenant's new requests fail closed with 503 ``redis_unavailable``.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from openai import OpenAI

from sluice.wire import contract
from tests.integration import test_gateway_support as support
from tests.integration.test_gateway_support import MODEL, REPLY
from tests.waiting import wait_until

fake_engine = support.fake_engine
make_gateway = support.make_gateway
make_fake_engine = support.make_fake_engine

pytestmark = [pytest.mark.model, pytest.mark.redis]

K1, K2 = "sk-tenant-one", "sk-tenant-two"


def keys_file(tmp_path, body: str):
    path = tmp_path / "keys.yaml"
    path.write_text(body)
    return str(path)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def client(gw, key: str) -> OpenAI:
    return OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=30)


def assert_not_found(r: httpx.Response, unknown: httpx.Response) -> None:
    """A foreign object answers exactly as an unknown one (same status, type and code)."""
    assert r.status_code == 404, (r.status_code, r.text)
    err, ref = r.json()["error"], unknown.json()["error"]
    assert (err["type"], err["code"]) == (ref["type"], ref["code"])


def test_a_tenant_finds_nothing_of_another(make_gateway, fake_engine, tmp_path):
    gw1, gw2 = make_gateway(api_keys=[K1, K2]), make_gateway(api_keys=[K1, K2])
    one = client(gw1, K1)
    stored = one.responses.create(model=MODEL, input="Say hello", max_output_tokens=64)
    assert stored.status == "completed" and stored.output_text == REPLY
    background = one.responses.create(model=MODEL, input="Say hello", background=True, max_output_tokens=64)
    wait_until(lambda: one.responses.retrieve(background.id).status == "completed", 20, "background ends")
    # a resumable chat stream of tenant one: its first event id
    with httpx.stream("POST", f"{gw1.url}/v1/chat/completions", headers=auth(K1), timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
        ids = [line[3:].strip() for line in r.iter_lines() if line.startswith("id:")]
    assert ids

    def as_two(method: str, path: str, **kw) -> httpx.Response:
        return httpx.request(method, f"{gw2.url}{path}", headers={**auth(K2), **kw.pop("headers", {})},
                             timeout=30, **kw)

    unknown = as_two("GET", "/v1/responses/resp_0123456789abcdef0123456789abcdef")
    assert unknown.status_code == 404
    for rid in (stored.id, background.id):
        assert_not_found(as_two("GET", f"/v1/responses/{rid}"), unknown)
        assert_not_found(as_two("GET", f"/v1/responses/{rid}/input_items"), unknown)
        assert_not_found(as_two("POST", f"/v1/responses/{rid}/cancel"), unknown)
        assert_not_found(as_two("DELETE", f"/v1/responses/{rid}"), unknown)
        r = as_two("POST", "/v1/responses", json={"model": MODEL, "input": "more", "previous_response_id": rid})
        assert_not_found(r, unknown)
        assert r.json()["error"]["param"] == "previous_response_id"
    assert_not_found(as_two("GET", f"/v1/responses/{background.id}", params={"stream": "true",
                                                                               "starting_after": "1"}), unknown)
    resumed = as_two("POST", "/v1/chat/completions", headers={"Last-Event-ID": ids[0]},
                     json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert resumed.status_code == 404 and resumed.json()["error"]["param"] == "Last-Event-ID"
    # the owner still has all of it, on either gateway (tenant two's deletes deleted nothing)
    owner = client(gw2, K1)
    assert owner.responses.retrieve(stored.id).output_text == REPLY
    assert [i.id for i in owner.responses.input_items.list(stored.id)]
    cont = owner.responses.create(model=MODEL, input="more", previous_response_id=stored.id, max_output_tokens=64)
    assert cont.status == "completed"
    with httpx.stream("POST", f"{gw2.url}/v1/chat/completions", timeout=30,
                      headers={**auth(K1), "Last-Event-ID": ids[0]},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
        assert r.status_code == 200
    owner.responses.delete(stored.id)
    with pytest.raises(Exception, match="404|not found"):
        owner.responses.retrieve(stored.id)
    # the engine saw each request with its tenant
    tenants = {req.tenant for req in fake_engine.requests}
    assert len(tenants) == 1 and tenants != {""}


def test_a_tenant_finds_no_conversation_of_another(make_gateway, fake_engine):
    """Conversations are their tenant's: every route and the ``conversation`` parameter answer
    another tenant exactly as an unknown id, on any gateway; the owner still has all of it."""
    gw1, gw2 = make_gateway(api_keys=[K1, K2]), make_gateway(api_keys=[K1, K2])
    one = client(gw1, K1)
    conv = one.conversations.create(items=[{"role": "user", "content": "secret"}], metadata={"k": "v"})
    turn = one.responses.create(model=MODEL, input="more", conversation=conv.id, max_output_tokens=64)
    item = one.conversations.items.list(conv.id).data[0]

    def as_two(method: str, path: str, **kw) -> httpx.Response:
        return httpx.request(method, f"{gw2.url}{path}", headers=auth(K2), timeout=30, **kw)

    unknown = as_two("GET", "/v1/conversations/conv_0123456789abcdef")
    assert unknown.status_code == 404
    base = f"/v1/conversations/{conv.id}"
    for method, path, body in (("GET", "", None), ("POST", "", {"metadata": {"k": "stolen"}}),
                               ("GET", "/items", None), ("POST", "/items", {"items": [{"role": "user",
                                                                                         "content": "x"}]}),
                               ("GET", f"/items/{item.id}", None), ("DELETE", f"/items/{item.id}", None),
                               ("DELETE", "", None)):
        assert_not_found(as_two(method, base + path, json=body), unknown)
    r = as_two("POST", "/v1/responses", json={"model": MODEL, "input": "x", "conversation": conv.id})
    assert_not_found(r, unknown)
    assert r.json()["error"]["param"] == "conversation"
    # its turns' responses, streamed again, are the owner's too
    assert_not_found(as_two("GET", f"/v1/responses/{turn.id}", params={"stream": "true"}), unknown)
    owner = client(gw2, K1)
    assert owner.conversations.retrieve(conv.id).metadata == {"k": "v"}
    assert len(owner.conversations.items.list(conv.id).data) == 3
    owner.conversations.delete(conv.id)
    with pytest.raises(Exception, match="404|not found"):
        one.conversations.retrieve(conv.id)


def test_keys_file_tenants_share_limits_across_gateways(make_gateway, fake_engine, tmp_path, redis_client):
    path = keys_file(tmp_path, f"""
tenants:
  small:
    weight: 3
    limits: {{rpm: 3, tpm: 100000}}
    keys: [{K1}]
  other:
    keys: [{K2}]
""")
    gw1, gw2 = make_gateway(keys_file=path), make_gateway(keys_file=path)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4}
    answers = [httpx.post(f"{(gw1, gw2)[i % 2].url}/v1/completions", json=body, headers=auth(K1), timeout=30)
               for i in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429], [a.text for a in answers]
    for a, left in zip(answers[:3], (2, 1, 0), strict=True):
        assert a.headers["x-ratelimit-limit-requests"] == "3"
        assert a.headers["x-ratelimit-remaining-requests"] == str(left)
        assert a.headers["x-ratelimit-limit-tokens"] == "100000"
        assert int(a.headers["x-ratelimit-remaining-tokens"]) < 100000
        assert a.headers["x-ratelimit-reset-requests"].endswith("s")
    refused = answers[3]
    err = refused.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests" and "small" in err["message"]
    assert K1 not in refused.text
    assert 1 <= int(refused.headers["retry-after"]) <= 20 and int(refused.headers["retry-after-ms"]) > 0
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    # the other tenant is untouched, and has no limits: no headers
    free = httpx.post(f"{gw1.url}/v1/completions", json=body, headers=auth(K2), timeout=30)
    assert free.status_code == 200 and "x-ratelimit-limit-requests" not in free.headers
    # a limited tenant's other responses carry the headers too (read, nothing taken)
    models = httpx.get(f"{gw2.url}/v1/models", headers=auth(K1), timeout=30)
    assert models.status_code == 200 and models.headers["x-ratelimit-remaining-requests"] == "0"
    # the engine was told each request's tenant and weight
    weights = {req.tenant: req.tenant_weight for req in fake_engine.requests}
    assert weights == {"small": 3, "other": 1}
    # the counters live in the tenant's own family
    assert redis_client.exists(contract.rpm_key("small")) and not redis_client.exists(contract.rpm_key("other"))


def test_tokens_per_minute_reserved_then_corrected(make_gateway, fake_engine, tmp_path, redis_client):
    path = keys_file(tmp_path, f"tenants:\n  t:\n    limits: {{tpm: 150}}\n    keys: [{K1}]\n")
    gw = make_gateway(keys_file=path)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 100}
    first = httpx.post(f"{gw.url}/v1/completions", json=body, headers=auth(K1), timeout=30)
    assert first.status_code == 200
    reserved_left = int(first.headers["x-ratelimit-remaining-tokens"])
    assert reserved_left <= 150 - 100  # prompt + max_tokens reserved
    used = first.json()["usage"]["total_tokens"]
    assert used < 50

    def left() -> int:
        r = httpx.get(f"{gw.url}/v1/models", headers=auth(K1), timeout=30)
        return int(r.headers["x-ratelimit-remaining-tokens"])

    # what it did not use comes back at its end
    wait_until(lambda: left() >= 150 - used - 1, 10, "the unused tokens given back")
    too_big = httpx.post(f"{gw.url}/v1/completions", json={**body, "max_tokens": 200}, headers=auth(K1), timeout=30)
    assert too_big.status_code == 429
    err = too_big.json()["error"]
    assert err["type"] == "tokens" and "Request too large" in err["message"] and "retry-after" not in too_big.headers


def test_concurrency_limit_and_its_release(make_gateway, fake_engine, tmp_path, redis_client):
    path = keys_file(tmp_path, f"tenants:\n  t:\n    limits: {{concurrent: 1, queued: 1}}\n    keys: [{K1}]\n"
                               f"  u:\n    keys: [{K2}]\n")
    gw = make_gateway(keys_file=path)
    fake_engine.pause()
    import threading

    held = threading.Thread(target=httpx.post, args=(f"{gw.url}/v1/completions",),
                            kwargs={"json": {"model": MODEL, "prompt": "x", "max_tokens": 2}, "headers": auth(K1),
                                    "timeout": 30})
    held.start()
    wait_until(lambda: redis_client.zcard(contract.active_key("t")) == 1, 10, "one request holds the place")
    assert redis_client.zcard(contract.tenant_queued_key("t")) == 1
    r = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=auth(K1), timeout=30)
    assert r.status_code == 429 and "concurrent" in r.json()["error"]["message"]
    # another tenant is not held back by it (its request waits for the paused engine like any other)
    other = threading.Thread(target=httpx.post, args=(f"{gw.url}/v1/completions",),
                             kwargs={"json": {"model": MODEL, "prompt": "x", "max_tokens": 2},
                                     "headers": auth(K2), "timeout": 30})
    other.start()
    fake_engine.paused = False
    held.join(30)
    other.join(30)
    wait_until(lambda: redis_client.zcard(contract.active_key("t")) == 0, 10, "the place given back")
    assert redis_client.zcard(contract.tenant_queued_key("t")) == 0
    r = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                   headers=auth(K1), timeout=30)
    assert r.status_code == 200


def test_unknown_key_is_refused_before_the_body_is_read(make_gateway, fake_engine):
    gw = make_gateway(api_keys=[K1])
    host, port = "127.0.0.1", int(gw.url.rsplit(":", 1)[1])
    with socket.create_connection((host, port), timeout=5) as s:
        # a body of 100 MB is announced and never sent: the answer must not wait for it
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n")
        start = time.monotonic()
        reply = b""
        while b"invalid_api_key" not in reply and time.monotonic() - start < 2:
            reply += s.recv(4096)
        assert time.monotonic() - start < 2
    assert reply.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in reply
    assert httpx.get(f"{gw.url}/v1/models", timeout=10).status_code == 401  # no key at all
    assert httpx.get(f"{gw.url}/v1/models", headers=auth(K1), timeout=10).status_code == 200
    assert httpx.get(f"{gw.url}/health", timeout=10).status_code == 200  # open paths stay open


@pytest.mark.both_topologies
def test_keys_in_redis_created_and_revoked_on_every_gateway(make_gateway, fake_engine, clean_redis, capsys):
    from sluice_cli import cli

    gws = [make_gateway(redis_keys=True), make_gateway(redis_keys=True)]
    assert cli.main(["keys", "create", "--tenant", "team-r", "--name", "bot", "--rpm", "100",
                     "--redis-url", clean_redis]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("sk-sluice-")
    for gw in gws:
        wait_until(lambda gw=gw: httpx.get(f"{gw.url}/v1/models", headers=auth(key), timeout=10).status_code == 200,
                   5, "the new key accepted")
    assert cli.main(["keys", "list", "--json", "--redis-url", clean_redis]) == 0
    [listed] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert listed["tenant"] == "team-r" and listed["limits"] == {"requests_per_minute": 100}
    assert key not in json.dumps(listed)
    assert cli.main(["keys", "revoke", listed["id"], "--redis-url", clean_redis]) == 0
    start = time.monotonic()
    for gw in gws:
        wait_until(lambda gw=gw: httpx.get(f"{gw.url}/v1/models", headers=auth(key), timeout=10).status_code == 401,
                   5, "the revoked key refused")
    assert time.monotonic() - start < 5
    assert cli.main(["keys", "revoke", listed["id"], "--redis-url", clean_redis]) == 1  # nothing left to revoke


def test_keys_cli_refuses_bad_input(clean_redis, capsys):
    from sluice_cli import cli

    assert cli.main(["keys", "create", "--redis-url", clean_redis]) == 2
    assert cli.main(["keys", "create", "--tenant", "a b", "--redis-url", clean_redis]) == 2
    assert cli.main(["keys", "create", "--tenant", "a", "--rpm", "0", "--redis-url", clean_redis]) == 2
    assert cli.main(["keys", "revoke", "--redis-url", clean_redis]) == 2
    assert cli.main(["keys", "revoke", "abc", "--redis-url", clean_redis]) == 2
    err = capsys.readouterr().err
    assert "--tenant is required" in err and "tenant id" in err and "positive" in err


def test_limited_tenant_fails_closed_when_redis_is_down(make_fake_engine, restartable_redis, tmp_path):
    path = keys_file(tmp_path, f"tenants:\n  t:\n    limits: {{rpm: 100}}\n    keys: [{K1}]\n")
    make_fake_engine(restartable_redis.url)
    gw = support.GatewayServer(redis_url=restartable_redis.url, keys_file=path).start()
    try:
        ok = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                        headers=auth(K1), timeout=30)
        assert ok.status_code == 200
        restartable_redis.stop()
        r = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                       headers=auth(K1), timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] in ("redis_unavailable", "no_engine")
        assert "retry-after" in r.headers
    finally:
        gw.stop()


def test_usage_api_answers_each_tenant_its_own_on_every_gateway(make_gateway, tmp_path, redis_client):
    """GET /v1/organization/usage/completions: OpenAI's Usage API shape, from what the engines wrote
    (``usage.record``, as their step pipeline does), by UTC hour or day, the caller's tenant only."""
    from sluice.wire import usage

    path = keys_file(tmp_path, f"tenants:\n  team-a:\n    keys: [{K1}]\n  team-b:\n    keys: [{K2}]\n")
    gw1, gw2 = make_gateway(keys_file=path), make_gateway(keys_file=path)
    day = (int(time.time()) // 86400 - 1) * 86400  # yesterday, 00:00 UTC
    for hour, rows in ((day + 3600, [usage.Usage("team-a", "m1", 1, 10, 5, 4), usage.Usage("team-a", "m2", 2, 20, 6, 0)]),
                       (day + 5 * 3600, [usage.Usage("team-a", "m1", 1, 7, 3, 0)]),
                       (day + 86400, [usage.Usage("team-a", "m1", 4, 40, 12, 8)]),
                       (day + 3600, [usage.Usage("team-b", "m1", 9, 99, 99, 99)])):
        pipe = redis_client.pipeline()
        usage.record(pipe, rows, now=hour + 60)
        pipe.execute()
    url = "/v1/organization/usage/completions"

    def get(gw, key=K1, **params):
        return httpx.get(f"{gw.url}{url}", params=params, headers=auth(key), timeout=30)

    daily = get(gw1, start_time=day, end_time=day + 2 * 86400).json()
    assert daily["object"] == "page" and not daily["has_more"] and daily["next_page"] is None
    assert [b["start_time"] for b in daily["data"]] == [day, day + 86400]
    first = daily["data"][0]["results"]
    assert len(first) == 1 and first[0]["model"] is None
    assert (first[0]["num_model_requests"], first[0]["input_tokens"], first[0]["output_tokens"],
            first[0]["input_cached_tokens"]) == (4, 37, 14, 4)
    by_model = get(gw2, start_time=day, end_time=day + 86400, group_by="model").json()["data"][0]["results"]
    assert [(r["model"], r["input_tokens"]) for r in by_model] == [("m1", 17), ("m2", 20)]
    only_m2 = get(gw2, start_time=day, end_time=day + 86400, **{"models[]": "m2"}).json()["data"][0]["results"]
    assert [r["input_tokens"] for r in only_m2] == [20]
    other = get(gw1, K2, start_time=day, end_time=day + 86400).json()["data"][0]["results"]
    assert [r["num_model_requests"] for r in other] == [9]  # team-b sees its own, never team-a's

    hourly = get(gw1, start_time=day, end_time=day + 6 * 3600, bucket_width="1h", limit=4).json()
    assert [b["start_time"] for b in hourly["data"]] == [day + i * 3600 for i in range(4)]
    assert [len(b["results"]) for b in hourly["data"]] == [0, 1, 0, 0] and hourly["has_more"]
    rest = get(gw2, start_time=day, end_time=day + 6 * 3600, bucket_width="1h", limit=4,
               page=hourly["next_page"]).json()
    assert [b["start_time"] for b in rest["data"]] == [day + 4 * 3600, day + 5 * 3600] and not rest["has_more"]
    assert rest["data"][1]["results"][0]["input_tokens"] == 7

    for params, param in (({}, "start_time"), ({"start_time": "soon"}, "start_time"),
                          ({"start_time": day, "end_time": day}, "end_time"),
                          ({"start_time": day, "bucket_width": "1m"}, "bucket_width"),
                          ({"start_time": day, "limit": 32}, "limit"),
                          ({"start_time": day, "group_by": "user_id"}, "group_by"),
                          ({"start_time": day, "project_ids": "p1"}, "project_ids"),
                          ({"start_time": day, "page": "12"}, "page"),
                          ({"start_time": day, "colour": "red"}, "colour")):
        r = get(gw1, **params)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (params, r.text)
    assert httpx.get(f"{gw1.url}{url}", params={"start_time": day}, timeout=30).status_code == 401
