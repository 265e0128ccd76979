"""Charts of the benchmarks' JSON results, with matplotlib (the optional ``bench`` extra).

- ``sluice bench serve``: TTFT, TPOT and ITL distributions and output throughput over time (from
  the per-request records in its JSON; a result without them gets percentile bars instead);
- ``sluice bench scheduler --sweep-watermarks``: evictions, thrashed admissions and recompute share
  against the watermark reserve, one line per pool when several sweeps are drawn together;
- ``sluice bench offline``: output tokens/s of each system compared.

Each bench writes its chart itself; ``sluice bench plot FILE.json...`` (``python -m sluice_bench.plots``)
draws them again from saved JSON, which is how the charts in docs/bench/ are made. matplotlib is
imported only here, on the Agg backend (no display needed); without it ``PlotUnavailable`` says
what to install.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MISSING_MESSAGE = (
    "charts need matplotlib, which is not installed: install the bench extra "
    "(pip install 'sluice[bench]'; `make serve` / `make test` include it)"
)


class PlotUnavailable(RuntimeError):
    """matplotlib is missing; the message says how to install it."""


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def require() -> None:
    """Raise PlotUnavailable now (before a long benchmark) when charts cannot be drawn."""
    if not available():
        raise PlotUnavailable(MISSING_MESSAGE)


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailable(MISSING_MESSAGE) from exc
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Fixed metadata: the same JSON gives the same PNG bytes (charts are committed under docs/).
    fig.savefig(path, dpi=110, metadata={"Software": None})
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def default_chart_path(json_path: str | Path | None, fallback: str) -> Path:
    """The chart that goes with a JSON result: same name, .png (``fallback`` without a JSON path)."""
    return Path(json_path).with_suffix(".png") if json_path else Path(fallback)


def add_plot_arguments(parser: argparse.ArgumentParser, what: str, default: str) -> None:
    """``--plot PNG`` / ``--no-plot`` for a bench command."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--plot", default=None, metavar="PNG",
                       help=f"write {what} as a PNG here (default: {default}); needs matplotlib, "
                            "the bench extra")
    group.add_argument("--no-plot", action="store_true", help="write no chart")


def plot_target(args: argparse.Namespace, json_path: str | Path | None, fallback: str, prog: str) -> Path | None:
    """Where a bench command's chart goes, or None for no chart; decided before the run.

    Without matplotlib, an explicit ``--plot`` is an error (exit 2, before a long run); the default
    chart is skipped with a note saying what to install.
    """
    if getattr(args, "no_plot", False):
        return None
    explicit = getattr(args, "plot", None)
    if available():
        return Path(explicit) if explicit else default_chart_path(json_path, fallback)
    if explicit:
        print(f"{prog}: --plot: {MISSING_MESSAGE}", file=sys.stderr)
        raise SystemExit(2)
    print(f"{prog}: no chart will be written: {MISSING_MESSAGE}; --no-plot skips charts", file=sys.stderr)
    return None


# --- kinds of result -----------------------------------------------------------------------------


def kind_of(doc: dict[str, Any]) -> str:
    """Which benchmark wrote ``doc``: "serve", "offline" or "scheduler"."""
    if "ttft_ms" in doc and "output_throughput" in doc:
        return "serve"
    if "rows" in doc and doc["rows"] and "tokens_per_s" in doc["rows"][0]:
        return "offline"
    if "results" in doc and doc["results"] and "watermark_blocks" in doc["results"][0]:
        return "scheduler"
    raise ValueError("not a result of sluice bench serve, offline or scheduler (unknown JSON layout)")


# --- sluice bench serve ----------------------------------------------------------------------------


def _tpot_ms(r: dict) -> float | None:
    n = r.get("output_tokens", 0)
    if n <= 1:
        return None
    return (r["latency_s"] - r["ttft_s"]) / (n - 1) * 1000


def throughput_series(requests: Sequence[dict], bin_s: float = 1.0) -> tuple[list[float], list[float], list[int]]:
    """Output tokens/s and requests in flight per ``bin_s`` window, from per-request records.

    A request's streamed chunks arrive at ``start + ttft`` and then after each ITL; its output
    tokens are spread evenly over its chunks (a chunk usually carries one token).
    """
    ok = [r for r in requests if r.get("ok")]
    if not ok:
        return [], [], []
    end = max(r["start_s"] + r["latency_s"] for r in ok)
    nbins = max(1, math.ceil(end / bin_s))
    tokens = [0.0] * nbins
    in_flight = [0] * nbins
    for r in ok:
        arrivals = [r["start_s"] + r["ttft_s"]]
        for gap in r.get("itl_s", []):
            arrivals.append(arrivals[-1] + gap)
        per_chunk = r["output_tokens"] / len(arrivals) if r["output_tokens"] else 0.0
        for t in arrivals:
            tokens[min(nbins - 1, int(t / bin_s))] += per_chunk
        first, last = int(r["start_s"] / bin_s), min(nbins - 1, int((r["start_s"] + r["latency_s"]) / bin_s))
        for b in range(first, last + 1):
            in_flight[b] += 1
    times = [(i + 0.5) * bin_s for i in range(nbins)]
    return times, [t / bin_s for t in tokens], in_flight


def _serve_title(doc: dict) -> str:
    rate = doc.get("request_rate")
    rate_text = "all at once" if rate in (None, "inf") or (isinstance(rate, float) and math.isinf(rate)) else f"{rate:g} req/s"
    return (f"sluice bench serve: {doc.get('completed', '?')} requests ({rate_text}), {doc.get('model', '')}: "
            f"{doc.get('output_throughput', 0):.1f} output tok/s")


def plot_serve(doc: dict, path: str | Path) -> Path:
    plt = _pyplot()
    requests = doc.get("requests")
    if not requests:
        return _plot_serve_summary(doc, path, plt)
    ok = [r for r in requests if r.get("ok")]
    ttft = [r["ttft_s"] * 1000 for r in ok]
    tpot = [t for t in (_tpot_ms(r) for r in ok) if t is not None]
    itl = [x * 1000 for r in ok for x in r.get("itl_s", [])]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, values, name, color in (
        (axes[0][0], ttft, "TTFT", "tab:blue"),
        (axes[0][1], tpot, "TPOT", "tab:orange"),
        (axes[1][0], itl, "ITL", "tab:green"),
    ):
        if values:
            lo, hi = min(values), max(values)
            if hi - lo < 1e-6 * max(1.0, abs(hi)):  # all (nearly) equal: one bar, centred
                lo, hi = lo - 0.5, hi + 0.5
            ax.hist(values, bins=min(40, max(5, len(values) // 3)), range=(lo, hi), color=color, alpha=0.8)
            mean = statistics.fmean(values)
            p99 = sorted(values)[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)]
            ax.axvline(mean, color="black", linestyle="--", linewidth=1, label=f"mean {mean:.0f} ms")
            ax.axvline(p99, color="red", linestyle=":", linewidth=1, label=f"p99 {p99:.0f} ms")
            ax.legend(loc="upper right", fontsize=8)
        ax.set_title(f"{name} distribution ({len(values)} samples)")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("count")
    ax = axes[1][1]
    times, tok_s, in_flight = throughput_series(requests)
    ax.plot(times, tok_s, color="tab:purple", label="output tokens/s")
    ax.set_xlabel("time since the first request (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput over time (1 s windows)")
    ax2 = ax.twinx()
    ax2.step(times, in_flight, where="mid", color="gray", alpha=0.6, label="requests in flight")
    ax2.set_ylabel("requests in flight")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right", fontsize=8)
    fig.suptitle(_serve_title(doc))
    fig.tight_layout()
    return _save(fig, path)


def _plot_serve_summary(doc: dict, path: str | Path, plt) -> Path:
    """A result without per-request records: its mean / median / percentiles as bars."""
    metrics = [k for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms") if k in doc]
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 4))
    for ax, key in zip(axes if len(metrics) > 1 else [axes], metrics, strict=True):
        stats = {k: v for k, v in doc[key].items() if k != "std" and k != "median"}
        ax.bar(list(stats), list(stats.values()), color="tab:blue")
        ax.set_title(key.split("_")[0].upper())
        ax.set_ylabel("ms")
    fig.suptitle(_serve_title(doc) + " (summary only)")
    fig.tight_layout()
    return _save(fig, path)


# --- sluice bench scheduler --sweep-watermarks ---------------------------------------------------------


def _pool_label(doc: dict) -> str:
    cfg = doc.get("config", {})
    return f"{cfg.get('num_blocks', '?')} blocks of {cfg.get('block_size', '?')}"


def plot_scheduler_sweep(docs: dict | Sequence[dict], path: str | Path) -> Path:
    """Evictions, thrashed admissions, recompute share and iterations against the reserve; one line
    per sweep (e.g. a tight and a roomy pool on the same workload)."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    docs = [docs] if isinstance(docs, dict) else list(docs)
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.8))
    panels = (
        ("evictions", "evictions (preemptions)", 1),
        ("thrashed_admissions", "of those thrash", 1),
        ("recompute_share", "recompute share (%)", 100),
        ("iterations", "iterations (steps)", 1),
    )
    markers = "osd^v"
    for i, doc in enumerate(docs):
        results = sorted(doc["results"], key=lambda r: r["watermark_blocks"])
        reserves = [r["watermark_blocks"] for r in results]
        for ax, (key, title, scale) in zip(axes, panels, strict=True):
            ax.plot(reserves, [r[key] * scale for r in results], marker=markers[i % len(markers)],
                    label=_pool_label(doc))
            ax.set_title(title)
            ax.set_xlabel("watermark reserve (blocks)")
            ax.set_xticks(reserves)
            if key != "recompute_share":
                ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].legend(fontsize=8)
    cfg = docs[0].get("config", {})
    wl = docs[0].get("workload", {})
    fig.suptitle(
        f"sluice bench scheduler --sweep-watermarks: {wl.get('num_requests', '?')} requests, "
        f"{cfg.get('max_num_seqs', '?')} slots, budget {cfg.get('max_num_batched_tokens', '?')} tokens"
    )
    fig.tight_layout()
    return _save(fig, path)


# --- sluice bench offline ------------------------------------------------------------------------------


def plot_offline(doc: dict, path: str | Path) -> Path:
    plt = _pyplot()
    rows = doc["rows"]
    names = [r["system"] for r in rows]
    values = [r["tokens_per_s"] for r in rows]
    base = values[0]
    fig, ax = plt.subplots(figsize=(8, 0.9 * len(rows) + 1.6))
    colors = ["tab:blue"] + ["tab:gray"] * (len(rows) - 1)
    bars = ax.barh(names[::-1], values[::-1], color=colors[::-1])
    for bar, value in zip(bars, values[::-1], strict=True):
        note = f"{value:.1f} tok/s" + (f"  (Sluice {base / value:.2f}x)" if value and value != base else "")
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + note, va="center", fontsize=9)
    ax.set_xlim(0, max(values) * 1.45)
    ax.set_xlabel("output tokens/s")
    wl = doc.get("workload", {})
    ax.set_title(
        f"sluice bench offline: {wl.get('num_requests', '?')} requests, prompts {wl.get('prompt_len', '?')}, "
        f"outputs {wl.get('output_len', '?')} tokens, {wl.get('dtype', '')}",
        fontsize=10,
    )
    fig.tight_layout()
    return _save(fig, path)


# --- from saved JSON -----------------------------------------------------------------------------------


def plot_files(paths: Sequence[str | Path], out: str | Path | None = None) -> list[Path]:
    """Charts for saved results: one per serve / offline result, next to its JSON; the scheduler
    sweeps among ``paths`` drawn together in one chart (next to the first, or ``out``).
    ``out`` names the chart when only one is drawn."""
    docs = []
    for p in paths:
        try:
            doc = json.loads(Path(p).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{p}: cannot read JSON ({exc})") from exc
        try:
            docs.append((Path(p), kind_of(doc), doc))
        except ValueError as exc:
            raise ValueError(f"{p}: {exc}") from exc
    sweeps = [(p, d) for p, k, d in docs if k == "scheduler"]
    others = [(p, k, d) for p, k, d in docs if k != "scheduler"]
    charts = len(others) + (1 if sweeps else 0)
    if out is not None and charts != 1:
        raise ValueError(f"--out names one chart, but these files make {charts}")
    written = []
    for p, k, d in others:
        target = out or p.with_suffix(".png")
        written.append(plot_serve(d, target) if k == "serve" else plot_offline(d, target))
    if sweeps:
        written.append(plot_scheduler_sweep([d for _, d in sweeps], out or sweeps[0][0].with_suffix(".png")))
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", help="JSON results of sluice bench serve / offline / scheduler")
    parser.add_argument("--out", default=None,
                        help="the chart's path when the files make one chart (default: next to the JSON, .png)")


def run(args: argparse.Namespace) -> int:
    try:
        written = plot_files(args.files, args.out)
    except (PlotUnavailable, ValueError) as exc:
        print(f"sluice bench plot: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sluice_bench.plots", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
