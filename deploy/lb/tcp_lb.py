"""A small TCP load balancer for compose: round-robin over every address a name resolves to.

    python tcp_lb.py --listen 0.0.0.0:8000 --backend gateway:8000

Docker's embedded DNS answers a service name with one address per replica, so after
``docker compose up --scale gateway=3`` each new client connection goes to the next replica.
The name is re-resolved at most every ``--refresh`` seconds, so replicas added or removed later
are picked up without a restart; a replica that refuses a connection is skipped for that
connection (the next one is tried). Balancing is per connection (layer 4), like a Kubernetes
Service: a keep-alive client stays on one replica. Standard library only.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import signal
import socket
import sys
import time

log = logging.getLogger("sluice-lb")


class Backends:
    def __init__(self, host: str, port: int, refresh: float) -> None:
        self.host, self.port, self.refresh = host, port, refresh
        self._addrs: list[str] = []
        self._resolved_at = 0.0
        self._counter = itertools.count()

    async def addresses(self) -> list[str]:
        now = time.monotonic()
        if not self._addrs or now - self._resolved_at > self.refresh:
            loop = asyncio.get_running_loop()
            try:
                infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
                addrs = sorted({info[4][0] for info in infos})
            except OSError as exc:
                log.warning("cannot resolve %s: %s", self.host, exc)
                addrs = []
            if addrs != self._addrs:
                log.info("backends for %s: %s", self.host, ", ".join(addrs) or "none")
            self._addrs, self._resolved_at = addrs, now
        return self._addrs

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
        addrs = await self.addresses()
        if not addrs:
            raise ConnectionError(f"no address for {self.host}")
        start = next(self._counter)
        last: BaseException | None = None
        for i in range(len(addrs)):
            addr = addrs[(start + i) % len(addrs)]
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(addr, self.port), 5)
                return reader, writer, addr
            except (TimeoutError, OSError) as exc:
                last = exc
                self._resolved_at = 0.0  # re-resolve next time: a replica may be gone
        raise ConnectionError(f"no backend of {self.host} accepted a connection: {last}")


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            if writer.can_write_eof():
                writer.write_eof()
        except (OSError, RuntimeError):
            pass


async def handle(backends: Backends, client_r, client_w) -> None:
    peer = client_w.get_extra_info("peername")
    try:
        server_r, server_w, addr = await backends.connect()
    except ConnectionError as exc:
        log.warning("%s: %s", peer, exc)
        client_w.close()
        return
    log.debug("%s -> %s", peer, addr)
    try:
        await asyncio.gather(pipe(client_r, server_w), pipe(server_r, client_w))
    finally:
        for w in (client_w, server_w):
            w.close()


def split_hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host or "0.0.0.0", int(port)


async def main_async(args: argparse.Namespace) -> None:
    host, port = split_hostport(args.listen)
    b_host, b_port = split_hostport(args.backend)
    backends = Backends(b_host, b_port, args.refresh)
    server = await asyncio.start_server(lambda r, w: handle(backends, r, w), host, port, reuse_address=True)
    log.info("listening on %s:%d, balancing over %s:%d", host, port, b_host, b_port)
    await backends.addresses()
    # As PID 1 in a container a default-handled SIGTERM is ignored: stop explicitly.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()
    log.info("stopping")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="0.0.0.0:8000")
    parser.add_argument("--backend", default="gateway:8000")
    parser.add_argument("--refresh", type=float, default=2.0, help="seconds between DNS lookups")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s", stream=sys.stdout
    )
    try:
        asyncio.run(main_async(args))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
