"""``sluice bench serve``: a serving benchmark against a running gateway, after vLLM's ``bench serve``.

Sends a seeded dataset of prompts (synthetic token-id prompts of given input/output lengths, or a
JSONL file) to ``/v1/completions`` with streaming, at a Poisson (or gamma, ``--burstiness``) or
fixed request rate, under an optional concurrency cap, and reports

- time to first token (TTFT), time per output token after the first (TPOT), inter-token latency
  between streamed chunks (ITL) and end-to-end latency (E2EL): mean, median, p99 in ms;
- request, output-token and total-token throughput;
- goodput: requests per second that met every SLO given with ``--goodput ttft:MS tpot:MS e2el:MS``.

It prints a table, writes the figures as JSON (``--json``; with every request's send time,
TTFT, ITLs and latency under ``requests``) and draws them (``--plot``, sluice_bench/plots.py): the TTFT,
TPOT and ITL distributions and output throughput over time.

``--num-warmups`` sends untimed requests first, whose prompts share no prefix with the measured
ones. ``--offline-baseline`` then runs the warm-ups and the measured requests through the offline
engine in this process and reports served over offline throughput, with both sides' prefix-cache
hits, so that a ratio between unlike runs is flagged. ``--rounds N`` alternates the two N times on
fresh prompts and reports the median ratio besides each round's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from sluice_bench import plots, results


@dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    ok: bool = False
    start: float = 0.0  # sent, seconds after the benchmark started
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    cached_tokens: int = 0  # of its prompt, served from the engine's prefix cache


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the gateway (default: %(default)s)")
    parser.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=None, help="sent as a Bearer token")
    parser.add_argument("--dataset", choices=["random", "jsonl"], default="random",
                        help="synthetic token-id prompts, or a JSONL file (--dataset-path)")
    parser.add_argument("--dataset-path", default=None,
                        help='JSONL lines {"prompt": str | [ids], "max_tokens"|"output_len": int}')
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--random-input-len", type=int, default=128)
    parser.add_argument("--random-output-len", type=int, default=64)
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths drawn uniformly from [len*(1-r), len*(1+r)]")
    parser.add_argument("--random-vocab", type=int, nargs=2, default=[100, 10000], metavar=("LO", "HI"),
                        help="token-id range of synthetic prompts (default: 100 10000)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second; inf sends all at once (default)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the inter-arrival times: 1 is Poisson (default)")
    parser.add_argument("--fixed-rate", action="store_true", help="evenly spaced arrivals instead of Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="generate exactly the output length (default: on)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    parser.add_argument("--percentiles", default="50,90,99", help="percentiles to report (default: 50,90,99)")
    parser.add_argument("--json", "--result-file", dest="json", default=None, help="write the results as JSON here")
    plots.add_plot_arguments(parser, "TTFT/TPOT/ITL distributions and throughput over time",
                             "next to --json, else bench-results/serve.png")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--fresh-connections", action="store_true",
                        help="a new connection for every request, no keep-alive (for a server that closes "
                             "connections after a few requests or seconds idle, as llama-server does)")
    parser.add_argument("--num-warmups", type=int, default=None,
                        help="requests sent first, all at once and not counted: random prompts of the --random-* "
                             "lengths from another seed, so that they warm no prefix the measured ones hit; the "
                             "offline baseline runs them first too (default: --num-prompts with --offline-baseline, "
                             "else 0)")
    parser.add_argument("--offline-baseline", action="store_true",
                        help="afterwards, run the same requests through the offline engine in this process "
                             "(needs the engine extra) and report the gateway + Redis overhead")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --offline-baseline: this many served runs, each followed by the offline "
                             "engine on the same requests, fresh random prompts each round (the first round's "
                             "are --seed's); reports each round's ratio and their median (default: 1)")
    parser.add_argument("--offline-model", default=None,
                        help="model directory for --offline-baseline (default: the embedded model)")
    parser.add_argument("--offline-cpus", default=None, metavar="LIST",
                        help="with --offline-baseline: the offline engine runs on these CPUs (a Linux CPU list) "
                             "with a compute thread each, as `sluice serve --reserved-cpus` places the served "
                             "engine; between its runs this process goes back to the CPUs it had (run the bench "
                             "on the reserved ones: taskset -c 0 sluice bench serve ...)")
    parser.add_argument("--offline-dtype", default=None,
                        help="dtype of the --offline-baseline engine; give the served engine's (dtype auto "
                             "probes the CPU at start, and two probes under load may choose differently)")


# --- dataset -----------------------------------------------------------------------------------


def synthetic_dataset(num: int, input_len: int, output_len: int, range_ratio: float, vocab: tuple[int, int],
                      seed: int | str) -> list[BenchRequest]:
    rng = random.Random(seed)

    def draw(n: int) -> int:
        lo, hi = max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))
        return rng.randint(lo, hi)

    out = []
    for _ in range(num):
        n_in, n_out = draw(input_len), draw(output_len)
        out.append(BenchRequest([rng.randrange(*vocab) for _ in range(n_in)], n_in, n_out))
    return out


def jsonl_dataset(path: str, num: int, default_output_len: int, seed: int) -> list[BenchRequest]:
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            obj = json.loads(line)
            prompt = obj["prompt"]
            n_out = int(obj.get("max_tokens") or obj.get("output_len") or default_output_len)
            n_in = len(prompt) if isinstance(prompt, list) else 0
            rows.append(BenchRequest(prompt, n_in, n_out))
    if not rows:
        raise SystemExit(f"no prompts in {path}")
    rng = random.Random(seed)
    rng.shuffle(rows)
    return [rows[i % len(rows)] for i in range(num)]


def arrival_gaps(num: int, rate: float, burstiness: float, fixed: bool, seed: int) -> list[float]:
    if math.isinf(rate) or rate <= 0:
        return [0.0] * num
    if fixed:
        return [1.0 / rate] * num
    rng = random.Random(seed + 1)
    theta = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(num)]


# --- one request -------------------------------------------------------------------------------

# aiohttp's errors for a pooled connection the server had closed, raised before any answer
STALE_CONNECTION_ERRORS = ("ClientOSError", "ServerDisconnectedError")


async def send_one(client, url: str, model: str, req: BenchRequest, args, t0: float | None = None) -> RequestResult:
    """One streamed completion through ``client`` (an ``aiohttp.ClientSession``): its TTFT, ITLs,
    latency and usage. aiohttp rather than httpx: on a machine the server shares, the load
    generator's CPU is taken from the server it measures, and aiohttp's streaming costs less of it
    per chunk (docs/performance.md, the serving path). A request whose pooled connection the server
    had closed (a keep-alive that timed out there: llama-server's closes after 5 s idle) is sent
    once more on a fresh one, its time counted from the first try; any other failure is reported."""
    start = time.perf_counter()
    res, answered = await _send_once(client, url, model, req, args, start)
    if not (res.ok or answered) and res.error.startswith(STALE_CONNECTION_ERRORS):
        res, _ = await _send_once(client, url, model, req, args, start)
    res.start = start - t0 if t0 is not None else 0.0
    return res


async def _send_once(client, url: str, model: str, req: BenchRequest, args, start: float
                     ) -> tuple[RequestResult, bool]:
    """One try of ``send_one``; also whether the server answered (a status line came back)."""
    payload = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "stream": True,
               "stream_options": {"include_usage": True}, "temperature": args.temperature,
               "ignore_eos": args.ignore_eos}
    res = RequestResult(prompt_len=req.prompt_len)
    last = start
    answered = False
    try:
        async with client.post(url, json=payload) as resp:
            answered = True
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return res, answered
            pending = b""
            done = False
            text_chunks = 0
            async for piece in resp.content.iter_any():
                pending += piece
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if not line.startswith(b"data: "):  # ids, comments (keep-alive pings), blank lines
                        continue
                    data = line[6:].rstrip(b"\r")
                    if data == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        res.error = chunk["error"].get("message", "error")
                        return res, answered
                    now = time.perf_counter()
                    if chunk.get("usage"):
                        res.output_tokens = chunk["usage"]["completion_tokens"]
                        res.prompt_len = chunk["usage"]["prompt_tokens"]
                        res.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        text_chunks += 1
                        if res.ttft == 0.0:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
                if done:
                    break
        res.latency = time.perf_counter() - start
        if res.output_tokens == 0:  # a server that reports no usage (one token a chunk): its chunks
            res.output_tokens = text_chunks
        res.ok = True
    except Exception as exc:  # noqa: BLE001 - report, do not abort the benchmark
        res.error = f"{type(exc).__name__}: {exc}"
    return res, answered


# --- the run -----------------------------------------------------------------------------------


def _stats(values: list[float], percentiles: list[float]) -> dict:
    if not values:
        values = [0.0]
    ordered = sorted(values)

    def pct(p: float) -> float:
        k = (len(ordered) - 1) * p / 100
        f, c = math.floor(k), math.ceil(k)
        return ordered[f] + (ordered[c] - ordered[f]) * (k - f)

    out = {"mean": statistics.fmean(values) * 1000, "median": statistics.median(values) * 1000,
           "std": (statistics.pstdev(values) * 1000) if len(values) > 1 else 0.0}
    for p in percentiles:
        out[f"p{p:g}"] = pct(p) * 1000
    return out


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos: dict[str, float] = {}
    for item in items or []:
        key, _, ms = item.partition(":")
        key = key.strip().lower()
        if key not in ("ttft", "tpot", "e2el") or not ms:
            raise SystemExit(f"--goodput: expected ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        slos[key] = float(ms)
    return slos


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float],
              percentiles: list[float]) -> dict:
    ok = [r for r in results if r.ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    cached_tokens = sum(r.cached_tokens for r in ok)
    good = 0
    for r in ok:
        tpot = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        measured = {"ttft": r.ttft * 1000, "tpot": tpot * 1000, "e2el": r.latency * 1000}
        if all(measured[k] <= v for k, v in slos.items()):
            good += 1
    summary = {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "total_cached_prompt_tokens": cached_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok], percentiles),
        "tpot_ms": _stats(tpots, percentiles),
        "itl_ms": _stats(itls, percentiles),
        "e2el_ms": _stats([r.latency for r in ok], percentiles),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
    }
    if slos:
        summary["goodput_slos_ms"] = slos
        summary["request_goodput"] = good / duration if duration else 0.0
    return summary


async def benchmark(args, requests: list[BenchRequest],
                    warmups: list[BenchRequest] = ()) -> tuple[dict, list[RequestResult]]:
    import aiohttp
    from tqdm.asyncio import tqdm

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0, force_close=args.fresh_connections)
    base = args.base_url.rstrip("/")
    async with aiohttp.ClientSession(headers=headers, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=args.timeout)) as client:
        model = args.model
        if model is None:
            try:
                async with client.get(f"{base}/v1/models") as resp:
                    resp.raise_for_status()
                    data = (await resp.json())["data"]
            except aiohttp.ClientError as exc:
                raise SystemExit(f"sluice bench serve: cannot list the models at {base}/v1/models: "
                                 f"{type(exc).__name__}: {exc}") from None
            if not data:
                raise SystemExit("the gateway lists no model with a live engine")
            model = data[0]["id"]
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        url = f"{base}/v1/completions"
        if warmups:
            warm = await asyncio.gather(*(send_one(client, url, model, req, args) for req in warmups))
            failed = [r for r in warm if not r.ok]
            print(f"warm-up: {len(warm)} requests, {len(failed)} failed" +
                  (f" ({failed[0].error})" if failed else ""))
        bar = tqdm(total=len(requests), disable=args.disable_tqdm, desc="requests")

        async def run(req: BenchRequest) -> RequestResult:
            if sem is None:
                res = await send_one(client, url, model, req, args, start)
            else:
                async with sem:
                    res = await send_one(client, url, model, req, args, start)
            bar.update(1)
            return res

        gaps = arrival_gaps(len(requests), args.request_rate, args.burstiness, args.fixed_rate, args.seed)
        cpu_start = time.process_time()
        start = time.perf_counter()  # read by run() above when each request is sent
        tasks = []
        for req, gap in zip(requests, gaps, strict=True):
            tasks.append(asyncio.create_task(run(req)))
            if gap > 0:
                await asyncio.sleep(gap)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        client_cpu = time.process_time() - cpu_start
        bar.close()
    percentiles = [float(p) for p in str(args.percentiles).split(",") if p]
    summary = summarize(list(results), duration, parse_goodput(args.goodput), percentiles)
    summary["client_cpu_s"] = client_cpu
    summary.update({"model": model, "base_url": base, "num_prompts": len(requests),
                    "request_rate": args.request_rate, "burstiness": args.burstiness,
                    "max_concurrency": args.max_concurrency, "seed": args.seed,
                    "requests": [request_record(r) for r in results]})
    return summary, list(results)


def request_record(r: RequestResult) -> dict:
    """One request in the JSON result: what the charts are drawn from (seconds)."""
    return {"ok": r.ok, "start_s": r.start, "prompt_len": r.prompt_len, "output_tokens": r.output_tokens,
            "ttft_s": r.ttft, "latency_s": r.latency, "itl_s": r.itl, "error": r.error}


def format_table(s: dict) -> str:
    lines = ["{s:=^60}".format(s=" Serving Benchmark Result ")]

    def row(label: str, value) -> None:
        lines.append(f"{label:<42}{value:>18}")

    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    row("Maximum request concurrency:", s["max_concurrency"] if s["max_concurrency"] else "none")
    row("Benchmark duration (s):", f"{s['duration_s']:.2f}")
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Prompt tokens from the prefix cache:", s["total_cached_prompt_tokens"])
    row("Request throughput (req/s):", f"{s['request_throughput']:.2f}")
    if "request_goodput" in s:
        row("Request goodput (req/s):", f"{s['request_goodput']:.2f}")
    row("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}")
    # the load generator's own CPU: on a machine it shares with the server, taken from the server
    row("Client CPU per output token (us):", f"{s['client_cpu_s'] / max(s['total_output_tokens'], 1) * 1e6:.1f}")
    row("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        lines.append("{s:-^60}".format(s=f" {title} "))
        short = key.split("_")[0].upper()
        for stat, value in s[key].items():
            if stat == "std":
                continue
            row(f"{stat.capitalize() if not stat.startswith('p') else 'P' + stat[1:]} {short} (ms):", f"{value:.2f}")
    lines.append("=" * 60)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.offline_cpus is not None:
        from sluice.cpu_placement import check_cpus

        try:
            if not args.offline_baseline:
                raise ValueError("--offline-cpus places the --offline-baseline engine; there is none without it")
            check_cpus(args.offline_cpus, "--offline-cpus")
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
    if args.rounds < 1 or (args.rounds > 1 and not args.offline_baseline):
        print("--rounds must be at least 1, and more than 1 only with --offline-baseline", file=sys.stderr)
        return 2
    if args.rounds > 1 and args.dataset != "random":
        # a second round of the same prompts would find them in both sides' prefix caches
        print("--rounds above 1 needs --dataset random (each round draws fresh prompts)", file=sys.stderr)
        return 2
    if args.dataset == "jsonl":
        if not args.dataset_path:
            print("--dataset jsonl needs --dataset-path", file=sys.stderr)
            return 2
        requests = jsonl_dataset(args.dataset_path, args.num_prompts, args.random_output_len, args.seed)
    else:
        requests = round_requests(args, 0)
    num_warmups = args.num_warmups if args.num_warmups is not None else (
        args.num_prompts if args.offline_baseline else 0)
    if num_warmups < 0:
        print("--num-warmups must be at least 0", file=sys.stderr)
        return 2
    warmups = synthetic_dataset(num_warmups, args.random_input_len, args.random_output_len, args.random_range_ratio,
                                tuple(args.random_vocab), f"warm-up {args.seed}")
    chart = plots.plot_target(args, args.json, "bench-results/serve.png", "sluice bench serve")
    summary, _ = asyncio.run(benchmark(args, requests, warmups))
    summary["num_warmups"] = num_warmups
    print(format_table(summary))
    if args.offline_baseline:
        try:
            summary["offline_baseline"] = offline_baseline(args, requests, warmups, summary)
        except ValueError as exc:  # its engine refused its settings, or a cpuset its --offline-cpus
            print(f"--offline-baseline: {exc}", file=sys.stderr)
            return 2
    if written := results.write(args.json, "serve", summary):
        print(f"results written to {written}")
    if chart is not None:
        print(f"chart written to {plots.plot_serve(summary, chart)}")
    rounds = summary.get("offline_baseline", {}).get("rounds", [])
    return 0 if summary["completed"] and all(r["served_completed"] for r in rounds) else 1


def round_requests(args, index: int) -> list[BenchRequest]:
    """Round ``index``'s random prompts (round 0's are ``--seed``'s), fresh to both engines' caches."""
    seed = args.seed if index == 0 else f"round {index} {args.seed}"
    return synthetic_dataset(args.num_prompts, args.random_input_len, args.random_output_len,
                             args.random_range_ratio, tuple(args.random_vocab), seed)


def offline_baseline(args, requests: list[BenchRequest], warmups: list[BenchRequest], served: dict) -> dict:
    """The same requests through the offline engine (one process, no HTTP, no Redis), all at once:
    what the served run would reach without the gateway and Redis in between. It runs under the
    served engine's OpenMP wait policy (``sluice engine`` sets it; the same here unless
    $OMP_WAIT_POLICY says otherwise), so that only the gateway and Redis differ. The warm-up
    requests go first, untimed, as they went to the served engine; and both sides' prefix-cache
    hits are compared, since a served engine that an earlier run with the same ``--seed`` left
    holding these prompts computes less than a fresh offline engine.

    With ``--rounds N`` the served run and this one alternate N times, each round on fresh prompts
    (``round_requests``), and the result adds every round's figures and the median ratio: one
    pair's ratio moves by a tenth from run to run on a machine the two sides share."""
    import os

    from engine_service.service.main import OMP_WAIT_POLICY

    if "torch" not in sys.modules:  # read once, when torch loads its OpenMP runtime
        os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)
    from engine_service import LLM, SamplingParams  # the engine extra; imported only here

    place = contextlib.nullcontext
    if args.offline_cpus is not None:  # the engine places itself (threads, CPUs) as the served one does;
        from sluice.cpu_placement import parse_cpu_list, pin_process, pinned, usable_cpus

        home = usable_cpus()  # this process then goes back, and onto those CPUs for each offline run only
        place = functools.partial(pinned, parse_cpu_list(args.offline_cpus))
    try:
        llm = LLM(args.offline_model, **({"dtype": args.offline_dtype} if args.offline_dtype else {}),
                  **({"cpus": args.offline_cpus} if args.offline_cpus is not None else {}))
    finally:
        if args.offline_cpus is not None:
            pin_process(home)

    def generate(batch: list[BenchRequest]) -> list:
        prompts = [r.prompt if isinstance(r.prompt, list) else {"prompt": r.prompt} for r in batch]
        params = [SamplingParams(temperature=args.temperature, max_tokens=r.output_len, ignore_eos=args.ignore_eos)
                  for r in batch]
        with place():
            return llm.generate(prompts, params, use_tqdm=False) if batch else []

    def timed(batch: list[BenchRequest], served_round: dict, label: str) -> dict:
        start = time.perf_counter()
        outs = generate(batch)
        duration = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        cached = sum(o.num_cached_tokens for o in outs)
        throughput = tokens / duration if duration else 0.0
        gap = abs(served_round["total_cached_prompt_tokens"] - cached)
        if gap > 0.05 * max(served_round["total_input_tokens"], 1):
            print(f"warning: {label}: the served engine took {served_round['total_cached_prompt_tokens']} prompt "
                  f"tokens from its prefix cache and the offline one {cached}: they did not compute the same work, "
                  "so the ratio does not measure the serving path (an earlier run with this --seed? give another)",
                  file=sys.stderr)
        return {"duration_s": duration, "total_output_tokens": tokens, "total_cached_prompt_tokens": cached,
                "output_throughput": throughput,
                "served_over_offline": served_round["output_throughput"] / throughput if throughput else 0.0}

    generate(warmups)
    result = timed(requests, served, "round 0" if args.rounds > 1 else "the measured requests")
    result["dtype"] = str(llm.engine.dtype).removeprefix("torch.")
    result["cpus"] = args.offline_cpus  # None: the CPUs the bench had
    print("{s:-^60}".format(s=" Offline engine, same requests "))
    print(f"{'Duration (s):':<42}{result['duration_s']:>18.2f}")
    print(f"{'Output token throughput (tok/s):':<42}{result['output_throughput']:>18.2f}")
    print(f"{'Prompt tokens from the prefix cache:':<42}{result['total_cached_prompt_tokens']:>18}")
    print(f"{'Served / offline throughput:':<42}{result['served_over_offline']:>18.3f}")
    if args.rounds > 1:
        def row(served_round: dict, offline: dict) -> dict:  # a round's line in the JSON
            return {"served_output_throughput": served_round["output_throughput"],
                    "served_completed": served_round["completed"], "served_failed": served_round["failed"],
                    "output_throughput": offline["output_throughput"],
                    "served_over_offline": offline["served_over_offline"]}

        rounds = [row(served, result)]
        for index in range(1, args.rounds):
            batch = round_requests(args, index)
            served_round, _ = asyncio.run(benchmark(args, batch))
            rounds.append(row(served_round, timed(batch, served_round, f"round {index}")))
        print("{s:-^60}".format(s=f" {args.rounds} rounds, served then offline "))
        for index, r in enumerate(rounds):
            print(f"{f'Round {index} (tok/s served, offline; ratio):':<42}"
                  f"{r['served_output_throughput']:>7.1f} {r['output_throughput']:>6.1f} {r['served_over_offline']:>4.3f}")
        result["rounds"] = rounds
        result["median_served_over_offline"] = statistics.median(r["served_over_offline"] for r in rounds)
        print(f"{'Served / offline throughput, median:':<42}{result['median_served_over_offline']:>18.3f}")
        failed = [str(i) for i, r in enumerate(rounds) if r["served_failed"]]
        if failed:
            print(f"warning: served requests failed in round(s) {', '.join(failed)}; a round's ratio counts only "
                  "the requests that completed", file=sys.stderr)
    print("=" * 60)
    return result
