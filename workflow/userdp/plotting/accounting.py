"""Figure: noise multiplier needed versus the contribution bound G, per accountant."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from ..io import read_frame
from ..privacy.comparison import ACCOUNTANT_LABELS, GROUP_BASELINES
from .output import legend_entries, save_figure

STYLE = {
    "els": {"color": "tab:blue", "marker": "o", "linestyle": "-"},
    "group": {"color": "tab:red", "marker": "s", "linestyle": "--"},
    "group_rdp": {"color": "tab:orange", "marker": "v", "linestyle": "-."},
    "uls": {"color": "tab:green", "marker": None, "linestyle": ":"},
}
#: Drawing order (the baselines first, so the tight accountant's line is on top).
ORDER = ("group_rdp", "group", "els", "uls")


def plot_noise_vs_group_size(parquet_path: str, png_path: str, pdf_path: str) -> None:
    """The figure of `noise_vs_group_size_figure` from the comparison's Parquet, as PNG and PDF."""
    save_figure(noise_vs_group_size_figure(read_frame(parquet_path)), png_path, pdf_path)


def noise_vs_group_size_figure(df):
    """One panel per epsilon: sigma versus G (log-log) per accountant, and below it each group-privacy
    baseline's sigma over the tight accountant's.

    Targets no sigma up to the configured maximum reaches (group privacy at
    large G) are drawn as an open marker at the top edge, labelled.
    """
    epsilons = sorted(df["epsilon"].unique())
    q, T, delta = df["sampling_rate"].iloc[0], int(df["steps"].iloc[0]), df["delta"].iloc[0]
    n = len(epsilons)
    fig, all_axes = plt.subplots(
        2, n, figsize=(4.2 * n, 5.6), sharey="row", sharex=True, squeeze=False, gridspec_kw={"height_ratios": [2.2, 1]}
    )
    axes = all_axes[:1]
    finite = df["noise_multiplier"].dropna()
    top = float(finite.max()) * 1.6 if len(finite) else 10.0
    for ax, eps in zip(axes[0], epsilons):
        sub = df[df["epsilon"] == eps]
        for kind in (k for k in ORDER if k in set(sub["accountant"])):
            d = sub[sub["accountant"] == kind].sort_values("group_size")
            ok = d[d["noise_multiplier"].notna()]
            ax.plot(ok["group_size"], ok["noise_multiplier"], label=ACCOUNTANT_LABELS[kind], **STYLE[kind])
            bad = d[d["noise_multiplier"].isna()]
            if len(bad):
                ax.plot(bad["group_size"], [top] * len(bad), linestyle="none", marker="^", markerfacecolor="none",
                        color=STYLE[kind]["color"], label=f"{ACCOUNTANT_LABELS[kind]}: infeasible")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"user-level ε = {eps:g}")
        ax.grid(True, which="both", alpha=0.3)
        # Lower row: how much more noise group privacy asks for than the tight accountant.
        rax = all_axes[1][list(axes[0]).index(ax)]
        piv = sub.pivot_table(index="group_size", columns="accountant", values="noise_multiplier")
        for kind in (k for k in GROUP_BASELINES if {"els", k} <= set(piv.columns)):
            ratio = (piv[kind] / piv["els"]).dropna()
            rax.plot(ratio.index, ratio.values, color=STYLE[kind]["color"], marker=STYLE[kind]["marker"],
                     linestyle=STYLE[kind]["linestyle"])
        rax.axhline(1.0, color="gray", linewidth=0.8)
        rax.set_xscale("log", base=2)
        gs = sorted(sub["group_size"].unique())
        rax.set_xticks(gs)
        rax.set_xticklabels([str(g) for g in gs])
        rax.set_xlabel("contribution bound G (examples per user, log scale)")
        rax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("noise multiplier σ\n(noise std / clip norm)")
    all_axes[1][0].set_ylabel("σ group privacy /\nσ tight (ELS)")
    handles, labels = legend_entries(axes[0])
    fig.legend(handles, labels, loc="lower center", ncol=min(2, len(labels)), frameon=False)
    fig.suptitle(
        f"Noise needed vs G at sampling rate q = {q:g}, T = {T} steps, δ = {delta:.0e}",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    return fig
