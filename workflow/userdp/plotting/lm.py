"""Figures of the language-model fine-tuning grid (from the summary tables only).

Each function takes the tables written by `userdp.evaluation.aggregate`
(and the pretrained model's metrics) and returns a matplotlib Figure; the
scripts save it. Nothing here trains or evaluates, so changing a plot never
reruns training.

Conventions: one colour and line style per method (ELS blue solid circles,
ULS orange dashed squares); the non-private reference (epsilon = inf) and the
pretrained model are horizontal reference lines; several seeds are shown as
their mean with a 95% confidence interval (t interval over seeds; one seed:
no bar).
"""

from __future__ import annotations

import math
from typing import Mapping

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from ..evaluation.findings import CellStats, contrast
from ..privacy import seed_secrecy
from .output import legend_entries

METHODS = {
    "els": {"color": "tab:blue", "marker": "o", "linestyle": "-", "label": "DP-SGD-ELS (example-level sampling)"},
    "uls": {"color": "tab:orange", "marker": "s", "linestyle": "--", "label": "DP-SGD-ULS (user-level sampling)"},
}
SHORT = {"els": "ELS", "uls": "ULS"}
PRETRAINED_STYLE = {"color": "0.35", "linestyle": "-.", "linewidth": 1.5}
LOSS_LABEL = "test loss (next-token cross-entropy, nats/token)"
TRAIN_LOSS_LABEL = "training loss (batch mean cross-entropy, nats/token)"
UPDATE_NORM_LABEL = "update signal norm (‖u‖² minus the noise's share, square root)"
BUDGET_LABEL = "compute budget K (per-example gradient evaluations)"


# Non-private reference lines: ELS dotted, ULS dashed (they often nearly coincide).
NONPRIVATE_DASHES = {"els": (0, (1, 1.5)), "uls": (0, (5, 3))}

def _num(x: float) -> str:
    if math.isinf(x):
        return "∞"
    return f"{x:g}"


def _eps_label(eps: float) -> str:
    return "ε = ∞ (non-private)" if math.isinf(eps) else f"ε = {_num(eps)}"


def _budget_title(budget: int, steps: int | None) -> str:
    t = f", T = {steps} steps" if steps is not None and not pd.isna(steps) else ""
    return f"K = {int(budget):,} example gradients{t}"


def _method_order(methods) -> list[str]:
    return [m for m in METHODS if m in set(methods)] + sorted(set(methods) - set(METHODS))


def _style(method: str) -> dict:
    return METHODS.get(method, {"color": "tab:green", "marker": "^", "linestyle": "-.", "label": method})


def ci_halfwidth(std: float, n: int) -> float:
    """Half-width of the 95% t interval of a mean of `n` values with sample standard deviation `std` (0 for n < 2)."""
    if n < 2 or not math.isfinite(std):
        return 0.0
    _, lo, hi = contrast([(1.0, CellStats(0.0, std * std, int(n)))])
    return (hi - lo) / 2


def mean_over_seeds(df: pd.DataFrame, keys: list[str], value: str = "test_loss") -> pd.DataFrame:
    """Mean, standard deviation, count and 95% interval half-width (`ci`) of `value` over seeds, per `keys`."""
    g = df.groupby(keys, dropna=False)[value]
    out = g.agg(["mean", "std", "count"]).reset_index()
    out["std"] = out["std"].fillna(0.0)
    out["ci"] = [ci_halfwidth(s, n) for s, n in zip(out["std"], out["count"])]
    return out


def _n_seeds(df: pd.DataFrame) -> int:
    return int(df["seed"].nunique()) if "seed" in df and len(df) else 0


def _seed_note(df: pd.DataFrame) -> str:
    n = _n_seeds(df)
    return "1 seed" if n == 1 else f"mean and 95% CI over {n} seeds"


def _main(summary: pd.DataFrame) -> pd.DataFrame:
    return summary[~summary["is_group_sweep"].astype(bool)]


def _pretrained_line(ax, pretrained: Mapping | None) -> None:
    """The pretrained model's test loss (its metrics' `test_loss`) as a reference line, when it has a finite one."""
    try:
        loss = float(pretrained.get("test_loss")) if pretrained else None
    except (TypeError, ValueError):
        loss = None
    if loss is not None and math.isfinite(loss):
        ax.axhline(loss, **PRETRAINED_STYLE, label="pretrained model, no fine-tuning")


def _delta_note(summary: pd.DataFrame) -> str:
    for col in ("plan_delta", "ledger_delta"):
        if col in summary and summary[col].notna().any():
            vals = pd.to_numeric(summary[col], errors="coerce").dropna().unique()
            if len(vals) == 1:
                return f", δ = {vals[0]:.2g}"
    return ""


def _steps_for(df: pd.DataFrame, budget: int) -> int | None:
    s = df.loc[df["budget"] == budget, "steps"] if "steps" in df else pd.Series([], dtype=float)
    return int(s.iloc[0]) if len(s) else None


def _panels(n: int, ylabel: str, sharey: bool = True):
    """A figure of `n` panels, at most 3 a row (those left over hidden), and its axes; the first column's y label."""
    cols = min(max(1, n), 3)
    rows = math.ceil(max(1, n) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.6 * rows), sharey=sharey, squeeze=False,
                             layout="constrained")
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel)
    return fig, axes


def _ticks_at(ax, ticks: list, labels: list[str], widen: bool = True) -> None:
    """x ticks exactly at `ticks` (no minor ticks); with `widen`, a single tick gets a factor 2 of room either side."""
    ax.set_xticks(ticks)
    ax.set_xticklabels(labels)
    ax.minorticks_off()
    if widen and len(ticks) == 1:
        ax.set_xlim(ticks[0] / 2, ticks[0] * 2)


def loss_vs_epsilon(summary: pd.DataFrame, pretrained: Mapping | None, dataset: str) -> Figure:
    """Figure 4: test loss vs epsilon, one panel per compute budget.

    Private cells are lines over epsilon; the non-private runs of each method
    and the pretrained model are horizontal reference lines.
    """
    main = _main(summary)
    budgets = sorted(main["budget"].unique())
    fig, axes = _panels(len(budgets), LOSS_LABEL)
    private_eps = sorted(e for e in main["epsilon"].unique() if math.isfinite(e))
    for ax, budget in zip(axes.flat, budgets):
        sub = main[main["budget"] == budget]
        stats = mean_over_seeds(sub, ["method", "epsilon"])
        for m in _method_order(sub["method"].unique()):
            st = _style(m)
            priv = stats[(stats["method"] == m) & np.isfinite(stats["epsilon"])].sort_values("epsilon")
            if len(priv):
                ax.errorbar(priv["epsilon"], priv["mean"], yerr=priv["ci"], color=st["color"], marker=st["marker"],
                            linestyle=st["linestyle"], capsize=3, label=st["label"])
            nonpriv = stats[(stats["method"] == m) & np.isinf(stats["epsilon"])]
            if len(nonpriv):
                # distinct dash patterns: the two references often nearly coincide
                ax.axhline(float(nonpriv["mean"].iloc[0]), color=st["color"],
                           linestyle=NONPRIVATE_DASHES.get(m, ":"), linewidth=1.6,
                           label=f"{SHORT.get(m, m)}, non-private (ε = ∞)")
        _pretrained_line(ax, pretrained)
        ax.margins(y=0.08)  # keep reference lines off the frame
        ax.set_xscale("log")
        if private_eps:
            _ticks_at(ax, private_eps, [_num(e) for e in private_eps])
        ax.set_title(_budget_title(budget, _steps_for(sub, budget)), fontsize=10)
        ax.set_xlabel(f"user-level privacy budget ε (log scale{_delta_note(sub)})")
        ax.grid(True, alpha=0.3)
    _legend_below(fig)
    fig.suptitle(f"{dataset}: test loss vs privacy budget ε ({_seed_note(main)}; "
                 f"{_rate_note(summary)})", fontsize=11)
    return footnotes(fig, summary)


def _rate_note(summary: pd.DataFrame) -> str:
    """How the plotted runs' learning rate was set: chosen on validation users, or the config's only rate."""
    from ..evaluation.select import ONLY_RATE

    only = "selection" in summary and summary["selection"].eq(ONLY_RATE).all()
    return "one learning rate, nothing chosen" if only else "learning rate chosen on validation users"


def loss_vs_budget(summary: pd.DataFrame, pretrained: Mapping | None, dataset: str) -> Figure:
    """Figure 5: test loss vs compute budget, one panel per private epsilon, ELS and ULS lines.

    Mean and 95% interval over seeds (bars and a shaded band); each method's
    non-private runs (their mean over budgets' runs at each budget, as a thin
    line) and the pretrained model are references.
    """
    main = _main(summary)
    stats = mean_over_seeds(main, ["method", "epsilon", "budget"])
    finite = sorted(e for e in stats["epsilon"].unique() if math.isfinite(e))
    panels = finite or [math.inf]
    fig, axes = _panels(len(panels), LOSS_LABEL)
    budgets = sorted(stats["budget"].unique())
    for ax, e in zip(axes.flat, panels):
        for m in _method_order(stats["method"].unique()):
            st = _style(m)
            s = stats[(stats["method"] == m) & (stats["epsilon"] == e)].sort_values("budget")
            if len(s):
                ax.errorbar(s["budget"], s["mean"], yerr=s["ci"], color=st["color"], marker=st["marker"],
                            linestyle=st["linestyle"], capsize=3, label=st["label"])
                ax.fill_between(s["budget"], s["mean"] - s["ci"], s["mean"] + s["ci"], color=st["color"], alpha=0.12)
            ref = stats[(stats["method"] == m) & np.isinf(stats["epsilon"])].sort_values("budget")
            if len(ref) and math.isfinite(e):
                ref_style = dict(color=st["color"], linestyle=NONPRIVATE_DASHES.get(m, ":"), linewidth=1.3,
                                 label=f"{SHORT.get(m, m)}, non-private (ε = ∞)")
                if len(ref) == 1:  # one budget: a line across the panel
                    ax.axhline(float(ref["mean"].iloc[0]), **ref_style)
                else:
                    ax.plot(ref["budget"], ref["mean"], **ref_style)
        _pretrained_line(ax, pretrained)
        ax.set_xscale("log")
        _ticks_at(ax, budgets, [f"{int(b):,}" for b in budgets])
        ax.set_title(_eps_label(e) + _delta_note(main), fontsize=10)
        ax.set_xlabel(BUDGET_LABEL + ", log scale", fontsize=9)
        ax.grid(True, alpha=0.3)
    _legend_below(fig)
    title = f"{dataset}: test loss vs compute budget, a panel per ε ({_seed_note(main)})"
    if len(budgets) == 1:
        title += "\nonly one budget configured (grid.budgets): one point per line"
    fig.suptitle(title, fontsize=11)
    return footnotes(fig, summary)


def uls_minus_els_grid(summary: pd.DataFrame) -> pd.DataFrame:
    """ULS - ELS mean test loss per (epsilon, budget) of the main grid, with its 95% Welch interval over seeds."""
    main = _main(summary)
    rows = []
    for (e, k), g in main.groupby(["epsilon", "budget"]):
        u, l = g[g["method"] == "uls"]["test_loss"], g[g["method"] == "els"]["test_loss"]
        if not len(u) or not len(l):
            continue
        effect, lo, hi = contrast([(1.0, CellStats.of(u)), (-1.0, CellStats.of(l))])
        rows.append({"epsilon": float(e), "budget": int(k), "diff": effect, "ci_low": lo, "ci_high": hi})
    return pd.DataFrame(rows, columns=["epsilon", "budget", "diff", "ci_low", "ci_high"])


def uls_minus_els(summary: pd.DataFrame, pretrained: Mapping | None, dataset: str) -> Figure:
    """Heat map of ULS - ELS test loss over (epsilon, budget), each cell with its 95% interval.

    Blue = ULS better (lower loss), red = ELS better; a cell whose interval
    excludes zero is marked with a star.
    """
    d = uls_minus_els_grid(summary)
    eps = sorted(d["epsilon"].unique()) if len(d) else []
    budgets = sorted(d["budget"].unique()) if len(d) else []
    fig, ax = plt.subplots(figsize=(1.9 * max(2, len(budgets)) + 2.2, 1.0 * max(2, len(eps)) + 1.6),
                           layout="constrained")
    if not len(d):
        ax.text(0.5, 0.5, "no (epsilon, budget) with both ELS and ULS", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_axis_off()
        fig.suptitle(f"{dataset}: ULS - ELS test loss", fontsize=11)
        return fig
    z = np.full((len(eps), len(budgets)), np.nan)
    for r in d.itertuples():
        z[eps.index(r.epsilon), budgets.index(r.budget)] = r.diff
    lim = float(np.nanmax(np.abs(z))) or 1e-9
    im = ax.imshow(z, cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto", origin="lower")
    for r in d.itertuples():
        sig = r.ci_high < 0 or r.ci_low > 0
        interval = ("" if not math.isfinite(r.ci_low) or r.ci_low == r.ci_high
                    else f"\n[{r.ci_low:+.3f}, {r.ci_high:+.3f}]")
        ax.text(budgets.index(r.budget), eps.index(r.epsilon), f"{r.diff:+.4f}{'*' if sig else ''}{interval}",
                ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(budgets)), [f"{int(b):,}" for b in budgets])
    ax.set_yticks(range(len(eps)), [_num(e) for e in eps])
    ax.set_xlabel(BUDGET_LABEL, fontsize=9)
    ax.set_ylabel("user-level ε (∞: non-private)")
    fig.colorbar(im, ax=ax, label="ULS - ELS test loss (nats/token)\nblue: ULS better, red: ELS better")
    fig.suptitle(f"{dataset}: ULS - ELS test loss "
                 f"({_seed_note(_main(summary))}; * interval excludes 0)", fontsize=10)
    return footnotes(fig, summary)


def loss_vs_group_size(
    summary: pd.DataFrame, pretrained: Mapping | None, dataset: str, epsilon: float, budget: int
) -> Figure:
    """Figure 6: test loss vs contribution bound G, per method, with the heuristic's G marked.

    Uses the G-sweep cells (run at `epsilon` and `budget`). The main cells at
    the same epsilon and budget ran at the G chosen by the heuristic (median
    for ELS, predicted SNR for ULS); they are drawn as stars with a vertical
    line. Without sweep cells only those points are drawn, and the title says so.
    """
    sweep = summary[summary["is_group_sweep"].astype(bool)]
    main = _main(summary)
    at = main[(main["epsilon"] == float(epsilon)) & (main["budget"] == int(budget))]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    sweep_stats = mean_over_seeds(sweep, ["method", "group_size"]) if len(sweep) else None
    heur_stats = mean_over_seeds(at, ["method", "group_size"]) if len(at) else None
    methods = _method_order(pd.concat([sweep["method"], at["method"]]).unique())
    all_g: list[float] = []
    for m in methods:
        st = _style(m)
        if sweep_stats is not None:
            s = sweep_stats[sweep_stats["method"] == m].sort_values("group_size")
            if len(s):
                ax.errorbar(s["group_size"], s["mean"], yerr=s["ci"], color=st["color"], marker=st["marker"],
                            linestyle=st["linestyle"], capsize=3, label=f"{st['label']}, G sweep")
                all_g += list(s["group_size"])
        if heur_stats is not None:
            h = heur_stats[heur_stats["method"] == m]
            for _, r in h.iterrows():
                ax.errorbar([r["group_size"]], [r["mean"]], yerr=[r["ci"]], color=st["color"], marker="*",
                            markersize=15, markeredgecolor="black", linestyle="none", capsize=3,
                            label=f"{SHORT.get(m, m)}, heuristic G = {int(r['group_size'])}")
                ax.axvline(r["group_size"], color=st["color"], linestyle=":", linewidth=1.2)
                all_g.append(r["group_size"])
    _pretrained_line(ax, pretrained)
    ax.set_xscale("log", base=2)
    gs = sorted({int(g) for g in all_g if pd.notna(g)})
    if gs:
        _ticks_at(ax, gs, [str(g) for g in gs])
    ax.set_xlabel("contribution bound G (max examples per user, log scale)")
    ax.set_ylabel(LOSS_LABEL)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    where = f"ε = {_num(float(epsilon))}, K = {int(budget):,}"
    if len(sweep):
        title = f"{dataset}: test loss vs G ({where}; {_seed_note(sweep)})"
    else:
        title = (f"{dataset}: test loss at the heuristic's G ({where})\n"
                 "no G sweep configured (grid.group_size_sweep is empty): only the heuristic's G is shown")
    ax.set_title(title, fontsize=11)
    return footnotes(fig, summary)


def epsilon_note(summary: pd.DataFrame) -> str:
    """Which epsilon the figure's ε axis shows: the released model's guarantee, or each run's (with the released)."""
    if "ledger_epsilon_meaning" not in summary.columns or not len(summary):
        return ""
    private = summary[np.isfinite(pd.to_numeric(summary["epsilon"], errors="coerce"))]
    meanings = sorted(set(private["ledger_epsilon_meaning"].dropna())) if len(private) else []
    if not meanings:
        return ""
    target_per_run = "plan_epsilon_target_of" in private and (private["plan_epsilon_target_of"]
                                                              == "each learning-rate run").any()
    if not target_per_run:
        return "ε = the released model's guarantee: " + "; ".join(m.removeprefix("released model: ") for m in meanings)
    ratio = pd.to_numeric(private["ledger_epsilon"], errors="coerce") / pd.to_numeric(private["epsilon"])
    return (f"ε = each learning-rate run's target (privacy.selection.accounting: per_run); the released models' "
            f"guarantees are {ratio.min():.2f}-{ratio.max():.2f}x larger (summary column ledger_epsilon)")


def footnotes(fig: Figure, summary: pd.DataFrame, epsilons: pd.DataFrame | None = None) -> Figure:
    """`fig` with a footnote saying which epsilon its ε shows (`epsilon_note` of `epsilons`, default `summary`) and,
    when any cell's seeds are derived (the summary's `seeds_mode`, from the ledgers), one saying so."""
    note = epsilon_note(summary if epsilons is None else epsilons)
    if note:
        footnote(fig, note)
    if "seeds_mode" in summary.columns and (summary["seeds_mode"] == "derived").any():
        footnote(fig, DERIVED_SEEDS_NOTE)
    return fig


def footnote(fig: Figure, text: str) -> None:
    """A note line above the figure's title, outside the canvas (a second call adds a line above it).

    Constrained layout does not see plain figure texts, and it fills the
    bottom margin with the legend; above the canvas nothing else is drawn.
    The figure is saved with bbox_inches="tight" (`output.save_figure`),
    which takes the lines in.
    """
    from matplotlib.transforms import ScaledTranslation

    line = len(getattr(fig, "userdp_footnotes", []))
    offset = ScaledTranslation(0, (2 + 10 * line) / 72, fig.dpi_scale_trans)
    fig.text(0.005, 1.0, text, fontsize=6.5, color="0.3", ha="left", va="bottom", transform=fig.transFigure + offset)
    fig.userdp_footnotes = [*getattr(fig, "userdp_footnotes", []), text]


DERIVED_SEEDS_NOTE = f"privacy.secret_seeds: {seed_secrecy.DERIVED_CAVEAT}"


def smooth(values: pd.Series, window: int) -> pd.Series:
    """Centred rolling mean (shorter windows at the ends)."""
    return values.rolling(window=max(1, window), center=True, min_periods=1).mean()


def curve_value(curves: pd.DataFrame) -> tuple[str, str, str]:
    """(column, axis label, title phrase) the training-curve figure plots.

    The batch loss when the logs have it (training.debug_step_log: a noise-free statistic, outside the
    guarantee), else update_signal_norm (post-processing of the privatised updates: inside it).
    """
    if "update_signal_norm" not in curves.columns or ("loss" in curves.columns and curves["loss"].notna().any()):
        return "loss", TRAIN_LOSS_LABEL, "training loss (outside the DP guarantee: training.debug_step_log)"
    return "update_signal_norm", UPDATE_NORM_LABEL, "noise-corrected norm of the privatised update"


def training_curves(curves: pd.DataFrame, dataset: str, window: int | None = None) -> Figure:
    """Figure 7: smoothed training curve vs step for each main cell's chosen-LR run (`curve_value`).

    One panel per compute budget; colour encodes epsilon (non-private black),
    line style the method; each seed is its own line.
    """
    value, value_label, value_title = curve_value(curves)
    main = curves[~curves["is_group_sweep"].astype(bool)] if len(curves) else curves
    budgets = sorted(main["budget"].unique()) if len(main) else []
    fig, axes = _panels(len(budgets), value_label, sharey=False)
    finite = sorted(e for e in main["epsilon"].unique() if math.isfinite(e)) if len(main) else []
    colours = _eps_colours(finite)
    for ax, budget in zip(axes.flat, budgets):
        sub = main[main["budget"] == budget]
        n_steps = int(sub.groupby(["method", "epsilon", "seed"]).size().max())
        w = window if window is not None else max(1, round(n_steps / 10))
        for (m, e, seed), run in sub.groupby(["method", "epsilon", "seed"], sort=True):
            run = run.sort_values("step")
            st = _style(m)
            ax.plot(run["step"], smooth(run[value], w), color=colours.get(e, "black"), linestyle=st["linestyle"],
                    linewidth=1.3, alpha=0.85)
        smooth_note = f"rolling mean over {w} steps" if w > 1 else "unsmoothed"
        ax.set_title(_budget_title(budget, int(sub["step"].max()) if len(sub) else None) + f"\n({smooth_note})",
                     fontsize=10)
        ax.set_xlabel("training step")
        ax.grid(True, alpha=0.3)
    handles = [Line2D([], [], color="0.3", linestyle=_style(m)["linestyle"], label=_style(m)["label"])
               for m in _method_order(main["method"].unique() if len(main) else [])]
    handles += [Line2D([], [], color=colours[e], label=_eps_label(e)) for e in finite]
    if len(main) and np.isinf(main["epsilon"]).any():
        handles.append(Line2D([], [], color="black", label=_eps_label(math.inf)))
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncol=min(4, len(handles)), fontsize=8, frameon=False)
    n = _n_seeds(main)
    seeds = "1 seed" if n == 1 else f"{n} seeds, one line each"
    fig.suptitle(f"{dataset}: {value_title}, each cell's chosen-learning-rate run ({seeds}; G-sweep runs left out)",
                 fontsize=11)
    if not len(main):
        axes[0, 0].text(0.5, 0.5, "no training logs", ha="center", va="center", transform=axes[0, 0].transAxes)
    return fig


def _eps_colours(finite_eps: list[float]) -> dict:
    """Viridis colours per private epsilon, kept away from its near-black end (black = non-private)."""
    cmap = plt.get_cmap("viridis")
    if len(finite_eps) == 1:
        return {finite_eps[0]: cmap(0.45)}
    return {e: cmap(0.15 + 0.75 * i / (len(finite_eps) - 1)) for i, e in enumerate(finite_eps)}


def _legend_below(fig: Figure) -> None:
    handles, labels = legend_entries(fig.axes)
    # private lines first, then the non-private references, then the pretrained model
    rank = [0 if l.startswith("DP-SGD") else 1 if "non-private" in l else 2 for l in labels]
    order = sorted(range(len(labels)), key=lambda i: (rank[i], i))
    handles, labels = [handles[i] for i in order], [labels[i] for i in order]
    if handles:
        ncol = min(3, len(handles))
        fig.legend(handles, labels, loc="outside lower center", ncol=ncol, fontsize=8, frameon=False)


def options_loss_gap(summary: pd.DataFrame, options: pd.DataFrame, dataset: str) -> Figure:
    """The loss gap to non-private of each option of grid.options against the grid's DP-SGD, one row of panels
    per option and a column per compute budget: over the private epsilons, the method's mean test loss minus
    its non-private reference's (same budget), DP-SGD in the method's style, the option dotted with diamonds.

    Mean and 95% interval over seeds of the private cells (the reference is its mean over seeds; both sides'
    intervals, not their difference's: the findings' claim 15 gives that). The reference is the grid's
    non-private run, with the base's optimizer, also for an option that changes the optimizer.
    """
    main = _main(summary)
    names = list(dict.fromkeys(options["option"])) if "option" in options and len(options) else []
    budgets = sorted(main["budget"].unique())
    rows, cols = max(1, len(names)), max(1, len(budgets))
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.9 * rows), sharey=True, squeeze=False,
                             layout="constrained")
    ref = mean_over_seeds(main[np.isinf(main["epsilon"].astype(float))], ["method", "budget"])
    private_eps = sorted(e for e in main["epsilon"].unique() if math.isfinite(e))

    def gap(df: pd.DataFrame, method: str, budget: int) -> pd.DataFrame:
        r = ref[(ref["method"] == method) & (ref["budget"] == budget)]
        sub = df[(df["method"] == method) & (df["budget"] == budget) & np.isfinite(df["epsilon"].astype(float))]
        if r.empty or sub.empty:
            return pd.DataFrame(columns=["epsilon", "mean", "ci"])
        st = mean_over_seeds(sub, ["epsilon"]).sort_values("epsilon")
        return st.assign(mean=st["mean"] - float(r["mean"].iloc[0]))

    for i, name in enumerate(names):
        opt = options[options["option"] == name]
        for j, budget in enumerate(budgets):
            ax = axes[i, j]
            for m in _method_order(opt["method"].unique()):
                st = _style(m)
                base, mine = gap(main, m, budget), gap(opt, m, budget)
                if len(base):
                    ax.errorbar(base["epsilon"], base["mean"], yerr=base["ci"], color=st["color"],
                                marker=st["marker"], linestyle=st["linestyle"], capsize=3,
                                label=f"DP-SGD-{SHORT.get(m, m)}")
                if len(mine):  # a little to the right (log axis), so that overlapping bars stay apart
                    ax.errorbar(mine["epsilon"] * 1.06, mine["mean"], yerr=mine["ci"], color=st["color"], marker="D",
                                markerfacecolor="white", linestyle=":", capsize=3,
                                label=f"{SHORT.get(m, m)} with the option")
            ax.axhline(0.0, color="0.35", linewidth=1, linestyle="-.")
            ax.set_xscale("log")
            if private_eps:
                _ticks_at(ax, private_eps, [_num(e) for e in private_eps], widen=False)
            ax.set_title(f"{name}: {_budget_title(budget, _steps_for(main, budget))}", fontsize=9)
            ax.set_xlabel(f"user-level privacy budget ε (log scale{_delta_note(main)})")
            ax.grid(True, alpha=0.3)
        axes[i, 0].set_ylabel("test loss − non-private (nats/token)")
    missing = ("grid.options is empty: no option to compare" if not names else
               "no non-private reference (grid.nonprivate: false): no loss gap to draw" if ref.empty else None)
    if missing:
        axes[0, 0].text(0.5, 0.5, missing, ha="center", va="center", transform=axes[0, 0].transAxes)
    _legend_below(fig)
    fig.suptitle(f"{dataset}: loss gap to non-private, each option vs DP-SGD at equal ε and compute "
                 f"({_seed_note(main)}; {_rate_note(summary)})", fontsize=11)
    return footnotes(fig, summary, pd.concat([summary, options], ignore_index=True))
