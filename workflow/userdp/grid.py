"""The grid of fine-tuning cells the config asks for (`Cell`, `iter_cells`, `grid_datasets`,
`steps_for_budget`) and of audited cells (`audit_cells`): each cell's plan and run paths are userdp.layout's
templates formatted with its wildcards.

Imports nothing from the stages (nor the config validation): it only reads an already validated config mapping.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Iterator, Mapping

from .errors import ConfigError
from .layout import (CELL, CELL_DIR, CELL_RE, GROUP_CELL, GROUP_PLAN, OPTION_CELL, OPTION_PLAN, PLAN, RUN_DIR, fmt_num,
                     parse_num, template_regex)


# ---------------------------------------------------------------- the grid


@dataclass(frozen=True)
class Cell:
    """One fine-tuning grid cell. `group_size` is set only for G-sweep cells, `option` (a name of grid.options)
    only for a private cell run with that option."""

    dataset: str
    method: str
    epsilon: float
    compute: int
    steps: int
    seed: int
    group_size: int | None = None
    option: str | None = None

    @property
    def eps_text(self) -> str:
        return fmt_num(self.epsilon)

    def wildcards(self) -> dict[str, str | int]:
        return {"dataset": self.dataset, "method": self.method, "eps": self.eps_text, "budget": self.compute,
                "seed": self.seed, "group": self.group_size or 0, "option": self.option or ""}

    def _template(self, plain: str, group: str, option: str) -> str:
        return group if self.group_size else option if self.option else plain

    @property
    def plan_path(self) -> str:
        """The plan this cell trains with (PLAN, GROUP_PLAN for a G-sweep cell, OPTION_PLAN for an option's)."""
        return self._template(PLAN, GROUP_PLAN, OPTION_PLAN).format(**self.wildcards())

    @property
    def cell(self) -> str:
        """The cell's folder below RUNS: the `{cell}` wildcard of CELL_DIR (CELL, GROUP_CELL or OPTION_CELL
        formatted)."""
        return self._template(CELL, GROUP_CELL, OPTION_CELL).format(**self.wildcards())

    @property
    def run_dir(self) -> str:
        """The cell's folder (CELL_DIR): metrics.json and the chosen learning rate's ledger and train log."""
        return CELL_DIR.format(dataset=self.dataset, cell=self.cell)

    def lr_dir(self, lr: float | int | str) -> str:
        """The run folder (RUN_DIR) of one learning rate of this cell."""
        return RUN_DIR.format(dataset=self.dataset, cell=self.cell, lr=fmt_num(lr))


_CELL_DIR_RE = re.compile(
    "(?:.*/)?" + template_regex(CELL_DIR, cell=CELL_RE)
)
_CELL_RES = tuple(re.compile(template_regex(t)) for t in (CELL, GROUP_CELL, OPTION_CELL))


def cell_of_dir(path: str, config: Mapping | None = None, *, steps: int | None = None) -> Cell:
    """The grid cell whose folder (CELL_DIR, possibly below another root) is `path`.

    The inverse of Cell.run_dir; the steps are `steps` when given (e.g. the cell's plan's), else those of
    the config's grid.budgets entry (steps_for_budget).
    """
    m = _CELL_DIR_RE.fullmatch(str(path).rstrip("/"))
    if m is None:
        raise ValueError(f"{path} is not a grid cell's folder ({CELL_DIR} with {{cell}} {CELL}, {GROUP_CELL} or "
                         f"{OPTION_CELL})")
    w = next(mm.groupdict() for r in _CELL_RES if (mm := r.fullmatch(m["cell"])) is not None)
    group = w.get("group")
    if steps is None:
        if config is None:
            raise TypeError("cell_of_dir needs the config (its grid.budgets) or the cell's steps")
        steps = steps_for_budget(config, w["budget"])
    return Cell(m["dataset"], w["method"], parse_num(w["eps"]), int(w["budget"]), int(steps), int(w["seed"]),
                None if group is None else int(group), w.get("option"))


def grid_datasets(config: Mapping) -> list[str]:
    """The datasets of the fine-tuning grid: grid.datasets, or every dataset when it is null."""
    ds = config["grid"]["datasets"]
    return list(config["datasets"]) if ds is None else list(ds)


def steps_for_budget(config: Mapping, compute: int | str) -> int:
    """The steps T of the grid.budgets entry with compute K = `compute`."""
    for b in config["grid"]["budgets"]:
        if int(b["compute"]) == int(compute):
            return int(b["steps"])
    raise ConfigError(
        f"no grid.budgets entry has compute {compute}; configured: {[b['compute'] for b in config['grid']['budgets']]}"
    )


def group_sweep_point(config: Mapping) -> dict:
    """Where the G sweep (grid.group_size_sweep) runs: the first epsilon and the first budget listed."""
    grid = config["grid"]
    b0 = grid["budgets"][0]
    return {"epsilon": float(grid["epsilons"][0]), "budget": int(b0["compute"]), "steps": int(b0["steps"])}


def iter_cells(config: Mapping) -> Iterator[Cell]:
    """Every fine-tuning cell of the grid: private cells, eps=inf references, G sweep."""
    grid = config["grid"]
    epsilons = [float(e) for e in grid["epsilons"]]
    if grid["nonprivate"]:
        epsilons.append(math.inf)
    for dataset in grid_datasets(config):
        for method in grid["methods"]:
            for eps in epsilons:
                for b in grid["budgets"]:
                    for seed in grid["seeds"]:
                        yield Cell(dataset, method, eps, int(b["compute"]), int(b["steps"]), int(seed))
            at = group_sweep_point(config)
            for g in grid["group_size_sweep"]:
                for seed in grid["seeds"]:
                    yield Cell(dataset, method, at["epsilon"], at["budget"], at["steps"], int(seed), int(g))


def option_methods(config: Mapping, option: str) -> list[str]:
    """The methods grid.options.<option> runs, in grid.methods order: its `methods`, or every grid method."""
    methods = config["grid"]["options"][option].get("methods")
    return [m for m in config["grid"]["methods"] if methods is None or m in methods]


def option_cells(config: Mapping) -> Iterator[Cell]:
    """Every cell of grid.options: for each option, each private cell of the grid (dataset x the option's methods
    x finite epsilon x budget x seed; no non-private reference, no G sweep), run with the option. Compared
    with the grid's cell of the same (dataset, method, epsilon, budget, seed) at equal epsilon and compute."""
    private = [c for c in iter_cells(config) if math.isfinite(c.epsilon) and c.group_size is None]
    for option in config["grid"].get("options") or {}:
        methods = option_methods(config, option)
        yield from (replace(c, option=option) for c in private if c.method in methods)


def audit_budget(config: Mapping) -> tuple[int, int]:
    """(K, T) of the audit: audit.budget, or the first grid.budgets entry when it is null."""
    b = config["audit"]["budget"] or config["grid"]["budgets"][0]
    return int(b["compute"]), int(b["steps"])


def audit_epsilons(config: Mapping) -> list[float]:
    """The finite epsilons the audit trains at: audit.epsilons, or grid.epsilons when it is null."""
    eps = config["audit"]["epsilons"]
    return [float(e) for e in (config["grid"]["epsilons"] if eps is None else eps)]


def audit_cells(config: Mapping) -> Iterator[Cell]:
    """Every audited cell: audit.datasets x audit.methods x the audit epsilons (+ inf), at the audit budget.

    The seed is audit.seed. The cells' files are AUDIT_* formatted with
    `audit_wildcards(cell)`, never the grid's plan and run paths.
    """
    a = config["audit"]
    compute, steps = audit_budget(config)
    epsilons = audit_epsilons(config) + ([math.inf] if a["nonprivate"] else [])
    datasets = grid_datasets(config) if a["datasets"] is None else list(a["datasets"])
    for dataset in datasets:
        for method in a["methods"]:
            for eps in epsilons:
                yield Cell(dataset, method, eps, compute, steps, int(a["seed"]))


def audited_datasets(config: Mapping) -> list[str]:
    """The datasets with audited cells, in config order."""
    return list(dict.fromkeys(c.dataset for c in audit_cells(config)))


def audit_learning_rate(config: Mapping) -> float:
    """The audit's one learning rate: audit.learning_rate, or the first of training.learning_rates."""
    lr = config["audit"]["learning_rate"]
    return float(config["training"]["learning_rates"][0] if lr is None else lr)


def audit_wildcards(cell: Cell, config: Mapping) -> dict[str, str | int]:
    """The wildcards of an audited cell's AUDIT_* paths (lr: the audit's learning rate)."""
    return {**cell.wildcards(), "lr": fmt_num(audit_learning_rate(config))}
