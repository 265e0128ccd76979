"""Each mode's share of its bandwidth bound in stored `sluice bench anchor` runs, grouped by where the
VM's two vCPUs sat during the iteration, as the read bandwidth beside it tells.

    python scripts/anchor_by_placement.py docs/bench/anchor-native-*.json [--json out.json]

On the 2-vCPU Zen 4 VMs of docs/performance.md a two-thread read is much slower while the vCPUs
share a CCD than while they sit on two (the tenth round; scripts/bench_placement.c tags both by a
cache line's round trip), and the default thresholds sit between the two. An iteration's reading is the mean of the readings just before and after it: at
or under --one-ccd it counts as one CCD, at or over --two-ccds as two, and between them as a
placement that moved during the iteration. Only iterations within one run are measured side by
side; this table pools runs to show how each placement's shares spread, not to compare runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def placement(reading: float, one_ccd: float, two_ccds: float) -> str:
    if reading <= one_ccd:
        return "one CCD"
    return "two CCDs" if reading >= two_ccds else "moved"


def pool(paths: list[Path], one_ccd: float, two_ccds: float) -> dict[str, dict[str, list[float]]]:
    """mode -> placement -> the shares of its iterations, over every run in paths."""
    out: dict[str, dict[str, list[float]]] = {}
    for path in paths:
        for row in json.loads(path.read_text())["rows"]:
            shares, readings = row.get("share_of_bandwidth_bound_runs"), row.get("read_bandwidth_beside_runs_gb_s")
            if not shares or not readings:
                continue  # llama.cpp's row has no bound
            mode = row["system"].removeprefix("sluice ").split(" ")[0]
            for share, reading in zip(shares, readings, strict=True):
                out.setdefault(mode, {}).setdefault(placement(reading, one_ccd, two_ccds), []).append(share)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="sluice bench anchor --json files")
    parser.add_argument("--one-ccd", type=float, default=36.0, help="GB/s at or under which an iteration had one CCD")
    parser.add_argument("--two-ccds", type=float, default=50.0, help="GB/s at or over which it had two")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.one_ccd >= args.two_ccds:
        parser.error("--one-ccd must be under --two-ccds")
    pooled = pool(args.runs, args.one_ccd, args.two_ccds)
    print(f"{len(args.runs)} anchor runs; each iteration's share of its bandwidth bound, by placement "
          f"(one CCD: <= {args.one_ccd:g} GB/s beside it, two: >= {args.two_ccds:g})")
    print(f"{'mode':<24}{'placement':<11}{'iterations':>11}{'min':>7}{'median':>8}{'max':>7}{'>= 0.8':>8}")
    summary = []
    for mode, by_place in pooled.items():
        for place in ("one CCD", "two CCDs", "moved"):
            shares = by_place.get(place)
            if not shares:
                continue
            met = sum(s >= 0.8 for s in shares)
            print(f"{mode:<24}{place:<11}{len(shares):>11}{min(shares):>7.2f}{statistics.median(shares):>8.2f}"
                  f"{max(shares):>7.2f}{met:>5}/{len(shares):<2}")
            summary.append({"mode": mode, "placement": place, "shares": shares, "median": statistics.median(shares),
                            "at_least_0_8": met})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"runs": [str(p) for p in args.runs], "one_ccd_gb_s": args.one_ccd,
                                         "two_ccds_gb_s": args.two_ccds, "rows": summary}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
