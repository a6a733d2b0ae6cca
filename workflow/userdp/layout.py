"""The workflow layout: where every artifact of the pipeline lives.

The one owner of:

- the path template of every artifact the library finds or names. Templates
  use Snakemake's wildcard syntax (`results/data/{dataset}/tokens.parquet`)
  and are the ones the rules write out (workflow/rules/*.smk; a test checks
  it); the library formats them with `str.format`
  (`layout.TOKENS.format(dataset="synth")`);
- the wildcard regexes (`WILDCARD_RES`, the rules' wildcard constraints,
  `CELL_RE` for the `{cell}` wildcard of the evaluation rules, `names_regex`);
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
    # a name of grid.options (a side-by-side variant of the private cells' mechanism or optimizer)
    "option": r"[A-Za-z][A-Za-z0-9_]*",
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


def names_regex(names: list[str]) -> str:
    """A wildcard regex matching exactly these names (e.g. the config's datasets; nothing if there are none)."""
    return "|".join(re.escape(n) for n in names) or "(?!)"


def _unnamed(template: str, **wildcard_res: str) -> str:
    """template_regex without group names (to embed in a wildcard constraint)."""
    return re.sub(r"\(\?P<[a-z_]+>", "(?:", template_regex(template, **wildcard_res))


# ---------------------------------------------------------------- path templates
# The artifacts the library itself finds or names (to read a cell's files back, to write a run folder). The
# rules (workflow/rules/*.smk) write every path out; tests/test_layout.py checks that each template here is one
# the rules spell, so the two cannot drift apart. Paths only the rules know (logs, benchmark files, report
# tables) are written there alone.

# The workflow's default config (the Snakefile's configfile, relative to the working directory).
DEFAULT_CONFIG = "config/config.yaml"

# Data stage.
DOWNLOADS = "data"  # raw downloads and caches, one folder per dataset (data/{dataset}/)
DATA = "results/data/{dataset}"
EXAMPLES = DATA + "/examples.parquet"
USERS = DATA + "/users.parquet"
CONTRIBUTIONS = DATA + "/contributions.json"
CONTRIBUTIONS_DP = DATA + "/contributions_dp.json"
PUBLIC = DATA + "/public.parquet"
TOKENS = DATA + "/tokens.parquet"
TOKENIZER = "results/tokenizer/tokenizer.json"

# Plan stage: one plan per (dataset, method, epsilon, budget[, G]).
_SETTING = "method~{method}/eps~{eps}/budget~{budget}"
_GROUP = "group~{group}"
_SEED = "seed~{seed}"
_LR = "lr~{lr}"
_OPTION = "option~{option}"
PLAN = "results/plan/{dataset}/" + _SETTING + ".json"
GROUP_PLAN = "results/plan/{dataset}/" + _SETTING + "/" + _GROUP + ".json"
# A private cell run with one of grid.options: its own plan and folder below option~{option}/.
OPTION_PLAN = "results/plan/{dataset}/" + _OPTION + "/" + _SETTING + ".json"
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

# Runs: a grid cell's folder is RUNS/{cell}, {cell} being CELL, GROUP_CELL or OPTION_CELL formatted (matched by
# CELL_RE); each learning rate trains into its RUN_DIR.
RUNS = "results/runs/{dataset}"
CELL = _SETTING + "/" + _SEED
GROUP_CELL = _SETTING + "/" + _GROUP + "/" + _SEED
OPTION_CELL = _OPTION + "/" + CELL


def _cell_re(eps: str) -> str:
    setting, seed = _unnamed(_SETTING, eps=eps), _unnamed(_SEED)
    return (f"(?:{_unnamed(_OPTION)}/{setting}/{seed}|{setting}(?:/{_unnamed(_GROUP)})?/{seed})")


CELL_RE = _cell_re(EPS_RE)
# The private cells (finite epsilon) and the non-private references (eps~inf): under random stopping
# (privacy.selection) the former are rule random_stopping's, the latter select_lr's.
PRIVATE_CELL_RE, NON_PRIVATE_CELL_RE = _cell_re(NUMBER_RE), _cell_re("inf")
CELL_DIR = RUNS + "/{cell}"
RUN_DIR = CELL_DIR + "/" + _LR
# Files of a run folder (RUN_DIR) and of a cell folder (CELL_DIR): the chosen
# learning rate's ledger and train log are copied up next to metrics.json.
LEDGER = "ledger.json"
TRAIN_LOG = "train_log.parquet"
RUN_MODEL = "model"  # the fine-tuned model's folder in a run folder (and a random-stopping cell's released model)
EVAL = "eval.json"
PLAN_FILE = "plan.json"  # the run spec in a run folder written by userdp.fine_tune (the pipeline keeps plans in results/plan/)
METRICS = "metrics.json"
PRETRAINED_METRICS = RUNS + "/pretrained/" + METRICS
# Per-user test scores: eval_users.parquet next to eval.json in a run folder.
EVAL_USERS = "eval_users.parquet"

# Summary of a dataset's grid, and the cost of privacy per user group (who pays for privacy).
SUMMARY_DIR = "results/summary/{dataset}"
SUMMARY = SUMMARY_DIR + "/metrics.parquet"
GROUPS = SUMMARY_DIR + "/groups.parquet"

# The user-level membership audit (target `audit`) and the white-box audit of the mechanism.
AUDIT = "results/audit/{dataset}"
AUDIT_TOKENS = AUDIT + "/tokens.parquet"
AUDIT_MECHANISM = AUDIT + "/mechanism.csv"

# Logs, one per job, and per-job resource use (snakemake's `benchmark:` files: wall s, cpu_time, max_rss, ...),
# one per log: the log's path under results/benchmarks with .tsv for .log (benchmarks/profile_pipeline.py sums
# them per rule).
LOGS = "results/logs"
BENCHMARKS = "results/benchmarks"


def benchmark_of(log_template: str) -> str:
    """The benchmark file template of the job whose log template is `log_template` (same wildcards)."""
    if not (log_template.startswith(LOGS + "/") and log_template.endswith(".log")):
        raise ValueError(f"{log_template!r} is not a log template under {LOGS}/")
    return BENCHMARKS + log_template[len(LOGS):-len(".log")] + ".tsv"


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
