"""The configuration of real processes: ``--config`` files drive a real ``sluice engine`` and
``sluice gateway``; a second engine on a taken gRPC port stops naming the flag; ``sluice serve``
puts no secret on its children's command lines, and the admin token it generates drains its
engine; every process starts with one ready line and no health-poll noise."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest

from sluice.wire import admin_pb2, admin_pb2_grpc
from tests.docker_support import free_ports
from tests.waiting import wait_http, wait_until

pytestmark = [pytest.mark.model, pytest.mark.redis]

CLI = [sys.executable, "-m", "sluice_cli.cli"]
API_KEY = "sk-e2e-config-0123456789"
SMALL_ENGINE = {"max-model-len": 1024, "kv-cache-memory": 128 << 20, "max-num-batched-tokens": 512}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("REDIS_URL", "SLUICE_REDIS_URL", "SLUICE_API_KEY", "SLUICE_ADMIN_TOKEN")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat_line = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat_line.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _drain(grpc_port: int, token: str | None) -> admin_pb2.DrainResponse:
    metadata = [("authorization", f"Bearer {token}")] if token else []
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        return admin_pb2_grpc.EngineAdminStub(channel).Drain(admin_pb2.DrainRequest(grace_period_s=5),
                                                               metadata=metadata, timeout=10)


def test_serve_keeps_secrets_off_its_childrens_command_lines(model_dir, tmp_path):
    port, grpc_port = free_ports(2)
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [*CLI, "serve", "--model", str(model_dir), "--port", str(port), "--grpc-port", str(grpc_port),
             "--max-model-len", "1024", "--api-key", API_KEY], stdout=log, stderr=subprocess.STDOUT, env=_env())
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=300, procs=[proc], log=log_path)
        output = log_path.read_text()
        found = re.search(r"admin token \(EngineAdmin\.Drain asks for it\) is in (\S+)", output)
        assert found, output
        token_file = Path(found.group(1))
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
        token = token_file.read_text().strip()
        assert len(token) >= 32
        # every process serve started, and theirs: the key, the token and the files' contents nowhere
        descendants = _descendants(proc.pid)
        lines = [_cmdline(pid) for pid in descendants]
        assert any(" engine " in line for line in lines) and any(" gateway " in line for line in lines), lines
        for line in lines:
            assert API_KEY not in line and token not in line, line
        assert any("--api-key-file" in line for line in lines) and any("--admin-token-file" in line for line in lines)
        # the key the gateway was given works, and is required
        url = f"http://127.0.0.1:{port}/v1/models"
        assert httpx.get(url, timeout=10).status_code == 401
        assert httpx.get(url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).status_code == 200
        # the generated token is the engine's: Drain without it is refused, with it accepted
        with pytest.raises(grpc.RpcError) as refused:
            _drain(grpc_port, None)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError):
            _drain(grpc_port, "not-the-token")
        assert _drain(grpc_port, token).accepted
        # the drained engine exits; serve stops the rest and removes the secrets' directory
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    output = log_path.read_text()
    assert code == 1 and "sluice serve: engine exited with 0; stopping" in output, output
    assert not token_file.parent.exists()
    # a clean start: one ready line a process, and the health polls serve made are not logged
    assert output.count("sluice serve: ready — OpenAI API at") == 1
    assert len(re.findall(r"engine \S+ ready: model '[^']+' on cpu, \w+; queue on redis://127\.0\.0\.1:\d+/0, "
                          rf"gRPC health/admin on 127\.0\.0\.1:{grpc_port} \(Drain needs the admin token\)",
                          output)) == 1, output
    assert output.count(f"gateway ready: OpenAI API at http://127.0.0.1:{port}/v1") == 1, output
    assert "GET /health" not in output and "Uvicorn running" not in output
    assert "created consumer group" not in output


def _yaml(path: Path, values: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(values))
    return path


@pytest.mark.docker
def test_config_files_drive_a_real_engine_and_gateway(model_dir, clean_redis, tmp_path):
    grpc_port, port = free_ports(2)
    (tmp_path / "redis-url").write_text(clean_redis + "\n")
    (tmp_path / "keys").write_text(f"# keys\n{API_KEY}\n")
    engine_cfg = _yaml(tmp_path / "engine.yaml", {
        "model": str(model_dir), "redis_url_file": "redis-url", "grpc-port": grpc_port,
        "served-model-name": "from-the-file", **SMALL_ENGINE})
    gateway_cfg = _yaml(tmp_path / "gateway.yaml", {
        "redis-url": clean_redis, "host": "127.0.0.1", "port": port, "api-key-file": str(tmp_path / "keys"),
        "max-queue-len": 50})
    engine_log, gateway_log = tmp_path / "engine.log", tmp_path / "gateway.log"
    procs = [subprocess.Popen([*CLI, "engine", "--config", str(engine_cfg)], stdout=engine_log.open("w"),
                              stderr=subprocess.STDOUT, env=_env()),
             subprocess.Popen([*CLI, "gateway", "--config", str(gateway_cfg)], stdout=gateway_log.open("w"),
                              stderr=subprocess.STDOUT, env=_env())]
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=300, procs=procs, log=engine_log)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", headers=headers, timeout=120,
                           json={"model": "from-the-file", "prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 3
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                          json={"model": "from-the-file", "prompt": "x"}).status_code == 401
        # a second engine on the same gRPC port stops at once, naming the flag (grpc shared the
        # port silently before: SO_REUSEPORT); so does a second gateway on the same HTTP port
        second = subprocess.run([*CLI, "engine", "--config", str(engine_cfg)], capture_output=True, text=True,
                                env=_env(), timeout=120)
        assert second.returncode == 2, second.stderr
        assert f"--grpc-port {grpc_port}: cannot listen on 127.0.0.1:{grpc_port}: the address is already in use" \
            in second.stderr
        assert "loading the model" not in second.stderr  # refused before the long part of the start
        second = subprocess.run([*CLI, "gateway", "--config", str(gateway_cfg)], capture_output=True, text=True,
                                env=_env(), timeout=60)
        assert second.returncode == 2 and f"--port {port}: cannot listen on 127.0.0.1:{port}" in second.stderr
        # the effective configuration, as sluice config --print shows it
        shown = subprocess.run([*CLI, "config", "--print", "engine", "--config", str(engine_cfg), "--seed", "3"],
                               capture_output=True, text=True, env=_env(), check=True, timeout=60).stdout
        assert re.search(rf"served-model-name: +from-the-file +# file \({re.escape(str(engine_cfg))}\)", shown)
        assert re.search(r"seed: +3 +# flag \(--seed\)", shown) and re.search(r"block-size: +16 +# default", shown)
        assert re.search(r"redis-url: +\S+ +# file \(.*redis_url_file redis-url\)", shown), shown
        wait_until(lambda: "ready: model 'from-the-file'" in engine_log.read_text(), 30, "the engine's ready line")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
    engine_out, gateway_out = engine_log.read_text(), gateway_log.read_text()
    assert re.search(rf"ready: model 'from-the-file' from {re.escape(str(model_dir))} on cpu, \w+; queue on "
                     rf"{re.escape(clean_redis)}, gRPC health/admin on 127\.0\.0\.1:{grpc_port}$", engine_out, re.M), \
        engine_out
    assert gateway_out.count(f"gateway ready: OpenAI API at http://127.0.0.1:{port}/v1") == 1, gateway_out
    assert "API keys required (--api-key)" in gateway_out
    assert "GET /health" not in gateway_out and "Uvicorn running" not in gateway_out, gateway_out
