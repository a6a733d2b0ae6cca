"""Figures of who pays for privacy (from results/summary/{dataset}/groups.parquet and users.parquet only).

- `cost_by_group`: the cost of privacy (loss minus the non-private reference's, nats/token) per user group,
  ELS and ULS bars side by side with their 95% bootstrap intervals, one panel per group kind and epsilon
  (the largest compute budget);
- `gap_vs_examples`: each held-out test user's loss gap against the user's number of examples (log scale),
  a point per user (synthetic datasets by default: groups.per_user_points) and a smoothed line (running
  mean over users ordered by their count) per method, one panel per epsilon, G marked.

Conventions as userdp.plotting.lm (ELS blue, ULS orange; the ε shown is the released model's guarantee,
said in a footnote from the summary).
"""

from __future__ import annotations

import textwrap
from typing import Mapping

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from ..evaluation.groups import GROUP_COLUMNS, users_group_size
from .lm import METHODS, SHORT, _eps_label, _legend_below, footnotes

COST_LABEL = "cost of privacy: loss − non-private loss\n(nats/token, mean over the group's test users)"
GAP_LABEL = "user's loss − non-private loss (nats/token)"
KIND_TITLES = {"contribution": "contribution size", "topic": "topic (synthetic.topic_weights)",
               "label": "label (group_column)"}


def _empty(dataset: str, why: str) -> Figure:
    fig, ax = plt.subplots(figsize=(6, 3), layout="constrained")
    ax.axis("off")
    ax.text(0.5, 0.5, why, ha="center", va="center", wrap=True)
    fig.suptitle(f"{dataset}: who pays for privacy", fontsize=11)
    return fig


def cost_by_group(groups: pd.DataFrame, summary: pd.DataFrame, dataset: str) -> Figure:
    """Cost of privacy per group: ELS and ULS bars with 95% intervals; panels: group kind x epsilon."""
    cost = groups[groups["measure"] == "cost"]
    if cost.empty:
        return _empty(dataset, "no private cell with its non-private reference (grid.nonprivate: true needed)")
    budget = int(cost["budget"].max())
    cost = cost[cost["budget"] == budget]
    kinds = [k for k in GROUP_COLUMNS if k in set(cost["group_kind"])]
    eps = sorted(cost["epsilon"].unique())
    fig, axes = plt.subplots(len(kinds), len(eps), figsize=(4.6 * len(eps), 3.8 * len(kinds)), squeeze=False,
                             sharey="row", layout="constrained")
    methods = [m for m in METHODS if m in set(cost["method"])]
    width = 0.8 / max(1, len(methods))
    for r, kind in enumerate(kinds):
        for c, e in enumerate(eps):
            ax = axes[r, c]
            sub = cost[(cost["group_kind"] == kind) & (cost["epsilon"] == e)]
            names = sub.sort_values("group_order").drop_duplicates("group")
            x = np.arange(len(names))
            for i, m in enumerate(methods):
                rows = sub[sub["method"] == m].set_index("group").reindex(names["group"])
                y = rows["cost"].to_numpy(dtype=float)
                lo = np.nan_to_num(y - rows["cost_low"].to_numpy(dtype=float), nan=0.0)
                hi = np.nan_to_num(rows["cost_high"].to_numpy(dtype=float) - y, nan=0.0)
                ax.bar(x + (i - (len(methods) - 1) / 2) * width, y, width, yerr=[lo, hi], capsize=3,
                       color=METHODS[m]["color"], alpha=0.85, label=METHODS[m]["label"])
            ax.axhline(0, color="0.3", linewidth=0.8)
            ax.set_xticks(x)
            ax.set_xticklabels([f"{textwrap.fill(str(g), 12)}\n(n = {n})" for g, n in zip(names["group"], names["n_users"])],
                               fontsize=8)
            ax.set_title(f"{KIND_TITLES.get(kind, kind)}, {_eps_label(float(e))}", fontsize=10)
            ax.grid(True, axis="y", alpha=0.3)
            if c == 0:
                ax.set_ylabel(COST_LABEL, fontsize=9)
    _legend_below(fig)
    n_seeds = int(cost["n_seeds"].max())
    fig.suptitle(f"{dataset}: cost of privacy per user group (K = {budget:,}; 95% bootstrap intervals over users "
                 f"and {n_seeds} seed(s); no bar: group below groups.min_users)", fontsize=11)
    return footnotes(fig, summary)


def running_mean(x: np.ndarray, y: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """The running mean of `y` over `window` neighbours in the order of `x` (ties kept in input order), at the
    mean `x` of each window (centred; shorter windows at the ends)."""
    order = np.argsort(x, kind="stable")
    xs = pd.Series(np.asarray(x, dtype=float)[order])
    ys = pd.Series(np.asarray(y, dtype=float)[order])
    w = max(1, int(window))
    return (xs.rolling(w, center=True, min_periods=1).mean().to_numpy(),
            ys.rolling(w, center=True, min_periods=1).mean().to_numpy())


def gap_vs_examples(users: pd.DataFrame, summary: pd.DataFrame, dataset: str,
                    points: Mapping[str, bool] | None = None) -> Figure:
    """Each test user's loss gap to the non-private reference vs the user's examples; one panel per epsilon at the
    largest budget; points (where `points[dataset]`) and a running mean per method; G marked."""
    fine = users[(users["model"] == "fine-tuned") & ~users["is_group_sweep"].astype(bool)]
    ref = fine[np.isinf(fine["epsilon"].astype(float))]
    priv = fine[np.isfinite(fine["epsilon"].astype(float))]
    if priv.empty or ref.empty:
        return _empty(dataset, "no private cell with its non-private reference (grid.nonprivate: true needed)")
    budget = int(priv["budget"].max())
    priv, ref = priv[priv["budget"] == budget], ref[ref["budget"] == budget]
    keys = ["method", "budget", "seed", "user_id"]
    merged = priv.merge(ref[keys + ["loss"]], on=keys, suffixes=("", "_ref"))
    merged["gap"] = merged["loss"] - merged["loss_ref"]
    per_user = merged.groupby(["method", "epsilon", "user_id"], as_index=False).agg(
        gap=("gap", "mean"), n_examples=("n_examples", "first"))
    show_points = bool((points or {}).get(dataset, False))
    eps = sorted(per_user["epsilon"].unique())
    fig, axes = plt.subplots(1, len(eps), figsize=(5.2 * len(eps), 4.4), squeeze=False, sharey=True,
                             layout="constrained")
    g = users_group_size(users)
    for ax, e in zip(axes.flat, eps):
        sub = per_user[per_user["epsilon"] == e]
        for m in [m for m in METHODS if m in set(sub["method"])]:
            s = sub[sub["method"] == m]
            st = METHODS[m]
            if show_points:
                ax.scatter(s["n_examples"], s["gap"], s=9, alpha=0.35, color=st["color"], marker=st["marker"],
                           linewidths=0, label=f"{SHORT[m]}: one test user")
            xs, ys = running_mean(s["n_examples"].to_numpy(), s["gap"].to_numpy(), max(5, len(s) // 8))
            ax.plot(xs, ys, color=st["color"], linestyle=st["linestyle"], linewidth=2,
                    label=f"{SHORT[m]}: running mean over {max(5, len(s) // 8)} users")
        if g is not None:
            ax.axvline(g, color="0.35", linestyle=":", linewidth=1.2, label=f"G = {g} (ELS bound)")
        ax.axhline(0, color="0.3", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("the test user's examples (log scale)")
        ax.set_title(_eps_label(float(e)), fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[0, 0].set_ylabel(GAP_LABEL)
    _legend_below(fig)
    what = "points: one held-out test user each" if show_points else "per-user points withheld (groups.per_user_points)"
    fig.suptitle(f"{dataset}: cost of privacy vs contribution (K = {budget:,}; {what})", fontsize=11)
    return footnotes(fig, summary)

