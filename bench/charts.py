"""Draw ``bench/results/*.png`` from the JSON ``make bench`` wrote (``bench/run_all.py``); measures nothing.

    .venv/bin/python bench/charts.py    # after make bench, or to redraw

One chart per benchmark whose JSON is there: ingest (throughput and p99
against concurrency, beside the bare and INSERT-only baselines), drain (rows/s
against consumer count, the compensator beside it), charges (the distribution
of creation-to-Succeeded latency with and without faults, the direct loop
beside it), reconcile (lines/s and peak RSS against file size, the parse-only
baseline beside it) and chaos (open payments against seconds, kills marked).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
COLOURS = {"bare": "#999999", "insert": "#4c72b0", "gateway": "#dd8452", "before": "#c44e52"}


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _subtitle(fig: plt.Figure) -> None:
    info = _load("machine") or {}
    text = (
        f"{info.get('date', '?')} · {info.get('cores', '?')} cores, {info.get('memory_gib', '?')} GiB · "
        f"MariaDB {info.get('mariadb', '?')} · RabbitMQ {info.get('rabbitmq', '?')} · Python {info.get('python', '?')}"
        + (" · QUICK" if info.get("quick") else "")
    )
    fig.text(0.5, 0.005, text, ha="center", va="bottom", fontsize=7, color="#555555")


def _save(fig: plt.Figure, name: str) -> None:
    _subtitle(fig)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(RESULTS / f"{name}.png", dpi=110)
    plt.close(fig)
    print(f"bench/results/{name}.png")


def ingest(doc: dict) -> None:
    rows = doc["summary"]
    conc = [r["concurrency"] for r in rows]
    apps = [a for a in ("bare", "insert", "gateway", "before") if a in rows[0]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for app in apps:
        label = {"insert": "INSERT-only", "gateway": "gateway", "bare": "bare Flask", "before": "gateway (before)"}[app]
        left.plot(conc, [r[app]["rps"] for r in rows], "o-", label=label, color=COLOURS[app])
        right.plot(conc, [r[app]["p99_ms"] for r in rows], "o-", label=label, color=COLOURS[app])
    for r in rows:
        if "gateway/insert" in r:
            left.annotate(f"{r['gateway/insert']:.2f}×", (r["concurrency"], r["gateway"]["rps"]), fontsize=8)
    left.set(
        xscale="log", xlabel="connections (wrk)", ylabel="callbacks/s", title="Ingest throughput (gateway/INSERT-only)"
    )
    right.set(xscale="log", yscale="log", xlabel="connections (wrk)", ylabel="p99 ms", title="Ingest p99 latency")
    for ax in (left, right):
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    _save(fig, "ingest")


def drain(doc: dict) -> None:
    summary = doc["summary"]
    consumers = sorted(
        (int(m.group(1)), v["rows_per_s"]) for k, v in summary.items() if (m := re.fullmatch(r"consumer x(\d+)", k))
    )
    before = sorted(
        (int(m.group(1)), v["rows_per_s"])
        for k, v in summary.items()
        if (m := re.fullmatch(r"before consumer x(\d+)", k))
    )
    compensator = [(k, v["rows_per_s"]) for k, v in summary.items() if k.startswith("compensator")]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    xs = [c for c, _ in consumers]
    ax.plot(xs, [r for _, r in consumers], "o-", color=COLOURS["gateway"], label="consumers (python -m consumer)")
    if before:
        ax.plot(
            [c for c, _ in before], [r for _, r in before], "o--", color=COLOURS["before"], label="consumers (before)"
        )
    for c, r in consumers:
        ax.annotate(f"{r:.0f}/s", (c, r), textcoords="offset points", xytext=(4, 4), fontsize=8)
    for name, rate in compensator:
        ax.axhline(rate, color=COLOURS["insert"], ls=":", label=f"one {name} ({rate:.0f}/s)")
    ax.axhline(1000, color="#55a868", ls="-.", lw=1, label="target 1,000/s with 2 consumers")
    ax.set(xlabel="consumer processes", ylabel="rows/s (full effect each)", title="Drain rate against consumer count")
    ax.set_xticks(xs, [str(c) for c in xs])
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(fig, "drain")


def charges(doc: dict) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    series = [("direct loop (one call)", doc["direct"], COLOURS["bare"])]
    series.append(("paysync, no faults", doc["paysync"], COLOURS["gateway"]))
    if doc.get("faulted"):
        series.append(("paysync, 15% of calls held 8 s", doc["faulted"], COLOURS["before"]))
    for label, run, colour in series:
        values = sorted(run["latencies_ms"])
        n = len(values)
        ax.plot(values, [(i + 1) / n for i in range(n)], color=colour, label=f"{label}: {run['per_second']:.0f}/s")
    ratio = doc["ratio"]
    ax.set(
        xscale="log",
        xlabel="ms from creation to Succeeded (direct: one call)",
        ylabel="share of payments",
        title=f"Charge latency (CDF); throughput paysync/direct {ratio:.2f}×",
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(fig, "charges")


def reconcile(doc: dict) -> None:
    results = doc["results"]
    sizes = [r["size"] for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(
        sizes,
        [r["size"] / r["reconcile"]["seconds"] for r in results],
        "o-",
        color=COLOURS["gateway"],
        label="reconcile",
    )
    left.plot(
        sizes, [r["size"] / r["baseline"]["seconds"] for r in results], "o--", color=COLOURS["bare"], label="parse only"
    )
    left.axhline(20000, color="#55a868", ls="-.", lw=1, label="target 20,000/s")
    right.plot(
        sizes, [r["reconcile"]["rss_kib"] / 1024 for r in results], "o-", color=COLOURS["gateway"], label="reconcile"
    )
    right.plot(
        sizes, [r["baseline"]["rss_kib"] / 1024 for r in results], "o--", color=COLOURS["bare"], label="parse only"
    )
    left.set(xscale="log", yscale="log", xlabel="settlement file lines", ylabel="lines/s", title="Reconciliation rate")
    right.set(xscale="log", xlabel="settlement file lines", ylabel="peak RSS MiB", title="Reconciliation peak memory")
    right.set_ylim(bottom=0)
    for ax in (left, right):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    _save(fig, "reconcile")


def chaos(doc: dict) -> None:
    series = [s for s in doc.get("timeseries") or [] if "open" in s]  # samples while MariaDB was down have none
    if not series:
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot([s["t"] for s in series], [s["open"] for s in series], color=COLOURS["gateway"], label="open payments")
    seen = set()
    for kill in doc.get("kills", []):
        kind = kill.get("kind", "kill")
        ax.axvline(
            kill["at"],
            color="#c44e52" if kind in ("mariadb", "rabbitmq") else "#999999",
            lw=0.7,
            alpha=0.6,
            label=None if kind in seen else f"kill: {kind}",
        )
        seen.add(kind)
    if doc.get("converged_at"):
        ax.axvline(doc["converged_at"], color="#55a868", ls="--", label=f"converged at {doc['converged_at']:.0f} s")
    ax.set(
        xlabel="seconds since start",
        ylabel="payments not yet terminal",
        title=f"Chaos run: convergence ({doc.get('args', {}).get('payments', '?')} payments, "
        f"{'every invariant held' if doc.get('ok') else 'INVARIANTS VIOLATED'})",
    )
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    _save(fig, "chaos")


def main() -> int:
    drawn = 0
    for name, draw in (
        ("ingest", ingest),
        ("drain", drain),
        ("charges", charges),
        ("reconcile", reconcile),
        ("chaos", chaos),
    ):
        doc = _load(name)
        if doc is not None:
            draw(doc)
            drawn += 1
    if not drawn:
        print("no bench/results/<name>.json yet: run make bench first", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
