"""The workflow layout: where every artifact of the pipeline lives, and the grid of cells.

The one owner of:

- the path template of every artifact and log. Templates use Snakemake's
  wildcard syntax (`results/data/{dataset}/tokens.parquet`): the rules use
  them as they are (a rule's output is e.g. `layout.PLAN` or
  `layout.RUN_DIR + "/" + layout.LEDGER`), the library formats them with
  `str.format` (`layout.TOKENS.format(dataset="synth")`);
- the wildcard regexes (`WILDCARD_RES`, the rules' wildcard constraints, and
  `CELL_RE` for the `{cell}` wildcard of the evaluation rules);
- the text of numbers in paths (`fmt_num`, `parse_num`);
- the grid (`Cell`, `grid_datasets`, `steps_for_budget`, `iter_cells`), whose
  plan and run paths are these templates formatted.

Imports nothing from the stages (nor the config validation): it only reads
an already validated config mapping.
"""

from __future__ import annotations

import math
import re
import string
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from .errors import ConfigError

# ---------------------------------------------------------------- wildcard regexes

# The text fmt_num gives a finite number: digits, an optional fraction and an
# exponent without '+' (1e-05, 0.5, 4, 1e16).
NUMBER_RE = r"[0-9]+(?:\.[0-9]+)?(?:e-?[0-9]+)?"
# What each wildcard of the templates below may match (the rules' wildcard constraints).
WILDCARD_RES: dict[str, str] = {
    "dataset": r"[A-Za-z0-9_-]+",
    "method": r"els|uls",
    "eps": r"inf|" + NUMBER_RE,
    "budget": r"[0-9]+",
    "seed": r"[0-9]+",
    "group": r"[0-9]+",
    "lr": NUMBER_RE,
}
EPS_RE = WILDCARD_RES["eps"]
LR_RE = WILDCARD_RES["lr"]


def template_regex(template: str, **wildcard_res: str) -> str:
    """A regex matching the instances of `template`: literal text escaped, each `{name}` a named group.

    A wildcard matches its regex in `wildcard_res`, else in WILDCARD_RES.
    """
    res = {**WILDCARD_RES, **wildcard_res}
    parts = []
    for literal, name, _, _ in string.Formatter().parse(template):
        parts.append(re.escape(literal))
        if name is not None:
            parts.append(f"(?P<{name}>{res[name]})")
    return "".join(parts)


def _unnamed(template: str, **wildcard_res: str) -> str:
    """template_regex without group names (to embed in a wildcard constraint)."""
    return re.sub(r"\(\?P<[a-z_]+>", "(?:", template_regex(template, **wildcard_res))


# ---------------------------------------------------------------- path templates

# The workflow's default config (the Snakefile's configfile, relative to the working directory).
DEFAULT_CONFIG = "config/config.yaml"

# Data stage.
DOWNLOADS = "data"  # raw downloads and caches, one folder per dataset (data/{dataset}/)
DOWNLOAD = DOWNLOADS + "/{dataset}/download.json"
DATA = "results/data/{dataset}"
EXAMPLES = DATA + "/examples.parquet"
USERS = DATA + "/users.parquet"
CONTRIBUTIONS = DATA + "/contributions.json"
CONTRIBUTIONS_DP = DATA + "/contributions_dp.json"
USER_LABELS = DATA + "/user_labels.parquet"  # per-user group labels (synthetic topic, datasets.<name>.group_column)
PUBLIC = DATA + "/public.parquet"
TOKENS = DATA + "/tokens.parquet"
PUBLIC_TOKENS = DATA + "/public_tokens.parquet"
DATA_ARTIFACT = DATA + "/{artifact}"  # any file of a dataset (rule unknown_dataset)
TOKENIZER_DIR = "results/tokenizer"
TOKENIZER = TOKENIZER_DIR + "/tokenizer.json"
TOKENIZER_INFO = TOKENIZER_DIR + "/tokenizer_info.json"

# Plan stage: one plan per (dataset, method, epsilon, budget[, G]).
_SETTING = "method~{method}/eps~{eps}/budget~{budget}"
_GROUP = "group~{group}"
_SEED = "seed~{seed}"
_LR = "lr~{lr}"
PLAN = "results/plan/{dataset}/" + _SETTING + ".json"
GROUP_PLAN = "results/plan/{dataset}/" + _SETTING + "/" + _GROUP + ".json"
ACCOUNTING_COMPARISON = "results/accounting/comparison.parquet"
#: The accountant memo shared by the pipeline's jobs (userdp.privacy.memo; safe to delete).
ACCOUNTING_MEMO = "results/cache/accounting"

# Models. A saved model folder holds MODEL_FILES.
MODEL_CONFIG = "config.json"
MODEL_WEIGHTS = "model.safetensors"
MODEL_FILES = (MODEL_CONFIG, MODEL_WEIGHTS)
# A fine-tuned run with model.lora saves only its adapter (peft's save_pretrained); the base is model.name or
# PRETRAINED, named in the adapter config.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
PRETRAINED = "results/model/pretrained"

# Runs: a grid cell's folder is RUNS/{cell}, {cell} being CELL or GROUP_CELL
# formatted (matched by CELL_RE); each learning rate trains into its RUN_DIR (one job of rule finetune
# trains every rate of a cell, or one rate: training.sweep_jobs, userdp.training.targets.lr_dirs).
RUNS = "results/runs/{dataset}"
CELL = _SETTING + "/" + _SEED
GROUP_CELL = _SETTING + "/" + _GROUP + "/" + _SEED


def _cell_re(eps: str) -> str:
    return _unnamed(_SETTING, eps=eps) + "(?:/" + _unnamed(_GROUP) + ")?/" + _unnamed(_SEED)


CELL_RE = _cell_re(EPS_RE)
# The private cells (finite epsilon) and the non-private references (eps~inf): under random stopping
# (privacy.selection) the former are rule random_stopping's, the latter select_lr's.
PRIVATE_CELL_RE, NON_PRIVATE_CELL_RE = _cell_re(NUMBER_RE), _cell_re("inf")
CELL_DIR = RUNS + "/{cell}"
RUN_DIR = CELL_DIR + "/" + _LR
# RUN_DIR with the cell's own wildcards (rules finetune and finetune_group).
FINETUNE_RUN_DIR = RUN_DIR.replace("{cell}", CELL)
FINETUNE_GROUP_RUN_DIR = RUN_DIR.replace("{cell}", GROUP_CELL)
# Files of a run folder (RUN_DIR) and of a cell folder (CELL_DIR): the chosen
# learning rate's ledger and train log are copied up next to metrics.json.
LEDGER = "ledger.json"
TRAIN_LOG = "train_log.parquet"
RUN_MODEL = "model"  # the fine-tuned model's folder in a run folder (and a random-stopping cell's released model)
EVAL = "eval.json"
PLAN_FILE = "plan.json"  # the run spec in a run folder written by userdp.fine_tune (the pipeline keeps plans in results/plan/)
METRICS = "metrics.json"
PRETRAINED_METRICS = RUNS + "/pretrained/" + METRICS
# Per-user test scores: eval_users.parquet next to eval.json in a run folder; the chosen (released) run's as
# users.parquet in the cell folder; the pretrained model's next to its metrics.json.
EVAL_USERS = "eval_users.parquet"
USER_SCORES = "users.parquet"
PRETRAINED_USER_SCORES = RUNS + "/pretrained/" + USER_SCORES

# Summary of a dataset's grid.
SUMMARY_DIR = "results/summary/{dataset}"
SUMMARY = SUMMARY_DIR + "/metrics.parquet"
SUMMARY_CSV = SUMMARY_DIR + "/metrics.csv"
TRAIN_CURVES = SUMMARY_DIR + "/train_curves.parquet"
# Who pays for privacy: every evaluated test user's loss per run, and the cost of privacy per user group.
SUMMARY_USERS = SUMMARY_DIR + "/users.parquet"
GROUPS = SUMMARY_DIR + "/groups.parquet"
GROUPS_CSV = SUMMARY_DIR + "/groups.csv"

# The findings table of a study (findings.name): each claim's effect, interval and verdict.
FINDINGS_DIR = "results/findings"
FINDINGS = FINDINGS_DIR + "/{study}.json"
FINDINGS_CSV = FINDINGS_DIR + "/{study}.csv"

# The synthetic mean-estimation study.
MEAN_ESTIMATION = "results/mean_estimation"
MEAN_ESTIMATION_CALIBRATION = MEAN_ESTIMATION + "/calibration.parquet"
MEAN_ESTIMATION_RESULTS = MEAN_ESTIMATION + "/results.parquet"
MEAN_ESTIMATION_LR_SWEEP = MEAN_ESTIMATION + "/lr_sweep.parquet"

# The user-level membership audit (target `audit`): canaries, the tokens the
# audit trains on, and per audited cell its plan, run folder and scores.
AUDIT = "results/audit/{dataset}"
AUDIT_CANARIES = AUDIT + "/canaries.parquet"
AUDIT_TOKENS = AUDIT + "/tokens.parquet"
AUDIT_PLAN = AUDIT + "/plan/" + _SETTING + ".json"
AUDIT_RUN_DIR = AUDIT + "/runs/" + _SETTING + "/" + _SEED + "/" + _LR
AUDIT_SCORES = AUDIT + "/scores/" + _SETTING + "/" + _SEED + ".parquet"
AUDIT_RESULT = AUDIT + "/scores/" + _SETTING + "/" + _SEED + ".json"
AUDIT_SUMMARY = AUDIT + "/summary.parquet"
AUDIT_SUMMARY_CSV = AUDIT + "/summary.csv"
AUDIT_TABLE = AUDIT + "/table.html"
AUDIT_MECHANISM = AUDIT + "/mechanism.csv"

# Logs, one per job.
LOGS = "results/logs"
LOG_DOWNLOAD = LOGS + "/data/download_{dataset}.log"
LOG_PREPARE = LOGS + "/data/prepare_{dataset}.log"
LOG_PREPARE_PUBLIC = LOGS + "/data/prepare_public_{dataset}.log"
LOG_TOKENIZER = LOGS + "/data/tokenizer.log"
LOG_TOKENIZE = LOGS + "/data/tokenize_{dataset}.log"
LOG_TOKENIZE_PUBLIC = LOGS + "/data/tokenize_public_{dataset}.log"
LOG_UNKNOWN_DATASET = LOGS + "/data/unknown_{dataset}_{artifact}.log"
LOG_CONTRIBUTIONS_DP = LOGS + "/plan/contributions_dp_{dataset}.log"
LOG_PLAN = LOGS + "/plan/{dataset}/" + _SETTING + ".log"
LOG_GROUP_PLAN = LOGS + "/plan/{dataset}/" + _SETTING + "/" + _GROUP + ".log"
LOG_ACCOUNTING_COMPARISON = LOGS + "/accounting/comparison.log"
LOG_FINDINGS = LOGS + "/findings/{study}.log"
LOG_PRETRAIN = LOGS + "/pretrain.log"
# training.sweep_jobs: per_cell = one fine-tuning job per cell trains and evaluates every learning rate in turn,
# with a log per cell; per_run = a job and a log per run folder (`_RUN` logs).
LOG_FINETUNE = LOGS + "/finetune/{dataset}/" + CELL + ".log"
LOG_FINETUNE_GROUP = LOGS + "/finetune/{dataset}/" + GROUP_CELL + ".log"
LOG_FINETUNE_RUN = LOGS + "/finetune/{dataset}/" + CELL + "/" + _LR + ".log"
LOG_FINETUNE_GROUP_RUN = LOGS + "/finetune/{dataset}/" + GROUP_CELL + "/" + _LR + ".log"
LOG_EVALUATE_PRETRAINED = LOGS + "/evaluate/{dataset}/pretrained.log"
LOG_SELECT_LR = LOGS + "/select_lr/{dataset}/{cell}.log"
LOG_RANDOM_STOPPING = LOGS + "/random_stopping/{dataset}/{cell}.log"
LOG_AGGREGATE = LOGS + "/aggregate/{dataset}.log"
LOG_GROUPS = LOGS + "/groups/{dataset}.log"
LOG_USER_LABELS = LOGS + "/data/user_labels_{dataset}.log"
LOG_MEAN_ESTIMATION_CALIBRATION = LOGS + "/mean_estimation/calibration.log"
LOG_MEAN_ESTIMATION = LOGS + "/mean_estimation/run.log"
LOG_AUDIT_CANARIES = LOGS + "/audit/{dataset}/canaries.log"
LOG_AUDIT_PLAN = LOGS + "/audit/{dataset}/plan/" + _SETTING + ".log"
LOG_AUDIT_FINETUNE = LOGS + "/audit/{dataset}/finetune/" + CELL + "/" + _LR + ".log"
LOG_AUDIT_SCORE = LOGS + "/audit/{dataset}/score/" + CELL + ".log"
LOG_AUDIT_SUMMARY = LOGS + "/audit/{dataset}/summary.log"
LOG_AUDIT_MECHANISM = LOGS + "/audit/{dataset}/mechanism.log"

# Per-job resource use (snakemake's `benchmark:` files: wall s, cpu_time, max_rss, ...), one per log: the
# log's path under results/benchmarks with .tsv for .log (benchmarks/profile_pipeline.py sums them per rule).
BENCHMARKS = "results/benchmarks"


def benchmark_of(log_template: str) -> str:
    """The benchmark file template of the job whose log template is `log_template` (same wildcards)."""
    if not (log_template.startswith(LOGS + "/") and log_template.endswith(".log")):
        raise ValueError(f"{log_template!r} is not a log template under {LOGS}/")
    return BENCHMARKS + log_template[len(LOGS):-len(".log")] + ".tsv"


def model_files(folder: str, adapter: bool = False) -> list[str]:
    """The files of a saved model folder (MODEL_FILES), or of a saved LoRA adapter (ADAPTER_FILES), in that order."""
    return [f"{folder}/{name}" for name in (ADAPTER_FILES if adapter else MODEL_FILES)]


# ---------------------------------------------------------------- numbers in paths


def fmt_num(x: float | int | str) -> str:
    """Canonical text of a number for artifact paths: 4, 0.5, 1e-05, 1e16, inf.

    `1` and `1.0` give the same text, so one cell never gets two paths. The
    exponent never has a '+' (repr(1e16) is '1e+16'), so the text matches the
    eps/lr wildcard patterns (NUMBER_RE), which allow `e-?[0-9]+`.
    """
    v = float(x)
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(v).replace("e+", "e")


#: File endings of the pipeline's artifacts that a config file never has (config files may be YAML or JSON).
ARTIFACT_SUFFIXES = (".parquet", ".csv", ".png", ".pdf", ".html", ".safetensors", ".log")


def looks_like_artifact(path: str) -> bool:
    """Whether `path` names a pipeline artifact (under results/, or with an artifact-only ending) rather than a
    config file (a command-line word given to --configfile by mistake). A JSON file outside results/ may be a
    config file."""
    p = path.replace("\\", "/")
    return p.startswith("results/") or "/results/" in p or p.endswith(ARTIFACT_SUFFIXES)


def parse_num(text: str) -> float:
    """The number a path's eps~/lr~ text stands for (the inverse of fmt_num)."""
    return float(text)


# ---------------------------------------------------------------- the grid


@dataclass(frozen=True)
class Cell:
    """One fine-tuning grid cell. `group_size` is set only for G-sweep cells."""

    dataset: str
    method: str
    epsilon: float
    compute: int
    steps: int
    seed: int
    group_size: int | None = None

    @property
    def eps_text(self) -> str:
        return fmt_num(self.epsilon)

    def wildcards(self) -> dict[str, str | int]:
        return {"dataset": self.dataset, "method": self.method, "eps": self.eps_text, "budget": self.compute,
                "seed": self.seed, "group": self.group_size or 0}

    @property
    def plan_path(self) -> str:
        """The plan this cell trains with (PLAN, or GROUP_PLAN for a G-sweep cell)."""
        return (GROUP_PLAN if self.group_size else PLAN).format(**self.wildcards())

    @property
    def cell(self) -> str:
        """The cell's folder below RUNS: the `{cell}` wildcard of CELL_DIR (CELL or GROUP_CELL formatted)."""
        return (GROUP_CELL if self.group_size else CELL).format(**self.wildcards())

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
_CELL_RES = tuple(re.compile(template_regex(t)) for t in (CELL, GROUP_CELL))


def cell_of_dir(path: str, config: Mapping | None = None, *, steps: int | None = None) -> Cell:
    """The grid cell whose folder (CELL_DIR, possibly below another root) is `path`.

    The inverse of Cell.run_dir; the steps are `steps` when given (e.g. the cell's plan's), else those of
    the config's grid.budgets entry (steps_for_budget).
    """
    m = _CELL_DIR_RE.fullmatch(str(path).rstrip("/"))
    if m is None:
        raise ValueError(f"{path} is not a grid cell's folder ({CELL_DIR} with {{cell}} {CELL} or {GROUP_CELL})")
    w = next(mm.groupdict() for r in _CELL_RES if (mm := r.fullmatch(m["cell"])) is not None)
    group = w.get("group")
    if steps is None:
        if config is None:
            raise TypeError("cell_of_dir needs the config (its grid.budgets) or the cell's steps")
        steps = steps_for_budget(config, w["budget"])
    return Cell(m["dataset"], w["method"], parse_num(w["eps"]), int(w["budget"]), int(steps), int(w["seed"]),
                None if group is None else int(group))


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


def audit_learning_rate(config: Mapping) -> float:
    """The audit's one learning rate: audit.learning_rate, or the first of training.learning_rates."""
    lr = config["audit"]["learning_rate"]
    return float(config["training"]["learning_rates"][0] if lr is None else lr)


def audit_wildcards(cell: Cell, config: Mapping) -> dict[str, str | int]:
    """The wildcards of an audited cell's AUDIT_* paths (lr: the audit's learning rate)."""
    return {**cell.wildcards(), "lr": fmt_num(audit_learning_rate(config))}


# ---------------------------------------------------------------- canonical params


def sorted_dict(value: Any) -> Any:
    """A copy of `value` with every mapping's keys in sorted order (recursively).

    For rule params built from the config: Snakemake records a param as its
    repr, so the record must depend on content only (see sort_keys_in_place).
    """
    if isinstance(value, Mapping):
        return {str(k): sorted_dict(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, (list, tuple)):
        return [sorted_dict(v) for v in value]
    return value


def sort_keys_in_place(obj: Any) -> None:
    """Sort the keys of every mapping in `obj`, recursively, keeping each dict object.

    Snakemake compares rule params by their repr, so without this a config
    whose keys merely come in another order (a reordered file, defaults filled
    in another order) would rerun every job. Each dict is rebuilt in place
    (clear + update) because Snakemake's `config` must stay the same object;
    lists keep their order (it means something: e.g. the first budget).
    """
    if isinstance(obj, dict):
        for value in obj.values():
            sort_keys_in_place(value)
        items = sorted(obj.items(), key=lambda kv: str(kv[0]))
        obj.clear()
        obj.update(items)
    elif isinstance(obj, list):
        for value in obj:
            sort_keys_in_place(value)
