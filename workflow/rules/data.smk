# Data stage: download -> prepare (clean, users, split, contribution stats)
# -> contribution figure; public text -> tokenizer -> tokens.
#
# Every rule is keyed by {dataset} alone, so asking for one dataset's
# artifacts (e.g. results/data/<new>/contributions.json from a --configfile)
# builds that dataset only. Whether a dataset has a public (pretraining) part
# is decided from the config: its source type or a `public` key
# (userdp.data.sources.has_public_part), so public.parquet / public_tokens.parquet rules exist only
# for such datasets and no checkpoint is needed.
from userdp import layout
from userdp.privacy.targets import stats_private
from userdp.data.targets import (
    datasets_regex,
    labelled_datasets_regex,
    public_datasets_regex,
    tokenizer_inputs,
    unknown_datasets_regex,
    unknown_dataset_error,
)

DATASETS_RE = datasets_regex(config)
PUBLIC_DATASETS_RE = public_datasets_regex(config)
LABELLED_DATASETS_RE = labelled_datasets_regex(config)
UNKNOWN_DATASETS_RE = unknown_datasets_regex(config)
DATA_RUNTIME = 240  # minutes; the full Stack Overflow corpus takes hours, the default seconds
# tokenizer.batch_rows bounds memory but changes no output: the scripts read it
# from the config (userdp.untracked), so it is no param and no rerun trigger.


localrules:
    download_data,


rule download_data:
    output:
        layout.DOWNLOAD,
    params:
        spec=lambda wildcards: config["datasets"][wildcards.dataset],
        seed=config["seed"],
    wildcard_constraints:
        dataset=DATASETS_RE,
    log:
        layout.LOG_DOWNLOAD,
    benchmark:
        layout.benchmark_of(layout.LOG_DOWNLOAD),
    threads: 1
    priority: PRIORITY["chain"]
    resources:
        mem_mb=config["resources"]["data_mem_mb"],
        runtime=DATA_RUNTIME,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/download_data.py"


rule prepare_data:
    input:
        layout.DOWNLOAD,
    output:
        examples=layout.EXAMPLES,
        users=layout.USERS,
        contributions=layout.CONTRIBUTIONS,
    params:
        spec=lambda wildcards: config["datasets"][wildcards.dataset],
        seed=config["seed"],
        # With DP contribution statistics contributions.json holds only the
        # public sizes (users per split): the option changes this output.
        contribution_stats_private=stats_private(config),
    wildcard_constraints:
        dataset=DATASETS_RE,
    log:
        layout.LOG_PREPARE,
    benchmark:
        layout.benchmark_of(layout.LOG_PREPARE),
    threads: 1
    priority: PRIORITY["chain"]
    resources:
        mem_mb=config["resources"]["data_mem_mb"],
        runtime=DATA_RUNTIME,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/prepare_data.py"


# Each user's group label (synthetic: rare/common topic; local: datasets.<name>.group_column, checked
# constant per user), for the cost-of-privacy table (rule groups). Asked for by rule all with the data, at the
# data priority, so that a group column that varies within a user stops the pipeline before any training.
rule user_labels:
    input:
        layout.DOWNLOAD,
    output:
        layout.USER_LABELS,
    params:
        spec=lambda wildcards: config["datasets"][wildcards.dataset],
        seed=config["seed"],
    wildcard_constraints:
        dataset=LABELLED_DATASETS_RE,
    log:
        layout.LOG_USER_LABELS,
    benchmark:
        layout.benchmark_of(layout.LOG_USER_LABELS),
    threads: 1
    priority: PRIORITY["chain"]
    resources:
        mem_mb=config["resources"]["data_mem_mb"],
        runtime=DATA_RUNTIME,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/user_labels.py"


rule prepare_public:
    input:
        layout.DOWNLOAD,
    output:
        layout.PUBLIC,
    params:
        spec=lambda wildcards: config["datasets"][wildcards.dataset],
        seed=config["seed"],
    wildcard_constraints:
        dataset=PUBLIC_DATASETS_RE,
    log:
        layout.LOG_PREPARE_PUBLIC,
    benchmark:
        layout.benchmark_of(layout.LOG_PREPARE_PUBLIC),
    threads: 1
    priority: PRIORITY["chain"]
    resources:
        mem_mb=config["resources"]["data_mem_mb"],
        runtime=60,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/prepare_public.py"


rule train_tokenizer:
    input:
        unpack(lambda wildcards: tokenizer_inputs(config)),
    output:
        tokenizer=layout.TOKENIZER,
        info=layout.TOKENIZER_INFO,
    params:
        name=config["tokenizer"]["name"],
        vocab_size=config["tokenizer"]["vocab_size"],
    log:
        layout.LOG_TOKENIZER,
    benchmark:
        layout.benchmark_of(layout.LOG_TOKENIZER),
    threads: config["tokenizer"]["threads"]
    priority: PRIORITY["chain"]
    resources:
        mem_mb=config["resources"]["data_mem_mb"],
        runtime=60,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/train_tokenizer.py"


rule tokenize:
    input:
        examples=layout.EXAMPLES,
        tokenizer=layout.TOKENIZER,
    output:
        layout.TOKENS,
    params:
        sequence_length=config["tokenizer"]["sequence_length"],
        long_examples=config["tokenizer"]["long_examples"],
    wildcard_constraints:
        dataset=DATASETS_RE,
    log:
        layout.LOG_TOKENIZE,
    benchmark:
        layout.benchmark_of(layout.LOG_TOKENIZE),
    threads: config["tokenizer"]["threads"]
    priority: PRIORITY["chain"]
    resources:
        mem_mb=config["resources"]["data_mem_mb"],
        runtime=DATA_RUNTIME,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/tokenize_data.py"


use rule tokenize as tokenize_public with:
    input:
        examples=layout.PUBLIC,
        tokenizer=layout.TOKENIZER,
    output:
        layout.PUBLIC_TOKENS,
    wildcard_constraints:
        dataset=PUBLIC_DATASETS_RE,
    log:
        layout.LOG_TOKENIZE_PUBLIC,
    benchmark:
        layout.benchmark_of(layout.LOG_TOKENIZE_PUBLIC),


# A target under results/data/ that names a dataset the config does not
# define gets a clear error at DAG-building time instead of "no rule".
rule unknown_dataset:
    input:
        lambda wildcards: unknown_dataset_error(config, wildcards.dataset),
    output:
        layout.DATA_ARTIFACT,
    wildcard_constraints:
        dataset=UNKNOWN_DATASETS_RE,
    log:
        layout.LOG_UNKNOWN_DATASET,
    benchmark:
        layout.benchmark_of(layout.LOG_UNKNOWN_DATASET),
    threads: 1
    resources:
        mem_mb=100,
        runtime=1,
    conda:
        "../envs/userdp.yaml"
    shell:
        "exit 1"
