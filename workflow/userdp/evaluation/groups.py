"""Who pays for privacy: each evaluated test user's loss per run, and the cost of privacy per user group.

Two tables per dataset (rule groups; docs/artifacts.md):

- ``users.parquet``: one row per evaluated TEST user and model (every grid
  cell's released run, and the pretrained model): the user's summed
  next-token NLL, target tokens, examples and own token-average ``loss``,
  and the user's group of each kind (``contribution_group``, ``topic_group``,
  ``label_group``; null where the dataset has no such label). These are
  held-out users, never trained on; the table is not covered by the
  training guarantee (docs/privacy.md) and is not in the report.
- ``groups.parquet`` / ``groups.csv``: the cost of privacy per group. For
  each method, finite epsilon and budget of the main grid (not the G sweep),
  a user's cost is the user's loss under the private run minus under the
  non-private reference of the same method, budget and seed (eps = inf);
  a group's ``cost`` is the mean over its users of the cost averaged over
  seeds. Rows of ``measure`` "cost" (one per group and method), "uls - els"
  (``method``: the ULS cost minus the ELS cost of the same users) and
  "disparity" (the largest minus the smallest group cost of a kind, groups
  of at least ``groups.min_users`` users).

Group kinds:
- ``contribution``: the user's number of examples (the held-out user's own
  count) in buckets with upper edges 1, the median of the evaluated users'
  counts and G, the ELS cells' contribution bound (whose data ELS cuts), or
  ``groups.size_edges``;
- ``topic``: "rare" / "common" main topic of a synthetic user
  (``synthetic.topic_weights``, userdp.data.synthetic);
- ``label``: ``datasets.<name>.group_column`` of local data.

Intervals: 95% percentile bootstrap over users and seeds, ``groups.bootstrap``
draws, seeded by the config seed. Each draw resamples the evaluated users
(with replacement, the same draw for every cell, so that differences of
methods or epsilons on the same users are paired) and the seeds (likewise);
a statistic (a group cost, a difference, a disparity: max - min recomputed
per draw) is evaluated on every draw. With one seed the interval covers the
choice of users only (the model-to-model noise of training is then not in it).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from ..errors import DataError
from ..io import read_frame, write_parquet
from ..grid import cell_of_dir
from ..seeding import derive_seed
from .targets import USER_SCORE_COLUMNS

log = logging.getLogger(__name__)

KINDS = ("contribution", "topic", "label")
GROUP_COLUMNS = {kind: f"{kind}_group" for kind in KINDS}
USER_COLUMNS = ["dataset", "model", "method", "epsilon", "budget", "seed", "group_size", "is_group_sweep",
                *USER_SCORE_COLUMNS, *GROUP_COLUMNS.values()]
#: The acceptance interface of groups.csv/.parquet (issue 25), then the rest.
GROUP_TABLE_COLUMNS = ["dataset", "group_kind", "group", "group_order", "measure", "method", "epsilon", "budget",
                       "n_users", "n_seeds", "cost", "cost_low", "cost_high", "loss", "reference_loss"]
PRETRAINED = "pretrained"
UMINUSE = "uls - els"
LEVEL = 0.95


@dataclass(frozen=True)
class Settings:
    """The `groups` config section: bucket edges (None: automatic), the smallest group with an interval and in
    the disparity, the number of bootstrap draws and the seed of the draws."""

    size_edges: tuple[int, ...] | None = None
    min_users: int = 10
    bootstrap: int = 2000
    seed: int = 0

    @classmethod
    def from_config(cls, section: Mapping[str, Any], seed: int) -> "Settings":
        edges = section.get("size_edges")
        return cls(None if edges is None else tuple(int(e) for e in edges), int(section["min_users"]),
                   int(section["bootstrap"]), int(seed))


# ------------------------------------------------------------------ the per-user table
def _user_frame(path: str | os.PathLike, what: str) -> pd.DataFrame:
    if not Path(path).exists():
        raise DataError(f"{what} {path} does not exist; rerun the rule that writes it (select_lr for a "
                        "cell's users.parquet, evaluate_pretrained for the pretrained model's).")
    df = read_frame(path)
    missing = [c for c in USER_SCORE_COLUMNS if c not in df.columns]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing}; rerun the evaluation (snakemake --forcerun "
                        "finetune finetune_group evaluate_pretrained: finished runs are restored, not trained again).")
    return df[list(USER_SCORE_COLUMNS)]


def els_group_size(summary: pd.DataFrame) -> int | None:
    """G of the ELS cells of the main grid (the most common one if they differ), or None without ELS cells."""
    if summary is None or summary.empty:
        return None
    s = summary[(summary["method"] == "els") & ~summary["is_group_sweep"].astype(bool)
                & np.isfinite(summary["epsilon"].astype(float))]
    g = s["group_size"].dropna()
    return None if g.empty else int(g.astype(int).mode().min())


def size_edges(counts: Sequence[int], group_size: int | None, edges: Sequence[int] | None = None) -> list[int]:
    """Upper edges of the contribution buckets: `edges` as given, or 1, the median of `counts` and G (sorted,
    distinct; the last bucket is everything above the largest edge)."""
    if edges is not None:
        return sorted({int(e) for e in edges})
    median = int(math.floor(float(np.median(np.asarray(counts, dtype=float))))) if len(counts) else 1
    return sorted({1, max(1, median)} | ({int(group_size)} if group_size else set()))


def size_labels(edges: Sequence[int], group_size: int | None) -> list[str]:
    """A label per bucket of `edges` (len(edges) + 1 buckets), in order."""
    labels, lo = [], 0
    for e in edges:
        labels.append(f"{e} example{'s' if e > 1 else ''}" if e == lo + 1 else f"{lo + 1}-{e} examples")
        lo = e
    labels.append(f">{lo} examples" + (" (above G)" if group_size is not None and lo == group_size else ""))
    return labels


def size_group(counts: Sequence[int], edges: Sequence[int], labels: Sequence[str]) -> list[str]:
    """Each count's bucket label (bucket i: edges[i-1] < n <= edges[i])."""
    idx = np.searchsorted(np.asarray(edges), np.asarray(counts), side="left")
    return [labels[i] for i in idx]


def build_users(dataset: str, cell_files: Sequence[str], pretrained_file: str, labels: pd.DataFrame | None,
                summary: pd.DataFrame | None, settings: Settings) -> tuple[pd.DataFrame, dict]:
    """The per-user table (USER_COLUMNS) of one dataset and how its contribution buckets were formed.

    `cell_files`: each cell's users.parquet (its cell from its folder, grid.cell_of_dir); every file must hold
    the same users (the evaluation's seeded choice), else the data are from different evaluations.
    """
    frames = []
    g_used = ({} if summary is None or "run_dir" not in summary.columns
              else dict(zip(summary["run_dir"].astype(str), summary["group_size"])))
    pre = _user_frame(pretrained_file, "pretrained per-user scores")
    users = sorted(pre["user_id"])
    frames.append(pre.assign(model=PRETRAINED, method=PRETRAINED, epsilon=math.nan, budget=None, seed=None,
                             group_size=None, is_group_sweep=False))
    for path in cell_files:
        cell = cell_of_dir(str(Path(path).parent), steps=0)  # the steps are not needed here
        df = _user_frame(path, "per-user scores")
        if sorted(df["user_id"]) != users:
            raise DataError(f"{path}: its test users differ from the pretrained model's ({pretrained_file}); the "
                            "evaluations used different user choices (evaluation.max_users or seed changed?). "
                            "Rerun the evaluation: snakemake --forcerun finetune finetune_group evaluate_pretrained "
                            "(finished runs are restored, not trained again).")
        g = g_used.get(str(Path(path).parent), cell.group_size)  # G actually used (the summary's)
        frames.append(df.assign(model="fine-tuned", method=cell.method, epsilon=float(cell.epsilon),
                                budget=int(cell.compute), seed=int(cell.seed),
                                group_size=None if g is None or pd.isna(g) else int(g),
                                is_group_sweep=cell.group_size is not None))
    out = pd.concat(frames, ignore_index=True)
    out["dataset"] = dataset
    counts = pre.set_index("user_id")["n_examples"]
    g = els_group_size(summary)
    edges = size_edges(counts.to_numpy(), g, settings.size_edges)
    names = size_labels(edges, g)
    bucket = dict(zip(counts.index, size_group(counts.to_numpy(), edges, names)))
    out[GROUP_COLUMNS["contribution"]] = out["user_id"].map(bucket)
    for kind in ("topic", "label"):
        col = GROUP_COLUMNS[kind]
        out[col] = None
        if labels is not None and len(labels):
            lab = labels[labels["kind"] == kind].drop_duplicates("user_id").set_index("user_id")["label"]
            if len(lab):
                unlabelled = sorted(set(users) - set(lab.index))
                if unlabelled:
                    raise DataError(f"user_labels.parquet of {dataset!r} has no {kind} label for {len(unlabelled)} "
                                    f"test user(s) (e.g. {unlabelled[:3]}); rerun rule user_labels.")
                out[col] = out["user_id"].map(lab)
    order = {"contribution": names}
    info = {"edges": edges, "group_size": g, "median": float(np.median(counts.to_numpy())) if len(counts) else None,
            "order": order}
    return out[USER_COLUMNS], info


# ------------------------------------------------------------------ bootstrap over users and seeds
class Draws:
    """Bootstrap draws over users and seeds shared by every statistic of one dataset (paired comparisons)."""

    def __init__(self, users: Sequence[str], seeds: Sequence[int], n_draws: int, seed: int):
        self.users = list(users)
        self.seeds = sorted(seeds)
        rng = np.random.default_rng(seed)
        n, s = len(self.users), len(self.seeds)
        # counts of each user / seed in each draw (multinomial = resampling with replacement)
        self.user_counts = rng.multinomial(n, np.full(n, 1.0 / n), size=n_draws).astype(float)
        self.seed_weights = rng.multinomial(s, np.full(s, 1.0 / s), size=n_draws).astype(float) / s

    def group(self, gaps: np.ndarray, mask: np.ndarray) -> tuple[float, np.ndarray]:
        """(point, draws) of the mean over the users in `mask` of `gaps` (users x seeds) averaged over seeds."""
        per_user = gaps.mean(axis=1)
        point = float(per_user[mask].mean()) if mask.any() else math.nan
        by_draw = self.seed_weights @ gaps[mask].T  # (draws, users in mask): each user's seed-resampled gap
        w = self.user_counts[:, mask]
        with np.errstate(invalid="ignore", divide="ignore"):
            draws = (w * by_draw).sum(axis=1) / w.sum(axis=1)
        return point, draws


def interval(draws: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    """The percentile interval of bootstrap draws (draws in which a group was empty are left out)."""
    d = draws[np.isfinite(draws)]
    if len(d) == 0:
        return math.nan, math.nan
    a = (1 - level) / 2
    return float(np.quantile(d, a)), float(np.quantile(d, 1 - a))


class CostModel:
    """Per-user costs of every private cell of one dataset's per-user table, with shared bootstrap draws."""

    def __init__(self, users: pd.DataFrame, settings: Settings, dataset: str):
        self.settings = settings
        fine = users[(users["model"] == "fine-tuned") & ~users["is_group_sweep"].astype(bool)]
        self.user_ids = sorted(users["user_id"].unique())
        self.index = {u: i for i, u in enumerate(self.user_ids)}
        self.loss: dict[tuple, np.ndarray] = {}  # (method, eps, budget, seed) -> loss per user (in user_ids order)
        for key, g in fine.groupby(["method", "epsilon", "budget", "seed"]):
            v = np.full(len(self.user_ids), math.nan)
            v[[self.index[u] for u in g["user_id"]]] = g["loss"].to_numpy(dtype=float)
            self.loss[(key[0], float(key[1]), int(key[2]), int(key[3]))] = v
        first = users.drop_duplicates("user_id").set_index("user_id")
        self.counts = first.loc[self.user_ids, "n_examples"].to_numpy()
        self.groups = {kind: first.loc[self.user_ids, col].to_numpy() for kind, col in GROUP_COLUMNS.items()}
        seeds = sorted({k[3] for k in self.loss})
        self.draws = Draws(self.user_ids, seeds or [0], settings.bootstrap,
                           derive_seed(settings.seed, "groups", dataset))
        self.cells = sorted({k[:3] for k in self.loss if math.isfinite(k[1])})

    def mean_loss(self, method: str, eps: float, budget: int, mask: np.ndarray) -> float:
        vals = [self.loss[k][mask] for k in self.loss if k[:3] == (method, eps, budget)]
        return float(np.nanmean(np.concatenate(vals))) if vals and mask.any() else math.nan

    def cost(self, method: str, eps: float, budget: int, mask: np.ndarray) -> tuple[float, np.ndarray] | None:
        """`Draws.group` of the users in `mask` with finite gaps: private minus non-private loss of `method` at
        `budget` (users x seeds); None unless every seed has both runs."""
        seeds = self.draws.seeds
        if any((method, e, budget, s) not in self.loss for s in seeds for e in (eps, math.inf)):
            return None  # a seed without its reference: the cell is not comparable to the others' draws
        cols = [self.loss[(method, eps, budget, s)] - self.loss[(method, math.inf, budget, s)] for s in seeds]
        gaps = np.stack(cols, axis=1)
        return self.draws.group(gaps, mask & np.isfinite(gaps).all(axis=1))

    def group_masks(self, kind: str, order: Sequence[str] | None = None) -> list[tuple[str, np.ndarray]]:
        labels = self.groups[kind]
        present = [x for x in pd.unique(labels) if x is not None and not (isinstance(x, float) and math.isnan(x))]
        names = [x for x in (order or []) if x in present] + sorted(x for x in present if x not in (order or []))
        return [(str(x), labels == x) for x in names]


def _row(dataset, kind, group, order, measure, method, eps, budget, n_users, n_seeds, point, draws, loss=math.nan,
         ref=math.nan, reliable=True) -> dict:
    lo, hi = interval(draws) if reliable else (math.nan, math.nan)
    return {"dataset": dataset, "group_kind": kind, "group": group, "group_order": order, "measure": measure,
            "method": method, "epsilon": float(eps), "budget": int(budget), "n_users": int(n_users),
            "n_seeds": int(n_seeds), "cost": point, "cost_low": lo, "cost_high": hi, "loss": loss,
            "reference_loss": ref}


def group_table(model: CostModel, dataset: str, order: Mapping[str, Sequence[str]] | None = None) -> pd.DataFrame:
    """groups.parquet's rows (GROUP_TABLE_COLUMNS) of one dataset: cost per group and method, ULS - ELS per
    group, the disparity per kind and method."""
    order = order or {}
    rows = []
    n_seeds = len(model.draws.seeds)
    for kind in KINDS:
        groups = model.group_masks(kind, order.get(kind))
        if not groups:
            continue
        for eps, budget in sorted({(e, b) for _, e, b in model.cells}):
            costs: dict[str, dict[str, tuple[float, np.ndarray]]] = {}
            for method in sorted({m for m, e, b in model.cells if (e, b) == (eps, budget)}):
                big = []
                for rank, (name, mask) in enumerate(groups):
                    c = model.cost(method, eps, budget, mask)
                    if c is None:
                        continue
                    n = int(mask.sum())
                    reliable = n >= model.settings.min_users
                    rows.append(_row(dataset, kind, name, rank, "cost", method, eps, budget, n, n_seeds, *c,
                                     model.mean_loss(method, eps, budget, mask),
                                     model.mean_loss(method, math.inf, budget, mask), reliable))
                    costs.setdefault(name, {})[method] = c
                    if reliable:
                        big.append((name, c, n))
                if len(big) >= 2:
                    points = np.array([c[0] for _, c, _ in big])
                    stack = np.stack([c[1] for _, c, _ in big])
                    draws = np.nanmax(stack, axis=0) - np.nanmin(stack, axis=0)
                    hi_g, lo_g = big[int(points.argmax())][0], big[int(points.argmin())][0]
                    rows.append(_row(dataset, kind, f"disparity: {hi_g} - {lo_g}", len(groups), "disparity", method,
                                     eps, budget, sum(n for *_, n in big), n_seeds,
                                     float(points.max() - points.min()), draws))
            for rank, (name, mask) in enumerate(groups):
                c = costs.get(name, {})
                if "els" in c and "uls" in c:
                    n = int(mask.sum())
                    rows.append(_row(dataset, kind, name, rank, "uls - els", UMINUSE, eps, budget, n, n_seeds,
                                     c["uls"][0] - c["els"][0], c["uls"][1] - c["els"][1],
                                     reliable=n >= model.settings.min_users))
    return pd.DataFrame(rows, columns=GROUP_TABLE_COLUMNS)


# ------------------------------------------------------------------ the claims (userdp.evaluation.findings reads them)
@dataclass
class Effect:
    """One measured effect of a group claim: its point, 95% interval, where it was measured and how."""

    key: str
    effect: float
    low: float
    high: float
    measured_at: str
    detail: str


def users_group_size(users: pd.DataFrame) -> int | None:
    """G of the ELS cells of the main grid, from the per-user table (as `els_group_size` from the summary)."""
    rows = users[(users["method"] == "els") & ~users["is_group_sweep"].astype(bool)].drop_duplicates(
        ["epsilon", "budget", "seed"])
    rows = rows[np.isfinite(rows["epsilon"].astype(float))]
    return els_group_size(rows) if len(rows) else None


def claim_effects(model: CostModel, dataset: str, group_size: int | None) -> dict[str, list[Effect] | str]:
    """The effects of claims F1-F4 (userdp.evaluation.findings.GROUP_CLAIMS) on one dataset, or the reason one
    cannot be measured. All at the smallest finite epsilon and the largest budget (F2: smallest vs largest
    epsilon), with the bootstrap draws over users and seeds (`Draws`)."""
    out: dict[str, list[Effect] | str] = {}
    if not model.cells:
        why = f"{dataset}: no private cell with its non-private reference (grid.nonprivate)"
        return {k: why for k in ("F1", "F2", "F3", "F4")}
    eps_all = sorted({e for _, e, _ in model.cells})
    k_hi = max(b for _, _, b in model.cells)
    e0 = eps_all[0]
    at = f"{dataset}, epsilon = {e0:g}, budget = {k_hi}"
    methods = [m for m in ("els", "uls") if (m, e0, k_hi) in model.cells]
    n_seeds = len(model.draws.seeds)
    seeds_txt = f"{n_seeds} seed(s)" + ("; one seed: the interval covers the choice of users only" if n_seeds == 1 else "")
    min_users = model.settings.min_users

    def per_method(a: tuple[float, np.ndarray], b: tuple[float, np.ndarray], where: str, detail: str) -> list[Effect]:
        """cost(a) - cost(b) at the largest budget for each method with both cells; a, b: (epsilon, users)."""
        effects = []
        for m in methods:
            x, y = model.cost(m, a[0], k_hi, a[1]), model.cost(m, b[0], k_hi, b[1])
            if x is not None and y is not None:
                lo, hi = interval(x[1] - y[1])
                effects.append(Effect(m, x[0] - y[0], lo, hi, f"{m.upper()}, {where}", detail))
        return effects

    # F1: rare-topic cost - common-topic cost, per method.
    topic = dict(model.group_masks("topic"))
    if "rare" not in topic or "common" not in topic:
        out["F1"] = f"{dataset}: no rare- and common-topic users (synthetic.topic_weights)"
    elif topic["rare"].sum() < min_users or topic["common"].sum() < min_users:
        out["F1"] = (f"{dataset}: {int(topic['rare'].sum())} rare- and {int(topic['common'].sum())} common-topic "
                     f"test users; both need groups.min_users = {min_users}")
    else:
        out["F1"] = per_method((e0, topic["rare"]), (e0, topic["common"]), at,
                               f"effect = cost(rare topic, {int(topic['rare'].sum())} users) - cost(common topic, "
                               f"{int(topic['common'].sum())} users); cost = loss - non-private loss; "
                               f"{seeds_txt}") or f"{dataset}: no cell pair for F1"

    # F2: cost at the smallest - at the largest epsilon, all evaluated users, per method.
    if len(eps_all) < 2:
        out["F2"] = f"{dataset}: one finite epsilon in the grid"
    else:
        e1 = eps_all[-1]
        everyone = np.ones(len(model.user_ids), dtype=bool)
        effects = per_method((e0, everyone), (e1, everyone),
                             f"{dataset}, epsilon {e0:g} vs {e1:g}, budget = {k_hi}",
                             f"effect = cost at epsilon {e0:g} - cost at {e1:g} over all "
                             f"{len(model.user_ids)} evaluated test users; {seeds_txt}")
        out["F2"] = effects or f"{dataset}: no cell pair for F2"

    # F3: heavy contributors (n > G): ELS cost - ULS cost.
    if group_size is None or len(methods) < 2:
        out["F3"] = f"{dataset}: needs ELS (with its G) and ULS cells"
    else:
        heavy = model.counts > group_size
        if heavy.sum() < min_users:
            out["F3"] = f"{dataset}: {int(heavy.sum())} test users above G = {group_size}; needs {min_users}"
        else:
            e, u = model.cost("els", e0, k_hi, heavy), model.cost("uls", e0, k_hi, heavy)
            if e is None or u is None:
                out["F3"] = f"{dataset}: no ELS/ULS pair with references for F3"
            else:
                lo, hi = interval(e[1] - u[1])
                out["F3"] = [Effect("", e[0] - u[0], lo, hi, at,
                                    f"effect = ELS cost - ULS cost of the {int(heavy.sum())} test users with more than "
                                    f"G = {group_size} examples (ELS median rule); {seeds_txt}")]

    # F4: disparity (max - min group cost) of ULS minus ELS, per group kind with >= 2 groups of min_users.
    effects = []
    if len(methods) == 2:
        for kind in KINDS:
            groups = [(n, mk) for n, mk in model.group_masks(kind) if mk.sum() >= min_users]
            if len(groups) < 2:
                continue
            disp = {}
            for m in methods:
                cs = [model.cost(m, e0, k_hi, mk) for _, mk in groups]
                if any(c is None for c in cs):
                    break
                points = np.array([c[0] for c in cs])
                stack = np.stack([c[1] for c in cs])
                disp[m] = (float(points.max() - points.min()), np.nanmax(stack, 0) - np.nanmin(stack, 0))
            if len(disp) == 2:
                lo, hi = interval(disp["uls"][1] - disp["els"][1])
                effects.append(Effect(kind, disp["uls"][0] - disp["els"][0], lo, hi, f"{kind} groups, {at}",
                                      f"effect = disparity(ULS) - disparity(ELS), disparity = largest - smallest "
                                      f"group cost over {len(groups)} {kind} groups (ELS {disp['els'][0]:.4g}, "
                                      f"ULS {disp['uls'][0]:.4g}); {seeds_txt}"))
    out["F4"] = effects or f"{dataset}: needs ELS and ULS cells and a group kind with two groups of {min_users} users"
    return out


# ------------------------------------------------------------------ the job
def run(dataset: str, cell_files: Sequence[str], pretrained_file: str, labels_file: str | None,
        summary_file: str, settings: Settings, out_users: str, out_parquet: str, out_csv: str) -> pd.DataFrame:
    """Rule groups: the per-user table and the group table of one dataset (every input read before any output)."""
    from .aggregate import write_csv

    labels = read_frame(labels_file) if labels_file else None
    summary = read_frame(summary_file)
    users, info = build_users(dataset, cell_files, pretrained_file, labels, summary, settings)
    model = CostModel(users, settings, dataset)
    table = group_table(model, dataset, info["order"])
    log.info("%s: %d users x %d models; contribution edges %s (median %s, G %s); %d group rows", dataset,
             users["user_id"].nunique(), len(cell_files) + 1, info["edges"], info["median"], info["group_size"],
             len(table))
    write_parquet(out_users, users)
    write_parquet(out_parquet, table)
    write_csv(out_csv, table)
    return table
