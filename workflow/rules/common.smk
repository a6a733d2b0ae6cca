# Shared set-up: config validation, wildcard constraints, what the config decides for the rules (the file sets
# that vary with it), the input functions and the targets of rule all.
#
# Paths are written out in the rules (results/...); the library spells the same templates in userdp.layout for
# its own use (aggregating, reading a cell's folder back), and tests/test_layout.py checks that every path the
# rules spell is one of layout's templates, so the two cannot drift apart.
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(workflow.basedir) / "workflow"))  # also when a test's Snakefile includes only this

from userdp import grid, layout
from userdp.config import option_config, validate_config
from userdp.privacy import memo
from userdp.seeding import SCHEME as SEEDING
from userdp.errors import ConfigError
from snakemake.exceptions import WorkflowError

# A target written after --configfile is read as one more config file (argparse takes every word up to the
# next option); an artifact read as config would then be reported as unknown config keys.
_targets_as_config = [str(f) for f in workflow.overwrite_configfiles if layout.looks_like_artifact(str(f))]
if _targets_as_config:
    raise WorkflowError(
        f"--configfile got {', '.join(_targets_as_config)}, which look like targets (pipeline artifacts), not "
        "config files: --configfile takes every word after it. Put targets first: "
        "snakemake TARGET ... --configfile my.yaml"
    )

# The jobs share one memo of accountant results (the plan's, the ledgers' and selection's epsilons are the same
# computations); USERDP_ACCOUNTING_MEMO="" turns it off.
os.environ.setdefault(memo.ENV, layout.ACCOUNTING_MEMO)

# torch's CPU allocator puts tensors of 2 MB and more on transparent huge pages: a training or evaluation step
# allocates its logits and activations afresh, and with 4 KB pages most of a job's system time was their page
# faults (docs/performance.md, "Huge pages"). Same numbers; THP_MEM_ALLOC_ENABLE=0 turns it off.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


try:
    validate_config(config, source="config (config/config.yaml and --configfile/--config)")
except ConfigError as exc:
    raise WorkflowError(str(exc)) from None


# Scheduling order among ready jobs (snakemake's `priority:`, higher first). The data stage and pretraining
# are one chain that every fine-tuning job waits for, so it goes first; then the plans the fine-tuning jobs
# need; the accounting comparison and the mean-estimation study (independent of the language model) fill a
# core beside the fine-tuning jobs instead of waiting for the end, and so do the figures whose inputs are
# ready early (the mean-estimation, noise and contribution figures); fine-tuning (each job evaluates its runs
# too) before the pretrained model's evaluation keeps the long jobs early and the short ones for the tail; a
# cell's learning-rate selection (a fraction of a second) runs as soon as its fine-tuning job is done, so the
# tail after the last fine-tuning job is one cell's selection, the summary and the figures that read it; the
# summary, the user-group analysis and the findings go before those figures (two figures and the findings wait
# for them). Order only: no job's result depends on it.
PRIORITY = dict(chain=100, plan=60, summary=58, side=55, finetune=50, select=45, evaluate=40)


# Every wildcard of the path templates (userdp.layout.WILDCARD_RES).
wildcard_constraints:
    **layout.WILDCARD_RES,


# ---------------------------------------------------------------- what the config decides

from userdp.data.labels import has_labels
from userdp.data.sources import has_public_part
from userdp.privacy.selection import one_job
from userdp.privacy.targets import counts_from_tokens, stats_private
from userdp.training.targets import learning_rate_texts, per_cell_jobs, uses_lora
from userdp.plotting.registry import per_user_points


DATASETS = list(config["datasets"])
GRID_DATASETS = grid.grid_datasets(config)
PUBLIC_DATASETS = [n for n, spec in config["datasets"].items() if has_public_part(spec)]
LABELLED_DATASETS = [n for n, spec in config["datasets"].items() if has_labels(spec)]
DATASETS_RE = layout.names_regex(DATASETS)
PUBLIC_DATASETS_RE = layout.names_regex(PUBLIC_DATASETS)
LABELLED_DATASETS_RE = layout.names_regex(LABELLED_DATASETS)
# Any dataset name the config does NOT define (the lookahead reads up to the next "/"): rule unknown_dataset.
UNKNOWN_DATASETS_RE = rf"(?!(?:{DATASETS_RE})/)[A-Za-z0-9_-]+"

# The learning rates as path text (lr~...), and whether one fine-tuning job trains them all (training.sweep_jobs
# per_cell) or one (per_run: the job's {lr} wildcard names it).
LEARNING_RATES = learning_rate_texts(config)
PER_CELL = per_cell_jobs(config)
# A fine-tuned model folder holds the model (config and weights), or under model.lora only its adapter.
MODEL_FILE_NAMES = layout.ADAPTER_FILES if uses_lora(config) else layout.MODEL_FILES
# model.name: a hub model, loaded as is; null: the small model rule pretrain builds in results/model/pretrained,
# pretrained on public text unless model.pretrain.steps is 0.
PRETRAINS = not config["model"]["name"] and config["model"]["pretrain"]["steps"] > 0
PRETRAINED_INPUTS = (
    {}
    if config["model"]["name"]
    else {
        "model": "results/model/pretrained/model.safetensors",
        "model_config": "results/model/pretrained/config.json",
    }
)


def base_model(wildcards):
    """What a fine-tuning or audit job loads as its base (its `model` param): model.name, the hub model, or the
    folder that pretraining writes. A function of the wildcards only, so a recorded param (Snakemake leaves params
    derived from input files out of its rerun record); the pipeline's folders are on one shared filesystem."""
    return config["model"]["name"] or "results/model/pretrained"


def model_files(folder):
    """The files of a fine-tuned model folder (`folder`, a path or a pattern): model or adapter, config first."""
    return [f"{folder}/{name}" for name in MODEL_FILE_NAMES]


def run_outputs(run_dir):
    """What training writes into a run folder: the ledger, the train log and the model."""
    return [f"{run_dir}/ledger.json", f"{run_dir}/train_log.parquet", *model_files(f"{run_dir}/model")]


def run_files(run_dir):
    """What one fine-tuning job writes, run folder by run folder: each run's outputs and its evaluation on
    held-out users. `run_dir` ends in lr~{lr}: one folder per learning rate for a per-cell job (its other
    wildcards stay), the pattern itself for a per-run job."""
    dirs = expand(run_dir, lr=LEARNING_RATES, allow_missing=True) if PER_CELL else [run_dir]
    return [path for d in dirs for path in [*run_outputs(d), f"{d}/eval.json", f"{d}/eval_users.parquet"]]


def public_dataset(needs):
    """The dataset whose public text trains the tokenizer and pretrains the model (tokenizer.public_dataset, or
    the first with a public part). `needs`: tokenizer.name or model.name, the null setting that needs it."""
    from userdp.data.tokenize import public_dataset_name

    name = public_dataset_name(config)
    if name is None:
        what, fix = {
            "tokenizer.name": ("a BPE tokenizer is trained", "set tokenizer.name"),
            "model.name": ("a small model is pretrained", "set model.name to a pretrained model"),
        }[needs]
        raise ConfigError(
            f"{needs} is null, so {what} on public text, but no dataset has a public part; add a synthetic or "
            "fortunes dataset, give a dataset a public corpus (datasets.<name>.public), set "
            f"tokenizer.public_dataset to a dataset with public text, or {fix}."
        )
    return name


def unknown_dataset_error(wildcards):
    """Rule unknown_dataset's input: the error for a target naming a dataset the config does not define."""
    raise ConfigError(
        f"dataset {wildcards.dataset!r} is not defined under 'datasets' in the config "
        f"(defined: {sorted(DATASETS)}); add it with --configfile (see config/README.md) or fix the target path."
    )


def tokenizer_inputs(wildcards):
    """The PUBLIC corpus only (never private text); none for a named tokenizer (tokenizer.name)."""
    if config["tokenizer"]["name"]:
        return {}
    return {"public": f"results/data/{public_dataset('tokenizer.name')}/public.parquet"}


def pretrain_inputs(wildcards):
    """The tokenizer, and the public tokens when there is pretraining to do."""
    ins = {"tokenizer": "results/tokenizer/tokenizer.json"}
    if PRETRAINS:
        ins["public"] = f"results/data/{public_dataset('model.name')}/public_tokens.parquet"
    return ins


# The train users' counts (for G and the sampling rates): tokens.parquet when long examples are chunked (rows
# are what the pool bounds), else users.parquet; and the DP histogram when privacy.contribution_stats.private.
COUNTS_INPUT = (
    {"tokens": "results/data/{dataset}/tokens.parquet"}
    if counts_from_tokens(config)
    else {"users": "results/data/{dataset}/users.parquet"}
)
DP_STATS_INPUT = {"contributions_dp": "results/data/{dataset}/contributions_dp.json"} if stats_private(config) else {}


def user_labels_input(wildcards):
    """The dataset's user labels, where it has them (LABELLED_DATASETS)."""
    if wildcards.dataset not in LABELLED_DATASETS:
        return {}
    return {"labels": f"results/data/{wildcards.dataset}/user_labels.parquet"}


# grid.options: each option's config (its keys merged over the base's), which its plans and runs read; and the
# option wildcard's values.
OPTIONS = {name: option_config(config, name) for name in config["grid"]["options"]}
OPTIONS_RE = layout.names_regex(list(OPTIONS))


def finetune_settings(wildcards):
    """A fine-tuning job's `settings` param (userdp.training.targets.finetune_params): from the config, or from
    the option's config (OPTIONS) for a cell of grid.options (its {option} wildcard, or the option level of
    its {cell} wildcard)."""
    from userdp.training.targets import finetune_params

    option = wildcards.get("option")
    if option is None and "cell" in wildcards.keys():
        option = grid.cell_of_dir(f"results/runs/{wildcards.dataset}/{wildcards.cell}", config).option
    if option and option not in OPTIONS:
        raise ConfigError(f"option~{option} is not an entry of grid.options (defined: {sorted(OPTIONS)}); add it "
                          "to the config or fix the target path.")
    return finetune_params(OPTIONS[option] if option else config, wildcards.dataset)


# The params shared by finetune and the fine-tuning rules reused from it, all but `evaluation`.
# learning_rates holds every rate (the same in both sweep_jobs modes, so switching reruns nothing; a job trains
# those of its outputs' run folders, in order, and restores a run that already finished, in an earlier job that
# was killed or in a rerun of an unchanged run, from its finished/ record); model is the base model; settings
# what else changes a run (finetune_settings).
FINETUNE_PARAMS = dict(
    learning_rates=[float(lr) for lr in LEARNING_RATES],
    model=base_model,
    settings=finetune_settings,
)


def cell_plan(wildcards):
    """The plan the cell in a {cell} wildcard trains with (userdp.grid.Cell.plan_path)."""
    return grid.cell_of_dir(f"results/runs/{wildcards.dataset}/{wildcards.cell}", config).plan_path


# ---------------------------------------------------------------- targets


CELLS = list(grid.iter_cells(config))  # the grid cells, in grid order
OPTION_CELLS = list(grid.option_cells(config))  # the cells of grid.options, in option and grid order


def cells(dataset=None, options=False):
    """The grid cells (`options`: the cells of grid.options instead), of `dataset` only if given."""
    return [c for c in (OPTION_CELLS if options else CELLS) if dataset is None or c.dataset == dataset]


def cell_files(pattern, dataset=None, options=False):
    """`pattern` (with {dataset} and {cell}) for every grid cell of `dataset` (every cell if None), in grid order
    (`options`: for every cell of grid.options instead)."""
    return [pattern.format(dataset=c.dataset, cell=c.cell) for c in cells(dataset, options)]


def data_targets():
    return (
        expand("results/data/{dataset}/contributions.json", dataset=DATASETS)
        + expand("results/data/{dataset}/tokens.parquet", dataset=GRID_DATASETS)
        + expand("results/data/{dataset}/user_labels.parquet", dataset=[d for d in GRID_DATASETS if d in LABELLED_DATASETS])
    )


def plan_targets():
    return [c.plan_path for c in CELLS + OPTION_CELLS] + ["results/accounting/comparison.parquet"]


def train_targets():
    """Every run's ledger, train log and model (cells selected by random stopping: the released model in the
    cell folder), and the pretrained model when the pipeline builds it."""
    out = []
    for c in CELLS + OPTION_CELLS:
        if one_job(config, c.epsilon):
            out += model_files(f"results/runs/{c.dataset}/{c.cell}/model")
        else:
            out += [f for lr in LEARNING_RATES for f in run_outputs(f"results/runs/{c.dataset}/{c.cell}/lr~{lr}")]
    return out + list(PRETRAINED_INPUTS.values())


def evaluation_targets():
    """Every cell's metrics (grid.options' too), the pretrained model's, and each grid dataset's summary and
    user-group tables (and the options' summary when there are options)."""
    return cell_files("results/runs/{dataset}/{cell}/metrics.json") + options_targets() + expand(
        [
            "results/runs/{dataset}/pretrained/metrics.json",
            "results/summary/{dataset}/metrics.parquet",
            "results/summary/{dataset}/metrics.csv",
            "results/summary/{dataset}/train_curves.parquet",
            "results/summary/{dataset}/users.parquet",
            "results/summary/{dataset}/groups.parquet",
            "results/summary/{dataset}/groups.csv",
        ],
        dataset=GRID_DATASETS,
    )


def options_targets():
    """The metrics of every cell of grid.options and each grid dataset's options summary (none without options)."""
    if not OPTIONS:
        return []
    return cell_files("results/runs/{dataset}/{cell}/metrics.json", options=True) + expand(
        ["results/summary/{dataset}/options.parquet", "results/summary/{dataset}/options.csv"],
        dataset=GRID_DATASETS,
    )


def findings_targets():
    return expand("results/findings/{study}.{ext}", study=config["findings"]["name"], ext=["json", "csv"])


def audit_files(pattern, dataset=None):
    """`pattern` (the AUDIT wildcards) for every audited cell (userdp.grid.audit_cells), of `dataset` if given."""
    return [
        pattern.format(**grid.audit_wildcards(c, config))
        for c in grid.audit_cells(config)
        if dataset is None or c.dataset == dataset
    ]


AUDITED_DATASETS = grid.audited_datasets(config)
AUDIT_BUDGET, AUDIT_STEPS = grid.audit_budget(config)
AUDIT_LR = layout.fmt_num(grid.audit_learning_rate(config))  # the audit's one learning rate, as path text


def audit_canary_inputs(wildcards):
    """The dataset's tokens and, for a canary design that needs to know which tokens and bigrams occur in the
    corpus, the pretraining corpus's tokens (when the pipeline pretrains its own model)."""
    ins = {"tokens": f"results/data/{wildcards.dataset}/tokens.parquet"}
    if config["audit"]["canary_design"] != "random" and PRETRAINS:
        ins["public"] = f"results/data/{public_dataset('model.name')}/public_tokens.parquet"
    return ins


def all_targets():
    from userdp.plotting.registry import figure_targets

    return (
        data_targets()
        + plan_targets()
        + train_targets()
        + evaluation_targets()
        + ["results/mean_estimation/results.parquet"]
        + figure_targets(config)
        + findings_targets()
    )


# ---------------------------------------------------------------- figures (figures.smk)

# The report's categories (of the figures and tables).
REPORT_DATA = "Data"
REPORT_ACCOUNTING = "Accounting"
REPORT_LM = "Language-model fine-tuning"
REPORT_GROUPS = "Who pays for privacy"
REPORT_AUDIT = "Privacy audit"
REPORT_MEAN_ESTIMATION = "Mean estimation (synthetic)"
REPORT_FINDINGS = "Findings"
# The (epsilon, budget) of the G sweep, drawn by plot_lm_loss_vs_group_size.
SWEEP_POINT = grid.group_sweep_point(config)


def figure_report(path, caption, category, subcategory=None, **labels):
    """An output shown in the report, under `category` / `subcategory`, captioned by workflow/report/<caption>.rst."""
    return report(path, caption=f"../report/{caption}.rst", category=category, subcategory=subcategory,
                  labels=labels or None)
