"""The registry of figures: every figure of the pipeline is declared here, once.

From these declarations come
- the figure rules (workflow/rules/figures.smk makes one rule `plot_<name>`
  per figure, with its inputs, its PNG and PDF outputs, its report entry
  and its plot params),
- the figure targets of rule `all` (`figure_targets`),
- the dispatch of the one plot script (workflow/scripts/plot_figure.py
  looks the figure up by its rule's name and calls `Figure.draw`).

Paths, by convention from the figure's name:
    results/figures/<name>_<dataset>.png|pdf  (per-dataset families)
    results/figures/<name>.png|pdf            (one figure per workflow)
    results/logs/figures/<name>[_<dataset>].log
    workflow/report/<name>.rst                (the report caption)

Adding a figure: write its plotting function (in a module of this package),
register it below with `_register(Figure(...))`, and write its caption
file. A new family also needs a `Family` with a `draw` adapter saying how
its functions are called.

Plotting functions are named by a string ("lm.loss_vs_epsilon", relative to
this package) and imported only when drawn, so reading the registry (the
Snakefile does, at every start) does not import matplotlib.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .. import grid, layout

FORMATS = ("png", "pdf")
FIGURE_DIR = "results/figures"
LOG_DIR = layout.LOGS + "/figures"
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
    """Figures drawn the same way from the same kind of artifact, and shown together in the report.

    `datasets` lists, for a config, the datasets a per-dataset family has a
    figure for (None: one figure per workflow). `dataset_regex`, if given,
    constrains the rules' {dataset} wildcard. `report_formats` are the
    formats shown in the report; with more than one, each entry is labelled
    with its format.
    """

    name: str
    category: str
    draw: DrawFn
    datasets: Callable[[Mapping], list[str]] | None = None
    dataset_regex: Callable[[Mapping], str] | None = None
    subcategory: str | None = None
    report_formats: tuple[str, ...] = FORMATS
    #: Whether rule `all` draws the family (False: only its own target, e.g. `snakemake audit`).
    in_all: bool = True

    @property
    def per_dataset(self) -> bool:
        return self.datasets is not None


@dataclass(frozen=True)
class Figure:
    """One figure: its name (file stem, rule plot_<name>, caption <name>.rst), inputs and plotting function.

    `inputs` maps input names to artifact paths ({dataset} in per-dataset
    families). `labels` are its report labels. `params`, if given, computes
    plot arguments from the config; they become rule params, so changing
    the config value re-plots the figure. `config_inputs`, if given, adds
    inputs that depend on the config (`inputs_for`).
    """

    name: str
    family: Family
    inputs: Mapping[str, str]
    function: str
    labels: Mapping[str, str] | None = None
    params: Callable[[Mapping], dict] | None = field(default=None, compare=False)
    config_inputs: Callable[[Mapping], Mapping[str, str]] | None = field(default=None, compare=False)

    @property
    def rule(self) -> str:
        return f"plot_{self.name}"

    @property
    def caption(self) -> str:
        """The caption file, relative to the repository root."""
        return f"{CAPTION_DIR}/{self.name}.rst"

    def _stem(self, dataset: str | None) -> str:
        if not self.family.per_dataset:
            return self.name
        return f"{self.name}_{dataset if dataset is not None else '{dataset}'}"

    def path(self, fmt: str, dataset: str | None = None) -> str:
        """The output file in format `fmt` (a template with {dataset} for per-dataset figures when no dataset)."""
        return f"{FIGURE_DIR}/{self._stem(dataset)}.{fmt}"

    @property
    def log(self) -> str:
        return f"{LOG_DIR}/{self._stem(None)}.log"

    def report_labels(self, fmt: str) -> dict[str, str] | None:
        """The report labels of the `fmt` file (its format added when the report shows several)."""
        if len(self.family.report_formats) < 2:
            return None if self.labels is None else dict(self.labels)
        return {**(self.labels or {}), "format": fmt.upper()}

    def inputs_for(self, config: Mapping) -> dict[str, str]:
        """The figure rule's inputs under `config`: `inputs` plus `config_inputs`."""
        return {**self.inputs, **({} if self.config_inputs is None else self.config_inputs(config))}

    def plot_params(self, config: Mapping) -> dict:
        return {} if self.params is None else dict(self.params(config))

    def plot_function(self) -> Callable[..., Any]:
        module, _, attr = self.function.rpartition(".")
        return getattr(importlib.import_module(f"{__package__}.{module}"), attr)

    def draw(self, inputs: Mapping[str, str], png: str, pdf: str, dataset: str | None = None, **params) -> None:
        """Draw this figure from `inputs` (paths by name) into `png` and `pdf`."""
        self.family.draw(self.plot_function(), inputs, str(png), str(pdf), dataset, params)


LM = Family(
    "lm", "Language-model fine-tuning", _draw_returned_figure, datasets=grid.grid_datasets, subcategory="{dataset}"
)
MEAN_ESTIMATION = Family("mean_estimation", "Mean estimation (synthetic)", _draw_mean_estimation)
CONTRIBUTIONS = Family(
    "contributions", "Data", _draw_contributions, datasets=lambda config: list(config["datasets"]),
    dataset_regex=lambda config: layout.names_regex(list(config["datasets"])), report_formats=("png",),
)
ACCOUNTING = Family("accounting", "Accounting", _draw_from_path)  # PNG and PDF in the report


# The membership audit (target `audit`, not rule all: it trains its own runs).
AUDIT = Family("audit", "Privacy audit", _draw_returned_figure, datasets=grid.audited_datasets, subcategory="{dataset}",
               report_formats=("png",), in_all=False)
# The white-box audit of the mechanism (target `audit_mechanism`): the same figure from mechanism.csv.
AUDIT_MECHANISM = Family("audit_mechanism", "Privacy audit", _draw_returned_figure, datasets=grid.audited_datasets,
                         subcategory="{dataset}", report_formats=("png",), in_all=False)
# Who pays for privacy: the cost of privacy per user group (rule groups' tables), per grid dataset.
GROUPS = Family("groups", "Who pays for privacy", _draw_returned_figure, datasets=grid.grid_datasets,
                subcategory="{dataset}", report_formats=("png",))
# The options of grid.options against the grid's DP-SGD, per grid dataset (none without options).
OPTIONS = Family("options", "Language-model fine-tuning", _draw_returned_figure,
                 datasets=lambda config: grid.grid_datasets(config) if config["grid"]["options"] else [],
                 subcategory="{dataset}")
FAMILIES = {f.name: f for f in (LM, MEAN_ESTIMATION, CONTRIBUTIONS, ACCOUNTING, AUDIT, AUDIT_MECHANISM, GROUPS,
                                OPTIONS)}

#: name -> Figure, in the order of the report.
FIGURES: dict[str, Figure] = {}


def _register(figure: Figure) -> None:
    if figure.name in FIGURES:
        raise ValueError(f"figure {figure.name!r} is registered twice")
    FIGURES[figure.name] = figure


def _group_sweep_point(config: Mapping) -> dict:
    at = grid.group_sweep_point(config)
    return {"epsilon": at["epsilon"], "budget": at["budget"]}


_LM_SUMMARY = {"summary": layout.SUMMARY, "pretrained": layout.PRETRAINED_METRICS}
_ME_RESULTS = {"results": layout.MEAN_ESTIMATION_RESULTS}

def _contribution_release(config: Mapping) -> dict[str, str]:
    # With privacy.contribution_stats.private the figure draws the DP histogram (contributions.json then holds
    # only the users per split).
    from ..privacy.targets import stats_private

    return {"release": layout.CONTRIBUTIONS_DP} if stats_private(config) else {}


_register(Figure("contributions", CONTRIBUTIONS, {"stats": layout.CONTRIBUTIONS},
                 "contributions.plot_contributions", labels={"figure": "contributions", "dataset": "{dataset}"},
                 config_inputs=_contribution_release))
_register(Figure("noise_vs_group_size", ACCOUNTING, {"comparison": layout.ACCOUNTING_COMPARISON},
                 "accounting.plot_noise_vs_group_size"))
_register(Figure("lm_loss_vs_epsilon", LM, _LM_SUMMARY, "lm.loss_vs_epsilon",
                 labels={"figure": "test loss vs epsilon"}))
_register(Figure("lm_loss_vs_budget", LM, _LM_SUMMARY, "lm.loss_vs_budget",
                 labels={"figure": "test loss vs compute budget"}))
_register(Figure("lm_uls_minus_els", LM, _LM_SUMMARY, "lm.uls_minus_els",
                 labels={"figure": "ULS - ELS over epsilon and budget"}))
_register(Figure("lm_loss_vs_group_size", LM, _LM_SUMMARY, "lm.loss_vs_group_size",
                 labels={"figure": "test loss vs group size G"}, params=_group_sweep_point))
_register(Figure("training_curves", LM, {"curves": layout.TRAIN_CURVES},
                 "lm.training_curves", labels={"figure": "training curves"}))
_register(Figure("lm_options_loss_gap", OPTIONS, {"summary": layout.SUMMARY, "options": layout.OPTIONS_SUMMARY},
                 "lm.options_loss_gap", labels={"figure": "loss gap to non-private per option"}))


def _per_user_points(config: Mapping) -> dict:
    # groups.per_user_points: per dataset, whether the figure draws a point per held-out test user
    mode = config["groups"]["per_user_points"]
    return {"points": {d: mode == "always" or (mode == "synthetic" and config["datasets"][d].get("source")
                                                == "synthetic") for d in grid.grid_datasets(config)}}


_register(Figure("groups_cost", GROUPS, {"groups": layout.GROUPS, "summary": layout.SUMMARY},
                 "groups.cost_by_group", labels={"figure": "cost of privacy per user group", "dataset": "{dataset}"}))
_register(Figure("groups_gap_vs_examples", GROUPS, {"users": layout.SUMMARY_USERS, "summary": layout.SUMMARY},
                 "groups.gap_vs_examples", labels={"figure": "cost of privacy vs the user's examples",
                                                   "dataset": "{dataset}"}, params=_per_user_points))
_register(Figure("audit_epsilon", AUDIT, {"summary": layout.AUDIT_SUMMARY}, "audit.empirical_vs_claimed",
                 labels={"figure": "empirical vs claimed epsilon", "dataset": "{dataset}"}))
_register(Figure("audit_mechanism_epsilon", AUDIT_MECHANISM, {"mechanism": layout.AUDIT_MECHANISM},
                 "audit.mechanism_vs_claimed",
                 labels={"figure": "empirical vs claimed epsilon, white-box", "dataset": "{dataset}"}))
_register(Figure("mean_estimation_vs_epsilon", MEAN_ESTIMATION, _ME_RESULTS, "mean_estimation.plot_vs_epsilon",
                 labels={"figure": "error vs epsilon"}))
_register(Figure("mean_estimation_vs_diversity", MEAN_ESTIMATION, _ME_RESULTS, "mean_estimation.plot_vs_diversity",
                 labels={"figure": "error vs intra-user diversity"}))
_register(Figure("mean_estimation_vs_budget", MEAN_ESTIMATION, _ME_RESULTS, "mean_estimation.plot_vs_budget",
                 labels={"figure": "error vs compute budget"}))
_register(Figure("mean_estimation_vs_group_size", MEAN_ESTIMATION, _ME_RESULTS,
                 "mean_estimation.plot_vs_group_size", labels={"figure": "error vs contribution bound G"}))


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
