"""The engine's admin surface: gRPC (health, GetStats, ``Drain``) and Prometheus metrics bind
loopback unless a flag says otherwise (whoever reaches the port could drain the engine), and
``--admin-token`` makes ``Drain`` ask for ``authorization: Bearer TOKEN``.

A fake worker stands in for the step loop: what is tested is the server, not the drain itself
(tests/integration/test_engine_service.py drains a real one).
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from engine_service.service import main as engine_main
from engine_service.service.admin import AdminServer
from engine_service.service.metrics import EngineMetrics
from sluice.wire import admin_pb2, admin_pb2_grpc
from sluice.wire.stats import EngineStats


def listening_addresses(port: int) -> set[str]:
    """The local addresses of TCP sockets in LISTEN state on ``port``, from /proc/net/tcp{,6}."""
    found = set()
    for name, width in (("tcp", 4), ("tcp6", 16)):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            hex_addr, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(hex_addr)
            # the kernel prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
            found.add(str(ipaddress.ip_address(raw)))
    return found


def is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_settings(*argv: str):
    parser = argparse.ArgumentParser()
    engine_main.add_arguments(parser)
    return engine_main.settings_from_args(parser.parse_args(["--model", "m", *argv]))


@dataclass
class FakeWorker:
    running: bool = True
    draining: bool = False
    drains: list = field(default_factory=list)
    on_serving_change: list = field(default_factory=list)

    def snapshot(self) -> EngineStats:
        return EngineStats(engine_id="e", running=1, waiting=2)

    def request_drain(self, grace: float | None = None, cause: str = "") -> None:
        self.drains.append(grace)
        self.draining = True


@pytest.fixture
def admin(request):
    servers = []

    def make(host: str, token: str | None = None) -> tuple[AdminServer, FakeWorker]:
        worker = FakeWorker()
        server = AdminServer(worker, "e", "m", free_port(), host, token=token)
        server.start()
        servers.append(server)
        return server, worker

    yield make
    for s in servers:
        s.stop(grace=0)


def test_defaults_bind_loopback(monkeypatch):
    monkeypatch.delenv("SLUICE_ADMIN_TOKEN", raising=False)
    s = default_settings()
    assert (s.grpc_host, s.metrics_host, s.admin_token) == ("127.0.0.1", "127.0.0.1", None)
    s = default_settings("--grpc-host", "0.0.0.0", "--metrics-host", "0.0.0.0", "--admin-token", "t")
    assert (s.grpc_host, s.metrics_host, s.admin_token) == ("0.0.0.0", "0.0.0.0", "t")
    monkeypatch.setenv("SLUICE_ADMIN_TOKEN", "from-env")
    assert default_settings().admin_token == "from-env"


def test_grpc_and_metrics_listen_where_told(admin):
    s = default_settings()
    server, _ = admin(s.grpc_host)
    addrs = listening_addresses(server.port)
    assert addrs and all(is_loopback(a) for a in addrs), addrs
    metrics = EngineMetrics("m", "e")
    try:
        port = metrics.serve(free_port(), s.metrics_host)
        addrs = listening_addresses(port)
        assert addrs and all(is_loopback(a) for a in addrs), addrs
    finally:
        metrics.close()
    # told otherwise, it listens on every interface (what a container behind a probe needs)
    server, _ = admin("0.0.0.0")
    assert not any(is_loopback(a) for a in listening_addresses(server.port))


def drain(port: int, token: str | None = None) -> admin_pb2.DrainResponse:
    metadata = (("authorization", f"Bearer {token}"),) if token is not None else None
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return admin_pb2_grpc.EngineAdminStub(channel).Drain(admin_pb2.DrainRequest(grace_period_s=7.0), timeout=5,
                                                              metadata=metadata)


def test_drain_needs_the_token_when_one_is_set(admin):
    server, worker = admin("127.0.0.1", token="s3cret")
    for wrong in (None, "", "nope", "s3cret-but-longer"):
        with pytest.raises(grpc.RpcError) as info:
            drain(server.port, wrong)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "--admin-token" in info.value.details()
    assert worker.drains == [] and not worker.draining
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:  # stats stay open (read-only)
        assert admin_pb2_grpc.EngineAdminStub(channel).GetStats(admin_pb2.GetStatsRequest(), timeout=5).waiting == 2
    reply = drain(server.port, "s3cret")
    assert reply.accepted and worker.drains == [7.0]


def test_drain_without_a_token_configured_is_open(admin):
    server, worker = admin("127.0.0.1")
    assert drain(server.port).accepted and worker.drains == [7.0]
