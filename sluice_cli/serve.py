"""``sluice serve``: the whole service on one machine in one command.

Starts a private ``redis-server`` (unless ``--redis-url``/``$REDIS_URL`` names one), one engine and
the gateway, prepares the default model on first use, waits until the API answers, and on
Ctrl-C (or SIGTERM) stops every process it started, in the reverse order: the gateway, then the
engine (which drains), then Redis.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from engine_service.config import add_engine_arguments, engine_cli_args, engine_config_from_args
from sluice.cpu_placement import format_cpu_list, physical_cores, pin_process, usable_cpus

# Redis persists its data with an append-only file, fsynced every second: a Redis restart loses at
# most the last second of queue (the same settings as compose.yaml and deploy/k8s).
REDIS_DURABILITY = ("--appendonly", "yes", "--appendfsync", "everysec")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout: float, what: str, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: a process it needs exited with {p.returncode}")
        if predicate():
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what}: not ready after {timeout:.0f}s")


def _redis_ready(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200
    except Exception:
        return False


def _reserve_cpus(count: int, engine_config, own_redis: bool) -> list[int] | None:
    """The CPUs Redis and the gateway run on, whole physical cores from the first of those this
    command may use, at least ``count`` of them; the engine's --cpus set to the others. None for 0.
    Raises ValueError naming the flag when the split cannot be made."""
    if count == 0:
        return None
    if engine_config.cpus is not None:
        raise ValueError("give --reserved-cpus or --cpus, not both")
    usable = usable_cpus()
    cores = physical_cores(usable)
    if count < 0 or count > len(usable) - len(cores[-1]):
        raise ValueError(f"--reserved-cpus must be from 0 to {len(usable) - len(cores[-1])} here (this process may "
                         f"use CPUs {format_cpu_list(usable)}, {len(cores)} physical cores, and the engine needs "
                         f"one core), got {count}")
    reserved: list[int] = []
    while len(reserved) < count:  # a core's SMT siblings stay together: never a core shared with the engine
        reserved += cores.pop(0)
    engine_config.cpus = format_cpu_list([cpu for core in cores for cpu in core])
    print(f"sluice serve: {'Redis and the gateway' if own_redis else 'the gateway'} on CPUs "
          f"{format_cpu_list(reserved)}, the engine on {engine_config.cpus}", file=sys.stderr)
    return reserved


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=1, help="gateway worker processes")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                        help="use this Redis instead of starting a private one ($REDIS_URL)")
    parser.add_argument("--grpc-port", type=int, default=50051, help="the engine's gRPC health/admin port")
    parser.add_argument("--api-key", default=None, help="require this Bearer key at the gateway")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="the engine's Prometheus /metrics port, on 127.0.0.1 (0: off)")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--reserved-cpus", type=int, default=0, metavar="N",
                        help="run Redis and the gateway on the first N CPUs this process may use (whole physical "
                             "cores: a core's SMT siblings go together) and the engine on the rest (its --cpus), "
                             "so that their work never stalls the engine's compute threads; 0 (the default): "
                             "every process on every CPU")
    # Every engine knob, generated from EngineConfig (torch-free), forwarded to `sluice engine`.
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    procs: list[subprocess.Popen] = []
    names: dict[int, str] = {}
    tmp = None

    def stop(*_: object) -> None:
        raise KeyboardInterrupt

    # Installed explicitly: a process started in the background by a shell without job control
    # inherits SIGINT ignored, and Python then never raises KeyboardInterrupt for Ctrl-C.
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        engine_config = engine_config_from_args(args)
        try:
            reserved = _reserve_cpus(args.reserved_cpus, engine_config, own_redis=not args.redis_url)
        except ValueError as exc:
            print(f"sluice serve: {exc}", file=sys.stderr)
            return 2
        if engine_config.model is None:
            from engine_service.model.prepare import ModelPrepareError, prepare_default_model

            try:
                engine_config.model = str(prepare_default_model(progress=True))
            except ModelPrepareError as exc:
                print(f"sluice serve: {exc}", file=sys.stderr)
                return 1

        if reserved is not None:  # after the model's preparation, which may take every CPU once. This
            # command, and so Redis and the gateway it starts (the engine moves itself to its --cpus
            # before it loads torch); the CPUs are some of its own, which Linux cannot refuse it
            pin_process(reserved)
        redis_url = args.redis_url
        if not redis_url:
            server = shutil.which("redis-server")
            if server is None:
                print("sluice serve: redis-server not found; install it (apt-get install redis-server) "
                      "or pass --redis-url", file=sys.stderr)
                return 1
            tmp = tempfile.mkdtemp(prefix="sluice-redis-")
            port = _free_port()
            procs.append(subprocess.Popen(
                [server, *REDIS_DURABILITY, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--dir", tmp], stdout=subprocess.DEVNULL, start_new_session=True))
            names[procs[-1].pid] = "redis-server"
            _wait(lambda: _redis_ready(port), 10, "redis-server", procs)
            redis_url = f"redis://127.0.0.1:{port}/0"
            print(f"sluice serve: private Redis at {redis_url}", file=sys.stderr)

        cli = [sys.executable, "-m", "sluice_cli.cli"]
        # The admin port's Drain needs no credentials: on this machine only.
        engine_cmd = [*cli, "engine", "--redis-url", redis_url, "--grpc-port", str(args.grpc_port),
                      "--grpc-host", "127.0.0.1", *engine_cli_args(engine_config)]
        if args.metrics_port:
            engine_cmd += ["--metrics-port", str(args.metrics_port), "--metrics-host", "127.0.0.1"]
        procs.append(subprocess.Popen(engine_cmd, start_new_session=True))
        names[procs[-1].pid] = "engine"
        gateway_cmd = [*cli, "gateway", "--redis-url", redis_url, "--host", args.host, "--port", str(args.port),
                       "--workers", str(args.workers)]
        if args.api_key:
            gateway_cmd += ["--api-key", args.api_key]
        procs.append(subprocess.Popen(gateway_cmd, start_new_session=True))
        names[procs[-1].pid] = "gateway"

        health = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}/health"
        _wait(lambda: _http_ok(health), args.ready_timeout, "gateway health", procs)
        print(f"sluice serve: ready — OpenAI API at http://{args.host}:{args.port}/v1 (Ctrl-C stops)",
              file=sys.stderr)
        while True:
            for p in procs:
                if p.poll() is not None:
                    print(f"sluice serve: {names[p.pid]} exited with {p.returncode}; stopping", file=sys.stderr)
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        return 0
    except RuntimeError as exc:
        print(f"sluice serve: {exc}", file=sys.stderr)
        return 1
    finally:
        # Children run in their own sessions, so Ctrl-C reaches only this process, which stops
        # them in order: gateway and engine first (the engine drains on SIGTERM), Redis last.
        # A second Ctrl-C (or SIGTERM) kills whatever is left.
        def force(*_: object) -> None:
            for p in procs:
                if p.poll() is None:
                    p.kill()

        signal.signal(signal.SIGINT, force)
        signal.signal(signal.SIGTERM, force)
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
