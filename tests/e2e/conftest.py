"""End-to-end fixtures: a real stack of processes (Redis in a container, an engine, gateways)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from sluice.wire.connection import connect
from tests.cluster_fixtures import clean_redis_cluster, redis_cluster, redis_cluster_factory  # noqa: F401
from tests.docker_support import free_port, free_ports
from tests.integration.conftest import clean_redis, redis_client, redis_server, redis_url  # noqa: F401
from tests.waiting import wait_http

ENGINE_FLAGS = ["--max-model-len", "2048", "--kv-cache-memory", str(256 << 20), "--max-num-batched-tokens", "512"]


@dataclass
class Stack:
    redis_url: str
    gateway_urls: list[str]
    grpc_port: int
    model_name: str
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return self.gateway_urls[0]

    def engine_stats(self):
        import grpc

        from sluice.wire import admin_pb2, admin_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}") as channel:
            return admin_pb2_grpc.EngineAdminStub(channel).GetStats(admin_pb2.GetStatsRequest(), timeout=5)

    def dump_logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in self.logs if p.exists())


CLI = [sys.executable, "-m", "sluice_cli.cli"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def start_gateway(redis: str, log: Path, extra_flags: list[str] | None = None,
                  port: int | None = None) -> tuple[subprocess.Popen, str]:
    """A `sluice gateway` process on ``port`` (default: a free one): (the process, its base URL).
    Not waited for."""
    port = port or free_port()
    proc = subprocess.Popen([*CLI, "gateway", "--redis-url", redis, "--host", "127.0.0.1", "--port", str(port),
                             *(extra_flags or [])], stdout=log.open("w"), stderr=subprocess.STDOUT, env=_env())
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(url: str, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    wait_http(f"{url}/health", timeout=timeout, procs=procs)


@contextmanager
def extra_gateway(redis: str, log: Path, extra_flags: list[str] | None = None) -> Iterator[tuple[subprocess.Popen, str]]:
    """A gateway of the test's own beside the stack (one it may ``kill -9``), healthy when yielded;
    stopped (SIGTERM, then SIGKILL after 10 s) and reaped on the way out, whatever happened."""
    proc, url = start_gateway(redis, log, extra_flags)
    try:
        wait_healthy(url, [proc])
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_stack(redis: str, model_dir: Path, log_dir: Path, num_gateways: int = 2,
                extra_gateway_flags: list[str] | None = None, extra_engine_flags: list[str] | None = None) -> Stack:
    grpc_port, *gateway_ports = free_ports(1 + num_gateways)  # distinct: none is bound before all are chosen
    stack = Stack(redis, [], grpc_port, model_dir.name)
    engine_log = log_dir / "engine.log"
    stack.logs.append(engine_log)
    stack.procs.append(subprocess.Popen(
        [*CLI, "engine", "--model", str(model_dir), "--redis-url", redis, "--grpc-port", str(grpc_port),
         *ENGINE_FLAGS, *(extra_engine_flags or [])], stdout=engine_log.open("w"), stderr=subprocess.STDOUT, env=_env()))
    for i in range(num_gateways):
        log = log_dir / f"gateway{i}.log"
        stack.logs.append(log)
        proc, url = start_gateway(redis, log, extra_gateway_flags, port=gateway_ports[i])
        stack.procs.append(proc)
        stack.gateway_urls.append(url)
    try:
        for url in stack.gateway_urls:
            wait_healthy(url, stack.procs)
    except (RuntimeError, AssertionError) as exc:
        logs = stack.dump_logs()
        stop_stack(stack)
        raise RuntimeError(f"{exc}\n{logs}") from exc
    return stack


def stop_stack(stack: Stack) -> None:
    for p in stack.procs:
        if p.poll() is None:
            p.terminate()
    for p in stack.procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def stack_redis_url(redis_topology: str, request: pytest.FixtureRequest) -> str:
    """An emptied Redis of the module's topology for its stack (see ``redis_topology``)."""
    if redis_topology == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
        cluster.heal()
        cluster.flushall()
        return cluster.url
    url = request.getfixturevalue("redis_url")
    connect(url).flushall()
    return url


@pytest.fixture(scope="module")
def stack(stack_redis_url, model_dir, tmp_path_factory) -> Iterator[Stack]:
    s = start_stack(stack_redis_url, Path(model_dir), tmp_path_factory.mktemp("stack"))
    try:
        yield s
    finally:
        stop_stack(s)
