"""Figure: how many examples each train user contributes (log-log histogram)."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ..io import atomic_path, read_json  # noqa: E402


def plot_contributions(stats_path: str | Path, png: str | Path, pdf: str | Path | None = None, dataset: str | None = None) -> None:
    """Plot the per-user contribution histogram of contributions.json to PNG (and PDF).

    Bins are powers of two (a log x-axis makes equal-width bins), the y-axis
    is log-scaled; the median and the 99th percentile are marked, since the
    median is the ELS heuristic for the contribution bound G and the tail is
    what that bound cuts off.
    """
    stats = read_json(stats_path)
    dataset = dataset or stats.get("dataset", "")
    freq = stats.get("frequency_train") or {}
    n = np.repeat(np.asarray(freq.get("n_examples", []), dtype=float), np.asarray(freq.get("n_users", []), dtype=int))
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=150)
    if len(n):
        top = int(np.ceil(np.log2(n.max()))) + 1
        edges = 2.0 ** np.arange(0, top + 1)
        counts, _ = np.histogram(n, bins=edges)
        ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color="#4C72B0", edgecolor="white",
               label="train users per bin")
        med = float(stats["median_train"])
        ax.axvline(med, color="#C44E52", lw=2, label=f"median = {med:g}")
        q99 = stats.get("quantiles_train", {}).get("0.99")
        if q99 is not None:
            ax.axvline(float(q99), color="#DD8452", lw=1.5, ls="--", label=f"99th percentile = {float(q99):g}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
        ax.set_xlim(0.7, edges[-1])  # a median of 1 must not sit on the axis
        ax.set_ylim(0.8, counts.max() * 2)
        ax.legend(framealpha=0.9, loc="upper right")
    else:
        ax.text(0.5, 0.5, "no train users", ha="center", va="center", transform=ax.transAxes)
    n_users = stats.get("n_users", {}).get("train", 0)
    n_ex = stats.get("n_examples", {}).get("train", 0)
    ax.set_xlabel("examples per user (log2 bins)")
    ax.set_ylabel("number of users")
    ax.set_title(f"Contributions per user: {dataset}\n{n_users:,} train users, {n_ex:,} examples")
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    for path in [png] + ([pdf] if pdf else []):
        path = Path(path)
        with atomic_path(path, suffix=path.suffix) as tmp:
            fig.savefig(tmp, format=path.suffix.lstrip("."))
    plt.close(fig)
