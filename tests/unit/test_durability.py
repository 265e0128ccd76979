"""Redis runs with AOF (appendfsync everysec) wherever Sluice starts it, and `sluice serve` keeps
the engine's credential-less gRPC admin on loopback."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def _aof(args: list[str]) -> None:
    pairs = dict(zip(args, args[1:], strict=False))
    assert pairs.get("--appendonly") == "yes", args
    assert pairs.get("--appendfsync") == "everysec", args


def test_compose_redis_uses_aof_on_a_volume():
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    redis = compose["services"]["redis"]
    _aof(redis["command"])
    assert any(v.endswith(":/data") for v in redis["volumes"])


def test_k8s_redis_uses_aof():
    for doc in yaml.safe_load_all((REPO / "deploy" / "k8s" / "20-redis.yaml").read_text()):
        if doc and doc["kind"] == "Deployment":
            (container,) = doc["spec"]["template"]["spec"]["containers"]
            _aof(container["args"])
            return
    pytest.fail("no Redis Deployment")


def test_serve_starts_redis_with_aof_and_binds_admin_on_loopback(monkeypatch, tmp_path):
    from sluice_cli import serve

    commands: list[list[str]] = []

    class FakeProc:
        _next = 1000

        def __init__(self, cmd, **_kw):
            commands.append([str(c) for c in cmd])
            FakeProc._next += 1
            self.pid = FakeProc._next
            self.returncode = None

        def poll(self):  # the gateway "exits" once everything is started: ends the watch loop
            return 1 if len(commands) >= 3 else None

        def send_signal(self, _sig): ...
        def wait(self, timeout=None): return 0
        def kill(self): ...

    monkeypatch.setattr(serve.subprocess, "Popen", FakeProc)
    monkeypatch.setattr(serve, "_redis_ready", lambda port: True)
    monkeypatch.setattr(serve, "_http_ok", lambda url: True)
    monkeypatch.setattr(serve.shutil, "which", lambda name: "/usr/bin/redis-server")
    monkeypatch.setattr(serve, "_check_ports", lambda values: None)  # nothing listens: the ports may be anyone's
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--model", str(tmp_path), "--ready-timeout", "5"])
    args.redis_url = None
    serve.run(args)
    redis_cmd, engine_cmd = commands[0], commands[1]
    assert redis_cmd[0].endswith("redis-server")
    _aof(redis_cmd)
    pairs = dict(zip(engine_cmd, engine_cmd[1:], strict=False))
    assert "engine" in engine_cmd and pairs.get("--grpc-host") == "127.0.0.1", engine_cmd
