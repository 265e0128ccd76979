"""``sluice bench serving-path``: what the serving path itself costs, with the model's cost taken out.

Starts a private ``redis-server``, an engine whose model is the stub (``engine_service.model.stub``:
fixed logits, no weights; the real scheduler, runner layout, sampler, step loop and Redis I/O run
around it) and a gateway (one uvicorn worker), then keeps 1, 64, 256 (``--streams``) streams in
flight against ``/v1/completions`` (or ``--endpoint chat``): each stream sends a text prompt (the
gateway tokenizes it), reads the SSE stream to its end (``max_tokens`` ends every request) and
sends the next. The client is a bare asyncio HTTP/1.1 reader (no JSON per chunk), so that it takes
little of the CPU the server shares with it.

Per level, after ``--warmup`` seconds, a ``--duration`` window measures

- tokens/s delivered to the clients (every request's ``usage.completion_tokens`` spread over its
  chunks, counted by the chunks' arrival in the window);
- CPU µs per delivered token of each process from ``/proc``: the engine split by thread (the step
  loop on the main thread; its Redis I/O threads, named ``sluice-io-*``; the rest: torch's, gRPC's,
  the metrics server's), the gateway, ``redis-server`` and the client itself;
- the engine's steps (its ``/metrics``): steps per second, the wall time of ``engine.step()``, and
  the step loop's CPU per step;

and with ``--profile`` a second window of the same length, under py-spy (the ``bench`` extra;
sampled, not traced) on the engine and the gateway, splits each process's CPU by component: for
the gateway tokenizing, detokenizing, SSE/JSON formatting, reading events from Redis, HTTP
(uvicorn/starlette), asyncio; for the engine loop the stub's forward, the sampler, the runner's
step layout, the scheduler, building and sending events, metrics. The step's non-forward time is
the loop's CPU per step less the stub forward's share.

``--source DIR`` (repeatable, ``--label`` each) runs the same levels against the processes of other
checkouts too (PYTHONPATH=DIR), every stack started at once on its own Redis and measured level by
level in turn, so an old and a new tree are compared side by side in one run; every source must
have the stub model. Writes a table and the JSON (``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from sluice_bench import results as results_file
from sluice_bench.stack import Stack, StackError, http_get, thread_cpu

ROOT = Path(__file__).resolve().parents[1]
STUB_ENV = "SLUICE_BENCH_STUB_MODEL"  # engine_service.model.stub.BENCH_ENV (no torch imported here)
PROMPT_WORDS = ("harbour", "lantern", "orchard", "granite", "meadow", "copper", "willow", "ferry",
                "pepper", "signal", "quarry", "thistle", "ribbon", "saddle", "tundra", "violet")


# --- processes ---------------------------------------------------------------------------------


@dataclass
class PathStack:
    """Redis + a stub engine + a gateway (``sluice_bench.stack``), run from ``source`` (a checkout)."""

    label: str
    source: Path
    engine_args: list[str] = field(default_factory=list)
    engine_env: dict[str, str] = field(default_factory=dict)
    extra_path: str = ""  # appended to the processes' PYTHONPATH (e.g. optional packages to try)
    gateway_args: list[str] = field(default_factory=list)  # extra `sluice gateway` arguments
    stack: Stack | None = None
    port: int = 0
    metrics_port: int = 0
    model: str = ""
    redis_url: str = ""

    def start(self, timeout: float = 180.0) -> None:
        self.stack = Stack(self.label, source=self.source, env={STUB_ENV: "1"}, extra_path=self.extra_path)
        try:
            url = self.redis_url = self.stack.redis()
            engine = self.stack.engine(url, ["--stub-model", "--log-level", "WARNING", *self.engine_args],
                                       name="engine", env=self.engine_env, metrics_port=0)
            gateway = self.stack.gateway(url, ["--log-level", "warning", *self.gateway_args], name="gateway")
            self.port, self.metrics_port = gateway.port, engine.port
            self.model = self.stack.wait_ready(gateway, timeout)
        except StackError as exc:
            raise SystemExit(str(exc)) from None

    @property
    def tmp(self) -> Path:
        assert self.stack is not None
        return self.stack.scratch

    def pid(self, name: str) -> int:
        assert self.stack is not None
        return self.stack.get(name).pid

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.stop()

    # --- what the processes spent ---
    def cpu(self) -> dict[str, float]:
        """CPU seconds so far, by component (see the module docstring)."""
        out = {"engine_loop": 0.0, "engine_redis_io": 0.0, "engine_other": 0.0}
        engine = self.pid("engine")
        for tid, comm, seconds in thread_cpu(engine):
            if tid == engine:
                out["engine_loop"] += seconds
            elif comm.startswith("sluice-io"):
                out["engine_redis_io"] += seconds
            else:
                out["engine_other"] += seconds
        out["gateway"] = sum(s for _, _, s in thread_cpu(self.pid("gateway")))
        out["redis_server"] = sum(s for _, _, s in thread_cpu(self.pid("redis")))
        return out

    def engine_metrics(self) -> dict[str, float]:
        body = http_get(f"http://127.0.0.1:{self.metrics_port}/metrics") or b""
        out: dict[str, float] = {}
        for line in body.decode().splitlines():
            for name, key in (("sluice:engine_step_duration_seconds_count", "steps"),
                              ("sluice:engine_step_duration_seconds_sum", "step_seconds"),
                              ("sluice:batch_size_sum", "batch_sum"), ("sluice:batch_size_count", "batches")):
                if line.startswith(name + "{") or line.startswith(name + " "):
                    out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return out


# --- the client --------------------------------------------------------------------------------


@dataclass
class Window:
    start: float
    end: float
    tokens: float = 0.0
    requests: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seen: list[tuple[float, list[float], int | None]] = field(default_factory=list)
    tokens_per_chunk: float = 1.0

    def close(self, finished_ratio: list[float]) -> None:
        """Tokens delivered inside the window (each request's tokens spread over its chunks),
        requests finished in it, TTFT of those that started in it, ITL of its chunks."""
        if finished_ratio:
            self.tokens_per_chunk = statistics.fmean(finished_ratio)
        for sent, times, tokens in self.seen:
            per_chunk = tokens / len(times) if tokens is not None else self.tokens_per_chunk
            self.tokens += per_chunk * sum(1 for t in times if self.start <= t < self.end)
            if tokens is not None and self.start <= times[-1] < self.end:
                self.requests += 1
            if self.start <= times[0] < self.end:
                self.ttft.append(times[0] - sent)
            self.itl.extend(b - a for a, b in zip(times, times[1:], strict=False) if self.start <= b < self.end)


class Client:
    """Streams on raw HTTP/1.1 keep-alive connections; counts SSE ``data:`` lines, parses only the
    usage chunk."""

    def __init__(self, port: int, model: str, endpoint: str, max_tokens: int, prompt_words: int) -> None:
        self.port, self.model, self.endpoint = port, model, endpoint
        self.max_tokens, self.prompt_words = max_tokens, prompt_words
        self.counter = 0

    def _body(self) -> bytes:
        self.counter += 1
        i = self.counter
        words = " ".join(PROMPT_WORDS[(i * 7 + k * 3) % len(PROMPT_WORDS)] for k in range(self.prompt_words))
        text = f"Request {i}: {words}."
        common = {"model": self.model, "max_tokens": self.max_tokens, "stream": True, "temperature": 0,
                  "ignore_eos": True, "stream_options": {"include_usage": True}}
        if self.endpoint == "chat":
            body = {**common, "messages": [{"role": "user", "content": text}]}
        else:
            body = {**common, "prompt": text}
        return json.dumps(body).encode()

    async def stream(self, stop_at: float, windows: list[Window]) -> None:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            while time.perf_counter() < stop_at:
                body = self._body()
                writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                sent = time.perf_counter()
                times, tokens, error = await self._read(reader)
                if error:
                    for w in windows:
                        if w.start <= sent < w.end:
                            w.errors.append(error)
                    await asyncio.sleep(0.05)
                    continue
                self._account(sent, times, tokens, windows)
        finally:
            writer.close()

    @staticmethod
    def _account(sent: float, times: list[float], tokens: int | None, windows: list[Window]) -> None:
        """Keep what a request saw; ``Window.close`` turns it into figures (a request cut at the
        end of the level has no usage: its chunks count at the level's tokens per chunk)."""
        if not times:
            return
        for w in windows:
            if sent < w.end and times[-1] >= w.start:
                w.seen.append((sent, times, tokens))

    async def _read(self, reader: asyncio.StreamReader) -> tuple[list[float], int | None, str]:
        head = await reader.readuntil(b"\r\n\r\n")
        status = head.split(b" ", 2)[1]
        headers = head.lower()
        if status != b"200":
            length = int(headers.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0]) if b"content-length:" in headers else 0
            body = await reader.readexactly(length) if length else b""
            return [], None, f"HTTP {status.decode()}: {body[:200]!r}"
        times: list[float] = []
        tokens = None
        pending = b""
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                return times, tokens, ""
            now = time.perf_counter()
            pending += data[:-2]
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    continue
                if b'"completion_tokens"' in payload:
                    tokens = json.loads(payload)["usage"]["completion_tokens"]
                    continue
                if b'"error"' in payload and b'"choices"' not in payload:
                    return times, None, payload[:200].decode(errors="replace")
                times.append(now)


# --- profiles ----------------------------------------------------------------------------------

# (component, substrings of a frame "function (file:line)"), tried from the leaf up: the first frame
# that matches names the component of the sample.
GATEWAY_RULES: list[tuple[str, tuple[str, ...]]] = [
    ("detokenizing", ("sluice/text/stream.py", "sluice/text/detokenizer.py")),
    ("tokenizing", ("apply_chat_template", "encode (sluice/text/tokenizer.py", "encode (gateway/serving.py",
                    "chat_template.py")),
    ("SSE/JSON formatting", ("serving_completion.py", "serving_chat.py", "chat_output.py", "gateway/protocol.py",
                             "_sse (gateway/serving.py", "sse_format", "pydantic", "json/", "sse_starlette/event.py",
                             "envelope (gateway/serving.py")),
    ("events from Redis", ("redis/", "gateway/broker.py", "sluice/wire/", "google/protobuf")),
    ("metrics", ("prometheus_client", "gateway/metrics.py")),
    ("generation bookkeeping", ("gateway/generation.py",)),
    ("HTTP (uvicorn/starlette)", ("uvicorn", "h11", "httptools", "starlette", "fastapi", "anyio", "sse_starlette")),
    ("asyncio loop", ("asyncio/",)),
]
ENGINE_RULES: list[tuple[str, tuple[str, ...]]] = [
    ("Redis I/O threads", ("_reader_loop", "_publisher_loop", "_cancel_loop", "_housekeeper_loop")),
    ("stub forward", ("engine_service/model/stub.py",)),
    ("sampler", ("engine_service/sampling/",)),
    ("runner step layout", ("engine_service/model/runner.py",)),
    ("scheduler", ("engine_service/core/",)),
    ("events (protobuf)", ("_event (engine_service/service/worker.py", "sluice/wire/", "google/protobuf")),
    ("metrics", ("prometheus_client", "engine_service/service/metrics.py")),
    ("engine outputs", ("engine_service/engine.py",)),
    ("step loop (worker)", ("engine_service/service/worker.py", "queue.py", "threading.py")),
]


def classify(raw: str, rules: list[tuple[str, tuple[str, ...]]]) -> dict[str, int]:
    """Samples per component from py-spy's ``--format raw`` (collapsed stacks, root first)."""
    counts: dict[str, int] = {}
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        name = "other"
        for frame in reversed(frames):
            hit = next((c for c, pats in rules if any(p in frame for p in pats)), None)
            if hit is not None:
                name = hit
                break
        counts[name] = counts.get(name, 0) + int(n)
    return counts


def _py_spy() -> str | None:
    return shutil.which("py-spy") or (shutil.which("py-spy", path=str(Path(sys.executable).parent)))


def start_profiles(stack: PathStack, seconds: float, rate: int) -> list[tuple[str, subprocess.Popen, Path]]:
    exe = _py_spy()
    if exe is None:
        raise SystemExit("--profile needs py-spy (pip install 'sluice[bench]')")
    out = []
    for name in ("engine", "gateway"):
        path = stack.tmp / f"{name}.raw"
        p = subprocess.Popen([exe, "record", "--pid", str(stack.pid(name)), "--duration", str(int(seconds)),
                              "--rate", str(rate), "--format", "raw", "--nonblocking", "--output", str(path)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out.append((name, p, path))
    return out


def finish_profiles(running: list[tuple[str, subprocess.Popen, Path]],
                    keep: Path | None = None) -> dict[str, dict[str, int]]:
    """Samples per component; ``keep``: copy py-spy's raw stacks there (``PREFIX-engine.raw``...)."""
    out = {}
    for name, p, path in running:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
        raw = path.read_text() if path.exists() else ""
        if keep is not None:
            keep.parent.mkdir(parents=True, exist_ok=True)
            Path(f"{keep}-{name}.raw").write_text(raw)
        out[name] = classify(raw, ENGINE_RULES if name == "engine" else GATEWAY_RULES)
    return out


# --- one level ---------------------------------------------------------------------------------


def _pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round((len(ordered) - 1) * p / 100)))]


async def run_level(stack: PathStack, streams: int, args: argparse.Namespace) -> dict:
    client = Client(stack.port, stack.model, args.endpoint, args.max_tokens, args.prompt_words)
    t0 = time.perf_counter()
    measured = Window(t0 + args.warmup, t0 + args.warmup + args.duration)
    windows = [measured]
    profiled = None
    if args.profile:
        profiled = Window(measured.end, measured.end + args.duration)
        windows.append(profiled)
    stop_at = windows[-1].end
    tasks = [asyncio.create_task(client.stream(stop_at, windows)) for _ in range(streams)]
    await asyncio.sleep(max(0.0, measured.start - time.perf_counter()))
    cpu0, m0, c0 = stack.cpu(), stack.engine_metrics(), time.process_time()
    await asyncio.sleep(max(0.0, measured.end - time.perf_counter()))
    cpu1, m1, c1 = stack.cpu(), stack.engine_metrics(), time.process_time()
    profiles = None
    if profiled is not None:
        running = start_profiles(stack, args.duration, args.profile_rate)
        await asyncio.sleep(max(0.0, profiled.end - time.perf_counter()))
    await asyncio.sleep(max(0.0, stop_at - time.perf_counter()))
    for t in tasks:  # streams still open are cut (the gateway cancels them at the engine)
        t.cancel()
    for res in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(res, BaseException) and not isinstance(res, asyncio.CancelledError):
            measured.errors.append(f"{type(res).__name__}: {res}")
    ratios = [tokens / len(times) for w in windows for _, times, tokens in w.seen if tokens is not None]
    for w in windows:
        w.close(ratios)
    if profiled is not None:
        keep = Path(args.keep_profiles) / f"{stack.label}-{streams}" if args.keep_profiles else None
        profiles = finish_profiles(running, keep)
    await asyncio.sleep(2.0)  # the engine drops what the cut streams left (outside every window)
    return summarize(streams, measured, cpu0, cpu1, m0, m1, c1 - c0, profiles, args.duration)


def summarize(streams: int, w: Window, cpu0: dict, cpu1: dict, m0: dict, m1: dict, client_cpu: float,
              profiles: dict | None, duration: float) -> dict:
    tokens = w.tokens
    cpu = {k: cpu1[k] - cpu0[k] for k in cpu0}
    cpu["client"] = client_cpu
    per_token = {k: (v / tokens * 1e6 if tokens else 0.0) for k, v in cpu.items()}
    engine = per_token["engine_loop"] + per_token["engine_redis_io"] + per_token["engine_other"]
    per_token["engine"] = engine
    per_token["engine_and_gateway"] = engine + per_token["gateway"]
    per_token["server_total"] = engine + per_token["gateway"] + per_token["redis_server"]
    steps = m1.get("steps", 0.0) - m0.get("steps", 0.0)
    step_s = m1.get("step_seconds", 0.0) - m0.get("step_seconds", 0.0)
    batch = (m1.get("batch_sum", 0.0) - m0.get("batch_sum", 0.0)) / max(1.0, m1.get("batches", 0) - m0.get("batches", 0))
    out = {
        "streams": streams,
        "tokens_per_s": tokens / duration,
        "requests_completed": w.requests,
        "tokens_per_chunk": w.tokens_per_chunk,
        "cpu_us_per_token": per_token,
        "cpu_share_of_window": {k: v / duration for k, v in cpu.items()},
        "engine": {
            "steps_per_s": steps / duration,
            "mean_batch": batch,
            "step_ms": step_s / steps * 1e3 if steps else 0.0,
            "loop_cpu_ms_per_step": cpu["engine_loop"] / steps * 1e3 if steps else 0.0,
        },
        "ttft_ms": {"p50": _pct(w.ttft, 50) * 1e3, "p99": _pct(w.ttft, 99) * 1e3},
        "itl_ms": {"p50": _pct(w.itl, 50) * 1e3, "p99": _pct(w.itl, 99) * 1e3},
        "errors": sorted(set(w.errors))[:5],
    }
    if profiles:
        out["profile_samples"] = profiles
        out["cpu_us_per_token_by_component"] = by_component(profiles, per_token)
        forward_share = profiles.get("engine", {}).get("stub forward", 0) / max(1, _loop_samples(profiles["engine"]))
        out["engine"]["forward_cpu_ms_per_step"] = out["engine"]["loop_cpu_ms_per_step"] * forward_share
        out["engine"]["non_forward_cpu_ms_per_step"] = out["engine"]["loop_cpu_ms_per_step"] * (1 - forward_share)
    return out


def _loop_samples(engine: dict[str, int]) -> int:
    return sum(n for k, n in engine.items() if k != "Redis I/O threads")


def by_component(profiles: dict, per_token: dict) -> dict:
    """CPU µs per token of each component: the process's (thread group's) CPU per token split by its
    share of the py-spy samples."""
    out = {}
    gw = profiles.get("gateway", {})
    total = sum(gw.values())
    for name, n in sorted(gw.items(), key=lambda kv: -kv[1]):
        out[f"gateway: {name}"] = per_token["gateway"] * n / total if total else 0.0
    eng = profiles.get("engine", {})
    loop_total = _loop_samples(eng)
    for name, n in sorted(eng.items(), key=lambda kv: -kv[1]):
        if name == "Redis I/O threads":
            continue
        out[f"engine loop: {name}"] = per_token["engine_loop"] * n / loop_total if loop_total else 0.0
    out["engine: Redis I/O threads"] = per_token["engine_redis_io"]
    out["engine: other threads (torch, gRPC, metrics)"] = per_token["engine_other"]
    out["redis-server"] = per_token["redis_server"]
    return out


# --- the run -----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", default="1,64,256", help="concurrent streams per level (default: %(default)s)")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds measured per level (default: %(default)s)")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds before each window (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default: %(default)s)")
    parser.add_argument("--prompt-words", type=int, default=24, help="words of each text prompt (default: %(default)s)")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--profile", action="store_true",
                        help="a second window per level under py-spy: CPU by component (needs py-spy)")
    parser.add_argument("--keep-profiles", default=None, metavar="DIR",
                        help="keep py-spy's raw stacks in DIR (LABEL-STREAMS-engine.raw, ...-gateway.raw)")
    parser.add_argument("--profile-rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--source", action="append", default=None, metavar="DIR",
                        help="run the engine and gateway from this checkout (repeatable; default: this one)")
    parser.add_argument("--label", action="append", default=None, help="a name per --source")
    parser.add_argument("--extra-path", action="append", default=[], metavar="LABEL=DIR",
                        help="append DIR to the PYTHONPATH of the stack labelled LABEL")
    parser.add_argument("--rounds", type=int, default=1, help="measure every level this many times, in turn")
    parser.add_argument("--engine-arg", action="append", default=[], help="extra `sluice engine` argument")
    parser.add_argument("--engine-env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable for the engine processes")
    parser.add_argument("--json", "--result-file", dest="json", default=None, help="write the results as JSON here")


def format_table(results: list[dict]) -> str:
    lines = [f"{'stack':<10}{'streams':>8}{'tok/s':>9}{'eng loop':>10}{'eng I/O':>9}{'eng oth':>9}"
             f"{'gateway':>9}{'redis':>8}{'client':>8}{'eng+gw':>9}{'step ms':>9}{'loop/step':>10}"]
    lines.append("  (CPU µs per delivered token; step ms: engine.step() wall; loop/step: step loop CPU ms per step)")
    for r in results:
        c, e = r["cpu_us_per_token"], r["engine"]
        lines.append(f"{r['label']:<10}{r['streams']:>8}{r['tokens_per_s']:>9.0f}{c['engine_loop']:>10.1f}"
                     f"{c['engine_redis_io']:>9.1f}{c['engine_other']:>9.1f}{c['gateway']:>9.1f}"
                     f"{c['redis_server']:>8.1f}{c['client']:>8.1f}{c['engine_and_gateway']:>9.1f}"
                     f"{e['step_ms']:>9.2f}{e['loop_cpu_ms_per_step']:>10.2f}")
    for r in results:
        comp = r.get("cpu_us_per_token_by_component")
        if comp:
            lines.append(f"-- {r['label']} at {r['streams']} streams, CPU µs per token by component (py-spy) --")
            for name, us in comp.items():
                lines.append(f"  {name:<52}{us:>8.1f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    levels = [int(x) for x in str(args.streams).split(",") if x.strip()]
    sources = [Path(s).resolve() for s in (args.source or [str(ROOT)])]
    labels = args.label or []
    if len(labels) < len(sources):
        labels += [s.name for s in sources[len(labels):]]
    if args.profile and _py_spy() is None:
        print("--profile needs py-spy (pip install py-spy)", file=sys.stderr)
        return 2
    engine_env = dict(kv.split("=", 1) for kv in args.engine_env)
    extra = dict(kv.split("=", 1) for kv in args.extra_path)
    stacks = [PathStack(label, src, engine_args=list(args.engine_arg), engine_env=engine_env,
                    extra_path=extra.get(label, "")) for label, src in zip(labels, sources, strict=False)]
    results: list[dict] = []
    try:
        for s in stacks:
            s.start()
        for rnd in range(args.rounds):
            for streams in levels:
                for s in stacks:
                    r = asyncio.run(run_level(s, streams, args))
                    r.update({"label": s.label, "round": rnd})
                    results.append(r)
                    print(f"{s.label} streams={streams}: {r['tokens_per_s']:.0f} tok/s, engine+gateway "
                          f"{r['cpu_us_per_token']['engine_and_gateway']:.1f} µs/token", file=sys.stderr)
    finally:
        for s in stacks:
            s.stop()
    print(format_table(results))
    doc = {"endpoint": args.endpoint, "max_tokens": args.max_tokens,
           "prompt_words": args.prompt_words, "duration_s": args.duration, "warmup_s": args.warmup,
           "sources": {s.label: str(s.source) + (f" + {s.extra_path}" if s.extra_path else "") for s in stacks},
           "results": results}
    if written := results_file.write(args.json, "serving-path", doc):
        print(f"results written to {written}")
    return 0 if all(not r["errors"] for r in results) else 1
