#!/usr/bin/env python3
"""Draws the charts of docs/benchmarks.md from the raw output kept in docs/data/.

    scripts/charts.py [DATA_DIR=docs/data] [OUT_DIR=docs/img]

Reads, from DATA_DIR:
  bench-*.json  one `sagabox bench --json` report per file (one JSON object); each
                becomes one group of bars: every mode's throughput as a ratio of the
                `raw_sql` baseline of the same run (`ratio_to_raw`).
  soak-*.csv    the output of scripts/soak.sh (its CSV lines; the demo's JSON summary
                after them is skipped): sagas finished per second and resident memory
                over the run's elapsed time.
  saga-bench.json  one `sagabox bench-saga --json` report: each mode's sagas per second
                at full load, run by run with its ratio to the floor of the same run,
                and its commits per saga at full load and paced.
Writes OUT_DIR/bench-ratios.svg, OUT_DIR/soak-<name>.svg for each soak file and
OUT_DIR/saga-bench.svg.

Needs Python 3 and matplotlib (`pip install matplotlib`); nothing else. The SVGs carry
no date and fixed element ids, so drawing them again from the same data changes nothing.
"""

import csv
import json
import sys
from pathlib import Path

try:
    import matplotlib
except ImportError:
    sys.exit("scripts/charts.py needs matplotlib: pip install matplotlib")

matplotlib.use("svg")
matplotlib.rcParams["svg.hashsalt"] = "sagabox"  # stable element ids between runs
matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: smaller, searchable
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

SVG_METADATA = {"Date": None, "Creator": "scripts/charts.py (matplotlib)"}

MODES = ["raw_sql", "guard", "actor", "batched", "batched_set", "no_inbox"]


def bench_label(report, path):
    """What distinguishes one bench run from another: its database and workload."""
    database = "SQLite" if report["database"].startswith("sqlite") else "PostgreSQL"
    workload = []
    if report.get("claim_only"):
        workload.append("claim only")
    if report.get("with_result"):
        workload.append("with result")
    if report.get("timeless"):
        workload.append("timeless")
    if report.get("duplicate_rate"):
        workload.append(f"{report['duplicate_rate']:.0%} duplicates")
    messages = max((mode["messages"] for mode in report["modes"]), default=0)
    detail = ", ".join(workload or ["full workload"])
    return f"{database}, {detail}\n{messages:,} msgs/mode, {report['rounds']} rounds ({path.stem})"


def draw_bench(files, out):
    reports = [(path, json.loads(path.read_text())) for path in files]
    # The full workload on PostgreSQL first, then SQLite, then the variants.
    reports.sort(
        key=lambda pr: (
            bool(pr[1].get("claim_only")),
            bool(pr[1].get("duplicate_rate")),
            bool(pr[1].get("timeless")),
            bool(pr[1].get("with_result")),
            pr[1]["database"].startswith("sqlite"),
            pr[0].name,
        )
    )
    modes = [m for m in MODES if any(m == r["mode"] for _, rep in reports for r in rep["modes"])]
    width = 0.8 / max(len(reports), 1)
    fig, ax = plt.subplots(figsize=(10.5, 5.8))
    for i, (path, report) in enumerate(reports):
        by_mode = {mode["mode"]: mode for mode in report["modes"]}
        xs, ys = [], []
        for j, mode in enumerate(modes):
            if mode in by_mode:
                xs.append(j + (i - (len(reports) - 1) / 2) * width)
                ys.append(by_mode[mode]["ratio_to_raw"])
        bars = ax.bar(xs, ys, width, label=bench_label(report, path))
        # raw_sql is 1 by definition: label only the others.
        labels = [
            "" if mode == "raw_sql" else f"{by_mode[mode]['ratio_to_raw']:.2f}"
            for mode in modes
            if mode in by_mode
        ]
        ax.bar_label(bars, labels=labels, fontsize=6.5, padding=2)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(modes)), modes)
    ax.set_ylabel("throughput ÷ raw_sql of the same run")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.set_title("sagabox bench: each mode against hand-written SQL, same run, same database")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    fig.tight_layout()
    fig.savefig(out, metadata=SVG_METADATA)
    plt.close(fig)


def read_soak(path):
    """The CSV rows of a soak.sh output, as numbers; anything else is skipped."""
    rows = []
    with path.open(newline="") as text:
        for fields in csv.reader(text):
            if len(fields) != 6 or not fields[0].isdigit():
                continue
            elapsed, finished, rate, rss_kb = (int(f) for f in fields[:4])
            if rss_kb == 0:
                # The demo had ended before this sample: a partial interval, no process.
                continue
            rows.append((elapsed, finished, rate, rss_kb / 1024, fields[4], fields[5]))
    if not rows:
        sys.exit(f"{path}: no soak.sh CSV rows (elapsed_s,finished,sagas_per_s,rss_kb,…)")
    return rows


def draw_soak(path, out):
    rows = read_soak(path)
    elapsed = [r[0] for r in rows]
    fig, (rate_ax, rss_ax) = plt.subplots(2, 1, sharex=True, figsize=(9, 5.4))
    rate_ax.plot(elapsed, [r[2] for r in rows], marker=".", color="tab:blue")
    rate_ax.set_ylabel("sagas finished / s")
    rate_ax.set_ylim(bottom=0)
    rate_ax.grid(alpha=0.3)
    # A new oldest month means the pruner dropped one: mark where it happened.
    for before, after in zip(rows, rows[1:]):
        if after[4] != before[4] and before[4]:
            for ax in (rate_ax, rss_ax):
                ax.axvline(after[0], color="grey", linewidth=0.6, linestyle=":")
    rss_ax.plot(elapsed, [r[3] for r in rows], marker=".", color="tab:red")
    rss_ax.set_ylabel("resident memory, MiB")
    rss_ax.set_ylim(0, max(r[3] for r in rows) * 1.15)
    rss_ax.set_xlabel("elapsed, s (dotted: the pruner dropped the oldest month)")
    rss_ax.grid(alpha=0.3)
    rate_ax.set_title(
        f"soak ({path.stem}): {rows[-1][1]:,} sagas finished at the last sample, {rows[-1][0]} s"
    )
    fig.tight_layout()
    fig.savefig(out, metadata=SVG_METADATA)
    plt.close(fig)


def draw_saga_bench(path, out):
    report = json.loads(path.read_text())
    runs = report["runs"]
    modes = list(dict.fromkeys(run["mode"] for run in runs))
    full = [run for run in runs if run["load"] == "full"]
    paced = [run for run in runs if run["load"] != "full"]
    numbers = sorted({run["run"] for run in full})
    fig, (rate_ax, commit_ax) = plt.subplots(
        1, 2, figsize=(11, 4.6), gridspec_kw={"width_ratios": [3, 2]}
    )
    width = 0.8 / max(len(numbers), 1)
    for i, number in enumerate(numbers):
        by_mode = {run["mode"]: run for run in full if run["run"] == number}
        xs = [j + (i - (len(numbers) - 1) / 2) * width for j, mode in enumerate(modes) if mode in by_mode]
        ys = [by_mode[mode]["sagas_per_sec"] for mode in modes if mode in by_mode]
        bars = rate_ax.bar(xs, ys, width, label=f"run {number}")
        labels = [
            "floor" if by_mode[mode]["ratio_to_floor"] is None else f"{by_mode[mode]['ratio_to_floor']:.2f}×"
            for mode in modes
            if mode in by_mode
        ]
        rate_ax.bar_label(bars, labels=labels, fontsize=6.5, padding=2)
    rate_ax.set_xticks(range(len(modes)), modes)
    rate_ax.set_ylabel("sagas / s at full load (label: × the floor of the same run)")
    rate_ax.legend(fontsize=8)
    rate_ax.grid(axis="y", alpha=0.3)
    for k, (load, rows, colour) in enumerate(
        [("full load", full, "tab:blue"), ("paced", paced, "tab:orange")]
    ):
        values = [
            sum(run["commits_per_saga"] for run in rows if run["mode"] == mode)
            / max(sum(1 for run in rows if run["mode"] == mode), 1)
            for mode in modes
        ]
        bars = commit_ax.bar([j + (k - 0.5) * 0.4 for j in range(len(modes))], values, 0.4, label=load, color=colour)
        commit_ax.bar_label(bars, labels=[f"{v:.1f}" for v in values], fontsize=7, padding=2)
    commit_ax.set_xticks(range(len(modes)), modes)
    commit_ax.set_ylabel("commits per saga (mean of the runs)")
    commit_ax.set_ylim(0, max(run["commits_per_saga"] for run in runs) * 1.3)
    commit_ax.legend(fontsize=8, loc="upper center", ncol=2)
    commit_ax.grid(axis="y", alpha=0.3)
    fig.suptitle(
        f"sagabox bench-saga: the checkout saga, {report['orders']:,} at concurrency "
        f"{report['concurrency']} and {report['paced_orders']:,} paced at {report['paced_rate']:g}/s"
    )
    fig.tight_layout()
    fig.savefig(out, metadata=SVG_METADATA)
    plt.close(fig)


def main():
    data = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/data")
    out = Path(sys.argv[2] if len(sys.argv) > 2 else "docs/img")
    out.mkdir(parents=True, exist_ok=True)
    bench = sorted(data.glob("bench-*.json"))
    soaks = sorted(data.glob("soak-*.csv"))
    saga_bench = data / "saga-bench.json"
    if not bench and not soaks and not saga_bench.exists():
        sys.exit(f"nothing to draw in {data}: expected bench-*.json, soak-*.csv or saga-bench.json")
    if bench:
        draw_bench(bench, out / "bench-ratios.svg")
        print(out / "bench-ratios.svg")
    for soak in soaks:
        target = out / f"{soak.stem}.svg"
        draw_soak(soak, target)
        print(target)
    if saga_bench.exists():
        draw_saga_bench(saga_bench, out / "saga-bench.svg")
        print(out / "saga-bench.svg")


if __name__ == "__main__":
    main()
