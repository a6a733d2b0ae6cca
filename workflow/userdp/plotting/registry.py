"""The registry of figures: every figure's plotting function and family, declared once.

The rules that draw them are written out in workflow/rules/figures.smk
(`plot_<name>`: inputs, PNG and PDF outputs, report entry, params);
from here come
- the dispatch of the one plot script (workflow/scripts/plot_figure.py
  looks the figure up by its rule's name and calls `Figure.draw`),
- the figure targets of rule `all` and of the audit targets
  (`figure_targets`; tests/test_eval_figures.py checks that each is an
  output its rule spells).

Paths, by convention from the figure's name:
    results/figures/<name>_<dataset>.png|pdf  (per-dataset families)
    results/figures/<name>.png|pdf            (one figure per workflow)
    workflow/report/<name>.rst                (the report caption)

Adding a figure: write its plotting function (in a module of this package),
register it below with `_register(Figure(...))`, write its rule in
figures.smk and its caption file. A new family also needs a `Family` with
a `draw` adapter saying how its functions are called.

Plotting functions are named by a string ("lm.loss_vs_epsilon", relative to
this package) and imported only when drawn, so reading the registry (the
Snakefile does, at every start) does not import matplotlib.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .. import grid

FORMATS = ("png", "pdf")
FIGURE_DIR = "results/figures"
CAPTION_DIR = "workflow/report"

#: draw adapter of a family: (plotting function, input paths by name, png, pdf, dataset or None, plot params)
DrawFn = Callable[[Callable[..., Any], Mapping[str, str], str, str, "str | None", Mapping[str, Any]], None]


def _load(path: str) -> Any:
    """A Parquet or CSV table as a DataFrame, a JSON file as a dict."""
    from ..io import read_frame, read_json

    if path.endswith(".parquet"):
        return read_frame(path)
    if path.endswith(".csv"):
        import pandas as pd

        return pd.read_csv(path)
    return read_json(path)


def _draw_returned_figure(fn, inputs, png, pdf, dataset, params) -> None:
    """`fn(<each input, loaded, by its name>, dataset=..., **params)` returns a Figure; save it as PNG and PDF."""
    from .output import save_figure

    save_figure(fn(**{k: _load(p) for k, p in inputs.items()}, dataset=dataset, **params), png, pdf)


def _draw_mean_estimation(fn, inputs, png, pdf, dataset, params) -> None:
    """`fn(results table, png, pdf, **params)` writes both files itself."""
    fn(_load(inputs["results"]), png, pdf, **params)


def _draw_contributions(fn, inputs, png, pdf, dataset, params) -> None:
    """`fn(contributions.json path, png, pdf, dataset=..., release=contributions_dp.json path or None)` writes both
    files itself; with DP contribution statistics it draws the release, never the exact counts."""
    fn(inputs["stats"], png, pdf, dataset=dataset, release=inputs.get("release"), **params)


def _draw_from_path(fn, inputs, png, pdf, dataset, params) -> None:
    """`fn(path of the only input, png, pdf, **params)` writes both files itself."""
    (path,) = inputs.values()
    fn(path, png, pdf, **params)


@dataclass(frozen=True)
class Family:
    """Figures drawn the same way from the same kind of artifact.

    `datasets` lists, for a config, the datasets a per-dataset family has a
    figure for (None: one figure per workflow).
    """

    name: str
    draw: DrawFn
    datasets: Callable[[Mapping], list[str]] | None = None
    #: Whether rule `all` draws the family (False: only its own target, e.g. `snakemake audit`).
    in_all: bool = True

    @property
    def per_dataset(self) -> bool:
        return self.datasets is not None


@dataclass(frozen=True)
class Figure:
    """One figure: its name (file stem, rule plot_<name>, caption <name>.rst), family and plotting function."""

    name: str
    family: Family
    function: str

    @property
    def rule(self) -> str:
        return f"plot_{self.name}"

    @property
    def caption(self) -> str:
        """The caption file, relative to the repository root."""
        return f"{CAPTION_DIR}/{self.name}.rst"

    def path(self, fmt: str, dataset: str | None = None) -> str:
        """The output file in format `fmt` (a template with {dataset} for per-dataset figures when no dataset)."""
        if not self.family.per_dataset:
            return f"{FIGURE_DIR}/{self.name}.{fmt}"
        return f"{FIGURE_DIR}/{self.name}_{dataset if dataset is not None else '{dataset}'}.{fmt}"

    def plot_function(self) -> Callable[..., Any]:
        module, _, attr = self.function.rpartition(".")
        return getattr(importlib.import_module(f"{__package__}.{module}"), attr)

    def draw(self, inputs: Mapping[str, str], png: str, pdf: str, dataset: str | None = None, **params) -> None:
        """Draw this figure from `inputs` (paths by name) into `png` and `pdf`."""
        self.family.draw(self.plot_function(), inputs, str(png), str(pdf), dataset, params)


LM = Family("lm", _draw_returned_figure, datasets=grid.grid_datasets)
MEAN_ESTIMATION = Family("mean_estimation", _draw_mean_estimation)
CONTRIBUTIONS = Family("contributions", _draw_contributions, datasets=lambda config: list(config["datasets"]))
ACCOUNTING = Family("accounting", _draw_from_path)
# The membership audit (target `audit`, not rule all: it trains its own runs).
AUDIT = Family("audit", _draw_returned_figure, datasets=grid.audited_datasets, in_all=False)
# The white-box audit of the mechanism (target `audit_mechanism`): the same figure from mechanism.csv.
AUDIT_MECHANISM = Family("audit_mechanism", _draw_returned_figure, datasets=grid.audited_datasets, in_all=False)
# Who pays for privacy: the cost of privacy per user group (rule groups' tables), per grid dataset.
GROUPS = Family("groups", _draw_returned_figure, datasets=grid.grid_datasets)
# The options of grid.options against the grid's DP-SGD, per grid dataset (none without options).
OPTIONS = Family("options", _draw_returned_figure,
                 datasets=lambda config: grid.grid_datasets(config) if config["grid"]["options"] else [])
FAMILIES = {f.name: f for f in (LM, MEAN_ESTIMATION, CONTRIBUTIONS, ACCOUNTING, AUDIT, AUDIT_MECHANISM, GROUPS,
                                OPTIONS)}

#: name -> Figure, in the order of the report.
FIGURES: dict[str, Figure] = {}


def _register(figure: Figure) -> None:
    if figure.name in FIGURES:
        raise ValueError(f"figure {figure.name!r} is registered twice")
    FIGURES[figure.name] = figure


_register(Figure("contributions", CONTRIBUTIONS, "contributions.plot_contributions"))
_register(Figure("noise_vs_group_size", ACCOUNTING, "accounting.plot_noise_vs_group_size"))
_register(Figure("lm_loss_vs_epsilon", LM, "lm.loss_vs_epsilon"))
_register(Figure("lm_loss_vs_budget", LM, "lm.loss_vs_budget"))
_register(Figure("lm_uls_minus_els", LM, "lm.uls_minus_els"))
_register(Figure("lm_loss_vs_group_size", LM, "lm.loss_vs_group_size"))
_register(Figure("training_curves", LM, "lm.training_curves"))
_register(Figure("lm_options_loss_gap", OPTIONS, "lm.options_loss_gap"))
_register(Figure("groups_cost", GROUPS, "groups.cost_by_group"))
_register(Figure("groups_gap_vs_examples", GROUPS, "groups.gap_vs_examples"))
_register(Figure("audit_epsilon", AUDIT, "audit.empirical_vs_claimed"))
_register(Figure("audit_mechanism_epsilon", AUDIT_MECHANISM, "audit.mechanism_vs_claimed"))
_register(Figure("mean_estimation_vs_epsilon", MEAN_ESTIMATION, "mean_estimation.plot_vs_epsilon"))
_register(Figure("mean_estimation_vs_diversity", MEAN_ESTIMATION, "mean_estimation.plot_vs_diversity"))
_register(Figure("mean_estimation_vs_budget", MEAN_ESTIMATION, "mean_estimation.plot_vs_budget"))
_register(Figure("mean_estimation_vs_group_size", MEAN_ESTIMATION, "mean_estimation.plot_vs_group_size"))


def per_user_points(config: Mapping) -> dict[str, bool]:
    """groups.per_user_points: per grid dataset, whether groups_gap_vs_examples draws a point per test user."""
    mode = config["groups"]["per_user_points"]
    return {d: mode == "always" or (mode == "synthetic" and config["datasets"][d].get("source") == "synthetic")
            for d in grid.grid_datasets(config)}


def figure_of_rule(rule: str) -> Figure:
    """The figure drawn by rule `rule` (plot_<name>)."""
    for figure in FIGURES.values():
        if figure.rule == rule:
            return figure
    raise ValueError(f"rule {rule!r} draws no registered figure; registered: {sorted(FIGURES)}")


def figure_targets(config: Mapping, family: str | None = None) -> list[str]:
    """PNG and PDF of every figure (of `family`, if given; else of every family rule `all` draws) the config asks for."""
    if family is not None and family not in FAMILIES:
        raise ValueError(f"unknown figure family {family!r}; known: {sorted(FAMILIES)}")
    out = []
    for figure in FIGURES.values():
        if family is not None and figure.family.name != family:
            continue
        if family is None and not figure.family.in_all:
            continue
        datasets = figure.family.datasets(config) if figure.family.per_dataset else [None]
        out += [figure.path(fmt, d) for d in datasets for fmt in FORMATS]
    return out
