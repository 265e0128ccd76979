"""``sluice bench fairness``: fair share between tenants on the real model, fed through Redis.

Starts a private ``redis-server`` and real ``sluice engine`` processes (the default model unless
``--model``) with few slots (``--max-num-seqs``, default 4), so that requests queue, and one queue
shard (``--queue-shards``, default 1: every request shares one queue, the case where one tenant's
flood stands in front of everyone; with more shards, requests that hash to different shards are
interleaved by the shards' rotation with or without tenants). For each engine count of
``--engines`` (default ``1,2``), three runs on the same engines (``alone`` and ``fair`` in turn
``--rounds`` times, so that a change of the machine's load weighs on both; ``fifo`` once):

- ``alone``: the light tenant alone, one request every ``--light-interval`` seconds;
- ``fifo``: a flood of ``--flood-requests`` requests queued at once, then the light requests as
  above, every request in one tenant (first come, first served: what a queue without tenants does);
- ``fair``: the same, the flood as tenant ``flood`` and the light requests as tenant ``light``
  (their own queue lanes; the engines' fair share, ``docs/fair-share.md``).

Measured at the client (a ``WireClient``, as a gateway would enqueue): each light request's time to
first token, enqueue to its first token event. A light request without a first token within
``--light-timeout`` seconds counts as that long at least (shown with ``>``). After each run every
request still open is cancelled and the engines are let idle. Also reported: the flood's requests
that got their first token while the light tenant was measured (what the flood was served), and the
engines' preemptions (the scheduler's, from their ``/metrics``). Prints a table; ``--json PATH``
writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sluice.wire import codec
from sluice.wire.client import WireClient
from sluice.wire.connection import connect, read_shard_message

MODEL = "bench-fairness"
FLOOD, LIGHT = "flood", "light"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Engines:
    """A private redis-server and ``count`` engine processes."""

    args: argparse.Namespace
    count: int
    tmp: str = ""
    url: str = ""
    procs: list[subprocess.Popen] = field(default_factory=list)
    metrics_ports: list[int] = field(default_factory=list)

    def start(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="sluice-bench-fairness-")
        server = shutil.which("redis-server")
        if server is None:
            raise SystemExit("redis-server not found (apt-get install redis-server)")
        port = _free_port()
        self.procs.append(subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                            "--appendonly", "no", "--dir", self.tmp], stdout=subprocess.DEVNULL,
                                           start_new_session=True))
        self.url = f"redis://127.0.0.1:{port}/0"
        a = self.args
        cli = [sys.executable, "-m", "sluice_cli.cli", "engine"]
        k = a.cpus_per_engine
        if k and self.count * k > len(os.sched_getaffinity(0)):
            raise SystemExit(f"--cpus-per-engine {k}: {self.count} engines need {self.count * k} CPUs, "
                             f"this process may use {len(os.sched_getaffinity(0))}")
        cpus = sorted(os.sched_getaffinity(0))
        for i in range(self.count):
            self.metrics_ports.append(_free_port())
            pin = ["--cpus", ",".join(str(c) for c in cpus[i * k:(i + 1) * k])] if k else []
            flags = ["--redis-url", self.url, "--grpc-port", "0", "--metrics-port", str(self.metrics_ports[-1]),
                     "--engine-id", f"fair-{i}-{uuid.uuid4().hex[:4]}", "--served-model-name", MODEL,
                     "--max-num-seqs", str(a.max_num_seqs), "--max-model-len", str(a.max_model_len),
                     "--queue-shards", str(a.queue_shards),
                     "--log-level", "WARNING", *(["--model", a.model] if a.model else []), *pin, *a.engine_arg]
            log = open(Path(self.tmp) / f"engine{i}.log", "w")  # noqa: SIM115 - closed with the process
            self.procs.append(subprocess.Popen([*cli, *flags], stdout=log, stderr=log, env={**os.environ},
                                               start_new_session=True))

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(Path(self.tmp).glob("engine*.log")))

    def wait_ready(self, client: WireClient, timeout: float = 300.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for p in self.procs[1:]:
                if p.poll() is not None:
                    raise SystemExit(f"an engine exited with {p.returncode}:\n{self.logs()}")
            try:
                if len([e for e in client.engines().values() if e.model == MODEL]) == self.count:
                    time.sleep(2.0)  # every engine has read the registry: the shards are split
                    return
            except Exception:  # noqa: BLE001 - Redis not up yet
                pass
            time.sleep(0.5)
        raise SystemExit(f"the engines did not register within {timeout:.0f}s:\n{self.logs()}")

    def preemptions(self) -> int:
        total = 0
        for port in self.metrics_ports:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                    body = resp.read().decode()
            except OSError:
                continue
            for line in body.splitlines():
                if line.startswith("sluice:num_preemptions_total"):
                    total += int(float(line.rsplit(" ", 1)[1]))
        return total

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)


class Listener:
    """Every event of one reply id: first-token and end times by request id."""

    def __init__(self, client: WireClient, reply: str) -> None:
        self.pubsub = client.subscribe(reply)
        self.first: dict[str, float] = {}
        self.ended: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            message = read_shard_message(self.pubsub, 0.2)
            if not message or message.get("type") not in (b"smessage", "smessage"):
                continue
            now = time.monotonic()
            for ev in codec.decode_events(message["data"]):
                if ev.token_ids and ev.request_id not in self.first:
                    self.first[ev.request_id] = now
                if codec.is_terminal(ev):
                    self.ended[ev.request_id] = now

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.pubsub.close()


@dataclass
class Run:
    engines: int
    name: str
    light_ttft_ms: list[float | None]  # None: no first token within --light-timeout
    flood_first_tokens: int  # flood requests that got a first token while the light tenant was measured
    preemptions: int
    seconds: float
    p50_ms: float = 0.0  # inf: more than half had none within the timeout
    p90_ms: float = 0.0
    ratio_to_alone: float | None = None


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_one(engines: Engines, client: WireClient, name: str, vocab: int, args: argparse.Namespace) -> Run:
    rng = random.Random(f"{args.seed}-{name}-{engines.count}")
    reply = client.new_reply_id()
    listener = Listener(client, reply)
    flood_tenant, light_tenant = {"alone": ("", LIGHT), "fifo": ("", ""), "fair": (FLOOD, LIGHT)}[name]
    # ids of this run's own: an engine remembers a cancel of an id it has not seen (an earlier
    # run's), and would drop a later request of that id
    tag = uuid.uuid4().hex[:6]
    sent: dict[str, float] = {}

    def send(rid: str, tenant: str, prompt_len: int, max_tokens: int) -> None:
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        request = codec.make_request(rid, MODEL, prompt, {"temperature": 0.0, "max_tokens": max_tokens,
                                                          "ignore_eos": True}, reply_to=reply, tenant=tenant)
        sent[rid] = time.monotonic()
        client.enqueue(request)

    preempted = engines.preemptions()
    started = time.monotonic()
    try:
        if name != "alone":
            for i in range(args.flood_requests):
                send(f"{name}-{tag}-flood-{i}", flood_tenant, args.flood_prompt_tokens, args.flood_max_tokens)
            time.sleep(args.flood_lead)  # the flood holds every slot; its backlog waits in Redis
        window = time.monotonic()
        lights = []
        for k in range(args.light_requests):
            due = window + k * args.light_interval
            if (delay := due - time.monotonic()) > 0:
                time.sleep(delay)
            lights.append(f"{name}-{tag}-light-{k}")
            send(lights[-1], light_tenant, args.light_prompt_tokens, args.light_max_tokens)
        end = sent[lights[-1]] + args.light_timeout
        while time.monotonic() < end and not all(r in listener.first for r in lights):
            time.sleep(0.05)
        window_end = time.monotonic()
        ttft = [round(1000 * (listener.first[r] - sent[r]), 1)
                if r in listener.first and listener.first[r] - sent[r] <= args.light_timeout else None for r in lights]
        flood_served = sum(1 for r, t in listener.first.items() if "-flood-" in r and window <= t <= window_end)
        open_ids = [r for r in sent if r not in listener.ended]
        if open_ids:
            client.cancel(open_ids, reply_to=reply)
        idle_by = time.monotonic() + 120
        while len(listener.ended) < len(sent) and time.monotonic() < idle_by:
            time.sleep(0.1)
    finally:
        listener.close()
    return Run(engines.count, name, ttft, flood_served, engines.preemptions() - preempted,
               round(time.monotonic() - started, 1))


def merge(parts: list[Run]) -> Run:
    """One run's rounds as one: the light requests of every round, the sums."""
    first = parts[0]
    return Run(first.engines, first.name, [v for p in parts for v in p.light_ttft_ms],
               sum(p.flood_first_tokens for p in parts), sum(p.preemptions for p in parts),
               round(sum(p.seconds for p in parts), 1))


def summarize(runs: list[Run]) -> None:
    alone = {r.engines: r for r in runs if r.name == "alone"}
    for r in runs:
        values = [v if v is not None else float("inf") for v in r.light_ttft_ms]
        r.p50_ms, r.p90_ms = statistics.median(values), _pct(values, 0.9)
        base = alone.get(r.engines)
        if base is not None and base.p50_ms and r.p50_ms != float("inf"):
            r.ratio_to_alone = round(r.p50_ms / base.p50_ms, 2)


def format_table(runs: list[Run], timeout_s: float) -> str:
    def ms(v: float) -> str:
        return f"> {timeout_s * 1000:,.0f}" if v == float("inf") else f"{v:,.0f}"

    rows = ["| engines | run | light TTFT p50 ms | p90 ms | x alone | light served | flood first tokens "
            "meanwhile | preemptions |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        served = sum(1 for v in r.light_ttft_ms if v is not None)
        ratio = f"{r.ratio_to_alone:.2f}" if r.ratio_to_alone is not None else "-"
        rows.append(f"| {r.engines} | {r.name} | {ms(r.p50_ms)} | {ms(r.p90_ms)} | {ratio} | {served}/{len(r.light_ttft_ms)} "
                    f"| {r.flood_first_tokens} | {r.preemptions} |")
    return "\n".join(rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: the prepared default model)")
    parser.add_argument("--engines", default="1,2", help="engine counts to run, comma-separated (default 1,2)")
    parser.add_argument("--max-num-seqs", type=int, default=4, help="each engine's slots (default 4)")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--queue-shards", type=int, default=1, help="the engines' --queue-shards (default 1)")
    parser.add_argument("--flood-requests", type=int, default=200)
    parser.add_argument("--flood-prompt-tokens", type=int, default=48)
    parser.add_argument("--flood-max-tokens", type=int, default=48)
    parser.add_argument("--flood-lead", type=float, default=2.0, help="seconds between the flood and the first light request")
    parser.add_argument("--light-requests", type=int, default=12)
    parser.add_argument("--light-interval", type=float, default=1.0, help="seconds between light requests (default 1)")
    parser.add_argument("--light-prompt-tokens", type=int, default=16)
    parser.add_argument("--light-max-tokens", type=int, default=4)
    parser.add_argument("--light-timeout", type=float, default=15.0,
                        help="a light request without a first token this long after it was sent counts as that long")
    parser.add_argument("--runs", default="alone,fair,fifo",
                        help="which runs, in order (default alone,fair,fifo: the two compared run back to back)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="run them this many times in turn (A B A B; fifo once), the figures over all "
                             "rounds (default 2)")
    parser.add_argument("--cpus-per-engine", type=int, default=0, metavar="N",
                        help="pin engine i to the i-th N CPUs of this process's (--cpus), so that saturated engines "
                             "do not share cores (default: not pinned)")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                        help="an extra `sluice engine` argument (repeat it: --engine-arg=--cpus --engine-arg=0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results here")


def run(args: argparse.Namespace) -> int:
    counts = [int(x) for x in args.engines.split(",") if x.strip()]
    names = [x.strip() for x in args.runs.split(",") if x.strip()]
    if unknown := set(names) - {"alone", "fifo", "fair"}:
        raise SystemExit(f"--runs: unknown {sorted(unknown)} (alone, fifo, fair)")
    runs: list[Run] = []
    for count in counts:
        engines = Engines(args, count)
        try:
            engines.start()
            client = WireClient(connect(engines.url))
            engines.wait_ready(client)
            card = client.model_card(MODEL)
            vocab = min(card.vocab_size, 32_000) if card is not None else 32_000
            # warm-up: each engine's first steps (kernels built, caches touched) stay out of the figures
            run_one(engines, client, "alone", vocab,
                    argparse.Namespace(**{**vars(args), "light_requests": 2 * count, "light_interval": 0.2}))
            rounds: dict[str, list[Run]] = {}
            for turn in range(args.rounds):
                for name in names:
                    if name == "fifo" and turn:  # once is enough: it serves none of them
                        continue
                    r = run_one(engines, client, name, vocab, args)
                    rounds.setdefault(name, []).append(r)
                    print(f"{count} engine(s), {name} (round {turn + 1}): light TTFT {r.light_ttft_ms} ms, "
                          f"{r.preemptions} preemptions", flush=True)
            runs += [merge(parts) for parts in rounds.values()]
            client.close()
        finally:
            engines.stop()
    summarize(runs)
    print()
    print(f"sluice bench fairness: {args.max_num_seqs} slots an engine, {args.queue_shards} queue shard(s), "
          f"flood {args.flood_requests} requests "
          f"({args.flood_prompt_tokens} prompt + {args.flood_max_tokens} tokens), light {args.light_requests} "
          f"requests one every {args.light_interval:g} s ({args.light_prompt_tokens} + {args.light_max_tokens})")
    print(format_table(runs, args.light_timeout))
    if args.json:
        doc = {"bench": "fairness", "config": vars(args), "runs": [asdict(r) for r in runs]}
        for r in doc["runs"]:
            for key in ("p50_ms", "p90_ms"):
                if r[key] == float("inf"):
                    r[key] = None
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
