"""The audit figures: empirical user-level epsilon lower bound vs claimed epsilon.

`empirical_vs_claimed` draws the black-box membership audit of released models
from its summary (userdp.evaluation.audit_report.summary_rows); `mechanism_vs_claimed`
draws the white-box audit of the mechanism from results/audit/{dataset}/
mechanism.csv (userdp.evaluation.mechanism_audit). Both plot, for each
cell the (epsilon, delta) one-run bound (filled) and, where the summary has
it, the Gaussian f-DP bound (hollow), with both ceilings. Points
on or below the y = x line agree with the claims; a private cell above it
would contradict its guarantee. The non-private references (claimed
epsilon = inf) sit at the right edge, on their own tick.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from .lm import SHORT, _method_order, _style

EMPIRICAL_LABEL = "user-level ε lower bound, 95% (filled: (ε, δ); hollow: f-DP)"
CLAIMED_LABEL = "claimed ε of the audited run (ledger)"


def empirical_vs_claimed(summary: pd.DataFrame, dataset: str | None = None) -> Figure:
    """Scatter of the black-box audit's lower bound against the claimed epsilon, per method, with the y = x line."""
    m = int(summary["canaries"].iloc[0]) if len(summary) else 0
    return _bounds_vs_claimed(summary, f"user-level membership audit ({m} canary users, one run per cell)", dataset)


def mechanism_vs_claimed(mechanism: pd.DataFrame, dataset: str | None = None) -> Figure:
    """The same scatter for the white-box audit of the mechanism (one point per method, epsilon and process count).

    Every privatised update is released in this threat model (DP-SGD's own analysis), so a bound above
    the claim would mean the engine or its accounting is broken; with several process counts in the table
    each gets its own label (the points of one cell are shifted apart, not merged).
    """
    df = mechanism.copy()
    m = int(df["canaries"].iloc[0]) if len(df) else 0
    if "processes" in df and df["processes"].nunique() > 1:
        df["series"] = [f"{SHORT.get(meth, meth)}, {int(p)} process{'es' if int(p) > 1 else ''}"
                        for meth, p in zip(df["method"], df["processes"])]
    return _bounds_vs_claimed(df, f"white-box audit of the mechanism\n({m} Dirac canary users, "
                                  "every privatised update released)", dataset)


def _bounds_vs_claimed(table: pd.DataFrame, heading: str, dataset: str | None) -> Figure:
    df = table.copy()
    claimed = df["epsilon_claimed"].astype(float).to_numpy()
    finite = claimed[np.isfinite(claimed)]
    shown = [df[c].astype(float) for c in ("epsilon_lower_bound", "epsilon_lower_bound_fdp",
                                            "epsilon_lower_bound_fdp_ceiling") if c in df]
    top = max([1.0, *finite.tolist(), *[float(v) for col in shown for v in col if np.isfinite(v)]])
    inf_x = top * 1.35  # where the non-private references are drawn
    fig, ax = plt.subplots(figsize=(6.4, 5.0))
    ax.plot([0, top * 1.1], [0, top * 1.1], color="0.4", linestyle=":", linewidth=1.2,
            label="y = x (bound equals the claim)")
    # a series per method, or per method and process count where the table has a `series` column
    if "series" not in df:
        df["series"] = [SHORT.get(m, m) for m in df["method"]]
    order = [(m, s) for m in _method_order(df["method"].unique())
             for s in dict.fromkeys(df.loc[df["method"] == m, "series"])]
    for i, (method, series) in enumerate(order):
        sub = df[(df["method"] == method) & (df["series"] == series)]
        st = dict(_style(method))
        if sum(1 for m, _ in order if m == method) > 1 and series != next(s for m, s in order if m == method):
            st["marker"] = "D"  # the second process count of the same method
        # methods side by side around their claimed epsilon, so equal points stay visible
        shift = (i - (len(order) - 1) / 2) * 0.03 * inf_x
        x = np.where(np.isinf(sub["epsilon_claimed"].astype(float)), inf_x, sub["epsilon_claimed"].astype(float))
        x = x + shift
        y = sub["epsilon_lower_bound"].astype(float).to_numpy()
        name = series
        if "likelihood_ratio_auc" in sub:
            name += " (likelihood-ratio AUC " + ", ".join(f"{a:.2f}" for a in sub["likelihood_ratio_auc"].astype(float)) + ")"
        ax.scatter(x, y, color=st["color"], marker=st["marker"], s=60, zorder=3, label=name)
        label_points = len(order) <= 2  # with more series the numbers overlap: they are in the table
        for xi, yi in zip(x, y) if label_points else ():
            ax.annotate(f"{yi:.2f}", (xi, yi), textcoords="offset points", xytext=(-28 if i == 0 else 6, 4), fontsize=8,
                        color=st["color"])
        # the Gaussian f-DP bound of the same guesses, hollow, where the summary has it
        fdp = sub["epsilon_lower_bound_fdp"].astype(float).to_numpy() if "epsilon_lower_bound_fdp" in sub else []
        if len(fdp) and np.isfinite(fdp).any():
            ax.scatter(x, fdp, facecolors="none", edgecolors=st["color"], marker=st["marker"], s=80, zorder=3,
                       linewidths=1.5, label=f"{series}, f-DP bound (Gaussian trade-off)")
            for xi, yi in zip(x, fdp) if label_points else ():
                if np.isfinite(yi):
                    ax.annotate(f"{yi:.2f}", (xi, yi), textcoords="offset points", xytext=(-28 if i == 0 else 6, -11),
                                fontsize=8, color=st["color"], style="italic")
    for col, style, what in (("epsilon_lower_bound_ceiling", "--", "(ε, δ) bound"),
                             ("epsilon_lower_bound_fdp_ceiling", "-.", "f-DP bound")):
        ceilings = df[col].astype(float) if col in df else pd.Series([], dtype=float)
        if len(ceilings) and np.isfinite(ceilings).any():
            ceiling = float(np.nanmax(ceilings))
            ax.axhline(ceiling, color="0.6", linestyle=style, linewidth=1,
                       label=f"largest {what} these canaries can show ({ceiling:.2f})")
    ticks = sorted({float(f"{t:.3g}") for t in finite.tolist()})
    has_inf = bool(np.isinf(claimed).any())
    ax.set_xticks(ticks + ([inf_x] if has_inf else []))
    ax.set_xticklabels([f"{t:g}" for t in ticks] + (["∞\n(non-private)"] if has_inf else []))
    ax.set_xlim(0, inf_x * 1.12 if has_inf else top * 1.15)
    ax.set_ylim(0, top * 1.15 + 0.1)
    ax.set_xlabel(CLAIMED_LABEL)
    ax.set_ylabel(EMPIRICAL_LABEL)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    title = f"{dataset}: " if dataset else ""
    ax.set_title(f"{title}{heading}", fontsize=10)
    fig.text(0.01, -0.02, "A lower bound is evidence of leakage, not a proof of privacy (docs/audits.md).",
             fontsize=7, color="0.3")
    fig.tight_layout()
    return fig
