"""compose.yaml end to end: build, `up`, the openai SDK through the load balancer, scale the
gateways to 3, tear everything down.

Needs Docker with the base images present (``.ci/setup-docker.sh`` installs Docker, builds the
stand-ins and collects the wheels for an offline build). The project is private to the test
(its own name, network and volume) and publishes only on 127.0.0.1 at a free port.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.docker_support import DockerUnavailable, compose_command, free_port, require_docker

pytestmark = [pytest.mark.docker, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"


class Compose:
    def __init__(self, project: str, port: int) -> None:
        cmd = compose_command()
        if cmd is None:
            pytest.fail(
                "neither `docker compose` nor `docker-compose` is installed; run .ci/setup-docker.sh",
                pytrace=False,
            )
        self.base = [*cmd, "-f", str(REPO / "compose.yaml"), "-p", project]
        self.env = {**os.environ, "SLUICE_PORT": str(port), "COMPOSE_PROJECT_NAME": project}
        self.project = project

    def __call__(self, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [*self.base, *args], cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"compose {' '.join(args)} failed ({proc.returncode}):\n"
                f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        return proc

    def container_ids(self, service: str) -> list[str]:
        return [line for line in self("ps", "-q", service).stdout.split() if line]

    def health(self, container: str) -> str:
        out = subprocess.run(
            ["docker", "inspect", "--format", "{{json .State.Health}}", container],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return (json.loads(out) or {}).get("Status", "none") if out not in ("", "null") else "none"

    def wait_healthy(self, service: str, count: int, timeout: float) -> list[str]:
        deadline = time.monotonic() + timeout
        states: list[str] = []
        while time.monotonic() < deadline:
            ids = self.container_ids(service)
            states = [self.health(c) for c in ids]
            if len(ids) == count and all(s == "healthy" for s in states):
                return ids
            time.sleep(2)
        raise AssertionError(f"{service}: wanted {count} healthy containers, have {states}\n{self.logs()}")

    def logs(self, *services: str) -> str:
        return self("logs", "--no-color", "--tail", "60", *services, check=False).stdout[-8000:]


@pytest.fixture(scope="module")
def compose_stack():
    try:
        require_docker("python:3.11-slim")
        require_docker("redis:7")
    except DockerUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)
    port = free_port()
    compose = Compose(f"sluice-e2e-{os.getpid()}", port)
    timings: dict[str, float] = {}
    try:
        t0 = time.monotonic()
        compose("build", timeout=1800)
        timings["build_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        compose("up", "-d", "--no-build", timeout=900)
        _wait_http(f"http://127.0.0.1:{port}/health", timeout=900, compose=compose)
        timings["up_to_healthy_s"] = time.monotonic() - t0
        print(f"\ncompose timings: {json.dumps({k: round(v, 1) for k, v in timings.items()})}")
        yield compose, f"http://127.0.0.1:{port}"
    finally:
        t0 = time.monotonic()
        compose("down", "-v", "--remove-orphans", "--timeout", "20", timeout=300, check=False)
        print(f"compose down: {time.monotonic() - t0:.1f} s")


def _wait_http(url: str, timeout: float, compose: Compose) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url, timeout=5)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(2)
    raise AssertionError(f"{url} not healthy after {timeout:.0f} s ({last})\n{compose.logs()}")


def test_compose_serves_openai_sdk_and_scales(compose_stack) -> None:
    from openai import OpenAI

    compose, base_url = compose_stack
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)

    models = [m.id for m in client.models.list().data]
    assert MODEL in models

    completion = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert completion.choices[0].text.strip()
    assert completion.usage.completion_tokens == 8
    assert completion.choices[0].finish_reason == "length"

    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")

    # scale the gateways to 3 behind the load balancer
    t0 = time.monotonic()
    compose("up", "-d", "--no-build", "--scale", "gateway=3", timeout=600)
    gateways = compose.wait_healthy("gateway", 3, timeout=300)
    print(f"\nscale to 3 gateways: {time.monotonic() - t0:.1f} s")
    # the lb re-resolves the service name every 2 s; then each new connection goes to the next replica
    time.sleep(5)
    before = {g: _request_count(g) for g in gateways}
    for i in range(9):  # a fresh client (connection) each time
        c = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        out = c.completions.create(model=MODEL, prompt=f"Count to {i}:", max_tokens=4, temperature=0)
        assert out.choices[0].text is not None
        c.close()
    served = {g: _request_count(g) - before[g] for g in gateways}
    lb_logs = compose.logs("lb")
    assert all(n > 0 for n in served.values()), f"requests per gateway: {served}\n{lb_logs}"


def _request_count(container: str) -> int:
    """POST /v1/completions lines in a gateway container's (uvicorn access) log."""
    proc = subprocess.run(["docker", "logs", container], capture_output=True, text=True)
    return (proc.stdout + proc.stderr).count("POST /v1/completions")
