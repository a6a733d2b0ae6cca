"""The findings table: each claim of the study, the measured effect with its 95% interval, and a verdict.

The claims (Charles et al., arXiv 2407.07737) are checked on the language-model
grid (per-dataset summaries), on the mean-estimation study and on the
accounting comparison. Every verdict comes from the numbers by one rule
(`verdict`), never by hand:

- each claim is "effect < threshold" or "effect > threshold" (a direction and
  a threshold, 0 unless the claim is about being within a tolerance);
- the effect is a linear contrast of cell means over seeds (`contrast`), its
  95% interval a Welch t interval (Welch-Satterthwaite degrees of freedom):
  each cell's seeds are an independent sample, cells are independent;
- reproduced: the whole interval is on the claimed side of the threshold;
  not reproduced: the whole interval is on the other side; inconclusive: the
  interval contains the threshold (the seed noise is larger than the effect);
  not measured: the grid has no cells for it (the detail says what is missing).

Effects, language model: differences of mean test loss (nats/token), written
ULS - ELS (negative = ULS better). Mean estimation: differences of mean
log squared error (log(ULS error / ELS error); -0.1 = ULS about 10% lower).
Deterministic effects (the accounting ratios, the pretrained model's loss)
have no seed variance: their interval is the point.

Claim 15 (`option_findings`) is measured once per option of grid.options and
method: the option's test loss minus the grid's DP-SGD cell's at the same
dataset, epsilon, budget (and seeds), mean over the private cells, by the same
Welch contrast.

Claims 11-14 (`group_findings`, who pays for privacy) are a separate block:
differences of per-group costs of privacy (loss minus the non-private
reference's) from the per-user tables of userdp.evaluation.groups, with 95%
bootstrap intervals over users and seeds instead of Welch intervals; the
verdict is formed by the same `verdict`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
from scipy import stats

from ..layout import fmt_num
from ..privacy.comparison import ACCOUNTANT_LABELS, GROUP_BASELINES
from ..seeding import derive_seed
from .audit_stats import auc

REPRODUCED = "reproduced"
NOT_REPRODUCED = "not reproduced"
INCONCLUSIVE = "inconclusive"
NOT_MEASURED = "not measured"
VERDICTS = (REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE, NOT_MEASURED)
LEVEL = 0.95

LM = "language model"
ME = "mean estimation"
ACCOUNTING = "accounting"

#: claim id -> the study's claim, as the table states it.
CLAIMS = {
    1: "ULS beats ELS at small epsilon",
    2: "ULS's advantage over ELS grows with the compute budget",
    3: "ULS's advantage over ELS grows with within-user diversity",
    4: "ELS is competitive with (or better than) ULS for homogeneous users at small budgets",
    5: "the tight ELS accountant needs less noise than group privacy",
    6: "DP fine-tuning (ELS and ULS) beats the pretrained model",
    7: "the ELS median rule's G is as good as the best G found by training",
    8: "the ULS rule's G is as good as the best G found by training",
}


@dataclass
class Finding:
    claim_id: int
    domain: str
    claim: str
    effect: float | None
    ci_low: float | None
    ci_high: float | None
    direction: str  # "<" or ">": the claim says effect <direction> threshold
    threshold: float
    verdict: str
    unit: str
    measured_at: str
    figure: str
    detail: str = ""
    cells: list = field(default_factory=list)

    def record(self) -> dict:
        out = asdict(self)
        for k in ("effect", "ci_low", "ci_high"):
            v = out[k]
            out[k] = None if v is None or not math.isfinite(v) else float(v)
        return out


@dataclass(frozen=True)
class CellStats:
    """Mean, sample variance and count of one cell's values over seeds."""

    mean: float
    var: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> "CellStats":
        v = np.asarray(values, dtype=float)
        v = v[np.isfinite(v)]
        if len(v) == 0:
            raise ValueError("a cell has no finite values")
        return cls(float(v.mean()), float(v.var(ddof=1)) if len(v) > 1 else math.nan, int(len(v)))

    @classmethod
    def constant(cls, value: float) -> "CellStats":
        return cls(float(value), 0.0, 1)


def contrast(terms: Iterable[tuple[float, CellStats]], level: float = LEVEL) -> tuple[float, float, float]:
    """Effect sum(c_i * mean_i) of independent cells and its Welch t interval at `level`.

    A cell with one value (and a non-constant role) has unknown variance: the
    interval is then infinite (inconclusive), never narrower than the data allow.
    """
    terms = [(float(c), s) for c, s in terms if c != 0]
    effect = sum(c * s.mean for c, s in terms)
    parts = [(c * c * s.var / s.n, s.n) for c, s in terms if s.var != 0.0]
    if not parts:
        return effect, effect, effect
    if any(math.isnan(p) for p, _ in parts):
        return effect, -math.inf, math.inf
    se2 = sum(p for p, _ in parts)
    if se2 == 0:
        return effect, effect, effect
    df = se2 ** 2 / sum(p * p / (n - 1) for p, n in parts)
    half = float(stats.t.ppf(0.5 + level / 2, df)) * math.sqrt(se2)
    return effect, effect - half, effect + half


def verdict(ci_low: float, ci_high: float, direction: str, threshold: float = 0.0) -> str:
    """The rule: reproduced if the whole interval is on the claimed side of `threshold`, not reproduced if the
    whole interval is on the other side, inconclusive otherwise."""
    if direction not in ("<", ">"):
        raise ValueError(f"direction must be '<' or '>', not {direction!r}")
    below, above = ci_high < threshold, ci_low > threshold
    if direction == "<":
        return REPRODUCED if below else NOT_REPRODUCED if ci_low >= threshold else INCONCLUSIVE
    return REPRODUCED if above else NOT_REPRODUCED if ci_high <= threshold else INCONCLUSIVE


def _finding(claim_id: int, domain: str, terms, direction: str, unit: str, measured_at: str, figure: str,
             threshold: float = 0.0, detail: str = "", cells: list | None = None) -> Finding:
    effect, lo, hi = contrast(terms)
    return Finding(claim_id, domain, CLAIMS[claim_id], effect, lo, hi, direction, threshold,
                   verdict(lo, hi, direction, threshold), unit, measured_at, figure, detail, cells or [])


def _not_measured(claim_id: int, domain: str, why: str, figure: str = "", direction: str = "<") -> Finding:
    return Finding(claim_id, domain, CLAIMS[claim_id], None, None, None, direction, 0.0, NOT_MEASURED, "", "",
                   figure, why)


# ------------------------------------------------------------------ a generic grid of cells
class Grid:
    """Cells of one study's table: `value` per seed, keyed by the `keys` columns."""

    def __init__(self, df: pd.DataFrame, keys: Sequence[str], value: str):
        self.keys = list(keys)
        self.cells = {k if isinstance(k, tuple) else (k,): CellStats.of(g[value].to_numpy())
                      for k, g in df.groupby(self.keys, dropna=False) if np.isfinite(g[value]).any()}

    def get(self, **where) -> CellStats | None:
        return self.cells.get(tuple(where[k] for k in self.keys))

    def values(self, key: str) -> list:
        i = self.keys.index(key)
        return sorted({k[i] for k in self.cells})


def _diff(grid: Grid, **where) -> list[tuple[float, CellStats]] | None:
    """Terms of ULS - ELS at `where` (None if a cell is missing)."""
    u, e = grid.get(method="uls", **where), grid.get(method="els", **where)
    return None if u is None or e is None else [(1.0, u), (-1.0, e)]


def _scaled(terms, c: float):
    return [(c * a, s) for a, s in terms]


def _method_claims(grid: Grid, domain: str, axis: str, diversity: Mapping, unit: str, figures: Mapping[str, str],
                   tolerance: float) -> list[Finding]:
    """Claims 1-4 on a grid with keys (method, epsilon, budget, `axis`); `diversity` maps axis values to a
    diversity level (None: unknown)."""
    out = []
    eps = [e for e in grid.values("epsilon") if math.isfinite(e)]
    budgets = grid.values("budget")
    units = grid.values(axis)
    if not eps or not budgets or not units:
        why = "the grid has no private ELS and ULS cells"
        return [_not_measured(i, domain, why) for i in (1, 2, 3, 4)]
    e0, k_lo, k_hi = eps[0], budgets[0], budgets[-1]

    # 1: ULS - ELS at the smallest epsilon and the largest budget, averaged over the axis (datasets / diversity).
    pairs = [d for u in units if (d := _diff(grid, epsilon=e0, budget=k_hi, **{axis: u}))]
    if pairs:
        out.append(_finding(1, domain, _scaled([t for d in pairs for t in d], 1 / len(pairs)), "<", unit,
                            f"epsilon = {e0:g}, budget = {k_hi}, mean over {len(pairs)} {axis} value(s)",
                            figures["budget"], detail="effect = ULS - ELS"))
    else:
        out.append(_not_measured(1, domain, f"no ELS/ULS pair at epsilon {e0}, budget {k_hi}"))

    # 2: (ULS - ELS at the largest budget) - (at the smallest), smallest epsilon, mean over the axis.
    if len(budgets) < 2:
        out.append(_not_measured(2, domain, "the grid has one compute budget"))
    else:
        terms, n = [], 0
        for u in units:
            hi, lo = _diff(grid, epsilon=e0, budget=k_hi, **{axis: u}), _diff(grid, epsilon=e0, budget=k_lo, **{axis: u})
            if hi and lo:
                terms += hi + _scaled(lo, -1.0)
                n += 1
        if n:
            out.append(_finding(2, domain, _scaled(terms, 1 / n), "<", unit,
                                f"epsilon = {e0:g}, budget {k_hi} vs {k_lo}, mean over {n} {axis} value(s)",
                                figures["heatmap"], detail="effect = (ULS - ELS at the largest budget) - (at the smallest)"))
        else:
            out.append(_not_measured(2, domain, "no ELS/ULS pairs at both the smallest and largest budget"))

    # 3 and 4 need the diversity of each axis value.
    known = sorted((d, u) for u, d in diversity.items() if d is not None and u in units)
    if len({d for d, _ in known}) < 2:
        out.append(_not_measured(3, domain, "fewer than two diversity levels in the grid (e.g. two synthetic "
                                 "datasets that differ in synthetic.alpha)"))
    else:
        (d_lo, u_lo), (d_hi, u_hi) = known[0], known[-1]
        a, b = _diff(grid, epsilon=e0, budget=k_hi, **{axis: u_hi}), _diff(grid, epsilon=e0, budget=k_hi, **{axis: u_lo})
        if a and b:
            out.append(_finding(3, domain, a + _scaled(b, -1.0), "<", unit,
                                f"epsilon = {e0:g}, budget = {k_hi}, {u_hi} (diversity {d_hi:g}) vs "
                                f"{u_lo} (diversity {d_lo:g})", figures["diversity"],
                                detail="effect = (ULS - ELS, most diverse) - (ULS - ELS, least diverse)"))
        else:
            out.append(_not_measured(3, domain, "no ELS/ULS pairs at both diversity extremes"))
    u_hom = known[0][1] if known else units[0]
    d4 = _diff(grid, epsilon=e0, budget=k_lo, **{axis: u_hom})
    if d4:
        out.append(_finding(4, domain, d4, ">", unit,
                            f"epsilon = {e0:g}, budget = {k_lo}, {axis} = {u_hom}"
                            + (" (least diverse)" if known else ""),
                            figures["budget"], threshold=-tolerance,
                            detail=f"effect = ULS - ELS; competitive = ELS at most {tolerance:g} worse"))
    else:
        out.append(_not_measured(4, domain, f"no ELS/ULS pair at budget {k_lo}", direction=">"))
    return out


def _rule_vs_best(claim_id: int, domain: str, method: str, rule_cells: Mapping, sweep: Mapping, unit: str,
                  figure: str, tolerance: float, where: str) -> Finding:
    """`rule_cells`/`sweep`: unit -> (rule's G, CellStats) / unit -> {G: CellStats}. Effect = mean over units of
    (rule's loss - the best G's loss)."""
    terms, parts = [], []
    for unit_key, (g_rule, rule_stats) in rule_cells.items():
        candidates = dict(sweep.get(unit_key, {}))
        candidates[g_rule] = rule_stats
        if len(candidates) < 2:
            continue
        g_best = min(candidates, key=lambda g: candidates[g].mean)
        parts.append(f"{unit_key}: rule G = {g_rule}, best G = {g_best}")
        if g_best != g_rule:
            terms += [(1.0, rule_stats), (-1.0, candidates[g_best])]
        else:
            terms += [(0.0, rule_stats)]
    if not parts:
        return _not_measured(claim_id, domain, f"no {method.upper()} G sweep next to the rule's cell", figure)
    n = len(parts)
    return _finding(claim_id, domain, _scaled(terms, 1 / n) or [(0.0, CellStats.constant(0.0))], "<", unit,
                    where, figure, threshold=tolerance,
                    detail=f"effect = rule's G - best G found by training (mean over {n}); " + "; ".join(parts))


# ------------------------------------------------------------------ language model
def lm_findings(summaries: Mapping[str, pd.DataFrame], pretrained: Mapping[str, float],
                diversity: Mapping[str, float | None], sweep_point: Mapping, tolerance: float) -> list[Finding]:
    """Claims 1-4, 6-8 on the language-model grid: `summaries` dataset -> summary table (userdp.evaluation.
    aggregate), `pretrained` dataset -> pretrained test loss, `diversity` dataset -> synthetic alpha or None."""
    unit = "nats/token (test loss)"
    df = _stacked(summaries, [])
    if df.empty:
        return [_not_measured(i, LM, "no language-model cells") for i in (1, 2, 3, 4, 6, 7, 8)]
    df["epsilon"] = df["epsilon"].astype(float)
    main = df[~df["is_group_sweep"].astype(bool)]
    grid = Grid(main, ["method", "epsilon", "budget", "dataset"], "test_loss")
    figures = {"budget": "lm_loss_vs_budget", "heatmap": "lm_uls_minus_els", "diversity": "lm_uls_minus_els"}
    out = _method_claims(grid, LM, "dataset", diversity, unit, figures, tolerance)

    # 6: each method's mean test loss minus the pretrained model's, smallest epsilon, largest budget.
    eps = [e for e in grid.values("epsilon") if math.isfinite(e)]
    budgets = grid.values("budget")
    for method in ("els", "uls"):
        terms, n = [], 0
        if eps:
            for d in grid.values("dataset"):
                s = grid.get(method=method, epsilon=eps[0], budget=budgets[-1], dataset=d)
                if s is not None and d in pretrained and math.isfinite(pretrained[d]):
                    terms += [(1.0, s), (-1.0, CellStats.constant(pretrained[d]))]
                    n += 1
        if n:
            f = _finding(6, LM, _scaled(terms, 1 / n), "<", unit,
                         f"{method.upper()}, epsilon = {eps[0]:g}, budget = {budgets[-1]}, mean over {n} dataset(s)",
                         "lm_loss_vs_budget", detail=f"effect = {method.upper()} - pretrained")
        else:
            f = _not_measured(6, LM, f"no {method.upper()} cell with a pretrained reference")
        f.claim = f"{CLAIMS[6]} ({method.upper()})"
        out.append(f)

    # 7 and 8: the rules' G vs the G sweep at the sweep point.
    sweep_df = df[df["is_group_sweep"].astype(bool)]
    e_s, k_s = float(sweep_point["epsilon"]), int(sweep_point["budget"])
    for claim_id, method, rule in ((7, "els", "median"), (8, "uls", "snr")):
        rule_cells, sweep = {}, {}
        for d in sorted(df["dataset"].unique()):
            at = main[(main.dataset == d) & (main.method == method) & (main.epsilon == e_s) & (main.budget == k_s)]
            if len(at):
                rule_cells[d] = (int(at["group_size"].iloc[0]), CellStats.of(at["test_loss"]))
            sw = sweep_df[(sweep_df.dataset == d) & (sweep_df.method == method)]
            sweep[d] = {int(g): CellStats.of(x["test_loss"]) for g, x in sw.groupby("group_size")}
        out.append(_rule_vs_best(claim_id, LM, method, rule_cells, sweep, unit, "lm_loss_vs_group_size",
                                 tolerance, f"epsilon = {e_s:g}, budget = {k_s}"))
    return out


# ------------------------------------------------------------------ mean estimation
def me_findings(results: pd.DataFrame, relative_tolerance: float) -> list[Finding]:
    """Claims 1-4, 7, 8 on the mean-estimation study (userdp.experiments.mean_estimation results)."""
    unit = "log squared error"
    tol = math.log1p(relative_tolerance)
    df = results.copy()
    df["log_error"] = np.log(df["squared_error"].astype(float))
    df = df.rename(columns={"compute_budget": "budget"})
    chosen = df[df["chosen"].astype(bool)]
    grid = Grid(chosen, ["method", "epsilon", "budget", "diversity"], "log_error")
    diversity = {d: float(d) for d in grid.values("diversity")}
    figures = {"budget": "mean_estimation_vs_budget", "heatmap": "mean_estimation_vs_budget",
               "diversity": "mean_estimation_vs_diversity"}
    out = _method_claims(grid, ME, "diversity", diversity, unit, figures, tol)
    out.append(_not_measured(6, ME, "mean estimation has no pretrained model", direction="<"))
    sweep = df[~df["chosen"].astype(bool)]
    for claim_id, method in ((7, "els"), (8, "uls")):
        rule_cells, sw = {}, {}
        for key, g in chosen[chosen.method == method].groupby(["epsilon", "budget", "diversity"]):
            label = f"eps {key[0]:g} K {key[1]} s {key[2]:g}"
            rule_cells[label] = (int(g["group_size"].iloc[0]), CellStats.of(g["log_error"]))
            x = sweep[(sweep.method == method) & (sweep.epsilon == key[0]) & (sweep.budget == key[1])
                      & (sweep.diversity == key[2])]
            sw[label] = {int(gs): CellStats.of(y["log_error"]) for gs, y in x.groupby("group_size")}
        f = _rule_vs_best(claim_id, ME, method, rule_cells, sw, unit, "mean_estimation_vs_group_size", tol,
                          "every (epsilon, budget, diversity) cell of the study")
        if claim_id == 8:
            f.detail = "ULS's G is the best of its sweep on tuning seeds, scored here on the evaluation seeds. " + f.detail
        out.append(f)
    return out


# ------------------------------------------------------------------ accounting
def accounting_findings(comparison: pd.DataFrame) -> list[Finding]:
    """Claim 5, once per group-privacy baseline present (RDP-based, the study's; PLD-based):
    sigma(baseline) / sigma(tight ELS) > 1 at every G > 1 (deterministic: no interval)."""
    tight = comparison[comparison["accountant"] == "els"]
    out = []
    for kind in GROUP_BASELINES:
        group = comparison[comparison["accountant"] == kind]
        if group.empty:
            continue
        name = ACCOUNTANT_LABELS[kind]
        m = tight.merge(group, on=["epsilon", "group_size"], suffixes=("_tight", "_group"))
        m = m[(m["group_size"] > 1) & m["noise_multiplier_tight"].notna() & m["noise_multiplier_group"].notna()]
        if m.empty:
            out.append(_not_measured(5, ACCOUNTING, f"the accounting comparison has no G > 1 with both the tight "
                                     f"accountant and {name}", "noise_vs_group_size", ">"))
            continue
        m = m.assign(ratio=m["noise_multiplier_group"] / m["noise_multiplier_tight"]).sort_values(
            ["epsilon", "group_size"])
        lo = float(m["ratio"].min())
        parts = "; ".join(f"eps {r.epsilon:g} G {int(r.group_size)}: {r.ratio:.3f}x" for r in m.itertuples())
        out.append(Finding(5, ACCOUNTING, CLAIMS[5], lo, lo, lo, ">", 1.0, verdict(lo, lo, ">", 1.0),
                           f"ratio of noise multipliers ({name} / tight)", "every (epsilon, G > 1) of the comparison",
                           "noise_vs_group_size", detail=f"baseline: {name}; effect = the smallest ratio; " + parts))
    if not out:
        out.append(_not_measured(5, ACCOUNTING, "the accounting comparison has no group-privacy baseline",
                                 "noise_vs_group_size", ">"))
    return out


# ------------------------------------------------------------------ who pays for privacy (user groups)
GROUPS = "user groups"

#: claim id -> the group claim (issue 25's F1-F4), stated before it was measured (docs/findings.md).
GROUP_CLAIMS = {
    11: "(F1) DP costs rare-topic users more than common-topic users",
    12: "(F2) the cost of privacy grows as epsilon shrinks",
    13: "(F3) ELS (median rule) costs heavy contributors (above G) more than ULS does",
    14: "(F4) ULS has a smaller disparity between user groups than ELS (equal epsilon and compute)",
}
_GROUP_KEYS = {11: ("F1", ">", "groups_cost"), 12: ("F2", ">", "groups_cost"),
               13: ("F3", ">", "groups_gap_vs_examples"), 14: ("F4", "<", "groups_cost")}


def group_findings(users: Mapping[str, pd.DataFrame], settings: Mapping, seed: int) -> list[Finding]:
    """Claims 11-14 on each dataset's per-user table (userdp.evaluation.groups): effects are differences of
    costs (loss minus the non-private reference's, nats/token) with 95% bootstrap intervals over users and
    seeds; the verdict by `verdict` against 0."""
    from . import groups as g

    unit = "nats/token (loss gap to the non-private reference)"
    opts = g.Settings.from_config(settings, seed)
    effects: dict[int, list] = {i: [] for i in GROUP_CLAIMS}
    why: dict[int, list[str]] = {i: [] for i in GROUP_CLAIMS}
    for dataset, table in users.items():
        model = g.CostModel(table, opts, dataset)
        measured = g.claim_effects(model, dataset, g.users_group_size(table))
        for claim_id, (key, _, _) in _GROUP_KEYS.items():
            got = measured[key]
            (why if isinstance(got, str) else effects)[claim_id] += [got] if isinstance(got, str) else got
    out = []
    for claim_id, claim in GROUP_CLAIMS.items():
        _, direction, figure = _GROUP_KEYS[claim_id]
        if not effects[claim_id]:
            out.append(Finding(claim_id, GROUPS, claim, None, None, None, direction, 0.0, NOT_MEASURED, "", "",
                               figure, "; ".join(why[claim_id]) or "no per-user tables"))
            continue
        for e in effects[claim_id]:
            out.append(Finding(claim_id, GROUPS, claim, e.effect, e.low, e.high, direction, 0.0,
                               verdict(e.low, e.high, direction, 0.0), unit, e.measured_at, figure,
                               e.detail + "; 95% bootstrap interval over users and seeds"))
    return out


# ------------------------------------------------------------------ options (grid.options) vs the grid's DP-SGD
OPTIONS = "options"
#: claim id -> the claim each option (grid.options) is measured against, once per option and method.
OPTION_CLAIMS = {15: "the option beats the grid's runs of the same method (DP-SGD in the study) at equal released "
                     "epsilon and compute"}


def option_findings(summaries: Mapping[str, pd.DataFrame], options: Mapping[str, pd.DataFrame],
                    methods: Mapping[str, Sequence[str]]) -> list[Finding]:
    """Claim 15, once per option of grid.options and method it runs (`methods`: option -> its methods, in
    config order): the mean over the private (dataset, epsilon, budget) cells of (the option's mean test loss
    - the grid's cell's), each cell's seeds a sample (Welch interval, as claims 1-4; the option's runs draw
    their own samples and noise, so the two sides are independent); negative = the option is better.

    `summaries` / `options`: dataset -> the summary (rule aggregate) / options table (rule aggregate_options).
    The detail gives the effect per epsilon, the noise multipliers' ratio, the largest relative difference of
    the released epsilons (ledgers) of paired cells, and which cells or seeds are missing or not finite (left
    out of the contrast, never silently).
    """
    unit = "nats/token (test loss)"
    keys = ["method", "epsilon", "budget", "dataset"]
    base, opts = _stacked(summaries, keys), _stacked(options, keys)
    base = base[~base["is_group_sweep"].astype(bool)] if len(base) else base
    out = []
    for name, option_methods in methods.items():
        mine = opts[opts["option"] == name] if "option" in opts else opts.iloc[0:0]
        for method in option_methods:
            rows = mine[mine["method"] == method]
            ref = base[(base["method"] == method) & np.isfinite(base["epsilon"].astype(float))]
            a, b = Grid(rows, keys[1:], "test_loss"), Grid(ref, keys[1:], "test_loss")
            common = sorted(set(a.cells) & set(b.cells))
            claim = f"{name}: {OPTION_CLAIMS[15]} ({method.upper()})"
            expected = {tuple(k) for k in ref[keys[1:]].drop_duplicates().itertuples(index=False)}
            left_out = [f"{len(expected - set(common))} of the grid's {len(expected)} private cells have no finite "
                        "option and grid values"] if expected - set(common) else []
            bad = sum(int((~np.isfinite(pd.to_numeric(df["test_loss"], errors="coerce"))).sum())
                      for df in (rows, ref) if "test_loss" in df)
            left_out += [f"{bad} non-finite seed value(s) left out"] if bad else []
            if not common:
                out.append(Finding(15, OPTIONS, claim, None, None, None, "<", 0.0, NOT_MEASURED, "", "",
                                   "lm_options_loss_gap", f"no {method.upper()} cell of option {name!r} with a grid "
                                   "cell of the same dataset, epsilon and budget (run the option's cells: "
                                   "snakemake --cores N)"))
                continue
            def mean_difference(at):  # terms of mean over the cells `at` of (option - grid)
                return [t for k in at for t in ((1.0 / len(at), a.cells[k]), (-1.0 / len(at), b.cells[k]))]

            terms, parts = mean_difference(common), []
            for eps in sorted({k[0] for k in common}):
                e, lo, hi = contrast(mean_difference([k for k in common if k[0] == eps]))
                parts.append(f"epsilon {eps:g}: {e:+.4f} [{lo:+.4f}, {hi:+.4f}]")
            sigma = _paired(rows, ref, "plan_noise_multiplier", lambda x, y: x / y).mean()
            eps_gap = _paired(rows, ref, "ledger_epsilon", lambda x, y: (x - y).abs() / y).max()
            effect, lo, hi = contrast(terms)
            out.append(Finding(
                15, OPTIONS, claim, effect, lo, hi, "<", 0.0, verdict(lo, hi, "<", 0.0), unit,
                f"{len(common)} (epsilon, budget, dataset) cells, {method.upper()}, mean over cells",
                "lm_options_loss_gap",
                detail="; ".join([f"effect = option - grid; per epsilon: {'; '.join(parts)}",
                                  f"noise multiplier option / grid: {sigma:.3f} (mean over cells)",
                                  f"released epsilon (ledger) of option and grid differ by at most {eps_gap:.2%}",
                                  *left_out]),
                cells=[list(map(str, k)) for k in common]))
    return out


def _stacked(tables: Mapping[str, pd.DataFrame], columns: Sequence[str]) -> pd.DataFrame:
    """The non-empty per-dataset tables stacked, each row with its `dataset` (an empty frame of `columns` if none)."""
    frames = [t.assign(dataset=d) for d, t in tables.items() if len(t)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=list(columns))


def _paired(rows: pd.DataFrame, ref: pd.DataFrame, column: str, fn) -> pd.Series:
    """fn(rows[column], ref[column]) over the cells of both with the same (dataset, epsilon, budget, seed)."""
    k = ["dataset", "epsilon", "budget", "seed"]
    if column not in rows or column not in ref:
        return pd.Series([math.nan])
    m = rows[k + [column]].merge(ref[k + [column]], on=k, suffixes=("", "_ref"))
    return fn(pd.to_numeric(m[column], errors="coerce"), pd.to_numeric(m[column + "_ref"], errors="coerce"))


# ------------------------------------------------------------------ the table
def build(summaries, pretrained, diversity, sweep_point, me_results, comparison, loss_tolerance: float,
          relative_tolerance: float, name: str, audit: list[Finding] | None = None,
          groups: tuple[Mapping[str, pd.DataFrame], Mapping, int] | None = None,
          options: tuple[Mapping[str, pd.DataFrame], Mapping[str, Sequence[str]]] | None = None) -> dict:
    """The findings table, in claim order; `audit`: the audit's findings (audit_findings, or the not-measured
    row); `groups`, if given, is (per-user table by dataset, the groups section, the seed) of
    claims 11-14 (`group_findings`); `options`, if given, is (options table by dataset, each option's methods)
    of claim 15 (`option_findings`)."""
    findings = lm_findings(summaries, pretrained, diversity, sweep_point, loss_tolerance)
    findings += group_findings(*groups) if groups is not None else []
    findings += option_findings(summaries, *options) if options is not None else []
    findings += accounting_findings(comparison) if comparison is not None else []
    findings += me_findings(me_results, relative_tolerance) if me_results is not None else []
    findings += list(audit or [])
    findings.sort(key=lambda f: (f.claim_id, f.domain != LM))
    counts = {v: sum(f.verdict == v for f in findings) for v in VERDICTS}
    return {
        "study": name,
        "level": LEVEL,
        "rule": ("reproduced: the 95% interval lies entirely on the claimed side of the threshold; not reproduced: "
                 "entirely on the other side; inconclusive: it contains the threshold; intervals are Welch t "
                 "intervals over seeds (userdp.evaluation.findings)"),
        "loss_tolerance": loss_tolerance,
        "relative_tolerance": relative_tolerance,
        "counts": counts,
        "findings": [f.record() for f in findings],
    }


TABLE_COLUMNS = ["claim_id", "domain", "claim", "verdict", "effect", "ci_low", "ci_high", "direction", "threshold",
                 "unit", "measured_at", "figure", "detail"]


def table(findings: Mapping) -> pd.DataFrame:
    """The findings as a table (one row per claim and domain), for the report's CSV."""
    return pd.DataFrame(findings["findings"], columns=TABLE_COLUMNS)


# ------------------------------------------------------------------ the privacy audit (ELS vs ULS leakage)
AUDIT = "privacy audit"
#: claim id -> claim of the black-box audit (its own block: the study's claims are CLAIMS).
AUDIT_CLAIMS = {9: "at equal claimed epsilon, ELS leaks more than ULS in practice (black-box canary audit)"}
#: The membership score the audit claim is measured with (userdp.evaluation.audit.SCORES): the loss on the
#: canary's secret, the stronger score on every audited cell measured with new_token canaries (the
#: likelihood ratio stays at AUC 1/2 in every private cell up to epsilon 256: docs/findings.md, claim 9).
AUDIT_SCORE = "loss"
AUDIT_BOOTSTRAP = 2000


def _paired_auc_difference(els: pd.DataFrame, uls: pd.DataFrame, score: str) -> tuple[np.ndarray, np.ndarray,
                                                                                        np.ndarray]:
    """(ELS scores, ULS scores, coins) of the same canaries, matched by user_id (both runs score every canary)."""
    m = els[["user_id", "included", score]].merge(uls[["user_id", "included", score]], on="user_id",
                                                  suffixes=("_els", "_uls"))
    if len(m) != len(els) or len(m) != len(uls) or not (m["included_els"] == m["included_uls"]).all():
        raise ValueError("the ELS and ULS audits scored different canaries (rebuild the audit)")
    return m[f"{score}_els"].to_numpy(float), m[f"{score}_uls"].to_numpy(float), m["included_els"].to_numpy(bool)


def audit_findings(results: Sequence[Mapping], scores: Mapping[tuple[str, str, str], pd.DataFrame],
                   seed: int = 0) -> list[Finding]:
    """Claim 9: ELS - ULS ROC AUC (AUDIT_SCORE, the loss) at each finite audited epsilon, mean over epsilons and
    datasets.

    `results`: the audit results (userdp.evaluation.audit, one per audited
    cell); `scores`: (dataset, method, epsilon target) -> that cell's
    per-canary scores. ELS and ULS of a dataset score the same canaries with
    the same coins, so the 95% interval is a paired percentile bootstrap
    over canaries (AUDIT_BOOTSTRAP resamples): it covers which canaries were
    drawn, not the training run's own randomness (one audited run per cell).
    """
    key = f"score_{AUDIT_SCORE}"
    cells = {(r["dataset"], r["method"], float(r["epsilon_target"])): r for r in results}
    pairs = sorted({(d, e) for d, m, e in cells if math.isfinite(e) and (d, "els", e) in cells
                    and (d, "uls", e) in cells})
    if not pairs:
        return [Finding(9, AUDIT, AUDIT_CLAIMS[9], None, None, None, ">", 0.0, NOT_MEASURED, "", "",
                        "audit_epsilon", "no dataset has audited ELS and ULS cells at the same target epsilon")]
    rng = np.random.default_rng(derive_seed(seed, "findings", "audit-bootstrap"))
    point, boot, parts = 0.0, np.zeros(AUDIT_BOOTSTRAP), []
    for d, e in pairs:
        s_els, s_uls, inc = _paired_auc_difference(scores[(d, "els", fmt_num(e))], scores[(d, "uls", fmt_num(e))], key)
        diff = auc(s_els, inc) - auc(s_uls, inc)
        idx = rng.integers(0, inc.size, size=(AUDIT_BOOTSTRAP, inc.size))
        with np.errstate(invalid="ignore", divide="ignore"):  # a resample with one class only has no AUC (nan)
            boot += (auc(s_els[idx], inc[idx]) - auc(s_uls[idx], inc[idx])) / len(pairs)
        point += diff / len(pairs)
        ce, cu = cells[(d, "els", e)], cells[(d, "uls", e)]
        parts.append(f"{d} eps {e:g} (claimed ELS {float(ce['epsilon_claimed']):.3g}, ULS "
                     f"{float(cu['epsilon_claimed']):.3g}): AUC ELS {ce[f'{AUDIT_SCORE}_auc']:.3f} vs ULS "
                     f"{cu[f'{AUDIT_SCORE}_auc']:.3f} (likelihood ratio: "
                     f"{ce.get('likelihood_ratio_auc', math.nan):.3f} vs {cu.get('likelihood_ratio_auc', math.nan):.3f}), "
                     f"bounds ELS {float(ce['epsilon_lower_bound']):.3g}/"
                     f"{float(ce.get('epsilon_lower_bound_fdp') or 0):.3g} vs ULS "
                     f"{float(cu['epsilon_lower_bound']):.3g}/"
                     f"{float(cu.get('epsilon_lower_bound_fdp') or 0):.3g} ((eps, delta)/f-DP)")
    lo, hi = (float(q) for q in np.nanquantile(boot, [(1 - LEVEL) / 2, (1 + LEVEL) / 2]))
    design = ", ".join(sorted({str(cells[(d, m, e)].get("canary_design")) for d, e in pairs for m in ("els", "uls")}))
    return [Finding(9, AUDIT, AUDIT_CLAIMS[9], point, lo, hi, ">", 0.0, verdict(lo, hi, ">", 0.0),
                    f"ROC AUC difference ({AUDIT_SCORE.replace('_', '-')} score)",
                    f"{len(pairs)} (dataset, epsilon) pair(s), {design} canaries", "audit_epsilon",
                    detail="effect = ELS - ULS AUC, mean over pairs; interval: paired bootstrap over canaries "
                           "(one run per cell: training noise not covered); " + "; ".join(parts))]
