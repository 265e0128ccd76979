"""gRPC on the engine's admin port: the standard ``grpc.health.v1`` service and ``EngineAdmin``.

Health is SERVING once the model is loaded and the step loop runs, NOT_SERVING while draining or
stopped. ``GetStats`` reads the worker's snapshot (refreshed after every step, so it agrees with
the engine's counters); ``Drain`` asks the step loop to drain, exactly as SIGTERM does.

Anyone who reaches the port can drain the engine, so the server listens on loopback unless
``--grpc-host`` says otherwise, and with ``--admin-token`` (``$SLUICE_ADMIN_TOKEN``) ``Drain``
needs ``authorization: Bearer TOKEN`` metadata (UNAUTHENTICATED without it). Health and
``GetStats`` stay open: they change nothing, and Kubernetes' gRPC probes send no metadata.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from sluice.ports import PortInUse, check_port_free
from sluice.wire import admin_pb2, admin_pb2_grpc

log = logging.getLogger("sluice.engine.admin")

ADMIN_SERVICE = "sluice.wire.EngineAdmin"
GRPC_PORT_HINT = "choose another port, or 0 for no gRPC server"


def bearer_ok(context: Any, token: str | None) -> bool:
    """True when no token is required or the call's ``authorization`` metadata is ``Bearer TOKEN``."""
    if not token:
        return True
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            scheme, _, given = str(value).partition(" ")
            return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())
    return False


class AdminServicer(admin_pb2_grpc.EngineAdminServicer):
    def __init__(self, worker: Any, engine_id: str, model: str, token: str | None = None) -> None:
        self.worker = worker
        self.engine_id = engine_id
        self.model = model
        self.token = token

    def GetStats(self, request: admin_pb2.GetStatsRequest, context: Any) -> admin_pb2.EngineStats:
        s = self.worker.snapshot()
        return dataclasses.replace(s, draining=s.draining or self.worker.draining).to_proto()

    def Drain(self, request: admin_pb2.DrainRequest, context: Any) -> admin_pb2.DrainResponse:
        if not bearer_ok(context, self.token):
            log.warning("Drain refused: no valid admin token (from %s)", context.peer())
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "Drain needs `authorization: Bearer TOKEN` metadata with the engine's --admin-token")
        s = self.worker.snapshot()
        accepted = self.worker.running and not self.worker.draining
        self.worker.request_drain(request.grace_period_s or None, cause="EngineAdmin.Drain")
        return admin_pb2.DrainResponse(accepted=accepted, running=s.running, waiting=s.waiting)


class AdminServer:
    def __init__(self, worker: Any, engine_id: str, model: str, port: int, host: str = "127.0.0.1",
                 token: str | None = None) -> None:
        self.health = health.HealthServicer()
        # grpc sets SO_REUSEPORT by default: a second engine on the same port would then share it
        # silently (and take half the probes). Off, a taken port is an error naming the flag.
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="sluice-grpc"),
                                  options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        admin_pb2_grpc.add_EngineAdminServicer_to_server(AdminServicer(worker, engine_id, model, token), self.server)
        self.host = host
        try:
            self.port = self.server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        except RuntimeError:  # grpc says only "Failed to bind": ask the socket why
            self.port = 0
        if self.port == 0:
            check_port_free("--grpc-port", port, host, GRPC_PORT_HINT)
            raise PortInUse(f"--grpc-port {port}: cannot listen on {host}:{port}; {GRPC_PORT_HINT}")
        self.set_serving(False)
        worker.on_serving_change.append(self.set_serving)

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", ADMIN_SERVICE):
            self.health.set(service, status)

    def start(self) -> None:
        self.server.start()
        log.debug("gRPC health and admin on %s:%d", self.host, self.port)  # the engine's ready line says it

    def stop(self, grace: float = 1.0) -> None:
        self.server.stop(grace).wait(grace + 0.5)
