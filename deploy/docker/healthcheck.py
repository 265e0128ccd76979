"""Container health checks, standard library only (plus grpcio-health-checking for ``grpc``).

    python healthcheck.py http http://127.0.0.1:8000/health    # exit 0 on HTTP 200
    python healthcheck.py grpc 127.0.0.1:50051 [SERVICE]         # exit 0 when SERVING
    python healthcheck.py drain 127.0.0.1:50051 [GRACE_S]        # EngineAdmin.Drain, wait for idle

``drain`` sends ``$SLUICE_ADMIN_TOKEN`` as a bearer token when it is set (the engine's ``--admin-token``).

Used by the Dockerfile's HEALTHCHECK and compose.yaml; Kubernetes uses its native probes.
"""

from __future__ import annotations

import sys


def check_http(url: str, timeout: float) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 0 if resp.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1


def check_grpc(target: str, service: str, timeout: float) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as exc:
            print(f"unhealthy: {target}: {exc.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    if status != "SERVING":
        print(f"unhealthy: {target}: {status}", file=sys.stderr)
        return 1
    return 0


def drain(target: str, grace_s: float) -> int:
    """Ask the engine to drain (stop reading the queue, finish what it runs), then wait until it
    holds no request or ``grace_s`` passes. A Kubernetes preStop hook: SIGTERM follows it."""
    import os
    import time

    import grpc

    from sluice.wire import admin_pb2, admin_pb2_grpc

    deadline = time.monotonic() + grace_s
    with grpc.insecure_channel(target) as channel:
        stub = admin_pb2_grpc.EngineAdminStub(channel)
        try:
            token = os.environ.get("SLUICE_ADMIN_TOKEN")
            metadata = (("authorization", f"Bearer {token}"),) if token else None
            resp = stub.Drain(admin_pb2.DrainRequest(grace_period_s=grace_s), timeout=10, metadata=metadata)
            print(f"drain accepted={resp.accepted} running={resp.running} waiting={resp.waiting}")
            while time.monotonic() < deadline:
                stats = stub.GetStats(admin_pb2.GetStatsRequest(), timeout=5)
                if stats.live_requests == 0 and stats.running == 0:
                    print("drained")
                    return 0
                time.sleep(1)
        except grpc.RpcError as exc:
            print(f"drain: {target}: {exc.code().name}", file=sys.stderr)
            return 1
    print("drain: grace period over", file=sys.stderr)
    return 1


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "http":
        return check_http(argv[1], timeout=4.0)
    if len(argv) >= 2 and argv[0] == "grpc":
        return check_grpc(argv[1], argv[2] if len(argv) > 2 else "", timeout=4.0)
    if len(argv) >= 2 and argv[0] == "drain":
        return drain(argv[1], float(argv[2]) if len(argv) > 2 else 60.0)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
