"""Docker helpers for the test suite: a Redis server in a container, reached on 127.0.0.1.

Importing this module sets the testcontainers environment DESIGN.md section 5 asks for (each only
when unset), before testcontainers itself is imported: no Ryuk reaper container (its image cannot
be pulled here), and containers reached through ports published on localhost rather than the
docker0 gateway address.

The Redis image is ``redis:7``; where Docker Hub is unreachable ``deploy/images/build-standins.sh``
builds a same-named stand-in from Debian packages (``.ci/setup-docker.sh`` runs it).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from sluice.wire.connection import connect

for _key, _value in (
    ("TESTCONTAINERS_RYUK_DISABLED", "true"),
    ("TC_HOST", "localhost"),
    ("TESTCONTAINERS_CONNECTION_MODE", "docker_host"),
):
    os.environ.setdefault(_key, _value)

REDIS_IMAGE = os.environ.get("SLUICE_TEST_REDIS_IMAGE", "redis:7")
LOOPBACK = "127.0.0.1"
SETUP_HINT = (
    "Install and start Docker and build the stand-in images with `.ci/setup-docker.sh` "
    "(as root; see docs/deploy.md)."
)


class DockerUnavailable(RuntimeError):
    """Docker (or the image a test needs) is not usable; the message says what to do."""


def docker_problem() -> str | None:
    """Why Docker cannot run test containers here, or None when it can."""
    try:
        import docker
    except ImportError:
        return "the `docker` Python package is missing (pip install 'testcontainers[redis]')."
    try:
        client = docker.from_env(timeout=10)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as exc:  # noqa: BLE001 - any failure means "no usable daemon"
        return f"the Docker daemon does not answer ({type(exc).__name__}: {exc})."
    return None


def require_docker(image: str | None = None) -> None:
    """Raise DockerUnavailable unless a daemon answers (and ``image`` is present locally)."""
    problem = docker_problem()
    if problem:
        raise DockerUnavailable(f"Docker is required for this test: {problem} {SETUP_HINT}")
    if image and not image_present(image):
        raise DockerUnavailable(
            f"image {image!r} is not present and Docker Hub may be unreachable. {SETUP_HINT}"
        )


def image_present(image: str) -> bool:
    import docker

    client = docker.from_env(timeout=10)
    try:
        client.images.get(image)
        return True
    except docker.errors.ImageNotFound:
        return False
    finally:
        client.close()


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that nothing listens on right now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` distinct TCP ports that nothing listens on right now. Held open together while
    chosen: separate ``free_port`` calls can return one port twice before its first user binds it."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            socks.append(sock)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for sock in socks:
            sock.close()


def wait_for_redis(url: str, timeout: float = 30.0) -> None:
    """Block until the Redis at ``url`` answers PING, or raise TimeoutError."""
    import redis

    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        client = connect(url, socket_connect_timeout=1, socket_timeout=1, retry=None)
        try:
            if client.ping():
                return
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
            last = exc
        except redis.exceptions.BusyLoadingError as exc:  # still loading its snapshot
            last = exc
        finally:
            client.close()
        time.sleep(0.1)
    raise TimeoutError(f"Redis at {url} did not answer PING within {timeout:.0f} s (last error: {last})")


@dataclass
class RedisServer:
    """``redis:7`` in a container, published on 127.0.0.1.

    ``port=None`` lets Docker pick the host port (fine for a server that is never restarted);
    ``fixed_port=True`` picks a free port up front and binds it explicitly, so that ``restart()``,
    ``stop()``/``start()`` bring the server back on the same ``url``.
    """

    image: str = REDIS_IMAGE
    fixed_port: bool = False
    command: str | None = None
    port: int | None = None
    _container: Any = field(default=None, repr=False)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> RedisServer:
        """Create and start the container (first call), or start it again after ``stop()``."""
        if self._container is not None:
            self._docker_container().start()
            self.wait_ready(timeout)
            return self
        require_docker(self.image)
        from testcontainers.community.redis import RedisContainer

        container = RedisContainer(self.image)
        if self.command:
            container.with_command(self.command)
        if self.fixed_port:
            self.port = self.port or free_port()
        # docker-py form: (host_ip, host_port) binds only on loopback; (host_ip,) picks the port.
        container.ports["6379/tcp"] = (LOOPBACK, self.port) if self.port else (LOOPBACK,)
        last: BaseException | None = None
        for _ in range(3):  # a fixed port may be grabbed by someone else between pick and bind
            try:
                container.start()
                break
            except Exception as exc:  # noqa: BLE001
                last = exc
                try:
                    container.stop()
                except Exception:  # noqa: BLE001
                    pass
                if not (self.fixed_port and "port is already allocated" in str(exc)):
                    raise
                self.port = free_port()
                container.ports["6379/tcp"] = (LOOPBACK, self.port)
        else:
            raise DockerUnavailable(f"could not start {self.image}: {last}")
        self._container = container
        self.port = int(container.get_exposed_port(6379))
        self.wait_ready(timeout)
        return self

    def stop(self, hard: bool = False) -> None:
        """Stop the server but keep its container: SIGTERM (Redis saves its snapshot) or SIGKILL."""
        c = self._docker_container()
        if hard:
            c.kill()
            c.wait(timeout=30)
        else:
            c.stop(timeout=10)

    def restart(self, hard: bool = False, downtime: float = 0.0, timeout: float = 60.0) -> None:
        """Take the server down and bring it back on the same host port.

        ``hard=True`` kills it (like a crash: writes since the last snapshot are lost);
        otherwise it shuts down cleanly. Either way every client connection and pub/sub
        subscription is dropped. ``downtime`` seconds pass before it starts again.
        """
        if not self.fixed_port:
            raise RuntimeError("restart() needs RedisServer(fixed_port=True) to keep its port")
        self.stop(hard=hard)
        if downtime:
            time.sleep(downtime)
        self.start(timeout)

    def remove(self) -> None:
        """Remove the container and its anonymous /data volume."""
        if self._container is not None:
            try:
                self._container.stop()
            finally:
                self._container = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # -- access ----------------------------------------------------------------------------------
    @property
    def host(self) -> str:
        return "localhost"

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the Redis container is not started")
        return f"redis://{self.host}:{self.port}/0"

    @property
    def container_id(self) -> str:
        return str(self._docker_container().id)

    def client(self, **kwargs: Any):

        return connect(self.url, **kwargs)

    def wait_ready(self, timeout: float = 60.0) -> None:
        wait_for_redis(self.url, timeout)

    def logs(self) -> str:
        return self._docker_container().logs().decode(errors="replace")

    def _docker_container(self):
        if self._container is None:
            raise RuntimeError("the Redis container is not started")
        return self._container.get_wrapped_container()


def compose_command() -> list[str] | None:
    """The Compose CLI to call: ``docker compose`` (v2 plugin) or ``docker-compose`` (v1)."""
    try:
        subprocess.run(["docker", "compose", "version"], check=True, capture_output=True, timeout=20)
        return ["docker", "compose"]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        subprocess.run(["docker-compose", "version"], check=True, capture_output=True, timeout=20)
        return ["docker-compose"]
    except (OSError, subprocess.SubprocessError):
        return None
