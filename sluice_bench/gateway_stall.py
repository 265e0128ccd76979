"""``sluice bench gateway-stall``: whether large request bodies stall a gateway's other clients.

Starts a private ``redis-server``, an engine on the stub model (``engine_service.model.stub``: the
real scheduler and step loop, no weights; the stack of ``sluice bench serving-path``) and one
gateway per configuration on the same Redis: ``pool-off`` (``--prepare-pool-workers 0``: every
request prepared on the event loop) and ``pool-on`` (the default prepare pool), and with
``--baseline DIR`` a gateway run from another checkout (``PYTHONPATH=DIR``, its own defaults).

Each gateway in turn (``--rounds`` times, the gateways alternating: A B A B) gets, for ``--duration``
seconds per attack shape:

- ``--streams`` streaming clients (``/v1/chat/completions``, short prompts, ``--max-tokens`` each,
  one request after another): the longest time one of them got no chunk (a stream that got
  nothing paused the whole window), and the p99 gap between two chunks;
- a ``/health`` prober (one request at a time): its latency p50 and max;
- ``--attackers`` clients sending large bodies back to back, from a separate process (so that
  building and sending them takes nothing from the measuring loop), in one of two shapes:
  ``long-message`` (a chat request whose one message is about ``--body-mb`` MB) or ``many-items``
  (a ``/v1/responses`` request of ``--items`` tiny input items, about as large): their answers
  (status counts) and how long each took.

A quiet window (no attackers) per gateway and round measures the same figures as a reference, and
the latency of a small non-streamed chat request (the path a small request takes, on the loop).
The pool-on gateway's workers are started (and their tokenizers built) before the first window.
Prints a table and writes the JSON (``--result-file``). The machine's load moves absolute figures;
compare the gateways within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from sluice_bench.serving_path import ROOT, STUB_ENV, Client, PathStack, _pct
from sluice_bench.stack import free_port as _free_port
from sluice_bench.stack import http_get as _get

SHAPES = ("long-message", "many-items")


# --- the gateways --------------------------------------------------------------------------------


@dataclass
class Gateway:
    label: str
    source: Path
    args: list[str]
    port: int = 0
    proc: subprocess.Popen | None = None


def start_gateway(gw: Gateway, redis_url: str, log_dir: str) -> None:
    gw.port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(gw.source), STUB_ENV: "1"}
    log = open(Path(log_dir) / f"gateway-{gw.label}.txt", "w")  # noqa: SIM115 - closed with the process
    gw.proc = subprocess.Popen([sys.executable, "-m", "sluice_cli.cli", "gateway", "--redis-url", redis_url,
                                "--host", "127.0.0.1", "--port", str(gw.port), "--log-level", "warning", *gw.args],
                               cwd=gw.source, env=env, stdout=log, stderr=log, start_new_session=True)


def wait_ready(gw: Gateway, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if gw.proc.poll() is not None:
            raise SystemExit(f"gateway {gw.label} exited with {gw.proc.returncode}")
        body = _get(f"http://127.0.0.1:{gw.port}/v1/models")
        if body and json.loads(body).get("data"):
            return
        time.sleep(0.3)
    raise SystemExit(f"gateway {gw.label} not ready after {timeout:.0f} s")


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def memory(gw: Gateway) -> dict:
    """The gateway's resident memory and its prepare workers' (now and at their peak), MiB."""
    pid = gw.proc.pid
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    workers = [{"rss_mib": _status_kib(c, "VmRSS") / 1024, "peak_mib": _status_kib(c, "VmHWM") / 1024}
               for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]  # not the
    # resource tracker multiprocessing starts beside them
    return {"gateway_rss_mib": _status_kib(pid, "VmRSS") / 1024, "workers": workers}


def stop_gateway(gw: Gateway) -> None:
    if gw.proc is not None and gw.proc.poll() is None:
        gw.proc.terminate()
        try:
            gw.proc.wait(15)
        except subprocess.TimeoutExpired:
            gw.proc.kill()
            gw.proc.wait()


# --- the large bodies (built and sent in a separate process) -----------------------------------


def large_body(shape: str, model: str, body_mb: float, items: int) -> tuple[str, bytes]:
    """(path, body) of one large request of ``shape``."""
    if shape == "long-message":
        text = ("All work and no play makes Jack a dull boy. " * int(body_mb * 1e6 / 44 + 1))[: int(body_mb * 1e6)]
        return "/v1/chat/completions", json.dumps({"model": model, "max_tokens": 16,
                                                   "messages": [{"role": "user", "content": text}]}).encode()
    per_item = max(1, int(body_mb * 1e6 / items) - len('{"role":"user","content":""},'))
    item = {"role": "user", "content": "x" * per_item}
    return "/v1/responses", json.dumps({"model": model, "max_output_tokens": 16, "input": [item] * items},
                                       separators=(",", ":")).encode()


async def _post(port: int, path: str, body: bytes) -> tuple[int, float]:
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.read()  # Connection: close: to the end
        return int(head.split(b" ", 2)[1]), time.perf_counter() - start
    finally:
        writer.close()


def _attack(port: int, path: str, body: bytes, attackers: int, seconds: float, out) -> None:
    """The attackers, in their own process: ``attackers`` clients posting ``body`` back to back."""

    async def one(results: list) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            try:
                results.append(await _post(port, path, body))
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                results.append((f"{type(exc).__name__}", 0.0))

    async def main() -> list:
        results: list = []
        await asyncio.gather(*(one(results) for _ in range(attackers)))
        return results

    out.send(asyncio.run(main()))
    out.close()


async def warm(gw: Gateway, model: str, shapes: list[str], args: argparse.Namespace) -> None:
    """Start the prepare pool's workers and build their tokenizers (a worker starts for its first
    job), outside every window: ``--attackers`` large bodies of each shape at once."""
    for shape in shapes:
        path, body = large_body(shape, model, args.body_mb, args.items)
        await asyncio.gather(*(_post(gw.port, path, body) for _ in range(args.attackers)))


# --- one window --------------------------------------------------------------------------------


@dataclass
class Probe:
    latencies: list[float] = field(default_factory=list)


async def _health(port: int, stop_at: float, probe: Probe, every: float) -> None:
    while time.perf_counter() < stop_at:
        start = time.perf_counter()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            await writer.drain()
            await reader.read()
            writer.close()
            probe.latencies.append(time.perf_counter() - start)
        except OSError:
            probe.latencies.append(float("inf"))
        await asyncio.sleep(max(0.0, every - (time.perf_counter() - start)))


async def _small_requests(port: int, model: str, stop_at: float, probe: Probe) -> None:
    body = json.dumps({"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi there!"}]})
    while time.perf_counter() < stop_at:
        status, seconds = await _post(port, "/v1/chat/completions", body.encode())
        probe.latencies.append(seconds if status == 200 else float("inf"))


async def _stream(client: Client, stop_at: float, times: list[float], errors: list[str]) -> None:
    """One streaming client: requests one after another, every chunk's arrival time kept."""
    path = "/v1/chat/completions"
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    try:
        while time.perf_counter() < stop_at:
            body = client._body()  # noqa: SLF001 - the serving-path bench's request
            writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            chunks, _, error = await client._read(reader)  # noqa: SLF001
            times.extend(chunks)
            if error:
                errors.append(error)
                await asyncio.sleep(0.05)
    finally:
        writer.close()


def longest_pause(times: list[float], start: float, end: float) -> float:
    """The longest time inside [start, end] with no chunk arriving (a stream that got nothing in the
    window paused all of it)."""
    inside = [start, *sorted(t for t in times if start <= t <= end), end]
    return max(b - a for a, b in zip(inside, inside[1:], strict=False))


async def measure(gw: Gateway, model: str, shape: str | None, args: argparse.Namespace) -> dict:
    """One window on ``gw``: streams and the health prober, under attack by ``shape`` (None: quiet,
    with the small-request prober instead)."""
    warmup, duration = 1.5, args.duration
    attack = None
    if shape is not None:
        path, body = large_body(shape, model, args.body_mb, args.items)
        recv, send = multiprocessing.get_context("spawn").Pipe(duplex=False)
        attack = multiprocessing.get_context("spawn").Process(
            target=_attack, args=(gw.port, path, body, args.attackers, warmup + duration, send), daemon=True)
        attack.start()
        send.close()
    t0 = time.perf_counter()
    start, end = t0 + warmup, t0 + warmup + duration
    client = Client(gw.port, model, "chat", args.max_tokens, 8)
    health, small = Probe(), Probe()
    times: list[list[float]] = [[] for _ in range(args.streams)]
    errors: list[str] = []
    tasks = [asyncio.create_task(_stream(client, end, times[i], errors)) for i in range(args.streams)]
    await asyncio.sleep(warmup)
    tasks.append(asyncio.create_task(_health(gw.port, end, health, args.health_every)))
    if shape is None:
        tasks.append(asyncio.create_task(_small_requests(gw.port, model, end, small)))
    await asyncio.sleep(max(0.0, end - time.perf_counter()))
    for t in tasks[:args.streams]:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    pauses = [longest_pause(ts, start, end) for ts in times]
    gaps = [b - a for ts in times for a, b in zip(ts, ts[1:], strict=False) if start <= b <= end]
    out: dict = {
        "gateway": gw.label, "shape": shape or "quiet",
        "stream_max_pause_s": max(pauses),
        "stream_p99_gap_s": _pct(gaps, 99),
        "stream_chunks": len(gaps),
        "stream_errors": sorted(set(errors))[:3],
        "health_p50_s": _pct(health.latencies, 50), "health_max_s": max(health.latencies, default=0.0),
        "health_probes": len(health.latencies),
    }
    if shape is None:
        out["small_request_p50_s"] = _pct(small.latencies, 50)
        out["small_requests"] = len(small.latencies)
    else:
        results = recv.recv() if recv.poll(duration + 60) else []
        attack.join(10)
        statuses: dict[str, int] = {}
        for status, _ in results:
            statuses[str(status)] = statuses.get(str(status), 0) + 1
        times = [s for _, s in results if s]
        out.update({"attack_statuses": statuses, "attack_p50_s": statistics.median(times) if times else 0.0,
                    "attack_body_bytes": len(body)})
    await asyncio.sleep(1.0)  # what the cut streams left is dropped outside every window
    return out


# --- the run -------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=8.0, help="seconds measured per window (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="times every gateway is measured, in turn")
    parser.add_argument("--streams", type=int, default=8, help="streaming clients (default: %(default)s)")
    parser.add_argument("--attackers", type=int, default=4, help="clients sending large bodies (default: %(default)s)")
    parser.add_argument("--body-mb", type=float, default=3.9, help="size of each large body, MB (default: %(default)s)")
    parser.add_argument("--items", type=int, default=100_000, help="input items of a many-items body")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="attack shapes (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per stream request")
    parser.add_argument("--health-every", type=float, default=0.05, help="seconds between /health probes")
    parser.add_argument("--pool-args", default="", help="extra gateway flags of the pool-on gateway")
    parser.add_argument("--baseline", default=None, metavar="DIR",
                        help="also a gateway run from this checkout (e.g. the main branch), its own defaults")
    parser.add_argument("--result-file", default=None, help="write the results as JSON here")


def format_table(results: list[dict]) -> str:
    head = (f"{'gateway':<10}{'window':<14}{'pause max':>10}{'gap p99':>9}{'health p50':>11}"
            f"{'max':>8}{'small p50':>10}  large bodies answered")
    lines = [head, "  (seconds; pause: the longest time a stream got no chunk; gap: between two chunks)"]
    for r in results:
        small = f"{r['small_request_p50_s']:>10.3f}" if "small_request_p50_s" in r else f"{'':>10}"
        answered = ", ".join(f"{k}x{v}" for k, v in sorted(r.get("attack_statuses", {}).items()))
        if answered:
            answered += f" (p50 {r['attack_p50_s']:.2f} s)"
        lines.append(f"{r['gateway']:<10}{r['shape']:<14}{r['stream_max_pause_s']:>10.3f}{r['stream_p99_gap_s']:>9.3f}"
                     f"{r['health_p50_s']:>11.4f}{r['health_max_s']:>8.3f}{small}  {answered}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = set(shapes) - set(SHAPES)
    if unknown:
        print(f"unknown shapes {sorted(unknown)}; known: {', '.join(SHAPES)}", file=sys.stderr)
        return 2
    stack = PathStack("bench", ROOT, gateway_args=["--prepare-pool-workers", "0"])
    gateways = [Gateway("pool-off", ROOT, ["--prepare-pool-workers", "0"]),
                Gateway("pool-on", ROOT, args.pool_args.split())]
    if args.baseline:
        gateways.append(Gateway("baseline", Path(args.baseline).resolve(), []))
    results: list[dict] = []
    load_before = os.getloadavg()
    try:
        stack.start()
        for gw in gateways:
            start_gateway(gw, stack.redis_url, stack.tmp)
        for gw in gateways:
            wait_ready(gw)
        asyncio.run(warm(gateways[1], stack.model, shapes, args))
        for rnd in range(args.rounds):
            for shape in [None, *shapes]:
                for gw in gateways if rnd % 2 == 0 else reversed(gateways):
                    r = asyncio.run(measure(gw, stack.model, shape, args))
                    r["round"] = rnd
                    results.append(r)
                    print(f"round {rnd} {gw.label:<9} {r['shape']:<13} pause max {r['stream_max_pause_s']:.3f} s, "
                          f"health max {r['health_max_s']:.3f} s {r.get('attack_statuses', '')}", file=sys.stderr)
        mem = {gw.label: memory(gw) for gw in gateways}
    finally:
        for gw in gateways:
            stop_gateway(gw)
        stack.stop()
    print(format_table(results))
    print(f"{os.cpu_count()} CPUs; load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}")
    for label, m in mem.items():
        workers = ", ".join(f"{w['rss_mib']:.0f} (peak {w['peak_mib']:.0f})" for w in m["workers"]) or "none"
        print(f"{label}: gateway {m['gateway_rss_mib']:.0f} MiB resident; prepare workers: {workers} MiB")
    doc = {"bench": "gateway-stall", "duration_s": args.duration, "streams": args.streams,
           "attackers": args.attackers, "body_mb": args.body_mb, "items": args.items,
           "gateways": {gw.label: {"source": str(gw.source), "args": gw.args} for gw in gateways},
           "cpus": os.cpu_count(), "load_average": {"before": load_before, "after": os.getloadavg()},
           "memory": mem, "results": results}
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(doc, indent=2))
        print(f"results written to {args.result_file}")
    return 0
