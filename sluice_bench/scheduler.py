"""batchbench: the real Scheduler driven with no model through a seeded synthetic workload.

``sluice bench scheduler`` generates arrival times (in steps), prompt lengths and output lengths
from a seed, runs the workload through the scheduler once per watermark reserve
(``--sweep-watermarks 0,1,2,3``), and prints a table of evictions (preemptions), thrashed
admissions, iterations and recompute share; ``--json PATH`` writes everything, and a sweep is also
drawn as a chart (``--plot``, sluice_bench/plots.py). The "sampled" tokens
are fake ids; a request stops at its target output length (``max_tokens`` with ``ignore_eos``).
It also measures the scheduler's own cost per step with 256 running and 1,000 waiting requests.
``--tenants`` runs the multi-tenant workload instead (``sluice_bench.scheduler_tenants``): a flood
tenant and a light one, the light tenant's time to first token alone, first come first served, and
with fair share, and two backlogged tenants' token shares against their weights; the cost is then
measured with the waiting and running requests of one tenant and of two.

The simulated clock advances one unit per step, so queue times and times to first token are in steps.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from engine_service.config import SchedulerConfig
from engine_service.core.request import Request
from engine_service.core.sampling_params import SamplingParams
from engine_service.core.scheduler import Scheduler, SchedulerOutput
from sluice_bench import plots

FAKE_TOKEN_BASE = 50_000


def fake_token(request: Request) -> int:
    """The "sampled" token: deterministic per request and position, never an EOS (none is set)."""
    return FAKE_TOKEN_BASE + (request.num_output_tokens * 7 + len(request.request_id)) % 97


def drive_step(
    scheduler: Scheduler, token_fn: Callable[[Request], int] = fake_token
) -> tuple[SchedulerOutput, list[Request]]:
    """One model-free engine step: schedule, "sample" a token for every chunk that samples, update."""
    out = scheduler.schedule()
    sampled = {c.request.request_id: token_fn(c.request) for c in out.chunks if c.samples}
    return out, scheduler.update_from_output(out, sampled)


class FakeKVRunner:
    """Stands in for the model runner, checking the block tables instead of computing.

    Each step it first writes every scheduled token's id into its KV slot (as the model writes each
    layer's K/V before attention reads it), then reads every scheduled request's whole context back
    through its block table and asserts it matches the request's tokens: a wrong prefix-cache hit,
    a block shared while being overwritten, or a slot outside the table shows up here. The "sampled"
    token is a function of the context read back, so outputs depend on the cache being right.
    """

    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 1000,
                 next_token: Callable[[list[int]], int] | None = None) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        # the "model": the token after a context (default: a hash of the whole context)
        self.next_token = next_token or (lambda context: hash(tuple(context)) % vocab_size)

    def slot(self, request: Request, pos: int) -> int:
        bs = self.block_size
        return request.block_ids[pos // bs] * bs + pos % bs

    def _steps(self, c) -> list[int]:
        """A multi-step chunk (``num_steps``): each step writes its input at its slot, reads the
        context back and "samples" the next input, as the native greedy steps do."""
        req, tokens = c.request, []
        context = list(req.all_token_ids[: c.start + 1])
        for j in range(c.num_steps):
            pos = c.start + j
            self.slots[self.slot(req, pos)] = context[pos]
            read = [self.slots[self.slot(req, q)] for q in range(pos + 1)]
            if read != context:
                raise AssertionError(f"request {req.request_id!r} reads a wrong KV context through its block table")
            tokens.append(self.next_token(read))
            context.append(tokens[-1])
        return tokens

    def step(self, out: SchedulerOutput) -> dict[str, int | list[int]]:
        """The sampled token per sampling chunk; for a chunk with drafts (speculative decoding), the
        drafts kept while each equals the model's token before it, then the model's next token; for a
        multi-step chunk, each step's token."""
        for c in out.chunks:
            req = c.request
            for pos, token in enumerate(c.token_ids, start=c.start):
                self.slots[self.slot(req, pos)] = token
        sampled: dict[str, int | list[int]] = {}
        for c in out.chunks:
            if c.num_steps > 1:
                sampled[c.request.request_id] = self._steps(c)
                continue
            req = c.request
            drafts = c.draft_token_ids or []
            end = c.start + c.num_tokens
            context = [self.slots[self.slot(req, pos)] for pos in range(end)]
            if context != (req.all_token_ids + drafts)[:end]:
                raise AssertionError(
                    f"request {req.request_id!r} reads a wrong KV context through its block table"
                )
            if not c.samples:
                continue
            if c.draft_token_ids is None:
                sampled[req.request_id] = self.next_token(context)
                continue
            known = end - len(drafts)
            tokens = []
            for j in range(len(drafts) + 1):
                tokens.append(self.next_token(context[: known + j]))
                if j == len(drafts) or tokens[-1] != drafts[j]:
                    break
            sampled[req.request_id] = tokens
        return sampled


@dataclass
class SyntheticRequest:
    request_id: str
    arrival: float  # in steps
    prompt_token_ids: list[int]
    output_len: int
    tenant: str = ""  # sluice.wire.tenants: "" is the default tenant
    weight: int = 1

    def to_request(self) -> Request:
        params = SamplingParams(max_tokens=self.output_len, ignore_eos=True, temperature=0.0)
        return Request(self.request_id, list(self.prompt_token_ids), params, arrival_time=self.arrival,
                       tenant=self.tenant, tenant_weight=self.weight)


@dataclass
class WorkloadSpec:
    num_requests: int = 8
    seed: int = 0
    arrival_rate: float = 0.0  # requests per step (Poisson); 0: all arrive at step 0
    prompt_len: tuple[int, int] = (2, 12)  # inclusive range
    output_len: tuple[int, int] = (4, 16)
    shared_prefix_len: int = 0  # tokens every prompt starts with (exercises the prefix cache)
    vocab_size: int = 32_000


def make_workload(spec: WorkloadSpec, max_kv_tokens: int | None = None) -> list[SyntheticRequest]:
    """A seeded list of requests; with ``max_kv_tokens`` (the pool's size in tokens) every request
    is shortened to pass the door (prompt + output - 1 <= max_kv_tokens)."""
    rng = random.Random(spec.seed)
    prefix = [rng.randrange(spec.vocab_size) for _ in range(spec.shared_prefix_len)]
    t = 0.0
    out = []
    for i in range(spec.num_requests):
        if spec.arrival_rate > 0 and i > 0:
            t += rng.expovariate(spec.arrival_rate)
        p = rng.randint(*spec.prompt_len)
        o = rng.randint(*spec.output_len)
        prompt = prefix + [rng.randrange(spec.vocab_size) for _ in range(p)]
        if max_kv_tokens is not None:
            prompt = prompt[:max_kv_tokens]
            o = max(1, min(o, max_kv_tokens + 1 - len(prompt)))
        out.append(SyntheticRequest(f"req-{i}", round(t, 3), prompt, o))
    return out


@dataclass
class SimResult:
    watermark_blocks: int
    iterations: int
    evictions: int
    thrashed_admissions: int
    recomputed_tokens: int
    forwarded_tokens: int
    recompute_share: float
    prefix_cache_hit_rate: float
    finished: int
    queue_time_mean_steps: float | None
    ttft_mean_steps: float | None
    schedule_us_per_step: float
    update_us_per_step: float
    stats: dict = field(repr=False, default_factory=dict)
    # per tenant: "ttft_steps" (each request's steps from arrival to its first token, that step
    # included, in arrival order), "forwarded_tokens" (recompute included)
    tenants: dict = field(repr=False, default_factory=dict)


def simulate(
    config: SchedulerConfig,
    workload: Sequence[SyntheticRequest],
    *,
    watermark_blocks: int | None = None,
    check_invariants: bool = False,
    max_steps: int = 1_000_000,
) -> SimResult:
    """Run ``workload`` to completion through a real Scheduler; the clock is the step counter."""
    clock = [0.0]
    sched = Scheduler(config, clock=lambda: clock[0], watermark_blocks=watermark_blocks)
    pending = sorted(workload, key=lambda r: r.arrival)
    requests: list[Request] = []
    nxt = 0
    sched_ns = update_ns = 0
    steps = 0
    forwarded: dict[str, int] = {}
    while nxt < len(pending) or sched.has_unfinished_requests():
        if not sched.has_unfinished_requests() and pending[nxt].arrival > clock[0]:
            clock[0] = float(pending[nxt].arrival)  # idle: jump to the next arrival
        while nxt < len(pending) and pending[nxt].arrival <= clock[0]:
            req = pending[nxt].to_request()
            sched.add_request(req)
            requests.append(req)
            nxt += 1
        t0 = time.perf_counter_ns()
        out = sched.schedule()
        t1 = time.perf_counter_ns()
        sampled = {c.request.request_id: fake_token(c.request) for c in out.chunks if c.samples}
        t2 = time.perf_counter_ns()
        sched.update_from_output(out, sampled)
        t3 = time.perf_counter_ns()
        for c in out.chunks:
            forwarded[c.request.tenant] = forwarded.get(c.request.tenant, 0) + c.num_tokens
        sched_ns += t1 - t0
        update_ns += t3 - t2
        if check_invariants:
            sched.check_invariants()
        steps += 1
        clock[0] += 1.0
        if steps > max_steps:
            raise RuntimeError(f"workload did not finish within {max_steps} steps")
    st = sched.stats
    queue = [r.queue_time for r in requests if r.queue_time is not None]
    ttft = [r.time_to_first_token for r in requests if r.time_to_first_token is not None]
    tenants: dict[str, dict] = {}
    for r in requests:
        t = tenants.setdefault(r.tenant, {"ttft_steps": [], "forwarded_tokens": forwarded.get(r.tenant, 0)})
        if r.time_to_first_token is not None:
            t["ttft_steps"].append(r.time_to_first_token + 1)  # the first token's own step counts
    return SimResult(
        watermark_blocks=sched.watermark_blocks,
        iterations=st.iterations,
        evictions=st.preemptions,
        thrashed_admissions=st.thrashed_admissions,
        recomputed_tokens=st.recomputed_tokens,
        forwarded_tokens=st.forwarded_tokens,
        recompute_share=st.recompute_share,
        prefix_cache_hit_rate=st.prefix_cache_hit_rate,
        finished=sum(1 for r in requests if r.is_finished),
        queue_time_mean_steps=statistics.fmean(queue) if queue else None,
        ttft_mean_steps=statistics.fmean(ttft) if ttft else None,
        schedule_us_per_step=sched_ns / 1e3 / max(steps, 1),
        update_us_per_step=update_ns / 1e3 / max(steps, 1),
        stats=st.as_dict(),
        tenants=tenants,
    )


def sweep_watermarks(
    config: SchedulerConfig, workload: Sequence[SyntheticRequest], reserves: Sequence[int], **kw
) -> list[SimResult]:
    return [simulate(config, workload, watermark_blocks=w, **kw) for w in reserves]


def aggregate(results: Sequence[SimResult]) -> SimResult:
    """Sum one reserve's results over several workloads (shares recomputed from the sums)."""
    fwd = sum(r.forwarded_tokens for r in results)
    rec = sum(r.recomputed_tokens for r in results)

    def mean(xs: list[float | None]) -> float | None:
        vals = [x for x in xs if x is not None]
        return statistics.fmean(vals) if vals else None

    return SimResult(
        watermark_blocks=results[0].watermark_blocks,
        iterations=sum(r.iterations for r in results),
        evictions=sum(r.evictions for r in results),
        thrashed_admissions=sum(r.thrashed_admissions for r in results),
        recomputed_tokens=rec,
        forwarded_tokens=fwd,
        recompute_share=rec / fwd if fwd else 0.0,
        prefix_cache_hit_rate=statistics.fmean(r.prefix_cache_hit_rate for r in results),
        finished=sum(r.finished for r in results),
        queue_time_mean_steps=mean([r.queue_time_mean_steps for r in results]),
        ttft_mean_steps=mean([r.ttft_mean_steps for r in results]),
        schedule_us_per_step=statistics.fmean(r.schedule_us_per_step for r in results),
        update_us_per_step=statistics.fmean(r.update_us_per_step for r in results),
    )


def measure_step_cost(
    num_running: int = 256,
    num_waiting: int = 1000,
    *,
    prompt_len: int = 128,
    block_size: int = 16,
    steps: int = 200,
    max_num_batched_tokens: int = 2048,
    enable_prefix_caching: bool = True,
    seed: int = 0,
    tenants: int = 1,
) -> dict:
    """Scheduler time per step in steady decode with ``num_running`` running and ``num_waiting``
    waiting requests (nobody finishes during the measurement; the pool has room for all), of
    ``tenants`` tenants in turn (1: the default tenant alone, the plain FIFO path)."""
    rng = random.Random(seed)
    out_len = steps + 64
    blocks_per_req = -(-(prompt_len + out_len) // block_size)
    cfg = SchedulerConfig(
        num_blocks=blocks_per_req * (num_running + 8),
        block_size=block_size,
        max_num_seqs=num_running,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=prompt_len + out_len + 1,
        watermark_blocks=0,
        enable_prefix_caching=enable_prefix_caching,
    )
    sched = Scheduler(cfg)
    params = SamplingParams(max_tokens=out_len, ignore_eos=True)
    for i in range(num_running + num_waiting):
        prompt = [rng.randrange(32_000) for _ in range(prompt_len)]
        sched.add_request(Request(f"r{i}", prompt, params, tenant=f"t{i % tenants}" if tenants > 1 else ""))
    warm = 0
    while (
        any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running)
        or sched.num_running < num_running
    ):
        drive_step(sched)
        warm += 1
        if warm > 10_000:
            raise RuntimeError("warm-up did not reach steady decode")
    sched_t: list[float] = []
    upd_t: list[float] = []
    cpu_t: list[float] = []
    for _ in range(steps):
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        out = sched.schedule()
        t1 = time.perf_counter_ns()
        c1 = time.thread_time_ns()
        sampled = {c.request.request_id: fake_token(c.request) for c in out.chunks if c.samples}
        c2 = time.thread_time_ns()
        t2 = time.perf_counter_ns()
        sched.update_from_output(out, sampled)
        t3 = time.perf_counter_ns()
        c3 = time.thread_time_ns()
        sched_t.append((t1 - t0) / 1e3)
        upd_t.append((t3 - t2) / 1e3)
        cpu_t.append((c1 - c0 + c3 - c2) / 1e3)
    assert sched.num_running == num_running and sched.num_waiting == num_waiting, "the measurement drifted"
    total = [a + b for a, b in zip(sched_t, upd_t, strict=True)]
    q = statistics.quantiles(total, n=100)
    return {
        "num_running": num_running,
        "num_waiting": num_waiting,
        "tenants": tenants,
        "steps": steps,
        "block_size": block_size,
        "enable_prefix_caching": enable_prefix_caching,
        # wall clock: schedule() and update_from_output(), the scheduler's whole share of a step
        "schedule_us_mean": statistics.fmean(sched_t),
        "update_us_mean": statistics.fmean(upd_t),
        "step_us_mean": statistics.fmean(total),
        "step_us_p50": statistics.median(total),
        "step_us_p99": q[98],
        # this thread's CPU time for the same calls: unaffected by other processes on a busy machine
        "step_cpu_us_mean": statistics.fmean(cpu_t),
        "step_cpu_us_p50": statistics.median(cpu_t),
    }


# --- CLI ---
def _pair(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    a, b = int(lo), int(hi or lo)
    if a < 1 or b < a:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with 1 <= MIN <= MAX, got {text!r}")
    return a, b


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("pool and scheduler")
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool (default 8; 2048 with --tenants)")
    g.add_argument("--block-size", type=int, default=None, help="tokens per block (default 4; 16 with --tenants)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="slots (default 3; 4 with --tenants)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step (default 10; 512 with --tenants)")
    g.add_argument("--max-model-len", type=int, default=None, help="default: the pool's size in tokens + 1")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    g.add_argument(
        "--watermark-blocks", type=int, default=None, help="one reserve (default: 1%% of the pool)"
    )
    g.add_argument(
        "--sweep-watermarks",
        type=str,
        default=None,
        help="comma-separated reserves, e.g. 0,1,2,3 (overrides the above)",
    )
    w = parser.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=8)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument(
        "--num-seeds", type=int, default=1, help="run seeds SEED..SEED+N-1 and print the sums (default 1)"
    )
    w.add_argument(
        "--arrival-rate", type=float, default=0.0, help="requests per step, Poisson; 0: all at once"
    )
    w.add_argument("--prompt-len", type=_pair, default=(2, 12), help="MIN,MAX tokens (default 2,12)")
    w.add_argument("--output-len", type=_pair, default=(4, 16), help="MIN,MAX tokens (default 4,16)")
    w.add_argument("--shared-prefix-len", type=int, default=0, help="tokens every prompt shares")
    t = parser.add_argument_group("tenants (--tenants: the multi-tenant workload, sluice_bench.scheduler_tenants)")
    t.add_argument("--tenants", action="store_true",
                   help="a flood tenant and a light one: the light tenant's TTFT alone, FIFO and fair; weights")
    t.add_argument("--flood-requests", type=int, default=300, help="the flood's requests, all at step 0 (default 300)")
    t.add_argument("--flood-prompt-len", type=_pair, default=(64, 256), help="MIN,MAX (default 64,256)")
    t.add_argument("--flood-output-len", type=_pair, default=(32, 128), help="MIN,MAX (default 32,128)")
    t.add_argument("--light-requests", type=int, default=30, help="the light tenant's requests (default 30)")
    t.add_argument("--light-every", type=int, default=25, help="steps between light requests (default 25)")
    t.add_argument("--light-prompt-len", type=_pair, default=(32, 96), help="MIN,MAX (default 32,96)")
    t.add_argument("--light-output-len", type=_pair, default=(16, 32), help="MIN,MAX (default 16,32)")
    t.add_argument("--flood-weight", type=int, default=1)
    t.add_argument("--light-weight", type=int, default=1)
    t.add_argument("--weights", type=_pair, default=(3, 1),
                   help="A,B: two backlogged tenants' weights, whose token shares are compared (default 3,1)")
    o = parser.add_argument_group("output")
    o.add_argument("--json", type=str, default=None, help="write the results as JSON to this path")
    plots.add_plot_arguments(o, "the --sweep-watermarks results",
                             "next to --json, else bench-results/scheduler-sweep.png")
    o.add_argument("--check-invariants", action="store_true", help="assert the invariants after every step")
    o.add_argument("--no-cost", action="store_true", help="skip the per-step cost measurement")
    o.add_argument("--cost-running", type=int, default=256)
    o.add_argument("--cost-waiting", type=int, default=1000)
    o.add_argument("--cost-steps", type=int, default=200)


def format_table(results: Sequence[SimResult]) -> str:
    head = f"{'reserve':>7} {'evictions':>9} {'thrash':>6} {'iterations':>10} {'recompute':>9} {'queue':>6} {'ttft':>6}"
    lines = [head, "-" * len(head)]
    for r in results:
        q = f"{r.queue_time_mean_steps:.1f}" if r.queue_time_mean_steps is not None else "-"
        t = f"{r.ttft_mean_steps:.1f}" if r.ttft_mean_steps is not None else "-"
        lines.append(
            f"{r.watermark_blocks:>7} {r.evictions:>9} {r.thrashed_admissions:>6} {r.iterations:>10} "
            f"{r.recompute_share:>9.1%} {q:>6} {t:>6}"
        )
    return "\n".join(lines)


def _pool_defaults(args: argparse.Namespace) -> None:
    """The pool's defaults: tiny for the watermark workload, room for a flood with --tenants."""
    tiny, roomy = (8, 4, 3, 10), (2048, 16, 4, 512)
    for name, value in zip(("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"),
                           roomy if args.tenants else tiny, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, value)


def run(args: argparse.Namespace) -> int:
    _pool_defaults(args)
    if args.tenants:
        return run_tenants(args)
    max_len = args.max_model_len or args.num_blocks * args.block_size + 1
    cfg = SchedulerConfig(
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_len,
        watermark_blocks=args.watermark_blocks,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    if args.sweep_watermarks:
        reserves = [int(x) for x in args.sweep_watermarks.split(",") if x.strip()]
    else:
        reserves = [cfg.resolved_watermark_blocks()]
    chart = None
    if len(reserves) > 1:  # one reserve makes no chart
        chart = plots.plot_target(args, args.json, "bench-results/scheduler-sweep.png", "sluice bench scheduler")
    per_seed: list[list[SimResult]] = []
    workloads: dict[int, list[SyntheticRequest]] = {}
    spec = None
    for seed in range(args.seed, args.seed + max(1, args.num_seeds)):
        spec = WorkloadSpec(
            num_requests=args.num_requests,
            seed=seed,
            arrival_rate=args.arrival_rate,
            prompt_len=tuple(args.prompt_len),
            output_len=tuple(args.output_len),
            shared_prefix_len=args.shared_prefix_len,
        )
        workloads[seed] = make_workload(
            spec, max_kv_tokens=min(args.num_blocks * args.block_size, max_len - 1)
        )
        per_seed.append(
            sweep_watermarks(cfg, workloads[seed], reserves, check_invariants=args.check_invariants)
        )
    if len(per_seed) == 1:
        results = per_seed[0]
        seeds = f"seed {args.seed}"
    else:
        results = [aggregate([runs[i] for runs in per_seed]) for i in range(len(reserves))]
        seeds = f"seeds {args.seed}..{args.seed + len(per_seed) - 1}, summed"
    print(
        f"batchbench: {args.num_requests} requests ({seeds}), {args.max_num_seqs} slots, "
        f"{args.num_blocks} blocks of {args.block_size} tokens, budget {args.max_num_batched_tokens}, "
        f"prefix caching {'off' if args.no_prefix_caching else 'on'}"
    )
    print(format_table(results))
    print("(evictions: preemptions by recompute; queue and ttft: mean, in steps)")
    for r in results:
        print(
            f"  reserve {r.watermark_blocks}: schedule {r.schedule_us_per_step:.1f} us/step, "
            f"update {r.update_us_per_step:.1f} us/step"
        )
    cost = None
    if not args.no_cost:
        cost = measure_step_cost(args.cost_running, args.cost_waiting, steps=args.cost_steps, seed=args.seed)
        print(
            f"scheduler cost, {cost['num_running']} running / {cost['num_waiting']} waiting, "
            f"{cost['steps']} decode steps: {cost['step_us_mean']:.0f} us/step mean "
            f"(schedule {cost['schedule_us_mean']:.0f} + update {cost['update_us_mean']:.0f}), "
            f"p50 {cost['step_us_p50']:.0f} us, p99 {cost['step_us_p99']:.0f} us; "
            f"CPU time {cost['step_cpu_us_mean']:.0f} us/step mean, p50 {cost['step_cpu_us_p50']:.0f} us"
        )
    if args.json or chart is not None:
        doc = {
            "config": asdict(cfg),
            "workload": asdict(spec) | {"seed": args.seed},
            "seeds": list(workloads),
            "requests": {
                seed: [
                    {
                        "id": r.request_id,
                        "arrival": r.arrival,
                        "prompt_len": len(r.prompt_token_ids),
                        "output_len": r.output_len,
                    }
                    for r in wl
                ]
                for seed, wl in workloads.items()
            },
            "results": [asdict(r) for r in results],
            "per_seed_results": {
                seed: [asdict(r) for r in runs] for seed, runs in zip(workloads, per_seed, strict=True)
            },
            "cost": cost,
        }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"wrote {args.json}")
    if chart is not None:
        print(f"wrote {plots.plot_scheduler_sweep(doc, chart)}")
    return 0


def _cost_line(cost: dict) -> str:
    return (f"{cost['num_running']} running / {cost['num_waiting']} waiting of {cost['tenants']} tenant(s), "
            f"{cost['steps']} decode steps: {cost['step_us_mean']:.0f} us/step mean "
            f"(schedule {cost['schedule_us_mean']:.0f} + update {cost['update_us_mean']:.0f}), "
            f"p50 {cost['step_us_p50']:.0f} us; CPU time p50 {cost['step_cpu_us_p50']:.0f} us")


def run_tenants(args: argparse.Namespace) -> int:
    """``--tenants``: the multi-tenant workload (sluice_bench.scheduler_tenants)."""
    from sluice_bench.scheduler_tenants import FairnessSpec, format_fairness_table, run_fairness, run_weights

    spec = FairnessSpec(flood_requests=args.flood_requests, flood_prompt_len=tuple(args.flood_prompt_len),
                        flood_output_len=tuple(args.flood_output_len), light_requests=args.light_requests,
                        light_every=args.light_every, light_prompt_len=tuple(args.light_prompt_len),
                        light_output_len=tuple(args.light_output_len), flood_weight=args.flood_weight,
                        light_weight=args.light_weight, weights=tuple(args.weights), seed=args.seed)
    longest = max(spec.flood_prompt_len[1] + spec.flood_output_len[1], spec.light_prompt_len[1] + spec.light_output_len[1])
    cfg = SchedulerConfig(num_blocks=args.num_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len or longest + 1, watermark_blocks=args.watermark_blocks,
                          enable_prefix_caching=not args.no_prefix_caching)
    runs = run_fairness(cfg, spec, check_invariants=args.check_invariants)
    weights = run_weights(cfg, spec)
    print(f"batchbench --tenants: {spec.flood_requests} flood requests at step 0 (weight {spec.flood_weight}), "
          f"{spec.light_requests} light requests one every {spec.light_every} steps (weight {spec.light_weight}); "
          f"{args.max_num_seqs} slots, {args.num_blocks} blocks of {args.block_size} tokens, budget "
          f"{args.max_num_batched_tokens}, seed {args.seed}")
    print(format_fairness_table(runs))
    print("(light TTFT: steps from arrival to the first token, its own step included; x alone: p50 over the "
          "alone run's p50; steps: to finish every request)")
    print(f"weights {weights.weights[0]}:{weights.weights[1]}, both backlogged for {weights.steps} steps: tokens "
          f"{weights.tokens[0]:,} : {weights.tokens[1]:,} = {weights.share:.2f} (the weights' ratio: "
          f"{weights.expected:.2f})")
    costs = []
    if not args.no_cost:
        for tenants in (1, 2):
            costs.append(measure_step_cost(args.cost_running, args.cost_waiting, steps=args.cost_steps,
                                           seed=args.seed, tenants=tenants))
            print("scheduler cost, " + _cost_line(costs[-1]))
    if args.json:
        doc = {"bench": "scheduler --tenants", "config": asdict(cfg), "workload": asdict(spec),
               "runs": [asdict(r) for r in runs], "weights": asdict(weights), "cost": costs}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"wrote {args.json}")
    return 0
