"""Figure: how many examples each train user contributes (log-log histogram).

From the exact counts of contributions.json by default; with DP contribution
statistics (`privacy.contribution_stats.private`) from the DP release
(contributions_dp.json) alone, post-processed as the G rules read it, so the
figure shows no exact statistic of the train users' counts.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from ..io import read_json
from .output import save_figure


def plot_contributions(stats_path: str | Path, png: str | Path, pdf: str | Path | None = None, dataset: str | None = None,
                       release: str | Path | None = None) -> None:
    """Plot the per-user contribution histogram of contributions.json to PNG (and PDF).

    Bins are powers of two (a log x-axis makes equal-width bins), the y-axis
    is log-scaled; the median and the 99th percentile are marked, since the
    median is the ELS heuristic for the contribution bound G and the tail is
    what that bound cuts off. With `release` (the DP histogram's file) the
    bars are its noisy counts as the G rules read them (rounded, clipped at 0)
    and the marks are its quantiles (bin lower edges): `_plot_release`.
    """
    stats = read_json(stats_path)
    dataset = dataset or stats.get("dataset", "")
    if release is not None:
        _plot_release(stats, release, png, pdf, dataset)
        return
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
        _log_axes(ax, edges[-1], counts.max() * 2)
    else:
        ax.text(0.5, 0.5, "no train users", ha="center", va="center", transform=ax.transAxes)
    n_users = stats.get("n_users", {}).get("train", 0)
    n_ex = stats.get("n_examples", {}).get("train", 0)
    _finish(fig, ax, "number of users",
            f"Contributions per user: {dataset}\n{n_users:,} train users, {n_ex:,} examples", png, pdf)


def _plot_release(stats: dict, release: str | Path, png: str | Path, pdf: str | Path | None, dataset: str) -> None:
    """The DP histogram of the counts (post-processing of the release; no exact statistic enters the figure).

    The title names the number of train users (public) and eps_stats; the
    example total and the exact quantiles are not drawn.
    """
    from ..privacy.contribution_stats import NoisyHistogram

    hist = NoisyHistogram.from_release(read_json(release), str(release))
    weights, edges = hist.weights, hist.lower_edges.astype(float)
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=150)
    if hist.total > 0:
        last = int(np.flatnonzero(weights > 0)[-1])
        widths = edges[: last + 1]  # bin [2^k, 2^(k+1)) has width 2^k
        ax.bar(edges[: last + 1], weights[: last + 1], width=widths, align="edge", color="#8172B3",
               edgecolor="white", label="train users per bin (DP, noisy)")
        med, q99 = hist.median_group_size(), hist.quantile(0.99)
        ax.axvline(med, color="#C44E52", lw=2, label=f"noisy median bin from {med:g}")
        ax.axvline(q99, color="#DD8452", lw=1.5, ls="--", label=f"noisy 99th percentile bin from {q99:g}")
        _log_axes(ax, edges[last] * 2, weights.max() * 2)
    else:
        ax.text(0.5, 0.5, "empty noisy histogram", ha="center", va="center", transform=ax.transAxes)
    n_users = stats.get("n_users", {}).get("train", 0)
    _finish(fig, ax, "number of users (noisy)", f"Contributions per user: {dataset}\n{n_users:,} train users; DP "
            f"histogram, \u03b5_stats = {hist.epsilon:g}", png, pdf)


def _log_axes(ax, x_max: float, y_max: float) -> None:
    """Log2 x axis (plain numbers) from below 1, log y axis from below 1, and the legend."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.set_xlim(0.7, x_max)  # a median of 1 must not sit on the axis
    ax.set_ylim(0.8, y_max)
    ax.legend(framealpha=0.9, loc="upper right")


def _finish(fig, ax, ylabel: str, title: str, png: str | Path, pdf: str | Path | None) -> None:
    ax.set_xlabel("examples per user (log2 bins)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    save_figure(fig, png, *([pdf] if pdf else []))
