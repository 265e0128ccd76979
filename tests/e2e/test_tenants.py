"""Tenants with real processes: Redis, a real engine and two `sluice gateway` processes given one keys
file and `--redis-keys`.

- another tenant's stored and background responses are 404s on either gateway, its owner's are not;
- a tenant's requests per minute are counted once across both gateways (429 with the headers);
- a key made with `sluice keys create` works on both gateways and, revoked, stops on both in seconds;
- the gateways' logs name no response id and no key.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import CLI, _env, start_stack, stop_stack
from tests.waiting import wait_until

pytestmark = [pytest.mark.model, pytest.mark.redis]

K_LIMITED, K_OTHER = "sk-e2e-limited-0123456789", "sk-e2e-other-0123456789"


@pytest.fixture(scope="module")
def tenant_stack(stack_redis_url, model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("tenant-stack")
    keys = logs / "keys.yaml"
    keys.write_text(f"""
tenants:
  limited:
    weight: 2
    limits: {{rpm: 4}}
    keys: [{K_LIMITED}]
  other:
    keys: [{K_OTHER}]
""")
    stack = start_stack(stack_redis_url, Path(model_dir), logs,
                        extra_gateway_flags=["--keys-file", str(keys), "--redis-keys"])
    try:
        yield stack
    finally:
        stop_stack(stack)


def client(url: str, key: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def test_isolation_across_gateway_processes(tenant_stack):
    gw1, gw2 = tenant_stack.gateway_urls
    other = client(gw1, K_OTHER)
    stored = other.responses.create(model=tenant_stack.model_name, input="Name a colour.", max_output_tokens=4,
                                    temperature=0)
    background = other.responses.create(model=tenant_stack.model_name, input="Name a fruit.", background=True,
                                        max_output_tokens=4, temperature=0)
    wait_until(lambda: client(gw2, K_OTHER).responses.retrieve(background.id).status not in ("queued", "in_progress"),
               120, "the background response ends")
    for rid in (stored.id, background.id):
        for method, path in (("GET", f"/v1/responses/{rid}"), ("GET", f"/v1/responses/{rid}/input_items"),
                             ("POST", f"/v1/responses/{rid}/cancel"), ("DELETE", f"/v1/responses/{rid}")):
            r = httpx.request(method, f"{gw2}{path}", headers={"Authorization": f"Bearer {K_LIMITED}"}, timeout=30)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (method, path, r.text)
        assert client(gw2, K_OTHER).responses.retrieve(rid).id == rid
    logs = "\n".join(Path(p).read_text(errors="replace") for p in tenant_stack.logs[1:])
    assert stored.id not in logs and background.id not in logs  # the access log shows /v1/responses/{id}
    assert "/v1/responses/{id}" in logs
    assert K_LIMITED not in logs and K_OTHER not in logs


def test_requests_per_minute_shared_by_two_gateway_processes(tenant_stack):
    urls = tenant_stack.gateway_urls
    body = {"model": tenant_stack.model_name, "prompt": "Hi", "max_tokens": 1}
    codes, last = [], None
    for i in range(5):
        last = httpx.post(f"{urls[i % 2]}/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {K_LIMITED}"})
        codes.append(last.status_code)
    assert codes == [200, 200, 200, 200, 429], codes
    assert last.json()["error"]["code"] == "rate_limit_exceeded" and int(last.headers["retry-after"]) >= 1
    assert last.headers["x-ratelimit-limit-requests"] == "4" and last.headers["x-ratelimit-remaining-requests"] == "0"
    # the other tenant does not feel it
    ok = httpx.post(f"{urls[1]}/v1/completions", json=body, timeout=120, headers={"Authorization": f"Bearer {K_OTHER}"})
    assert ok.status_code == 200


def test_sluice_keys_create_and_revoke_reach_both_gateways(tenant_stack):
    run = lambda *args: subprocess.run([*CLI, "keys", *args, "--redis-url", tenant_stack.redis_url],  # noqa: E731
                                       capture_output=True, text=True, timeout=60, env=_env())
    made = run("create", "--tenant", "made-by-cli", "--name", "e2e")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()

    def status(url: str) -> int:
        return httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code

    for url in tenant_stack.gateway_urls:
        wait_until(lambda url=url: status(url) == 200, 10, "the new key accepted")
    listed = run("list", "--tenant", "made-by-cli")
    assert listed.returncode == 0 and "made-by-cli" in listed.stdout and key not in listed.stdout
    key_id = listed.stdout.splitlines()[1].split()[0]
    revoked = run("revoke", key_id)
    assert revoked.returncode == 0, revoked.stderr
    start = time.monotonic()
    for url in tenant_stack.gateway_urls:
        wait_until(lambda url=url: status(url) == 401, 10, "the revoked key refused")
    assert time.monotonic() - start < 5
