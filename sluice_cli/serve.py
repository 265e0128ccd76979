"""``sluice serve``: the whole service on one machine in one command.

Starts a private ``redis-server`` (unless ``--redis-url``/``$SLUICE_REDIS_URL``/``$REDIS_URL`` names
one), one engine and the gateway, prepares the default model on first use, waits until the API
answers, and on Ctrl-C (or SIGTERM) stops every process it started, in the reverse order: the
gateway, then the engine (which drains), then Redis.

Every engine, engine-service and gateway knob is a flag (and a ``--config`` key) of ``sluice
serve`` too: it forwards the values that differ from the defaults to the process that takes them.
Secrets (the Redis URL, the API keys, the engine's admin token) never go on a child's command line:
each is written to a 0600 file in a private directory and passed as ``--FLAG-file PATH``. Without
an admin token, serve generates one for its engine and prints where it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

from engine_service.config import EngineConfig
from engine_service.service import main as engine_main
from engine_service.service.settings import ServiceSettings
from gateway import main as gateway_main
from gateway.config import GatewayConfig
from sluice.config import KnobSet, changed_argv, from_args, knob, settings_of
from sluice.config import add_arguments as add_knob_arguments
from sluice.cpu_placement import format_cpu_list, physical_cores, pin_process, usable_cpus
from sluice.ports import PortInUse, check_port_free

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


@dataclass
class ServeSettings:
    """``sluice serve``'s own knobs; two of them shadow a child's knob of the same name with
    serve's own meaning (the API's address; a Redis of the user's instead of a private one)."""

    knob_title = "sluice serve"  # its --help group and docs section (a class attribute, not a knob)

    host: str = knob("127.0.0.1", "address of the OpenAI API (the gateway's --host; this machine only by "
                     "default)", shadows=True)
    redis_url: str | None = knob(None, "use this Redis instead of starting a private one", env=("SLUICE_REDIS_URL",
                                 "REDIS_URL"), secret=True, shadows=True, metavar="URL")
    ready_timeout: float = knob(600.0, "seconds to wait for the API to answer before giving up",
                                bounds=(1, None))
    reserved_cpus: int = knob(  # its range depends on the machine: checked by _reserve_cpus
        0, "run Redis and the gateway on the first N CPUs this process may use (whole physical cores: a core's "
        "SMT siblings go together) and the engine on the rest (its --cpus), so that their work never stalls the "
        "engine's compute threads; 0: every process on every CPU", metavar="N")


# sluice serve's knobs: its own, then every knob of the processes it starts
KNOBS = KnobSet("sluice serve", [ServeSettings, ServiceSettings, EngineConfig, GatewayConfig])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_knob_arguments(parser, KNOBS)


def _secret_file(directory: str, name: str, text: str) -> str:
    """``text`` in a new file only this user may read (0600), in serve's private directory."""
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    return path


def child_argv(child: str, knobs: KnobSet, values: dict[str, Any], secret_dir: str,
               fixed: dict[str, Any] | None = None) -> list[str]:
    """The flags that give the child command ``child`` (``knobs``: its knob set) ``values``: the
    non-default ones, ``fixed`` ones always, and every secret that is set as ``--FLAG-file`` of a
    0600 file ``secret_dir/CHILD.FLAG``."""
    fixed = fixed or {}
    values = {**values, **fixed}
    out = changed_argv([k for k in knobs if k.name not in fixed], values)
    for k in knobs:
        value = values.get(k.name)
        if k.secret:
            if value not in (None, "", []):
                text = "\n".join(value) if isinstance(value, list) else str(value)
                out += [k.file_flag, _secret_file(secret_dir, f"{child}.{k.flag_name}", text)]
        elif k.name in fixed:
            out += [k.flag, str(value)]
    return out


def _check_ports(values: dict[str, Any]) -> None:
    """The ports serve's children will listen on, checked before anything starts (PortInUse)."""
    check_port_free("--port", values["port"], values["host"])
    if values["grpc_port"]:
        check_port_free("--grpc-port", values["grpc_port"], values["grpc_host"])
    if values["metrics_port"]:
        check_port_free("--metrics-port", values["metrics_port"], values["metrics_host"])


def run(args: argparse.Namespace) -> int:
    procs: list[subprocess.Popen] = []
    names: dict[int, str] = {}
    tmp = None
    run_dir = None

    def stop(*_: object) -> None:
        raise KeyboardInterrupt

    # Installed explicitly: a process started in the background by a shell without job control
    # inherits SIGINT ignored, and Python then never raises KeyboardInterrupt for Ctrl-C.
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        values = {name: s.value for name, s in settings_of(args).items()}
        engine_config = from_args(EngineConfig, args)
        try:
            reserved = _reserve_cpus(values["reserved_cpus"], engine_config, own_redis=not values["redis_url"])
            _check_ports(values)
        except (ValueError, PortInUse) as exc:
            print(f"sluice serve: {exc}", file=sys.stderr)
            return 2
        if engine_config.model is None:
            from engine_service.model.prepare import ModelPrepareError, prepare_default_model

            try:
                engine_config.model = str(prepare_default_model(progress=True))
            except ModelPrepareError as exc:
                print(f"sluice serve: {exc}", file=sys.stderr)
                return 1
        values.update(dataclasses.asdict(engine_config))  # the model prepared, the CPUs split

        if reserved is not None:  # after the model's preparation, which may take every CPU once. This
            # command, and so Redis and the gateway it starts (the engine moves itself to its --cpus
            # before it loads torch); the CPUs are some of its own, which Linux cannot refuse it
            pin_process(reserved)
        # The children's secrets, each in a file only this user reads, in a directory only this
        # user enters: a child's command line names the file, never the secret (ps shows argv).
        run_dir = tempfile.mkdtemp(prefix="sluice-serve-")
        redis_url = values["redis_url"]
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

        generated = not values["admin_token"]
        if generated:  # Drain needs it: whoever reaches the gRPC port is not enough
            values["admin_token"] = secrets.token_urlsafe(32)
        # the admin port's address always said (loopback unless told otherwise: Drain is there)
        engine_cmd = [*CLI, "engine", *child_argv("engine", engine_main.KNOBS, values, run_dir,
                                                  fixed={"redis_url": redis_url, "grpc_host": values["grpc_host"]})]
        if generated:
            print(f"sluice serve: the engine's admin token (EngineAdmin.Drain asks for it) is in "
                  f"{os.path.join(run_dir, 'engine.admin-token')}", file=sys.stderr)
        env = child_env()
        procs.append(subprocess.Popen(engine_cmd, start_new_session=True, env=env))
        names[procs[-1].pid] = "engine"
        gateway_cmd = [*CLI, "gateway", *child_argv("gateway", gateway_main.KNOBS, values, run_dir,
                                                    fixed={"redis_url": redis_url, "host": values["host"]})]
        procs.append(subprocess.Popen(gateway_cmd, start_new_session=True, env=env))
        names[procs[-1].pid] = "gateway"

        host, port = values["host"], values["port"]
        health = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/health"
        _wait(lambda: _http_ok(health), values["ready_timeout"], "gateway health", procs)
        print(f"sluice serve: ready — OpenAI API at http://{host}:{port}/v1 (Ctrl-C stops)", file=sys.stderr)
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
        for directory in (tmp, run_dir):
            if directory:
                shutil.rmtree(directory, ignore_errors=True)


CLI = [sys.executable, "-m", "sluice_cli.cli"]


def child_env() -> dict[str, str]:
    """This process's environment without the knobs' variables: a child's configuration is the
    flags serve gives it, which already hold what those variables said here."""
    named = set(engine_main.KNOBS.env_vars()) | set(gateway_main.KNOBS.env_vars())
    return {k: v for k, v in os.environ.items() if k not in named}
