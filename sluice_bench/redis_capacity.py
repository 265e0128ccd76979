"""``sluice bench redis-capacity``: Redis capacity with the model's cost taken out, one Redis against
a Redis Cluster, side by side.

    sluice bench redis-capacity [--duration 20] [--engines 2] [--gateways 2] [--concurrency 32]
        [--tokens 16] [--rounds 1] [--json PATH]

For each topology, one after the other in the same run -- a private ``redis-server`` on a free
127.0.0.1 port, then a local Redis Cluster of 3 masters (both started by ``sluice_bench.stack``) --
it runs:

- ``--engines`` engine processes, each with the REAL ``RedisIO`` (reader with credit, marker checks,
  canceller, publisher, housekeeper) and the REAL ``Worker`` step loop around a fake engine that
  emits one token per running request per step without any model or sleep (256 slots): what is
  measured is the contract's Redis path (XREADGROUP, EXISTS of the markers, SET of the emitted
  marker, one pipelined SPUBLISH per reply_to per step, XACK, heartbeats, trims);
- ``--gateways`` load-generator processes, each holding one real ``gateway.broker.Broker`` and
  keeping ``--concurrency`` requests in flight (register, the enqueue script, events read from the
  gateway's sharded channel until the terminal one, ``settled``), ``--tokens`` tokens each.

After ``--warmup`` seconds it measures a ``--duration`` window: requests/s and token events/s
received by the load generators; from Redis itself (``INFO commandstats`` and ``INFO cpu`` of
every node, before and after) the commands per request by command and Redis CPU seconds per 1,000
requests, in total and on the busiest node; from the processes, their socket writes (redis-py's
``send_packed_command``: one per command or pipeline per connection, i.e. one network round trip)
per request, and their own CPU. Also: Redis's CPU with no client (a second before the processes
start), requests per CPU-second of all the bench's processes (the machine may be shared: this does
not depend on what else runs), and an estimate, labelled as one, of the requests/s at which the
busiest node would be saturated at the measured CPU per request. It prints a table with the
cluster/standalone ratios and writes the JSON (``--json``); ``--rounds`` alternates the topologies
several times. ``measure()`` is the function the test runs for a couple of seconds.

Requires ``redis-server`` and ``redis-cli`` >= 7 on PATH (sharded pub/sub).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from sluice_bench import results as results_file
from sluice_bench.redis_cluster import HOST, REDIS_SERVER
from sluice_bench.stack import Stack

SLOTS = 256  # the fake engine's admission headroom: Redis, not the engine, limits the flow
# Commands a Lua script runs are counted in commandstats as well: per request, the gateway's
# ENQUEUE_SCRIPT runs SET + XADD and the engine's TAKE_SCRIPT EXISTS, EXISTS, SET; a cancel's
# CANCEL_SCRIPT runs SET + GET.
SCRIPT_INNER_COMMANDS = 5
CANCEL_INNER_COMMANDS = 2
# Per-process counters (one row per process, written by it alone, read by the parent).
# C_CANCELS: in an engine's row, the request ids its cancel listener handed its step loop.
C_COMPLETED, C_COMPLETED_EVENTS, C_EVENTS, C_BAD, C_SENDS, C_TOKENS, C_CANCELS = range(7)
N_COUNTERS = 7
_IGNORED_COMMANDS = {"info"}  # the bench's own polling
IDLE_S = 1.0  # Redis CPU with no client is measured this long before the processes start


@dataclass
class BenchConfig:
    duration_s: float = 20.0
    warmup_s: float = 3.0
    engines: int = 2
    gateways: int = 2
    concurrency: int = 32  # requests in flight per load generator
    tokens: int = 16  # max_tokens of every request (the fake engine emits exactly that many)
    models: int = 1  # engines and requests are spread round-robin over this many model names
    cluster_replicas: int = 0  # replicas per master in the cluster topology
    # sys.setswitchinterval in the engine processes (None: Python's 5 ms). A diagnostic: the step
    # loop of a model-free engine never blocks, so its I/O threads wait for the GIL.
    engine_switch_interval_ms: float | None = None
    # Every request logged (GenerateRequest.log_events, its record written before the XADD), as a
    # resumable stream is: sluice_bench/event_log.py compares both.
    log_events: bool = False
    # Each request is cancelled after this many token events (as a stop string matched in the
    # gateway cancels it), then read to its end (the engine's abort); 0: never.
    cancel_after: int = 0

    def model(self, i: int) -> str:
        return f"bench-{i % self.models}"


# --- topologies ----------------------------------------------------------------------------------

class Standalone:
    """A private redis-server (no persistence) on a free port."""

    name = "standalone"

    def __init__(self) -> None:
        self.stack = Stack("redis-capacity")
        self._url = ""

    def __enter__(self) -> Standalone:
        self._url = self.stack.redis()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.stop()

    @property
    def url(self) -> str:
        return self._url

    @property
    def port(self) -> int:
        return self.stack.get("redis").port

    def nodes(self) -> dict[str, tuple[redis.Redis, str]]:
        """name -> (client, role) of every node."""
        return {f"{HOST}:{self.port}": (redis.Redis(host=HOST, port=self.port, socket_timeout=5), "master")}


class Cluster:
    """A local Redis Cluster of 3 masters (and ``replicas`` replicas each)."""

    name = "cluster"

    def __init__(self, replicas: int = 0) -> None:
        self.stack = Stack("redis-capacity")
        self.replicas = replicas
        self.cluster = None

    def __enter__(self) -> Cluster:
        self.cluster = self.stack.cluster(masters=3, replicas=self.replicas)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.stop()

    @property
    def url(self) -> str:
        return self.cluster.url

    def nodes(self) -> dict[str, tuple[redis.Redis, str]]:
        masters = {n.port for n in self.cluster.masters()}
        return {n.address: (self.cluster.node_client(n), "master" if n.port in masters else "replica")
                for n in self.cluster.live_nodes()}


# --- counting round trips ------------------------------------------------------------------------

def _count_sends(counters: Any, row: int) -> None:
    """Count every socket write of redis-py in this process (a command, or a whole pipeline to one
    connection: one network round trip each) into ``counters[row*N + C_SENDS]``."""
    import redis.asyncio.connection as aconn
    import redis.connection as conn

    index = row * N_COUNTERS + C_SENDS
    sync_send = conn.AbstractConnection.send_packed_command
    async_send = aconn.AbstractConnection.send_packed_command

    def counted_sync(self: Any, command: Any, check_health: bool = True) -> None:
        counters[index] += 1
        return sync_send(self, command, check_health)

    async def counted_async(self: Any, command: Any, check_health: bool = True) -> None:
        counters[index] += 1
        return await async_send(self, command, check_health)

    conn.AbstractConnection.send_packed_command = counted_sync
    aconn.AbstractConnection.send_packed_command = counted_async


# --- the engine process --------------------------------------------------------------------------

class FastFakeEngine:
    """No model: one token per running request per step, finished at max_tokens, no sleep."""

    vocab_size = 1000
    max_model_len = 4096

    def __init__(self, slots: int = SLOTS) -> None:
        self.slots = slots
        self.reqs: dict[str, list] = {}  # id -> [max_tokens, generated]
        self.iterations = 0
        self.generated = 0

    def add_request(self, rid: str, prompt: list[int], params: Any, arrival_time: float | None = None,
                    *, tenant: str = "", tenant_weight: int = 1) -> None:
        self.reqs[rid] = [params.max_tokens or 16, 0]

    def abort_request(self, ids: list[str]) -> list[Any]:
        from engine_service.core.outputs import EngineOutput
        from engine_service.core.request import FinishReason

        return [EngineOutput(rid, [], finish_reason=FinishReason.ABORT) for rid in ids if self.reqs.pop(rid, None)]

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def admission_headroom(self) -> int:
        return max(0, self.slots - len(self.reqs))

    def step(self) -> list[Any]:
        from engine_service.core.outputs import EngineOutput
        from engine_service.core.request import FinishReason

        self.iterations += 1
        outs = []
        for rid, state in list(self.reqs.items()):
            state[1] += 1
            done = state[1] >= state[0]
            outs.append(EngineOutput(rid, [7], finish_reason=FinishReason.LENGTH if done else None,
                                     num_output_tokens=state[1]))
            if done:
                del self.reqs[rid]
        self.generated += len(outs)
        return outs

    def get_stats(self) -> Any:
        from sluice.wire.stats import EngineStats

        return EngineStats(running=len(self.reqs), iterations=self.iterations, free_blocks=self.slots,
                           total_blocks=self.slots, generation_tokens_total=self.generated)


class _CountingInbox(queue.Queue):
    """The step loop's inbox, counting the request ids of the clients' cancels that reach it."""

    def __init__(self, counters: Any, index: int) -> None:
        super().__init__()
        self.counters, self.index = counters, index

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        from engine_service.service.io_types import CancelNote

        if isinstance(item, CancelNote) and item.cause == "cancel":
            self.counters[self.index] += len(item.request_ids)
        super().put(item, block, timeout)


def _engine_main(url: str, model: str, engine_id: str, ready: Any, stop: Any, counters: Any, row: int,
                 switch_interval_ms: float | None = None) -> None:
    from engine_service.service.redis_io import RedisIO
    from engine_service.service.settings import ServiceSettings
    from engine_service.service.worker import Worker

    _count_sends(counters, row)
    if switch_interval_ms is not None:
        sys.setswitchinterval(switch_interval_ms / 1000)
    settings = ServiceSettings(redis_url=url, engine_id=engine_id)
    holder: dict[str, Worker] = {}
    io = RedisIO(settings, model, _CountingInbox(counters, row * N_COUNTERS + C_CANCELS), {"name": model, "bench": "1"},
                 lambda: holder["w"].snapshot().load() if "w" in holder else {})
    worker = holder["w"] = Worker(FastFakeEngine(), io, settings, model)
    io.start()

    def watch() -> None:
        io.connected.wait(30)
        ready.set()
        stop.wait()
        worker.request_stop()

    threading.Thread(target=watch, daemon=True).start()
    try:
        worker.run()
    finally:
        io.stop(flush_timeout=5.0)


# --- the load-generator process ------------------------------------------------------------------

def _loadgen_main(url: str, cfg: BenchConfig, index: int, ready: Any, stop: Any, counters: Any, row: int) -> None:
    _count_sends(counters, row)
    asyncio.run(_load(url, cfg, index, ready, stop, counters, row))


async def _load(url: str, cfg: BenchConfig, index: int, ready: Any, stop: Any, counters: Any, row: int) -> None:
    from gateway.broker import Broker, Lost
    from sluice.wire import codec
    from sluice.wire.event_log import StreamRecord

    base = row * N_COUNTERS
    broker = Broker(url)
    await broker.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    ready.set()
    loop.run_in_executor(None, stop.wait).add_done_callback(lambda _: loop.call_soon_threadsafe(stopping.set))

    async def client(slot: int) -> None:
        n = 0
        while not stopping.is_set():
            rid = uuid.uuid4().hex
            q: asyncio.Queue = asyncio.Queue()
            broker.register([rid], q)
            req = codec.make_request(rid, cfg.model(index * cfg.concurrency + slot + n), [1, 2, 3],
                                     {"max_tokens": cfg.tokens, "temperature": 0.0},
                                     deadline=time.time() + 120, reply_to=broker.gateway_id,
                                     gateway_id=broker.gateway_id, log_events=cfg.log_events, log_ttl_s=60)
            n += 1
            record = None
            if cfg.log_events:
                record = StreamRecord(id=rid, endpoint="chat", model=req.model, created=int(time.time()),
                                      reply_to="", request_ids=[rid], prompt_ids=[[1, 2, 3]], prompt_tokens=[3],
                                      deadline=req.deadline)
            await broker.enqueue(req, record)
            events, ok, cancelled = 0, True, False
            while True:
                try:
                    event = await asyncio.wait_for(q.get(), 60)
                except TimeoutError:
                    ok = False
                    break
                if isinstance(event, Lost):
                    ok = False
                    break
                if event.token_ids:
                    events += 1
                    counters[base + C_EVENTS] += 1
                    counters[base + C_TOKENS] += len(event.token_ids)
                    if events == cfg.cancel_after and not cancelled:
                        cancelled = True
                        counters[base + C_CANCELS] += 1
                        await broker.cancel([rid])
                if codec.is_terminal(event):
                    ok = ok and not event.HasField("error")
                    break
            broker.settled(rid)
            broker.unregister([rid])
            if ok and (events == cfg.tokens or (cancelled and cfg.cancel_after <= events <= cfg.tokens)):
                counters[base + C_COMPLETED_EVENTS] += events
                counters[base + C_COMPLETED] += 1
            else:
                counters[base + C_BAD] += 1

    await asyncio.gather(*(client(i) for i in range(cfg.concurrency)))  # in flight finish after stop
    await broker.close()


# --- measuring -----------------------------------------------------------------------------------

def _proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (Linux /proc); 0.0 where unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


@dataclass
class _Snapshot:
    t: float
    counters: list[int]
    commands: dict[str, dict[str, int]]  # node -> command -> calls
    cpu: dict[str, float]  # node -> used_cpu_sys + used_cpu_user
    net: dict[str, tuple[int, int]] = field(default_factory=dict)  # node -> (bytes in, bytes out)
    proc_cpu: dict[str, float] = field(default_factory=dict)  # "engines"/"loadgens" -> seconds


def _command_calls(info: dict[str, Any]) -> dict[str, int]:
    out = {}
    for key, value in info.items():
        name = key.removeprefix("cmdstat_")
        if isinstance(value, dict) and name not in _IGNORED_COMMANDS:
            out[name] = int(value.get("calls", 0))
    return out


def _snapshot(nodes: dict[str, tuple[redis.Redis, str]], counters: Any, procs: dict[str, list[Any]]) -> _Snapshot:
    commands, cpu, net = {}, {}, {}
    t = time.monotonic()
    values = list(counters)
    for name, (client, _) in nodes.items():
        commands[name] = _command_calls(client.info("commandstats"))
        info = client.info("cpu")
        cpu[name] = float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
        stats = client.info("stats")
        net[name] = (int(stats["total_net_input_bytes"]), int(stats["total_net_output_bytes"]))
    proc_cpu = {kind: sum(_proc_cpu_s(p.pid) for p in ps) for kind, ps in procs.items()}
    return _Snapshot(t, values, commands, cpu, net=net, proc_cpu=proc_cpu)


def _delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b) if b.get(k, 0) - a.get(k, 0)}


def _totals(values: list[int], rows: range, col: int) -> int:
    return sum(values[r * N_COUNTERS + col] for r in rows)


def measure(topology: Any, cfg: BenchConfig) -> dict[str, Any]:
    """Run engines and load generators on ``topology`` (started), measure a window, stop them
    (letting the requests in flight finish) and return the figures."""
    ctx = mp.get_context("spawn")
    n_rows = cfg.engines + cfg.gateways
    counters = ctx.RawArray("q", n_rows * N_COUNTERS)
    stop_engines, stop_load = ctx.Event(), ctx.Event()
    engines, loadgens = [], []
    readies = []
    run_id = uuid.uuid4().hex[:6]
    for i in range(cfg.engines):
        ready = ctx.Event()
        engines.append(ctx.Process(target=_engine_main, name=f"bench-engine-{i}", daemon=True,
                                   args=(topology.url, cfg.model(i), f"bench-{run_id}-{i}", ready, stop_engines,
                                         counters, i, cfg.engine_switch_interval_ms)))
        readies.append(ready)
    for i in range(cfg.gateways):
        ready = ctx.Event()
        loadgens.append(ctx.Process(target=_loadgen_main, name=f"bench-loadgen-{i}", daemon=True,
                                    args=(topology.url, cfg, i, ready, stop_load, counters, cfg.engines + i)))
        readies.append(ready)
    procs = {"engines": engines, "loadgens": loadgens}
    nodes = topology.nodes()
    idle_before = _snapshot(nodes, counters, {})
    time.sleep(IDLE_S)  # what the nodes spend with no client at all (cron, a cluster's bus)
    idle = _snapshot(nodes, counters, {})
    idle_cpu_per_s = sum(idle.cpu.values()) - sum(idle_before.cpu.values())
    idle_cpu_per_s /= idle.t - idle_before.t
    try:
        for p in engines:
            p.start()
        for r in readies[:cfg.engines]:
            if not r.wait(60):
                raise RuntimeError("an engine process did not connect to Redis within 60 s")
        for p in loadgens:
            p.start()
        for r in readies[cfg.engines:]:
            if not r.wait(60):
                raise RuntimeError("a load generator did not start within 60 s")
        time.sleep(cfg.warmup_s)
        before = _snapshot(nodes, counters, procs)
        time.sleep(cfg.duration_s)
        after = _snapshot(nodes, counters, procs)
        stop_load.set()
        for p in loadgens:
            p.join(90)
        stop_engines.set()
        for p in engines:
            p.join(30)
    finally:
        stop_load.set()
        stop_engines.set()
        for p in engines + loadgens:
            if p.is_alive():
                p.kill()
                p.join(5)
        for client, _ in nodes.values():
            client.close()
    final = list(counters)
    figures = _figures(topology, cfg, nodes, before, after, final)
    figures["redis_idle_cpu_s_per_s"] = idle_cpu_per_s
    return figures


def _figures(topology: Any, cfg: BenchConfig, nodes: dict[str, tuple[redis.Redis, str]],
             before: _Snapshot, after: _Snapshot, final: list[int]) -> dict[str, Any]:
    window = after.t - before.t
    gen_rows = range(cfg.engines, cfg.engines + cfg.gateways)
    all_rows = range(cfg.engines + cfg.gateways)

    def d(col: int, rows: range = gen_rows) -> int:
        return _totals(after.counters, rows, col) - _totals(before.counters, rows, col)

    requests = d(C_COMPLETED)
    per_req = (lambda x: x / requests) if requests else (lambda x: float("nan"))
    by_node = {name: _delta(before.commands[name], after.commands[name]) for name in nodes}
    masters = [name for name, (_, role) in nodes.items() if role == "master"]
    by_command: dict[str, int] = {}
    for name in masters:
        for cmd, calls in by_node[name].items():
            by_command[cmd] = by_command.get(cmd, 0) + calls
    total_commands = sum(by_command.values())
    enqueues = by_command.get("xadd", 0)  # one per enqueue script (hand-backs are rare)
    cpu = {name: after.cpu[name] - before.cpu[name] for name in nodes}
    cpu_total = sum(cpu.values())
    busiest = max(cpu, key=cpu.get)
    node_rows = {
        name: {
            "role": nodes[name][1],
            "commands": sum(by_node[name].values()),
            "command_share": (sum(by_node[name].values()) / total_commands) if total_commands and name in masters else 0.0,
            "cpu_s": cpu[name],
            "cpu_share": cpu[name] / cpu_total if cpu_total else 0.0,
            "cpu_utilisation": cpu[name] / window,
        }
        for name in nodes
    }
    proc_cpu = {kind: after.proc_cpu[kind] - before.proc_cpu[kind] for kind in after.proc_cpu}
    bench_cpu = cpu_total + sum(proc_cpu.values())
    tokens = d(C_TOKENS)
    per_token = (lambda x: x / tokens) if tokens else (lambda x: float("nan"))
    # Bytes Redis read from its clients (commands) and wrote to them (replies, pub/sub messages),
    # the bench's own INFO polling included (a few KB a snapshot, spread over the window's tokens)
    net_in = sum(after.net[n][0] - before.net[n][0] for n in masters)
    net_out = sum(after.net[n][1] - before.net[n][1] for n in masters)
    cancels = [after.counters[r * N_COUNTERS + C_CANCELS] - before.counters[r * N_COUNTERS + C_CANCELS]
               for r in range(cfg.engines)]
    return {
        "topology": topology.name,
        "nodes": len(nodes),
        "masters": len(masters),
        "window_s": window,
        "requests": requests,
        "requests_per_s": requests / window,
        "token_events": d(C_EVENTS),
        "token_events_per_s": d(C_EVENTS) / window,
        "commands_per_request": per_req(total_commands),
        # ENQUEUE_SCRIPT's SET and XADD run inside Redis, not sent by a client
        "client_commands_per_request": per_req(total_commands - SCRIPT_INNER_COMMANDS * enqueues
                                               - CANCEL_INNER_COMMANDS * d(C_CANCELS)),
        "commands_per_request_by_command": dict(sorted(((k, per_req(v)) for k, v in by_command.items()),
                                                       key=lambda kv: -kv[1])),
        "tokens": tokens,
        "commands_per_token": per_token(total_commands),
        "redis_bytes_in_per_token": per_token(net_in),
        "redis_bytes_out_per_token": per_token(net_out),
        # cancels: the clients' (one per request with cfg.cancel_after) and, per engine, the request
        # ids its step loop was told to cancel
        "cancels_sent": d(C_CANCELS),
        "cancels_received_per_engine": cancels,
        "round_trips_per_request": per_req(d(C_SENDS, all_rows)),
        "round_trips_per_request_engines": per_req(d(C_SENDS, range(cfg.engines))),
        "round_trips_per_request_loadgens": per_req(d(C_SENDS)),
        "redis_cpu_s_per_1k_requests": per_req(cpu_total) * 1000,
        "busiest_node": busiest,
        "busiest_node_cpu_s_per_1k_requests": per_req(cpu[busiest]) * 1000,
        "busiest_node_cpu_share": cpu[busiest] / cpu_total if cpu_total else 0.0,
        "busiest_node_cpu_utilisation": cpu[busiest] / window,
        # An estimate, not a measurement: the requests/s at which the busiest node would be busy
        # all the time, at this window's Redis CPU per request (Redis executes commands on one
        # thread; per-request cost falls as batches grow, so this is on the low side).
        "redis_bound_requests_per_s": requests / cpu[busiest] if cpu[busiest] else 0.0,
        "python_cpu_s_per_1k_requests": {k: per_req(v) * 1000 for k, v in proc_cpu.items()},
        # The machine is shared: how many cores the bench's processes (Redis and Python) got, and
        # the requests per CPU-second they spent, which does not depend on what else ran.
        "bench_cores_used": bench_cpu / window,
        "requests_per_cpu_s": requests / bench_cpu if bench_cpu else 0.0,
        "load_average_1m": os.getloadavg()[0],
        "per_node": node_rows,
        # over the whole run, the requests in flight at the stop included: the correctness check
        "check": {
            "completed": _totals(final, gen_rows, C_COMPLETED),
            "events_of_completed": _totals(final, gen_rows, C_COMPLETED_EVENTS),
            "expected_events": _totals(final, gen_rows, C_COMPLETED) * cfg.tokens,
            "bad": _totals(final, gen_rows, C_BAD),
        },
    }


# --- the command ---------------------------------------------------------------------------------

ROWS = [
    ("requests/s", "requests_per_s", "{:,.0f}"),
    ("token events/s", "token_events_per_s", "{:,.0f}"),
    ("Redis commands / request", "commands_per_request", "{:.2f}"),
    ("  sent by clients / request", "client_commands_per_request", "{:.2f}"),
    ("client round trips / request", "round_trips_per_request", "{:.2f}"),
    ("  engines", "round_trips_per_request_engines", "{:.2f}"),
    ("  load generators", "round_trips_per_request_loadgens", "{:.2f}"),
    ("Redis commands / token", "commands_per_token", "{:.2f}"),
    ("Redis bytes in / token", "redis_bytes_in_per_token", "{:,.0f}"),
    ("Redis bytes out / token", "redis_bytes_out_per_token", "{:,.0f}"),
    ("Redis CPU s / 1k requests", "redis_cpu_s_per_1k_requests", "{:.3f}"),
    ("busiest node CPU s / 1k req", "busiest_node_cpu_s_per_1k_requests", "{:.3f}"),
    ("busiest node share of CPU", "busiest_node_cpu_share", "{:.0%}"),
    ("busiest node CPU utilisation", "busiest_node_cpu_utilisation", "{:.0%}"),
    ("Redis-bound requests/s (est.)", "redis_bound_requests_per_s", "{:,.0f}"),
    ("Redis idle CPU s / s", "redis_idle_cpu_s_per_s", "{:.3f}"),
    ("cores used by the bench", "bench_cores_used", "{:.2f}"),
    ("requests / CPU-second (all)", "requests_per_cpu_s", "{:,.0f}"),
    ("load average (1 min)", "load_average_1m", "{:.1f}"),
]
RATIOS = ["requests_per_s", "token_events_per_s", "commands_per_request", "round_trips_per_request",
          "redis_cpu_s_per_1k_requests", "busiest_node_cpu_s_per_1k_requests", "busiest_node_cpu_utilisation",
          "redis_bound_requests_per_s", "requests_per_cpu_s"]


def mean_result(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean of several rounds' figures, leaf by leaf (numbers averaged, the rest from the first)."""
    first = runs[0]
    if isinstance(first, dict):
        return {k: mean_result([r[k] for r in runs if k in r]) if not isinstance(first[k], str) else first[k]
                for k in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return sum(runs) / len(runs)
    if isinstance(first, list) and all(isinstance(r, list) and len(r) == len(first) for r in runs):
        return [mean_result(list(column)) for column in zip(*runs, strict=True)]
    return first


def table(results: dict[str, dict[str, Any]]) -> str:
    names = list(results)
    lines = [f"{'':32}" + "".join(f"{n:>14}" for n in names) + ("   cluster/standalone" if len(names) == 2 else "")]
    for label, key, fmt in ROWS:
        cells = "".join(f"{fmt.format(results[n][key]):>14}" for n in names)
        ratio = ""
        if len(names) == 2 and key in RATIOS and results[names[0]][key]:
            ratio = f"   {results[names[1]][key] / results[names[0]][key]:.2f}x"
        lines.append(f"{label:32}{cells}{ratio}")
    for kind in ("engines", "loadgens"):
        cells = "".join(f"{results[n]['python_cpu_s_per_1k_requests'].get(kind, 0):>14.3f}" for n in names)
        lines.append(f"{'Python CPU s / 1k req, ' + kind:32}{cells}")
    if any(results[n].get("cancels_sent") for n in names):
        lines.append(f"{'cancels sent':32}" + "".join(f"{results[n]['cancels_sent']:>14,.0f}" for n in names))
        for i in range(len(results[names[0]]["cancels_received_per_engine"])):
            cells = "".join(f"{results[n]['cancels_received_per_engine'][i]:>14,.0f}" for n in names)
            lines.append(f"{f'  received by engine {i}':32}{cells}")
    lines.append("commands / request by command:")
    commands = sorted({c for n in names for c in results[n]["commands_per_request_by_command"]},
                      key=lambda c: -results[names[0]]["commands_per_request_by_command"].get(c, 0))
    for cmd in commands:
        cells = "".join(f"{results[n]['commands_per_request_by_command'].get(cmd, 0):>14.3f}" for n in names)
        lines.append(f"  {cmd:30}{cells}")
    return "\n".join(lines)


def node_shares(rounds: list[dict[str, dict[str, Any]]]) -> str:
    """Each round's share of Redis CPU and commands per node."""
    lines = []
    for i, results in enumerate(rounds, 1):
        for name, result in results.items():
            shares = ", ".join(f"{row['role']} {row['cpu_share']:.0%} CPU / {row['command_share']:.0%} commands"
                               for row in sorted(result["per_node"].values(), key=lambda r: -r["cpu_share"]))
            lines.append(f"round {i} {name}: {result['requests_per_s']:,.0f} requests/s, "
                         f"{result['requests_per_cpu_s']:,.0f} requests/CPU-s; nodes: {shares}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=20.0, help="measured window per topology, seconds")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of load before the window")
    parser.add_argument("--engines", type=int, default=2, help="engine processes (real RedisIO + Worker, fake engine)")
    parser.add_argument("--gateways", type=int, default=2, help="load-generator processes (one gateway Broker each)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight per load generator")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per request (max_tokens)")
    parser.add_argument("--models", type=int, default=1, help="model names (queues) to spread engines and requests over")
    parser.add_argument("--cancel-after", type=int, default=0,
                        help="cancel each request after this many token events, as a stop string does (0: never); "
                             "the table then shows the cancels each engine received")
    parser.add_argument("--cluster-replicas", type=int, default=0, choices=(0, 1), help="replicas per cluster master")
    parser.add_argument("--topologies", default="standalone,cluster", help="comma-separated: standalone, cluster")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the topologies this many times, alternating (the table shows the means)")
    parser.add_argument("--engine-switch-interval-ms", type=float, default=None,
                        help="sys.setswitchinterval of the engine processes, in ms (default: Python's 5 ms); "
                             "a diagnostic of how long the engine's I/O threads wait for the GIL")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")


def run(args: argparse.Namespace) -> int:
    def usage(message: str) -> int:
        print(f"sluice bench redis-capacity: {message}", file=sys.stderr)
        return 2

    for name in ("duration", "engines", "gateways", "concurrency", "tokens", "models", "rounds"):
        if getattr(args, name) <= 0:
            return usage(f"--{name} must be positive")
    if args.cancel_after < 0:
        return usage("--cancel-after must not be negative")
    if args.engine_switch_interval_ms is not None and args.engine_switch_interval_ms <= 0:
        return usage("--engine-switch-interval-ms must be positive")
    if args.engines < args.models:
        return usage("--engines must be at least --models (every model needs an engine)")
    if args.warmup < 0:
        return usage("--warmup must not be negative")
    topologies = [t.strip() for t in args.topologies.split(",") if t.strip()]
    unknown = [t for t in topologies if t not in ("standalone", "cluster")]
    if unknown or not topologies:
        return usage(f"--topologies: unknown {unknown or args.topologies!r}; use standalone,cluster")
    cfg = BenchConfig(duration_s=args.duration, warmup_s=args.warmup, engines=args.engines, gateways=args.gateways,
                      concurrency=args.concurrency, tokens=args.tokens, models=args.models,
                      cluster_replicas=args.cluster_replicas, cancel_after=args.cancel_after,
                      engine_switch_interval_ms=args.engine_switch_interval_ms)
    rounds: list[dict[str, dict[str, Any]]] = []
    for i in range(args.rounds):
        results: dict[str, dict[str, Any]] = {}
        for name in topologies:
            topology = Standalone() if name == "standalone" else Cluster(cfg.cluster_replicas)
            print(f"round {i + 1} {name}: starting Redis, {cfg.engines} engines, {cfg.gateways} load generators ...",
                  flush=True)
            with topology:
                results[name] = measure(topology, cfg)
            check = results[name]["check"]
            print(f"round {i + 1} {name}: {results[name]['requests_per_s']:,.0f} requests/s; whole run: "
                  f"{check['completed']} requests completed, {check['bad']} failed", flush=True)
        rounds.append(results)
    means = {name: mean_result([r[name] for r in rounds]) for name in topologies}
    for name in topologies:
        means[name].pop("per_node", None)  # node names differ per round: see "rounds"
        means[name].pop("check", None)
        means[name]["busiest_node"] = None
    print()
    print(table(means))
    print(node_shares(rounds))
    ratios = {}
    if len(topologies) == 2:
        a, b = (means[n] for n in topologies)
        ratios = {k: b[k] / a[k] for k in RATIOS if a[k]}
    report = {
        "config": {**asdict(cfg), "rounds": args.rounds, "topologies": topologies},
        "machine": {"redis_server": _redis_version(), "redis_py": redis.__version__},
        "means": means,
        "ratios_second_to_first": ratios,
        "rounds": rounds,
    }
    if written := results_file.write(args.json, "redis-capacity", report):
        print(f"\nwrote {written}")
    bad = sum(r["check"]["bad"] for results in rounds for r in results.values())
    return 1 if bad else 0


def _redis_version() -> str:
    try:
        return subprocess.run([REDIS_SERVER, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        return "?"

