"""Chaos: real processes (a redis-server with AOF, two engines, a gateway) under mixed traffic while
engines are killed (-9) and restarted, Redis is restarted (cleanly, and once with kill -9), an
engine is drained, clients hang up. It runs twice: on one Redis, and on a Redis Cluster (3 masters
with a replica each, AOF) whose Redis faults are a master killed -9 under traffic, a replica
promoted in its place, and the old master restarted as a replica: once the master of the request
queue's slot, once the master of the gateway's events channel.

At the end every request has a terminal outcome — completed, or an error the client was told
about within 10 s of the fault (or of its own start) — no engine holds a KV block or a running
request, and the stream holds no pending entry. The table it prints is the one in the README:

    SLUICE_CHAOS_S=105 python -m pytest -q -s tests/chaos        # the traffic's duration (s), 70 by default

It writes the counts as JSON to $SLUICE_CHAOS_JSON when that is set.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from sluice.wire import contract
from sluice.wire.connection import connect
from sluice_bench.redis_cluster import LocalRedisCluster
from tests.queue_helpers import pending_count, queue_length
from tests.waiting import wait_http

pytestmark = [pytest.mark.model, pytest.mark.chaos, pytest.mark.redis]

REPO = Path(__file__).resolve().parents[2]
MODEL = "chaos"
DURATION_S = float(os.environ.get("SLUICE_CHAOS_S", "70"))
CLIENTS = 6
CLIENT_TIMEOUT_S = 45.0  # a request still open after this long is "hung"
TOLD_WITHIN_S = 10.0
ENGINE_IDS = ("chaos-e1", "chaos-e2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), e.get("PYTHONPATH", "")])
    e.setdefault("OMP_NUM_THREADS", "1")  # two engines share the CPUs with everything else
    return e


class Redis:
    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.dir = workdir / "redis"
        self.dir.mkdir()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.log = open(workdir / "redis.log", "ab")  # noqa: SIM115

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", "everysec", "--save", ""],
            stdout=self.log, stderr=subprocess.STDOUT)
        end = time.monotonic() + 20
        while time.monotonic() < end:
            try:
                if connect(self.url, socket_timeout=1, retry=None).ping():
                    return
            except redis.RedisError:
                time.sleep(0.05)
        raise AssertionError("redis-server did not start")

    def restart(self, pause: float = 1.0) -> None:
        """A clean restart (SIGTERM: Redis writes the AOF out and exits), ``pause`` s of no Redis."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(20)
        time.sleep(pause)
        self.start()

    def crash(self, pause: float = 1.0) -> None:
        """kill -9: Redis loses what it had not fsynced yet (AOF everysec: up to the last second)."""
        self.proc.kill()
        self.proc.wait(20)
        time.sleep(pause)
        self.start()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


class ClusterRedis:
    """The same faults on a Redis Cluster: a master killed -9 and failed over, then restarted."""

    def __init__(self, workdir: Path) -> None:
        self.cluster = LocalRedisCluster(persistence=True, base_dir=workdir / "redis-cluster")
        self.url = ""

    def start(self) -> None:
        self.cluster.start()
        self.url = self.cluster.url

    def _fail_over(self, key: str) -> str:
        killed = self.cluster.kill_master(key)
        promoted = self.cluster.wait_for_failover(timeout=30)
        self.cluster.restart_node(killed)  # back as a replica of the promoted one
        return f"{killed.port} -> {promoted.port}"

    def restart(self) -> str:
        """The master of a request queue shard's slot (its stream, its in-flight markers; the other
        shards on that node go with it)."""
        return "queue master kill -9, failover " + self._fail_over(contract.request_stream(MODEL, 0))

    def crash(self) -> str:
        """The master of a gateway's events channel (its token events, its requests' markers)."""
        gateways = connect(self.url).keys(contract.gateway_key("*"))
        gateway_id = gateways[0].decode().rsplit(":", 1)[1] if gateways else "none"
        return "events master kill -9, failover " + self._fail_over(contract.events_channel(gateway_id))

    def stop(self) -> None:
        self.cluster.stop()


class Engine:
    def __init__(self, engine_id: str, model_dir: Path, url: str, workdir: Path) -> None:
        self.engine_id = engine_id
        self.cmd = [sys.executable, "-m", "sluice_cli.cli", "engine", "--model", str(model_dir), "--redis-url", url,
                    "--grpc-port", "0", "--engine-id", engine_id, "--served-model-name", MODEL,
                    "--num-blocks", "256", "--max-model-len", "256", "--max-num-seqs", "4",
                    "--heartbeat-ttl", "2", "--drain-grace-s", "4", "--log-level", "INFO"]
        self.log_path = workdir / f"{engine_id}.log"
        self.log = open(self.log_path, "ab")  # noqa: SIM115
        self.proc: subprocess.Popen | None = None
        self.started_wall = 0.0

    def start(self) -> None:
        self.started_wall = time.time()
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=env(), stdout=self.log, stderr=subprocess.STDOUT)

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def drain(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            # the engine logs every thread's stack 5 s past its 4 s grace (service/worker.py): show them
            self.log.flush()
            tail = (self.log_path.read_text(errors="replace").splitlines() or [""])[-80:]
            raise AssertionError(f"{self.engine_id} still running 30 s after SIGTERM; its log ends:\n"
                                 + "\n".join(tail)) from None

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@dataclass
class Outcome:
    kind: str
    started: float
    ended: float = 0.0
    result: str = ""  # "completed", "disconnected", "hung", or the error code
    detail: str = ""
    retry_after: float | None = None


@dataclass
class Chaos:
    started: float = field(default_factory=time.monotonic)
    faults: list[tuple[float, str]] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fault(self, what: str) -> None:
        with self.lock:
            self.faults.append((time.monotonic(), what))

    def last_fault_before(self, t: float) -> float | None:
        with self.lock:
            times = [ft for ft, _ in self.faults if ft <= t]
        return max(times) if times else None


PROMPTS = ["Tell me about rivers", "Count to five", "What is a cat?", "Write a haiku about rain",
           "List three colors", "Why is the sky blue?"]


def _error_code(resp: httpx.Response, out: Outcome | None = None) -> str:
    if out is not None and resp.headers.get("retry-after"):
        out.retry_after = float(resp.headers["retry-after"])
    try:
        return str(resp.json()["error"].get("code") or resp.status_code)
    except Exception:  # noqa: BLE001
        return f"http_{resp.status_code}"


def one_request(client: httpx.Client, base: str, rng: random.Random, out: Outcome) -> None:
    max_tokens = rng.randint(2, 8)
    prompt = rng.choice(PROMPTS)
    try:
        if out.kind == "completion":
            r = client.post(f"{base}/v1/completions",
                            json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8})
            out.result = "completed" if r.status_code == 200 and r.json()["choices"] else _error_code(r, out)
            if r.status_code != 200:
                out.detail = r.text[:200]
            return
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "stream": True}
        with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                out.result, out.detail = _error_code(r, out), r.text[:200]
                return
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    out.result = "completed"
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    out.result, out.detail = str(chunk["error"].get("code") or "stream_error"), data[:200]
                    return
                if out.kind == "disconnect":
                    out.result = "disconnected"  # hang up after the first chunk
                    return
            out.result = "stream_ended_without_done"
    except httpx.TimeoutException:
        out.result = "hung"
    except httpx.HTTPError as exc:
        out.result, out.detail = "transport_error", repr(exc)[:200]


def traffic(chaos: Chaos, base: str, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    timeout = httpx.Timeout(CLIENT_TIMEOUT_S, connect=5.0)
    with httpx.Client(timeout=timeout) as client:
        while not stop.is_set():
            kind = rng.choices(["completion", "stream", "disconnect"], weights=[4, 4, 1])[0]
            out = Outcome(kind, time.monotonic())
            one_request(client, base, rng, out)
            out.ended = time.monotonic()
            if out.ended - out.started > CLIENT_TIMEOUT_S:
                out.result = "hung"
            with chaos.lock:
                chaos.outcomes.append(out)
            # As a well-behaved client: a 503/429 says when to come back (Retry-After).
            pause = out.retry_after if out.retry_after is not None else rng.uniform(0.0, 0.2)
            time.sleep(pause)


def wait_engine(r_url: str, engine_id: str, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            r = connect(r_url, socket_timeout=2)
            if r.exists(contract.engine_key(engine_id)) and r.hexists(contract.ENGINES_KEY, engine_id):
                return
        except redis.RedisError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"engine {engine_id} did not come up")


def faults(chaos: Chaos, rds: Redis, engines: list[Engine], stop: threading.Event, seed: int) -> None:
    try:
        _faults(chaos, rds, engines, stop, seed)
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        chaos.fault(f"fault thread failed: {exc!r}")
        raise


def serving(url: str, engine: Engine) -> bool:
    """This life of ``engine`` heartbeats (not a lingering key of the one before it)."""
    try:
        r = connect(url, socket_timeout=2)
        raw = r.hget(contract.ENGINES_KEY, engine.engine_id)
        alive = r.exists(contract.engine_key(engine.engine_id))
    except redis.RedisError:
        return False
    if not raw or not alive or engine.proc is None or engine.proc.poll() is not None:
        return False
    info = json.loads(raw)
    return float(info.get("heartbeat") or 0) > engine.started_wall and not info.get("draining")


def _faults(chaos: Chaos, rds: Redis, engines: list[Engine], stop: threading.Event, seed: int) -> None:
    """The plan's faults one after the other, ``period`` seconds apart. An engine fault waits (up to
    45 s) until both engines serve, so one engine is down at a time (a reload of the model takes a
    while); if they still do not, a Redis restart comes instead."""
    plan = ["kill9", "redis", "drain", "redis-9", "kill9", "drain", "redis", "kill9"]
    period = max(6.0, (DURATION_S - 12.0) / len(plan))
    stop.wait(6.0)
    for slot, what in enumerate(plan):
        if stop.is_set():
            return
        up = [e for e in engines if serving(rds.url, e)]
        if not what.startswith("redis"):
            end = time.monotonic() + 45
            while len(up) < len(engines) and time.monotonic() < end and not stop.is_set():
                stop.wait(0.5)
                up = [e for e in engines if serving(rds.url, e)]
            if len(up) < len(engines) or stop.is_set():
                what = "redis"
        if what == "kill9":
            engine = up[slot % len(up)]  # alternate engines
            chaos.fault(f"kill -9 {engine.engine_id}")
            engine.kill9()
            engine.start()  # same --engine-id: its new life reclaims what the old one held
        elif what == "drain":
            engine = up[(slot + 1) % len(up)]
            chaos.fault(f"drain {engine.engine_id}")
            code = engine.drain()
            assert code == 0, f"drained engine exited with {code}"
            engine.start()
        elif what == "redis-9":
            chaos.fault("redis kill -9")
            detail = rds.crash()
        else:
            chaos.fault("redis restart")
            detail = rds.restart()
        if what.startswith("redis") and detail:
            chaos.faults[-1] = (chaos.faults[-1][0], f"redis {detail}")
        stop.wait(period)


@pytest.mark.parametrize("topology", ["standalone", "cluster"])
def test_chaos(topology, model_dir, tmp_path):
    rds = Redis(tmp_path) if topology == "standalone" else ClusterRedis(tmp_path)
    rds.start()
    engines = [Engine(eid, model_dir, rds.url, tmp_path) for eid in ENGINE_IDS]
    gw_port = free_port()
    gw_log = open(tmp_path / "gateway.log", "ab")  # noqa: SIM115
    gateway = subprocess.Popen(
        [sys.executable, "-m", "sluice_cli.cli", "gateway", "--redis-url", rds.url, "--host", "127.0.0.1",
         "--port", str(gw_port), "--request-timeout-s", "120", "--log-level", "warning"],
        cwd=REPO, env=env(), stdout=gw_log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{gw_port}"
    chaos = Chaos()
    stop_traffic, stop_faults = threading.Event(), threading.Event()
    threads: list[threading.Thread] = []
    try:
        for e in engines:
            e.start()
        for e in engines:
            wait_engine(rds.url, e.engine_id, timeout=180)
        wait_http(f"{base}/health", timeout=60, interval=0.2)
        chaos.started = time.monotonic()
        threads = [threading.Thread(target=traffic, args=(chaos, base, stop_traffic, i), daemon=True)
                   for i in range(CLIENTS)]
        threads.append(threading.Thread(target=faults, args=(chaos, rds, engines, stop_faults, 12), daemon=True))
        for t in threads:
            t.start()
        stop_faults.wait(DURATION_S)
        stop_faults.set()
        threads[-1].join(60)
        stop_traffic.set()
        for t in threads[:-1]:
            t.join(CLIENT_TIMEOUT_S + 10)
        still_open = sum(t.is_alive() for t in threads[:-1])

        # Quiet: both engines back, idle, every block free; nothing pending in the stream.
        for e in engines:
            wait_engine(rds.url, e.engine_id, timeout=120)
        r = connect(rds.url)
        # (an entry whose acknowledgement a Redis crash lost is taken back after 30 s idle)
        end = time.monotonic() + 50
        while True:
            loads = {e.engine_id: json.loads(r.hget(contract.ENGINES_KEY, e.engine_id) or b"{}") for e in engines}
            running = sum(int(v.get("running") or 0) + int(v.get("live_requests") or 0) + int(v.get("waiting") or 0)
                          for v in loads.values())
            leaked = sum(int(v.get("total_blocks") or 0) - int(v.get("free_blocks") or 0) for v in loads.values())
            pending = pending_count(r, MODEL)
            if (running == 0 and leaked == 0 and pending == 0) or time.monotonic() > end:
                break
            time.sleep(0.5)
        stream_len = queue_length(r, MODEL)
        registry = {k.decode() for k in r.hkeys(contract.ENGINES_KEY)}
    finally:
        stop_traffic.set()
        stop_faults.set()
        gateway.terminate()
        try:
            gateway.wait(10)
        except subprocess.TimeoutExpired:
            gateway.kill()
        for e in engines:
            e.stop()
        rds.stop()
        gw_log.close()

    outcomes = chaos.outcomes
    late = []
    for o in outcomes:
        if o.result in ("completed", "disconnected", "hung"):
            continue
        fault = chaos.last_fault_before(o.ended)
        since = max(o.started, fault if fault is not None else o.started)
        if o.ended - since > TOLD_WITHIN_S:
            late.append(o)
    counts = Counter(o.result for o in outcomes)
    errors = {k: v for k, v in sorted(counts.items()) if k not in ("completed", "disconnected", "hung")}
    table = {
        "duration_s": round(DURATION_S),
        "faults": [what for _, what in chaos.faults],
        "sent": len(outcomes),
        "completed": counts.get("completed", 0),
        "disconnected_by_client": counts.get("disconnected", 0),
        "errored": errors,
        "told_late": len(late),
        "hung": counts.get("hung", 0) + still_open,
        "leaked_blocks": leaked,
        "running_at_end": running,
        "pending_entries": pending,
        "stream_length_at_end": stream_len,
    }
    lines = [
        f"chaos ({topology}): {table['duration_s']} s of traffic, faults: {', '.join(table['faults'])}",
        "| sent | completed | client disconnects | errored (by code) | told late (>10 s) | hung | leaked blocks "
        "| running at end | pending entries |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|",
        f"| {table['sent']} | {table['completed']} | {table['disconnected_by_client']} | "
        f"{', '.join(f'{k} {v}' for k, v in errors.items()) or '0'} | {table['told_late']} | {table['hung']} | "
        f"{leaked} | {running} | {pending} |",
    ]
    print("\n" + "\n".join(lines))
    if os.environ.get("SLUICE_CHAOS_JSON"):
        out = Path(os.environ["SLUICE_CHAOS_JSON"])
        out = out.with_name(f"{out.stem}-{topology}{out.suffix}")
        out.write_text(json.dumps({"topology": topology, **table}, indent=2) + "\n")
    details = [(o.kind, o.result, round(o.ended - o.started, 1), o.detail) for o in late[:5]]
    assert not [f for f in table["faults"] if "failed" in f], table["faults"]
    assert table["hung"] == 0, f"hung requests; see {tmp_path}"
    assert not late, f"errors told more than {TOLD_WITHIN_S}s after the fault: {details}"
    assert leaked == 0 and running == 0, loads
    assert pending == 0
    assert table["completed"] > 0 and len(chaos.faults) >= 5, table["faults"]
    assert {"kill", "redis", "drain"} <= {f.split()[0] for f in table["faults"]}, table["faults"]
    assert "transport_error" not in counts, [o.detail for o in outcomes if o.result == "transport_error"][:3]
    assert set(ENGINE_IDS) <= registry
