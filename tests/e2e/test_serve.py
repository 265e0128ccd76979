"""`sluice serve`: one command brings up Redis, an engine and the gateway; Ctrl-C stops them all."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from openai import OpenAI

from sluice.cpu_placement import format_cpu_list, physical_cores
from tests.docker_support import free_port
from tests.waiting import wait_http

pytestmark = [pytest.mark.model, pytest.mark.redis]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class _Serve:
    port: int
    grpc_port: int
    code: int | None = None
    output: str = ""
    pid: int = 0


@contextlib.contextmanager
def _sluice_serve(model_dir, tmp_path, *flags: str):
    """`sluice serve` started on free ports, its API answering; on leaving, Ctrl-C and its exit
    awaited: the exit code and everything it printed on the yielded record."""
    run = _Serve(free_port(), free_port())
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    with (tmp_path / "serve.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sluice_cli.cli", "serve", "--model", str(model_dir), "--port", str(run.port),
             "--grpc-port", str(run.grpc_port), "--max-model-len", "1024", *flags],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
        run.pid = proc.pid
        try:
            wait_http(f"http://127.0.0.1:{run.port}/health", timeout=300, procs=[proc], log=tmp_path / "serve.log")
            yield run
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                run.code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
    run.output = (tmp_path / "serve.log").read_text()


def test_serve_one_command_then_ctrl_c(model_dir, tmp_path):
    with _sluice_serve(model_dir, tmp_path) as run:
        c = OpenAI(base_url=f"http://127.0.0.1:{run.port}/v1", api_key="x", max_retries=0, timeout=120)
        resp = c.chat.completions.create(model=model_dir.name, messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=8, temperature=0)
        assert resp.choices[0].message.content and resp.usage.completion_tokens <= 8
        assert _port_open(run.grpc_port)
    output = run.output
    assert run.code == 0, output
    assert not _port_open(run.port) and not _port_open(run.grpc_port)
    assert "private Redis at redis://127.0.0.1:" in output
    # the engine's start-up heap left the garbage collector's walks once it was loaded (sluice.heap)
    assert "start-up objects frozen out of the garbage collector's walks" in output
    redis_port = int(output.split("private Redis at redis://127.0.0.1:")[1].split("/")[0])
    assert not _port_open(redis_port), "the private redis-server outlived sluice serve"


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _thread_cpus(pid: int) -> set[tuple[int, ...]]:
    masks = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            masks.add(tuple(sorted(os.sched_getaffinity(int(tid)))))
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    return masks


def test_serve_reserved_cpus_keeps_redis_and_the_gateway_off_the_engines(model_dir, tmp_path):
    """--reserved-cpus 1: Redis and the gateway (every thread) on the first physical core, every
    thread of the engine on the others, with a compute thread a core; and the service answers."""
    cores = physical_cores(sorted(os.sched_getaffinity(0)))
    if len(cores) < 2:
        pytest.skip("a core for Redis and the gateway and one for the engine: this machine gives one")
    reserved, engine = tuple(cores[0]), tuple(cpu for core in cores[1:] for cpu in core)
    with _sluice_serve(model_dir, tmp_path, "--reserved-cpus", "1") as run:
        c = OpenAI(base_url=f"http://127.0.0.1:{run.port}/v1", api_key="x", max_retries=0, timeout=120)
        resp = c.completions.create(model=model_dir.name, prompt="Hello", max_tokens=4, temperature=0)
        assert resp.usage.completion_tokens == 4
        roles = {}
        for pid in _children(run.pid):
            cmdline = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            role = "redis" if "redis-server" in cmdline[0] else cmdline[3] if len(cmdline) > 3 else "?"
            roles[role] = _thread_cpus(pid)
        assert roles == {"redis": {reserved}, "gateway": {reserved}, "engine": {engine}}
    output = run.output
    assert run.code == 0, output
    assert f"pinned to CPUs {format_cpu_list(engine)}, compute threads: {len(cores) - 1} (one a physical core)" \
        in output
