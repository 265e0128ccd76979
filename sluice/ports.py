"""A port a process is told to listen on, checked before the long part of its start: one that is
taken stops the process with a message naming the flag that chose it (the CLI exits 2).

The check binds the address the way the real server will (``SO_REUSEADDR``: a port in TIME_WAIT
after a restart is free; no ``SO_REUSEPORT``: a port another process listens on is not)."""

from __future__ import annotations

import errno
import socket


class PortInUse(RuntimeError):
    """A port could not be bound; the message names the flag, the address and what to do."""


def port_error(flag: str, port: int, host: str, exc: OSError, hint: str = "choose another port") -> Exception:
    """``PortInUse`` for the errors a taken or forbidden address gives; ``exc`` itself otherwise."""
    if exc.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
        why = "is already in use (another process listens there)" if exc.errno == errno.EADDRINUSE \
            else (exc.strerror or str(exc))
        return PortInUse(f"{flag} {port}: cannot listen on {host}:{port}: the address {why}; {hint}")
    return exc


def check_port_free(flag: str, port: int, host: str = "127.0.0.1", hint: str = "choose another port") -> None:
    """Raise ``PortInUse`` naming ``flag`` if ``host:port`` cannot be bound now. Port 0 (any free
    port) always can."""
    if not port:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(1)
        except OSError as exc:
            raise port_error(flag, port, host, exc, hint) from exc
