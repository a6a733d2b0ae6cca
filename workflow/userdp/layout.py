"""The workflow layout: where every artifact of the pipeline lives.

The one owner of:

- the path template of every artifact and log. Templates use Snakemake's
  wildcard syntax (`results/data/{dataset}/tokens.parquet`): the rules use
  them as they are (a rule's output is e.g. `layout.PLAN` or
  `layout.RUN_DIR + "/" + layout.LEDGER`), the library formats them with
  `str.format` (`layout.TOKENS.format(dataset="synth")`);
- the wildcard regexes (`WILDCARD_RES`, the rules' wildcard constraints, and
  `CELL_RE` for the `{cell}` wildcard of the evaluation rules);
- the text of numbers in paths (`fmt_num`, `parse_num`).

The grid of cells, whose plan and run paths are these templates formatted,
is userdp.grid.

Imports nothing from the stages (nor the config validation): it only reads
an already validated config mapping.
"""

from __future__ import annotations

import math
import re
import string


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
