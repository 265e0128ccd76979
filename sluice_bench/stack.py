"""The one way a benchmark starts and stops the Sluice processes it measures on this machine.

A ``Stack`` is a context manager. Inside it a bench asks for what it needs, in order:

- ``redis(url=None)``: a private ``redis-server`` on a free 127.0.0.1 port (no persistence, its
  files in the stack's scratch directory), or ``url`` as given (an outside Redis: nothing started);
- ``cluster(masters, replicas)``: a local Redis Cluster of ``redis-server`` processes
  (``sluice_bench.redis_cluster``, the same class the tests use);
- ``engine(redis_url, args)`` and ``gateway(redis_url, args)``: ``sluice engine`` and
  ``sluice gateway`` processes (``python -m sluice_cli.cli``), optionally from another checkout
  (``source``: its directory goes first on their PYTHONPATH and is their working directory, so an
  old and a new tree can run side by side);
- ``wait_ready(gateway)``: until the gateway lists a model (an engine has published its card and
  is alive), failing at once, with the log's path, when any process of the stack has exited.

Every process runs in its own session (a Ctrl-C of the bench reaches them only through ``stop``)
and writes to one log file in the scratch directory. ``stop()`` (also on leaving the ``with``)
stops them in the reverse order of their start: gateways, then engines (SIGINT: they drain), then
Redis; a process still running 10 s later is killed. The scratch directory goes with them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

HOST = "127.0.0.1"
STOP_TIMEOUT_S = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 2.0) -> bytes | None:
    """The body of a 2xx answer, or None (nothing listening yet, an error status, a timeout)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read()
    except Exception:  # noqa: BLE001 - not up yet
        return None


def http_answers(url: str, timeout: float = 2.0) -> bool:
    """Whether anything answers HTTP at ``url``, whatever the status (a gateway without an engine
    answers /health with 503)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True
    except Exception:  # noqa: BLE001 - not listening yet
        return False


class StackError(RuntimeError):
    """A process of the stack did not start (the message names it and the log)."""


@dataclass
class Proc:
    """One started process: its role, the Popen, and where it listens (0: nowhere known)."""

    name: str
    popen: subprocess.Popen
    port: int = 0

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


@dataclass
class Stack:
    """Redis, engines and gateways of one bench run; see the module docstring."""

    label: str = "bench"
    source: Path | None = None  # a checkout to run the processes from (default: this one)
    env: dict[str, str] = field(default_factory=dict)  # added to every process's environment
    extra_path: str = ""  # appended to the processes' PYTHONPATH
    procs: list[Proc] = field(default_factory=list)
    scratch: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="sluice-bench-")))
    _log: IO[str] | None = None
    _clusters: list = field(default_factory=list)

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def log_path(self) -> Path:
        return self.scratch / "log.txt"

    def _log_file(self) -> IO[str]:
        if self._log is None:
            self._log = open(self.log_path, "a")  # noqa: SIM115 - closed by stop()
        return self._log

    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        path = [str(self.source)] if self.source else []
        path += [p for p in (os.environ.get("PYTHONPATH", ""), self.extra_path) if p]
        env = {**os.environ, **self.env, **(extra or {})}
        if path:
            env["PYTHONPATH"] = os.pathsep.join(path)
        return env

    def _start(self, name: str, cmd: list[str], port: int = 0, env: dict[str, str] | None = None,
               quiet: bool = False) -> Proc:
        log = self._log_file()
        popen = subprocess.Popen(cmd, cwd=self.source, env=self._env(env), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL if quiet else log,
                                 stderr=subprocess.DEVNULL if quiet else log, start_new_session=True)
        proc = Proc(name, popen, port)
        self.procs.append(proc)
        return proc

    def get(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    # --- Redis ---------------------------------------------------------------------------------

    def redis(self, url: str | None = None, timeout: float = 10.0) -> str:
        """``url`` when given; else a private redis-server's URL once it answers PING."""
        if url:
            return url
        server = shutil.which(os.environ.get("SLUICE_TEST_REDIS_SERVER", "redis-server"))
        if server is None:
            raise StackError("redis-server not found: install it (apt-get install redis-server) or pass a Redis URL")
        port = free_port()
        proc = self._start("redis", [server, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no",
                                     "--dir", str(self.scratch)], port, quiet=True)
        self._wait(lambda: _pings(port), timeout, "redis-server")
        return f"redis://{HOST}:{proc.port}/0"

    def cluster(self, masters: int = 3, replicas: int = 0):
        """A started local Redis Cluster (``sluice_bench.redis_cluster.LocalRedisCluster``)."""
        from sluice_bench.redis_cluster import LocalRedisCluster

        cluster = LocalRedisCluster(masters=masters, replicas_per_master=replicas)
        cluster.start()
        self._clusters.append(cluster)
        return cluster

    # --- Sluice processes ----------------------------------------------------------------------

    def engine(self, redis_url: str, args: list[str] | tuple[str, ...] = (), name: str | None = None,
               env: dict[str, str] | None = None, metrics_port: int | None = None) -> Proc:
        """``sluice engine --redis-url URL --grpc-port 0 [--metrics-port P] ARGS``; ``port`` is the
        metrics port (0 when none was asked for)."""
        cmd = [sys.executable, "-m", "sluice_cli.cli", "engine", "--redis-url", redis_url, "--grpc-port", "0"]
        port = free_port() if metrics_port == 0 else (metrics_port or 0)
        if port:
            cmd += ["--metrics-port", str(port)]
        name = name or f"engine{sum(p.name.startswith('engine') for p in self.procs) or ''}"
        return self._start(name, [*cmd, *args], port, env)

    def gateway(self, redis_url: str, args: list[str] | tuple[str, ...] = (), name: str | None = None,
                port: int | None = None, env: dict[str, str] | None = None) -> Proc:
        """``sluice gateway --redis-url URL --host 127.0.0.1 --port P ARGS``."""
        port = port or free_port()
        cmd = [sys.executable, "-m", "sluice_cli.cli", "gateway", "--redis-url", redis_url, "--host", HOST,
               "--port", str(port)]
        name = name or f"gateway{sum(p.name.startswith('gateway') for p in self.procs) or ''}"
        return self._start(name, [*cmd, *args], port, env)

    def command(self, name: str, cmd: list[str], port: int = 0) -> Proc:
        """Another server the bench compares against (llama-server), stopped with the stack."""
        return self._start(name, cmd, port)

    def wait_ready(self, gateway: Proc, timeout: float = 180.0) -> str:
        """The first model the gateway lists (an engine is alive and its card published)."""
        model: list[str] = []

        def listed() -> bool:
            body = http_get(f"{gateway.url}/v1/models")
            data = json.loads(body).get("data") if body else None
            if data:
                model.append(data[0]["id"])
            return bool(data)

        self._wait(listed, timeout, f"{gateway.name} listing a model")
        return model[0]

    def wait_http(self, url: str, timeout: float = 60.0) -> None:
        """Until anything answers HTTP at ``url``, whatever the status."""
        self._wait(lambda: http_answers(url), timeout, url)

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        """Until ``predicate()``, failing at once when a process of the stack has exited."""
        self._wait(predicate, timeout, what)

    def _wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.popen.poll() is not None:
                    raise StackError(f"{self.label}: {proc.name} exited with {proc.popen.returncode} while waiting "
                                     f"for {what} (log: {self.log_path})")
            if predicate():
                return
            time.sleep(0.1)
        raise StackError(f"{self.label}: no {what} after {timeout:.0f} s (log: {self.log_path})")

    # --- stopping ------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every process, newest first (engines drain on SIGINT); kill what outlives 10 s."""
        for proc in reversed(self.procs):
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGINT if proc.name.startswith("engine") else signal.SIGTERM)
            try:
                proc.popen.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()
        self.procs.clear()
        for cluster in reversed(self._clusters):
            cluster.stop()
        self._clusters.clear()
        if self._log is not None:
            self._log.close()
            self._log = None
        shutil.rmtree(self.scratch, ignore_errors=True)


def _pings(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


_TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> list[tuple[int, str, float]]:
    """(thread id, thread name, CPU seconds so far) of every thread of ``pid``, from /proc."""
    out = []
    base = Path(f"/proc/{pid}/task")
    for task in base.iterdir() if base.exists() else []:
        try:
            stat = (task / "stat").read_text()
            comm = (task / "comm").read_text().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out.append((int(task.name), comm, (int(fields[11]) + int(fields[12])) / _TICK))
    return out
