"""The multi-tenant workload of ``sluice bench scheduler --tenants``: fair share, model-free.

A *flood* tenant queues ``--flood-requests`` requests at step 0; a *light* tenant sends one request
every ``--light-every`` steps. With few slots (``--max-num-seqs``) the flood fills them and its
backlog waits. The light tenant's time to first token (in steps, the first token's own step
included) is measured four ways, each run through the real Scheduler:

- ``alone``: the light tenant's requests and nothing else;
- ``fifo``: with the flood, every request in one tenant (first come, first served: the light
  requests wait behind the flood's backlog);
- ``fair, no slot moves``: two tenants, admission by fair share only (a light request takes the
  next slot that frees);
- ``fair``: two tenants, the scheduler's default (a light request may take a slot of the flood at
  the next step's start: ``engine_service.core.fair_share``).

Then ``weights``: two flood tenants of weights ``--weights A,B`` queue at once, and the tokens each
forwards until the first backlog runs dry are compared with the weights' ratio.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from dataclasses import dataclass

from engine_service.config import SchedulerConfig
from engine_service.core.scheduler import Scheduler
from sluice_bench.scheduler import SimResult, SyntheticRequest, simulate

FLOOD, LIGHT = "flood", "light"


@dataclass
class FairnessSpec:
    flood_requests: int = 300
    flood_prompt_len: tuple[int, int] = (64, 256)
    flood_output_len: tuple[int, int] = (32, 128)
    light_requests: int = 30
    light_every: int = 25  # steps between light requests (the light tenant's "one a second")
    light_prompt_len: tuple[int, int] = (32, 96)
    light_output_len: tuple[int, int] = (16, 32)
    flood_weight: int = 1
    light_weight: int = 1
    weights: tuple[int, int] = (3, 1)  # the weights workload's two tenants
    seed: int = 0
    vocab_size: int = 32_000


def _prompt(rng: random.Random, lo_hi: tuple[int, int], vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(rng.randint(*lo_hi))]


def make_fairness_workload(spec: FairnessSpec, *, flood: bool = True,
                           light_tenant: str = LIGHT) -> list[SyntheticRequest]:
    """The seeded requests: the flood (tenant "flood") at step 0 unless ``flood`` is off, and the
    light requests (``light_tenant``; the flood's own for first come, first served)."""
    rng = random.Random(spec.seed)
    flood_reqs = [SyntheticRequest(f"flood-{i}", 0.0, _prompt(rng, spec.flood_prompt_len, spec.vocab_size),
                                   rng.randint(*spec.flood_output_len), FLOOD, spec.flood_weight)
                  for i in range(spec.flood_requests)]
    light_weight = spec.flood_weight if light_tenant == FLOOD else spec.light_weight
    light_reqs = [SyntheticRequest(f"light-{k}", float(10 + k * spec.light_every),
                                   _prompt(rng, spec.light_prompt_len, spec.vocab_size),
                                   rng.randint(*spec.light_output_len), light_tenant, light_weight)
                  for k in range(spec.light_requests)]
    return (flood_reqs if flood else []) + light_reqs


@dataclass
class FairnessRun:
    name: str
    light_ttft_p50: float  # steps
    light_ttft_p90: float
    light_ttft_max: float
    ratio_to_alone: float | None  # p50 over the alone run's p50
    steps: int  # to finish every request (the flood's cost of fairness shows here and in recompute)
    preemptions: int
    recompute_share: float
    light_ttft_steps: list[float]


def _light_ttfts(result: SimResult, workload: list[SyntheticRequest]) -> list[float]:
    """The light requests' TTFTs, whichever tenant they ran as (ids say which were light)."""
    by_tenant = result.tenants
    if LIGHT in by_tenant:
        return list(by_tenant[LIGHT]["ttft_steps"])
    # one tenant: the light requests are the flood tenant's last ``light_requests`` in arrival order,
    # which simulate() keeps (its requests are sorted by arrival, flood first at step 0)
    n = sum(1 for r in workload if r.request_id.startswith("light-"))
    return list(by_tenant[FLOOD]["ttft_steps"][-n:]) if n else []


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_fairness(config: SchedulerConfig, spec: FairnessSpec, *, check_invariants: bool = False) -> list[FairnessRun]:
    """The four runs of the module's doc, side by side on the same requests."""
    runs = [
        ("alone", make_fairness_workload(spec, flood=False), config),
        ("fifo (one tenant)", make_fairness_workload(spec, light_tenant=FLOOD), config),
        ("fair, no slot moves", make_fairness_workload(spec),
         dataclasses.replace(config, fair_share_preemption=False)),
        ("fair", make_fairness_workload(spec), config),
    ]
    out: list[FairnessRun] = []
    alone_p50: float | None = None
    for name, workload, cfg in runs:
        result = simulate(cfg, workload, check_invariants=check_invariants)
        ttft = _light_ttfts(result, workload)
        p50 = statistics.median(ttft)
        if alone_p50 is None:
            alone_p50 = p50
        out.append(FairnessRun(name, p50, _pct(ttft, 0.9), max(ttft), p50 / alone_p50 if alone_p50 else None,
                               result.iterations, result.evictions, result.recompute_share, ttft))
    return out


@dataclass
class WeightsRun:
    weights: tuple[int, int]
    tokens: tuple[int, int]  # forwarded by each tenant while both were backlogged
    share: float  # tokens[0] / tokens[1]
    expected: float  # weights[0] / weights[1]
    steps: int


def run_weights(config: SchedulerConfig, spec: FairnessSpec) -> WeightsRun:
    """Two backlogged tenants ("a", "b") of ``spec.weights``: the tokens each forwards until one's
    backlog runs dry."""
    rng = random.Random(spec.seed + 1)
    sched = Scheduler(config, clock=lambda: 0.0)
    wa, wb = spec.weights
    for i in range(spec.flood_requests):
        for tenant, weight in (("a", wa), ("b", wb)):
            sched.add_request(SyntheticRequest(f"{tenant}-{i}", 0.0,
                                               _prompt(rng, spec.flood_prompt_len, spec.vocab_size),
                                               rng.randint(*spec.flood_output_len), tenant, weight).to_request())
    tokens = {"a": 0, "b": 0}
    steps = 0
    while all(load.waiting for load in sched.fair_view().tenants.values()) and len(sched.fair_view().tenants) == 2:
        out = sched.schedule()
        for c in out.chunks:
            tokens[c.request.tenant] += c.num_tokens
        sched.update_from_output(out, {c.request.request_id: 50_000 for c in out.chunks if c.samples})
        steps += 1
    return WeightsRun((wa, wb), (tokens["a"], tokens["b"]), tokens["a"] / max(1, tokens["b"]), wa / wb, steps)


def format_fairness_table(runs: list[FairnessRun]) -> str:
    head = (f"{'run':<22} {'light TTFT p50':>14} {'p90':>6} {'max':>6} {'x alone':>8} "
            f"{'steps':>7} {'preemptions':>11} {'recompute':>9}")
    lines = [head, "-" * len(head)]
    for r in runs:
        ratio = f"{r.ratio_to_alone:.2f}" if r.ratio_to_alone is not None else "-"
        lines.append(f"{r.name:<22} {r.light_ttft_p50:>14.1f} {r.light_ttft_p90:>6.1f} {r.light_ttft_max:>6.1f} "
                     f"{ratio:>8} {r.steps:>7,} {r.preemptions:>11} {r.recompute_share:>9.1%}")
    return "\n".join(lines)
