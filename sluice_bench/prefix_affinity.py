"""``sluice bench prefix-affinity``: one queue against a queue sharded by prompt prefix, side by side.

Engine services (the real ``RedisIO`` reader with its shard ownership and stealing, the real
``Worker`` step loop, the real ``Scheduler`` with its block pool and prefix cache) run in this
process against a private ``redis-server`` (or ``--redis-url``). By default the model is replaced by
a cost model: a step sleeps ``--prefill-us-per-token`` per prompt token it actually computes
(prefix-cache hits are free) plus ``--decode-ms-per-step`` when it decodes, so what the prefix
cache saves shows as time. ``--model DIR`` runs the real model instead (``LLMEngine``, one per
engine, in this process). Each engine's KV pool (``--num-blocks``) is too small for every tenant's
prefix, all of them together are large enough.

Workloads (seeded, the same requests for every queue mode):

- ``tenants``: ``--tenants`` system prompts of ``--system-tokens`` tokens; each request is one
  tenant's system prompt and a distinct ``--user-tokens`` user turn, ``--output-tokens`` out;
- ``uniform``: the same lengths, no shared prefix at all (sharding must cost nothing here).

Queue modes (``--modes``): ``shared`` (one shard: every engine reads one queue), ``hash`` (``--shards``
shards owned by rendezvous hashing alone) and ``bounded`` (the same shards, ownership bounded by
load: ``--shard-load-slack``). Requests arrive as a Poisson process of ``--rate`` requests/s, or
``--concurrency`` at a time (a new one as one ends), each enqueued on the shard a gateway would
choose (``sluice.wire.shards``, from the model card). Reported per run: prefix-cache hit rate
(cached / prompt tokens), prompt tokens computed, requests and output tokens per second, p50 and
p99 queue time (enqueue to admission by an engine) and time to first token, the entries stolen,
and the busiest engine's prompt tokens over the engines' mean. ``--json PATH`` writes everything.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine_service.config import SchedulerConfig
from engine_service.core.outputs import EngineOutput
from engine_service.core.request import Request
from engine_service.core.sampling_params import SamplingParams
from engine_service.core.scheduler import Scheduler
from engine_service.service.main import model_card
from engine_service.service.metrics import NullMetrics
from engine_service.service.redis_io import RedisIO
from engine_service.service.settings import ServiceSettings
from engine_service.service.worker import Worker, new_inbox
from sluice.wire import card as wire_card
from sluice.wire import codec, contract
from sluice.wire.client import WireClient
from sluice.wire.connection import connect, read_shard_message
from sluice.wire.stats import EngineStats
from sluice_bench import results as results_file
from sluice_bench.stack import Stack, StackError

MODEL = "bench-prefix-affinity"
VOCAB = 32_000


class SimEngine:
    """The engine interface the step loop drives, over the real Scheduler, with a cost model for
    the forward pass (sleep) and fake sampled tokens."""

    vocab_size = VOCAB

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_model_len: int,
                 prefill_s_per_token: float, decode_s_per_step: float) -> None:
        self.scheduler = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=block_size,
                                                   max_num_seqs=max_num_seqs, max_num_batched_tokens=2048,
                                                   max_model_len=max_model_len))
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.prefill_s = prefill_s_per_token
        self.decode_s = decode_s_per_step
        self.requests: dict[str, Request] = {}
        self.prompt_tokens_computed = 0
        self.iterations = 0
        self.last_batch = (0, 0)

    def add_request(self, rid: str, prompt: list[int], params: SamplingParams, arrival_time: float | None = None,
                    *, tenant: str = "", tenant_weight: int = 1) -> None:
        req = Request(rid, list(prompt), params, frozenset(), time.monotonic(), tenant=tenant,
                      tenant_weight=tenant_weight)
        self.scheduler.add_request(req)
        self.requests[rid] = req

    def abort_request(self, ids) -> list[EngineOutput]:
        out = []
        for req in self.scheduler.abort_requests([i for i in ids if i in self.requests]):
            self.requests.pop(req.request_id, None)
            out.append(EngineOutput(req.request_id, [], finish_reason=req.finish_reason))
        return out

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def fair_view(self):
        return self.scheduler.fair_view()

    def admission_headroom(self) -> int:
        s = self.scheduler
        if s.num_waiting > 0 or s.block_pool.num_free_blocks <= s.watermark_blocks:
            return 0
        return max(0, self.max_num_seqs - s.num_running)

    def step(self) -> list[EngineOutput]:
        out = self.scheduler.schedule()
        self.last_batch = (len(out.chunks), out.num_batched_tokens)
        if not out.chunks:
            return []
        prefill = sum(min(c.num_tokens, max(0, c.request.num_prompt_tokens - c.start)) for c in out.chunks)
        decodes = any(c.start >= c.request.num_prompt_tokens for c in out.chunks)
        self.prompt_tokens_computed += prefill
        self.iterations += 1
        time.sleep(prefill * self.prefill_s + (self.decode_s if decodes else 0.0))
        sampled = {c.request.request_id: 1000 + c.request.num_output_tokens % 97 for c in out.chunks if c.samples}
        outputs = []
        for req in self.scheduler.update_from_output(out, sampled):
            tokens = [sampled[req.request_id]] if req.request_id in sampled else []
            outputs.append(EngineOutput(req.request_id, tokens, finish_reason=req.finish_reason,
                                        num_prompt_tokens=req.num_prompt_tokens,
                                        num_output_tokens=req.num_output_tokens,
                                        num_cached_tokens=req.num_cached_tokens))
            if req.is_finished:
                self.requests.pop(req.request_id, None)
        return outputs

    def get_stats(self) -> EngineStats:
        s = self.scheduler
        st = s.stats
        return EngineStats(running=s.num_running, waiting=s.num_waiting, free_blocks=s.block_pool.num_free_blocks,
                           total_blocks=s.config.num_blocks, iterations=self.iterations,
                           prefix_cache_queries=st.prefix_cache_queries, prefix_cache_hits=st.prefix_cache_hits)


class _QueueTimes(NullMetrics):
    """Records each request's queue time (gateway XADD to engine admission) as the worker reports it."""

    def __init__(self, sink: list[float]) -> None:
        self.sink = sink

    def request_started(self, request_id: str, n: int, enqueue_time: float = 0.0) -> None:
        if enqueue_time:
            self.sink.append(time.time() - enqueue_time)


@dataclass
class _Engine:
    engine: Any
    io: RedisIO
    worker: Worker
    thread: threading.Thread


def _model_engine(args: argparse.Namespace, max_model_len: int) -> Any:
    """The real model (``--model``): an ``LLMEngine`` with the bench's pool and batch limits."""
    from engine_service.config import EngineConfig
    from engine_service.engine import LLMEngine

    return LLMEngine(EngineConfig(model=args.model, num_blocks=args.num_blocks, block_size=args.block_size,
                                  max_num_seqs=args.max_num_seqs, max_model_len=max_model_len))


def _start_engine(url: str, args: argparse.Namespace, shards: int, slack: float, queue_times: list[float]) -> _Engine:
    settings = ServiceSettings(redis_url=url, engine_id=f"sim-{uuid.uuid4().hex[:6]}", queue_shards=shards,
                               shard_prefix_blocks=args.prefix_blocks, steal_after_ms=args.steal_after_ms,
                               shard_load_slack=slack, heartbeat_interval_s=0.5, heartbeat_ttl_s=2.0)
    max_model_len = args.system_tokens + args.user_tokens + args.output_tokens + 64
    if args.model:
        engine = _model_engine(args, max_model_len)
        card = model_card(engine, MODEL, settings).encode()
    else:
        engine = SimEngine(args.num_blocks, args.block_size, args.max_num_seqs, max_model_len,
                           args.prefill_us_per_token / 1e6, args.decode_ms_per_step / 1e3)
        card = {wire_card.F_NAME: MODEL, wire_card.F_MAX_MODEL_LEN: str(engine.max_model_len),
                wire_card.F_CONTRACT_VERSION: str(contract.CONTRACT_VERSION),
                wire_card.F_QUEUE_SHARDS: str(shards), wire_card.F_BLOCK_SIZE: str(args.block_size),
                wire_card.F_SHARD_PREFIX_BLOCKS: str(args.prefix_blocks)}
    holder: dict[str, Worker] = {}
    io = RedisIO(settings, MODEL, new_inbox(), card, lambda: holder["w"].snapshot().load() if "w" in holder else {})
    worker = Worker(engine, io, settings, MODEL)
    holder["w"] = worker
    worker.metrics = _QueueTimes(queue_times)
    io.start()
    thread = threading.Thread(target=worker.run, daemon=True, name=f"bench-{settings.engine_id}")
    thread.start()
    return _Engine(engine, io, worker, thread)


def make_workload(kind: str, args: argparse.Namespace, vocab: int = VOCAB) -> list[list[int]]:
    """The requests' prompts: random token ids below ``vocab`` (ids 0-99 left out: a model's
    special tokens sit there)."""
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    systems = [tokens(args.system_tokens) for _ in range(args.tenants)]
    prompts = []
    for _ in range(args.num_requests):
        user = tokens(args.user_tokens)
        if kind == "tenants":
            prompts.append(systems[rng.randrange(args.tenants)] + user)
        else:
            prompts.append(tokens(args.system_tokens) + user)
    return prompts


MODES = {"shared": "one shard", "hash": "shards by hash alone", "bounded": "shards bounded by load"}
HASH_ONLY_SLACK = 1e9  # a bound no engine reaches: rendezvous ownership alone


def mode_settings(mode: str, args: argparse.Namespace) -> tuple[int, float]:
    """(shard count, load slack) of a queue mode."""
    if mode == "shared":
        return 1, args.shard_load_slack
    if mode == "hash":
        return args.shards, HASH_ONLY_SLACK
    if mode == "bounded":
        return args.shards, args.shard_load_slack
    raise ValueError(f"unknown queue mode {mode!r} (one of {', '.join(MODES)})")


@dataclass
class RunResult:
    workload: str
    mode: str
    shards: int
    requests: int
    completed: int
    prefix_cache_hit_rate: float
    prompt_tokens: int
    prompt_tokens_computed: int
    seconds: float
    requests_per_s: float
    output_tokens_per_s: float
    queue_p50_ms: float
    queue_p99_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    stolen: int
    busiest_over_mean: float  # the busiest engine's prompt tokens over the engines' mean
    ownership_changes: int
    per_engine: list[dict] = field(default_factory=list)


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def run_one(url: str, args: argparse.Namespace, kind: str, mode: str, prompts: list[list[int]]) -> RunResult:
    shards, slack = mode_settings(mode, args)
    r = connect(url)
    r.flushall()
    queue_times: list[float] = []
    engines = [_start_engine(url, args, shards, slack, queue_times) for _ in range(args.engines)]
    client = WireClient(r)
    try:
        end = time.monotonic() + 20
        while len([e for e in client.engines().values() if e.model == MODEL]) < args.engines:
            if time.monotonic() > end:
                raise RuntimeError("the engines did not register")
            time.sleep(0.1)
        time.sleep(1.5)  # every engine has read the registry: ownership settled
        reply = f"bench-{uuid.uuid4().hex[:8]}"
        pubsub = client.subscribe(reply)
        sent: dict[str, float] = {}
        first: dict[str, float] = {}
        done: dict[str, Any] = {}
        stop = threading.Event()
        slots = threading.Semaphore(args.concurrency) if args.concurrency > 0 else None

        def listen() -> None:
            while not stop.is_set() and len(done) < len(prompts):
                msg = read_shard_message(pubsub, 0.2)
                if not msg or msg.get("type") not in (b"smessage", "smessage"):
                    continue
                now = time.monotonic()
                for ev in codec.decode_events(msg["data"]):
                    if ev.token_ids and ev.request_id not in first:
                        first[ev.request_id] = now
                    if codec.is_terminal(ev) and ev.request_id not in done:
                        done[ev.request_id] = (now, ev)
                        if slots is not None:
                            slots.release()

        listener = threading.Thread(target=listen, daemon=True)
        listener.start()
        rng = random.Random(args.seed + 1)
        params = {"temperature": 0.0, "max_tokens": args.output_tokens, "ignore_eos": True}
        t0 = time.monotonic()
        limit = t0 + args.timeout_s
        next_at = t0
        for i, prompt in enumerate(prompts):
            if slots is not None:
                if not slots.acquire(timeout=max(0.0, limit - time.monotonic())):
                    break
            else:
                next_at += rng.expovariate(args.rate)
                delay = next_at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            rid = f"{kind}-{mode}-{i}"
            request = codec.make_request(rid, MODEL, prompt, params, reply_to=reply)
            sent[rid] = time.monotonic()
            client.enqueue(request)
        while len(done) < len(prompts) and time.monotonic() < limit:
            time.sleep(0.05)
        stop.set()
        listener.join(2)
        pubsub.close()
        finished = [ev for _, ev in done.values() if ev.HasField("finished")]
        prompt_tokens = sum(ev.finished.usage.prompt_tokens for ev in finished)
        cached = sum(ev.finished.usage.cached_tokens for ev in finished)
        span = max((t for t, _ in done.values()), default=t0) - t0
        ttft = [first[rid] - sent[rid] for rid in first]
        served: dict[str, list[int]] = {e.io.consumer: [0, 0, 0] for e in engines}  # requests, prompt, cached
        for ev in finished:
            row = served.setdefault(ev.engine_id, [0, 0, 0])
            row[0] += 1
            row[1] += ev.finished.usage.prompt_tokens
            row[2] += ev.finished.usage.cached_tokens
        mean = prompt_tokens / len(engines) if engines else 0.0
        per_engine = [{"engine_id": e.io.consumer, "owned_shards": list(e.io.view.owned),
                       "requests": served[e.io.consumer][0], "prompt_tokens": served[e.io.consumer][1],
                       "prompt_tokens_computed": served[e.io.consumer][1] - served[e.io.consumer][2],
                       "prefix_cache_hit_rate": round(served[e.io.consumer][2] / served[e.io.consumer][1], 4)
                       if served[e.io.consumer][1] else 0.0,
                       "stolen": e.io.stats["stolen"], "ownership_changes": e.io.stats["ownership_changes"]}
                      for e in engines]
        return RunResult(
            workload=kind, mode=mode, shards=shards, requests=len(prompts), completed=len(finished),
            prefix_cache_hit_rate=round(cached / prompt_tokens, 4) if prompt_tokens else 0.0,
            prompt_tokens=prompt_tokens, prompt_tokens_computed=prompt_tokens - cached,
            seconds=round(span, 3),
            requests_per_s=round(len(finished) / span, 2) if span else 0.0,
            output_tokens_per_s=round(len(finished) * args.output_tokens / span, 1) if span else 0.0,
            queue_p50_ms=round(1000 * _pct(queue_times, 50), 1), queue_p99_ms=round(1000 * _pct(queue_times, 99), 1),
            ttft_p50_ms=round(1000 * _pct(ttft, 50), 1), ttft_p99_ms=round(1000 * _pct(ttft, 99), 1),
            stolen=sum(e.io.stats["stolen"] for e in engines),
            busiest_over_mean=round(max(row["prompt_tokens"] for row in per_engine) / mean, 3) if mean else 0.0,
            ownership_changes=sum(e.io.stats["ownership_changes"] for e in engines), per_engine=per_engine,
        )
    finally:
        for e in engines:
            e.worker.request_stop()
        for e in engines:
            e.thread.join(10)
            e.io.stop(flush_timeout=2.0)
        client.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", default=None, help="use this Redis (it is FLUSHALLed!) instead of a private redis-server")
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--shards", type=int, default=contract.DEFAULT_QUEUE_SHARDS, help="the sharded run's shard count")
    parser.add_argument("--tenants", type=int, default=48)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--user-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=600)
    parser.add_argument("--rate", type=float, default=20.0, help="Poisson arrivals, requests/s")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefix-blocks", type=int, default=contract.DEFAULT_SHARD_PREFIX_BLOCKS)
    parser.add_argument("--num-blocks", type=int, default=900,
                        help="KV blocks per engine (default: about two fifths of the tenants' prefixes fit beside a full batch, all of them in three engines)")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--prefill-us-per-token", type=float, default=40.0, help="cost model: per prompt token computed")
    parser.add_argument("--decode-ms-per-step", type=float, default=4.0, help="cost model: per step that decodes")
    parser.add_argument("--steal-after-ms", type=int, default=contract.DEFAULT_STEAL_AFTER_MS)
    parser.add_argument("--shard-load-slack", type=float, default=contract.DEFAULT_SHARD_LOAD_SLACK,
                        help="the bounded mode's load slack (the engines' --shard-load-slack)")
    parser.add_argument("--concurrency", type=int, default=0,
                        help="keep this many requests in flight instead of Poisson arrivals (0: --rate)")
    parser.add_argument("--model", default=None, metavar="DIR",
                        help="run this model (an LLMEngine per engine) instead of the cost model")
    parser.add_argument("--modes", default="shared,bounded", help=f"queue modes to run, of {', '.join(MODES)}")
    parser.add_argument("--workloads", default="tenants,uniform")
    parser.add_argument("--repeat", type=int, default=1, help="run the modes in turns this many times (A B A B)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results here")


def _table(results: list[RunResult]) -> str:
    head = ("| workload | queue | hit rate | prompt tokens computed | busiest engine / mean | req/s | out tok/s "
            "| queue p50 / p99 ms | TTFT p50 / p99 ms | stolen | completed |")
    rows = [head, "|" + "---|" * 11]
    for r in results:
        queue = "1 shard" if r.mode == "shared" else f"{r.shards} shards, {r.mode}"
        rows.append(f"| {r.workload} | {queue} | {r.prefix_cache_hit_rate:.1%} | {r.prompt_tokens_computed:,} "
                    f"| {r.busiest_over_mean:.2f} | {r.requests_per_s:.1f} | {r.output_tokens_per_s:.0f} "
                    f"| {r.queue_p50_ms:.0f} / {r.queue_p99_ms:.0f} | {r.ttft_p50_ms:.0f} / {r.ttft_p99_ms:.0f} "
                    f"| {r.stolen} | {r.completed}/{r.requests} |")
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in modes:
        if mode not in MODES:
            print(f"unknown queue mode {mode!r} (one of {', '.join(MODES)})", file=sys.stderr)
            return 2
    vocab = VOCAB
    if args.model:
        vocab = int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    results: list[RunResult] = []
    with Stack("prefix-affinity") as stack:
        try:
            url = stack.redis(args.redis_url)
        except StackError as exc:
            print(exc, file=sys.stderr)
            return 2
        for kind in [w.strip() for w in args.workloads.split(",") if w.strip()]:
            prompts = make_workload(kind, args, vocab)
            for _ in range(args.repeat):
                for mode in modes:
                    result = run_one(url, args, kind, mode, prompts)
                    print(f"{kind}, {MODES[mode]}: hit rate {result.prefix_cache_hit_rate:.1%}, busiest engine "
                          f"{result.busiest_over_mean:.2f}x the mean, {result.requests_per_s:.1f} req/s, "
                          f"queue p99 {result.queue_p99_ms:.0f} ms", flush=True)
                    results.append(result)
    print()
    print(_table(results))
    results_file.write(args.json, "prefix-affinity", {"config": {k: v for k, v in vars(args).items() if k != "func"},
                                                      "results": [asdict(r) for r in results]})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice bench prefix-affinity", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
