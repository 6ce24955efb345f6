"""PNG plots of the benchmark results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

from bench._analysis import rolling_median  # noqa: E402

COLORS = {
    "uniform": "#9e9e9e", "static": "#8c6d31", "profiled": "#1f77b4",
    "predictive": "#2ca02c", "oracle": "#d62728",
}


def _smooth(values: Sequence[float], window: int = 5) -> list[float]:
    if len(values) < window:
        return list(values)
    med = rolling_median(values, window)
    return [med[0]] * (window // 2) + med + [med[-1]] * (len(values) - len(med) - window // 2)


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_balance(rows: Sequence[Any], series: Mapping[str, Mapping[str, Sequence[float]]], path: Path) -> None:
    """Efficiency bars per scenario and strategy, and step time over steps per strategy."""
    scenarios = list(dict.fromkeys(r.scenario for r in rows))
    strategies = list(dict.fromkeys(r.strategy for r in rows))
    eff = {(r.scenario, r.strategy): r.efficiency for r in rows}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.15, 1]})
    width = 0.8 / max(1, len(strategies))
    for j, s in enumerate(strategies):
        xs = [i + (j - (len(strategies) - 1) / 2) * width for i in range(len(scenarios))]
        ys = [eff.get((sc, s), 0.0) for sc in scenarios]
        bars = ax1.bar(xs, ys, width, label=s, color=COLORS.get(s))
        ax1.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
    ax1.axhline(0.95, color="black", lw=0.8, ls="--")
    ax1.text(len(scenarios) - 0.5, 0.955, "target 0.95", ha="right", va="bottom", fontsize=8)
    ax1.set_xticks(range(len(scenarios)), [f"speeds {s}" for s in scenarios], fontsize=8)
    ax1.set_ylabel("efficiency = oracle step time / achieved")
    ax1.set_ylim(0, 1.2)
    ax1.set_title("Steady-state efficiency, 4 CPU ranks")
    ax1.legend(fontsize=8, ncol=len(strategies), loc="upper center")

    # The most heterogeneous scenario shows the convergence best.
    pick = "1,1,0.5,0.25" if "1,1,0.5,0.25" in series else scenarios[-1]
    for s, ys in series[pick].items():
        ax2.plot(range(len(ys)), _smooth(ys), label=s, color=COLORS.get(s), lw=1.4)
    ax2.set_xlabel("step")
    ax2.set_ylabel("step time, ms (rolling median of 5)")
    ax2.set_title(f"Step time over a run, speeds {pick}")
    ax2.set_ylim(bottom=0)
    ax2.legend(fontsize=8)
    _save(fig, path)


def plot_reaction(runs: Mapping[str, Mapping[str, Any]], path: Path) -> None:
    """Step time against the moving oracle, one panel per case (up to 3 a row)."""
    cols = min(3, max(1, len(runs)))
    rows = -(-len(runs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(runs):]:
        ax.set_visible(False)
    for ax, (event, data) in zip(axes.flat, runs.items(), strict=False):
        ref = data["reference_ms"]
        ax.plot(range(len(ref)), ref, color="black", lw=1, ls="--", label="oracle (moving)")
        for s, ys in data["step_ms"].items():
            ax.plot(range(len(ys)), _smooth(ys), label=s, color=COLORS.get(s), lw=1.3)
        ax.axvline(data["event_step"], color="gray", lw=0.8, ls=":")
        ax.set_title(event)
        ax.set_xlabel("step")
        ax.set_ylabel("step time, ms (rolling median of 5)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    _save(fig, path)


def plot_capacity(results: Sequence[Any], path: Path) -> None:
    """Dashboard latency and backend CPU against the number of ranks."""
    ranks = [r.ranks for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(ranks, [r.latency_p50_ms or 0 for r in results], "o-", label="p50")
    ax1.plot(ranks, [r.latency_p99_ms or 0 for r in results], "o-", label="p99")
    ax1.axhline(500, color="black", lw=0.8, ls="--")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("ranks (10 steps/s each)")
    ax1.set_ylabel("dashboard latency, ms")
    ax1.legend()
    ax2.plot(ranks, [r.backend_cpu_pct for r in results], "o-", label="backend")
    ax2.plot(ranks, [r.generator_cpu_pct for r in results], "o-", label="load generator")
    ax2.plot(ranks, [r.dashboard_client_cpu_pct for r in results], "o-", label="dashboard client")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("ranks (10 steps/s each)")
    ax2.set_ylabel("CPU, % of one core")
    ax2.legend()
    _save(fig, path)
