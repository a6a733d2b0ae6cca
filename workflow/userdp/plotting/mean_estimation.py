"""Figures of the synthetic mean-estimation study (one function per figure; see userdp.plotting.registry).

All read results/mean_estimation/results.parquet (see
userdp.experiments.mean_estimation.run_study) and plot the mean squared error
||theta_T - mu||^2 over the report seeds, with error bars of one standard
error. ELS uses G = median n_u (the study's heuristic), ULS the best G of
the sweep (chosen on tuning seeds); the diversity figure also shows ULS at
the median G, and the group-size figure shows both methods at every G.
"""

from __future__ import annotations

from typing import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from .output import legend_entries, save_figure

STYLE = {
    "els": dict(color="#1f77b4", marker="o", label="DP-SGD-ELS (G = median)"),
    "uls": dict(color="#d62728", marker="s", label="DP-SGD-ULS (best G)"),
    "uls_median": dict(color="#d62728", marker="s", linestyle="--", mfc="none", alpha=0.7,
                       label="DP-SGD-ULS (G = median)"),
}
YLABEL = r"squared error $\|\theta_T - \mu\|^2$"


def _fmt_budget(k: float) -> str:
    """1e4, 4e4, 1.6e5: compact and exact for round budgets."""
    if k < 1e4:
        return f"{int(k)}"
    e = int(np.floor(np.log10(k)))
    return f"{k / 10**e:g}e{e}"


def _stats(df: pd.DataFrame, x: str) -> pd.DataFrame:
    g = df.groupby(x)["squared_error"]
    out = g.agg(["mean", "count"])
    out["sem"] = (g.std(ddof=1) / np.sqrt(out["count"])).fillna(0.0)
    return out.reset_index().sort_values(x)


def _line(ax, df: pd.DataFrame, x: str, style: dict) -> None:
    if df.empty:
        return
    s = _stats(df, x)
    ax.errorbar(s[x], s["mean"], yerr=s["sem"], capsize=2, lw=1.5, ms=4, **style)


def _panels(df: pd.DataFrame, row: str, col: str):
    """The figure, its axes, and per panel (axes, row value, column value, the panel's rows of `df`): a row of
    panels per value of column `row`, a column per value of `col`."""
    rows, cols = sorted(df[row].unique()), sorted(df[col].unique())
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(3.3 * len(cols) + 0.6, 2.7 * len(rows) + 1.0),
                             squeeze=False)
    panels = [(axes[i, j], r, c, df[(df[row] == r) & (df[col] == c)])
              for i, r in enumerate(rows) for j, c in enumerate(cols)]
    return fig, axes, panels


def _log_axes(ax, values, title: str, fmt: Callable[[float], str] = lambda v: f"{v:g}", base: int = 10) -> None:
    """Log-log axes, x ticks exactly at the swept values, plainly labelled (no overlapping log minor labels)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    ax.set_xscale("log", base=base)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(FixedLocator(sorted(values)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt(v)))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="major", alpha=0.3)


def _finish(fig, axes, title: str, xlabel: str, out_png: str, out_pdf: str | None) -> None:
    for ax in axes[-1, :]:
        ax.set_xlabel(xlabel)
    for ax in axes[:, 0]:
        ax.set_ylabel(YLABEL)
    handles, labels = legend_entries(axes.flat)
    h = fig.get_figheight()
    # Lay out the panels first, then make room at the top for title and legend.
    fig.tight_layout()
    fig.subplots_adjust(top=1 - 1.0 / h)
    fig.suptitle(title, y=1.0 - 0.02 / h, fontsize=11)
    fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 4), frameon=False,
               bbox_to_anchor=(0.5, 1.0 - 0.45 / h), fontsize=9)
    save_figure(fig, out_png, *([out_pdf] if out_pdf else []))


def _setting(df: pd.DataFrame) -> str:
    r = df.iloc[0]
    return (f"d = {int(r['dimension'])}, N = {int(r['n_users'])} users, median n_u = {int(r['median_contributions'])}, "
            f"tau = {r['inter_user_spread']:g}, C = {r['clip_norm']:g}, delta = {r['delta']:.1e}, "
            f"{df['seed'].nunique()} seeds (mean ± s.e.)")


def _chosen(df: pd.DataFrame, method: str) -> pd.DataFrame:
    return df[(df["method"] == method) & df["chosen"]]


def plot_vs_epsilon(results: pd.DataFrame, out_png: str, out_pdf: str | None = None) -> None:
    """Error vs epsilon; rows: compute budget, columns: diversity s."""
    fig, axes, panels = _panels(results, "compute_budget", "diversity")
    for ax, k, s, cell in panels:
        for m in ("els", "uls"):
            _line(ax, _chosen(cell, m), "epsilon", STYLE[m])
        _log_axes(ax, results["epsilon"].unique(), f"K = {_fmt_budget(k)}, s = {s:g}")
    _finish(fig, axes, f"Mean estimation: error vs privacy budget ε\n{_setting(results)}",
            "user-level ε", out_png, out_pdf)


def plot_vs_diversity(results: pd.DataFrame, out_png: str, out_pdf: str | None = None) -> None:
    """Error vs intra-user diversity s; rows: compute budget, columns: epsilon."""
    med = int(results["median_contributions"].iloc[0])
    fig, axes, panels = _panels(results, "compute_budget", "epsilon")
    for ax, k, e, cell in panels:
        for m in ("els", "uls"):
            _line(ax, _chosen(cell, m), "diversity", STYLE[m])
        _line(ax, cell[(cell["method"] == "uls") & (cell["group_size"] == med)], "diversity", STYLE["uls_median"])
        _log_axes(ax, results["diversity"].unique(), f"K = {_fmt_budget(k)}, ε = {e:g}")
    _finish(fig, axes, f"Mean estimation: error vs intra-user diversity s\n{_setting(results)}",
            "intra-user diversity s", out_png, out_pdf)


def plot_vs_budget(results: pd.DataFrame, out_png: str, out_pdf: str | None = None) -> None:
    """Error vs compute budget K; rows: epsilon, columns: diversity s."""
    fig, axes, panels = _panels(results, "epsilon", "diversity")
    for ax, e, s, cell in panels:
        for m in ("els", "uls"):
            _line(ax, _chosen(cell, m), "compute_budget", STYLE[m])
        _log_axes(ax, results["compute_budget"].unique(), f"ε = {e:g}, s = {s:g}", _fmt_budget)
    _finish(fig, axes, f"Mean estimation: error vs compute budget K\n{_setting(results)}",
            "compute budget K (per-example gradients)", out_png, out_pdf)


def plot_vs_group_size(results: pd.DataFrame, out_png: str, out_pdf: str | None = None,
                       epsilon: float | None = None) -> None:
    """Error vs contribution bound G at one epsilon (default: ELS's sweep epsilon); rows: budget, columns: s.

    Both methods at every G of the sweep; the dotted line marks ELS's median
    heuristic and the star ULS's chosen G (picked on the tuning seeds).
    """
    if epsilon is None:
        # The epsilon where ELS ran the whole sweep (the most Gs per method).
        per_eps = results[results["method"] == "els"].groupby("epsilon")["group_size"].nunique()
        eps = float(per_eps.idxmax()) if len(per_eps) else float(sorted(results["epsilon"].unique())[0])
    else:
        eps = epsilon
    df = results[results["epsilon"] == eps]
    med = int(df["median_contributions"].iloc[0])
    fig, axes, panels = _panels(df, "compute_budget", "diversity")
    for ax, k, s, cell in panels:
        for m, label in (("els", "DP-SGD-ELS"), ("uls", "DP-SGD-ULS")):
            style = {**STYLE[m], "label": label}
            _line(ax, cell[cell["method"] == m], "group_size", style)
        best = _chosen(cell, "uls")
        if not best.empty:
            st = _stats(best, "group_size")
            ax.plot(st["group_size"], st["mean"], marker="*", ms=13, color="#d62728", mec="k", ls="none",
                    label="ULS: G chosen on tuning seeds")
        ax.axvline(med, color="#1f77b4", ls=":", lw=1.2, label=f"ELS heuristic G = median = {med}")
        _log_axes(ax, df["group_size"].unique(), f"K = {_fmt_budget(k)}, s = {s:g}", lambda v: f"{int(v)}", base=2)
    _finish(fig, axes, f"Mean estimation: error vs contribution bound G at ε = {eps:g}\n{_setting(df)}",
            "contribution bound G (examples per user)", out_png, out_pdf)
