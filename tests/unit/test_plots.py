"""Benchmark charts (sluice_bench/plots.py): each bench's chart from its JSON, the series behind them,
the CLI that redraws saved results, and the message when matplotlib is missing."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pytest

from sluice_bench import plots

REPO = Path(__file__).resolve().parents[2]
DOCS_BENCH = REPO / "docs" / "bench"
SAMPLES = REPO / "tests" / "data" / "bench"  # saved results of other benches, to draw
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG header, after checking it is a PNG."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _serve_doc(with_requests: bool = True) -> dict:
    doc = json.loads((SAMPLES / "serve-burst.json").read_text())
    doc.pop("requests", None)
    if with_requests:
        doc["requests"] = [
            {"ok": True, "start_s": 0.1 * i, "prompt_len": 16, "output_tokens": 8, "ttft_s": 0.2 + 0.01 * i,
             "latency_s": 0.2 + 0.01 * i + 7 * 0.05, "itl_s": [0.05] * 7, "error": ""}
            for i in range(20)
        ] + [{"ok": False, "start_s": 0.0, "prompt_len": 16, "output_tokens": 0, "ttft_s": 0.0,
              "latency_s": 0.0, "itl_s": [], "error": "HTTP 503"}]
    return doc


def test_throughput_series_spreads_tokens_over_chunk_arrivals() -> None:
    # chunks arrive at 0.5, 1.1 and 1.7 s; 6 tokens in 3 chunks: 2 tokens per chunk
    reqs = [{"ok": True, "start_s": 0.0, "ttft_s": 0.5, "itl_s": [0.6, 0.6], "latency_s": 1.7, "output_tokens": 6},
            {"ok": True, "start_s": 1.2, "ttft_s": 0.1, "itl_s": [], "latency_s": 0.1, "output_tokens": 1},
            {"ok": False, "start_s": 0.0, "ttft_s": 0.0, "itl_s": [], "latency_s": 0.0, "output_tokens": 0}]
    times, tok_s, in_flight = plots.throughput_series(reqs, bin_s=1.0)
    assert times == [0.5, 1.5]
    assert tok_s == [2.0, 4.0 + 1.0]
    assert in_flight == [1, 2]
    assert sum(tok_s) == 7  # every output token counted once
    assert plots.throughput_series([], 1.0) == ([], [], [])


@pytest.mark.parametrize("with_requests", [True, False])
def test_serve_chart(tmp_path, with_requests) -> None:
    out = plots.plot_serve(_serve_doc(with_requests), tmp_path / "serve.png")
    width, height = _png_size(out)
    assert width > 600 and height > 300


def test_offline_and_sweep_charts_from_the_committed_results(tmp_path) -> None:
    offline = json.loads((SAMPLES / "offline.json").read_text())
    assert _png_size(plots.plot_offline(offline, tmp_path / "o.png"))[0] > 500
    sweeps = [json.loads((DOCS_BENCH / n).read_text()) for n in ("scheduler-sweep.json", "scheduler-sweep-roomy.json")]
    assert _png_size(plots.plot_scheduler_sweep(sweeps, tmp_path / "s.png"))[0] > 1000
    assert _png_size(plots.plot_scheduler_sweep(sweeps[0], tmp_path / "one.png"))[0] > 1000


def test_same_json_same_png(tmp_path) -> None:
    offline = json.loads((SAMPLES / "offline.json").read_text())
    a = plots.plot_offline(offline, tmp_path / "a.png").read_bytes()
    b = plots.plot_offline(offline, tmp_path / "b.png").read_bytes()
    assert a == b  # no timestamp in the metadata: committed charts change only when the data does


def test_kind_of() -> None:
    assert plots.kind_of(_serve_doc()) == "serve"
    assert plots.kind_of(json.loads((SAMPLES / "offline.json").read_text())) == "offline"
    assert plots.kind_of(json.loads((DOCS_BENCH / "scheduler-sweep.json").read_text())) == "scheduler"
    with pytest.raises(ValueError, match="unknown JSON layout"):
        plots.kind_of({"something": 1})


def test_bench_plot_command(tmp_path, capsys) -> None:
    from sluice_cli.cli import main

    serve = tmp_path / "serve.json"
    serve.write_text(json.dumps(_serve_doc()))
    offline = tmp_path / "offline.json"
    offline.write_text((SAMPLES / "offline.json").read_text())
    tight, roomy = tmp_path / "tight.json", tmp_path / "roomy.json"
    tight.write_text((DOCS_BENCH / "scheduler-sweep.json").read_text())
    roomy.write_text((DOCS_BENCH / "scheduler-sweep-roomy.json").read_text())
    assert main(["bench", "plot", str(serve), str(offline), str(tight), str(roomy)]) == 0
    out = capsys.readouterr().out
    for png in (serve.with_suffix(".png"), offline.with_suffix(".png"), tight.with_suffix(".png")):
        assert f"wrote {png}" in out
        _png_size(png)
    assert not roomy.with_suffix(".png").exists()  # the sweeps share one chart
    assert main(["bench", "plot", str(offline), "--out", str(tmp_path / "x.png")]) == 0
    _png_size(tmp_path / "x.png")
    # bad input: a clear message and exit 2, no traceback
    assert main(["bench", "plot", str(offline), str(serve), "--out", str(tmp_path / "y.png")]) == 2
    assert "--out names one chart, but these files make 2" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["bench", "plot", str(bad)]) == 2
    assert "cannot read JSON" in capsys.readouterr().err
    bad.write_text('{"rows": []}')
    assert main(["bench", "plot", str(bad)]) == 2
    assert "not a result of sluice bench" in capsys.readouterr().err
    assert main(["bench", "plot", str(tmp_path / "missing.json")]) == 2


def test_scheduler_sweep_writes_its_chart(tmp_path, capsys) -> None:
    from sluice_cli.cli import main

    path = tmp_path / "sweep.json"
    argv = ["bench", "scheduler", "--sweep-watermarks", "0,1,2", "--json", str(path), "--no-cost"]
    assert main(argv) == 0
    assert f"wrote {path.with_suffix('.png')}" in capsys.readouterr().out
    assert _png_size(path.with_suffix(".png"))[0] > 1000
    chart = tmp_path / "elsewhere" / "c.png"
    assert main([*argv, "--plot", str(chart)]) == 0
    _png_size(chart)
    (tmp_path / "n.png").unlink(missing_ok=True)
    assert main(["bench", "scheduler", "--sweep-watermarks", "0,1", "--no-cost", "--no-plot",
                 "--json", str(tmp_path / "n.json")]) == 0
    assert not (tmp_path / "n.png").exists()


# --- without matplotlib ----------------------------------------------------------------------------


@pytest.fixture
def no_matplotlib(monkeypatch):
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError


def test_missing_matplotlib_says_what_to_install(no_matplotlib, tmp_path, capsys) -> None:
    assert not plots.available()
    with pytest.raises(plots.PlotUnavailable, match=re.escape("pip install 'sluice[bench]'")):
        plots.plot_offline(json.loads((SAMPLES / "offline.json").read_text()), tmp_path / "o.png")
    with pytest.raises(plots.PlotUnavailable, match="matplotlib"):
        plots.require()
    # the default chart is skipped with a note; the run goes on
    args = argparse.Namespace(plot=None, no_plot=False)
    assert plots.plot_target(args, tmp_path / "r.json", "x.png", "sluice bench serve") is None
    err = capsys.readouterr().err
    assert "sluice bench serve: no chart will be written" in err and "sluice[bench]" in err
    # an explicit --plot stops before the (long) run
    with pytest.raises(SystemExit) as exc:
        plots.plot_target(argparse.Namespace(plot="c.png", no_plot=False), None, "x.png", "sluice bench offline")
    assert exc.value.code == 2
    assert "sluice bench offline: --plot: charts need matplotlib" in capsys.readouterr().err
    # --no-plot: nothing said
    assert plots.plot_target(argparse.Namespace(plot=None, no_plot=True), None, "x.png", "p") is None
    assert capsys.readouterr().err == ""


def test_missing_matplotlib_bench_scheduler_still_runs(no_matplotlib, tmp_path, capsys) -> None:
    from sluice_cli.cli import main

    path = tmp_path / "sweep.json"
    assert main(["bench", "scheduler", "--sweep-watermarks", "0,1", "--json", str(path), "--no-cost"]) == 0
    assert path.exists() and not path.with_suffix(".png").exists()
    assert "no chart will be written" in capsys.readouterr().err
    assert main(["bench", "plot", str(path)]) == 2
    assert "charts need matplotlib" in capsys.readouterr().err


# --- the committed charts ------------------------------------------------------------------------------


def test_the_docs_charts_are_drawn_from_committed_results() -> None:
    docs = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    shown = {(doc.parent / m).resolve() for doc in docs
             for m in re.findall(r"!\[[^\]]*\]\(([\w./-]+\.png)\)", doc.read_text())}
    assert (DOCS_BENCH / "scheduler-sweep.png").resolve() in shown
    for png in shown:
        _png_size(png)
        # each chart is drawn from a committed JSON of the same name
        assert png.with_suffix(".json").exists(), png
