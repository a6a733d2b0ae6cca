# Data stage: download -> prepare (clean, users, split, contribution stats) -> tokens; the public text of a
# dataset -> tokenizer -> public tokens (pretraining).
#
# Every rule is keyed by {dataset} alone, so asking for one dataset's artifacts (e.g.
# results/data/<new>/contributions.json from a --configfile) builds that dataset only. Whether a dataset has a
# public (pretraining) part or user labels is decided from the config (common.smk: PUBLIC_DATASETS,
# LABELLED_DATASETS), so no checkpoint is needed. tokenizer.batch_rows bounds memory but changes no output:
# the scripts read it from the config (userdp.untracked), so it is no param and no rerun trigger.
DATA_RUNTIME = 240  # minutes; the full Stack Overflow corpus takes hours, the default seconds


localrules:
    download_data,


rule download_data:
    output:
        "data/{dataset}/download.json",
    params:
        spec=lambda wildcards: config["datasets"][wildcards.dataset],
        seed=config["seed"],
    wildcard_constraints:
        dataset=DATASETS_RE,
    log:
        "results/logs/data/download_{dataset}.log",
    benchmark:
        "results/benchmarks/data/download_{dataset}.tsv"
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
        "data/{dataset}/download.json",
    output:
        examples="results/data/{dataset}/examples.parquet",
        users="results/data/{dataset}/users.parquet",
        contributions="results/data/{dataset}/contributions.json",
    params:
        spec=lambda wildcards: config["datasets"][wildcards.dataset],
        seed=config["seed"],
        seeding=SEEDING,  # the seeding scheme (userdp.seeding.SCHEME): a new one reruns the job
        # With DP contribution statistics contributions.json holds only the
        # public sizes (users per split): the option changes this output.
        contribution_stats_private=stats_private(config),
    wildcard_constraints:
        dataset=DATASETS_RE,
    log:
        "results/logs/data/prepare_{dataset}.log",
    benchmark:
        "results/benchmarks/data/prepare_{dataset}.tsv"
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
        "data/{dataset}/download.json",
    output:
        "results/data/{dataset}/user_labels.parquet",
    params:
        spec=lambda wildcards: config["datasets"][wildcards.dataset],
        seed=config["seed"],
        seeding=SEEDING,  # the seeding scheme (userdp.seeding.SCHEME): a new one reruns the job
    wildcard_constraints:
        dataset=LABELLED_DATASETS_RE,
    log:
        "results/logs/data/user_labels_{dataset}.log",
    benchmark:
        "results/benchmarks/data/user_labels_{dataset}.tsv"
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
        "data/{dataset}/download.json",
    output:
        "results/data/{dataset}/public.parquet",
    params:
        spec=lambda wildcards: config["datasets"][wildcards.dataset],
        seed=config["seed"],
        seeding=SEEDING,  # the seeding scheme (userdp.seeding.SCHEME): a new one reruns the job
    wildcard_constraints:
        dataset=PUBLIC_DATASETS_RE,
    log:
        "results/logs/data/prepare_public_{dataset}.log",
    benchmark:
        "results/benchmarks/data/prepare_public_{dataset}.tsv"
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
        unpack(tokenizer_inputs),
    output:
        tokenizer="results/tokenizer/tokenizer.json",
        info="results/tokenizer/tokenizer_info.json",
    params:
        name=config["tokenizer"]["name"],
        vocab_size=config["tokenizer"]["vocab_size"],
    log:
        "results/logs/data/tokenizer.log",
    benchmark:
        "results/benchmarks/data/tokenizer.tsv"
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
        examples="results/data/{dataset}/examples.parquet",
        tokenizer="results/tokenizer/tokenizer.json",
    output:
        "results/data/{dataset}/tokens.parquet",
    params:
        sequence_length=config["tokenizer"]["sequence_length"],
        long_examples=config["tokenizer"]["long_examples"],
    wildcard_constraints:
        dataset=DATASETS_RE,
    log:
        "results/logs/data/tokenize_{dataset}.log",
    benchmark:
        "results/benchmarks/data/tokenize_{dataset}.tsv"
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
        examples="results/data/{dataset}/public.parquet",
        tokenizer="results/tokenizer/tokenizer.json",
    output:
        "results/data/{dataset}/public_tokens.parquet",
    wildcard_constraints:
        dataset=PUBLIC_DATASETS_RE,
    log:
        "results/logs/data/tokenize_public_{dataset}.log",
    benchmark:
        "results/benchmarks/data/tokenize_public_{dataset}.tsv"


# A target under results/data/ that names a dataset the config does not
# define gets a clear error at DAG-building time instead of "no rule".
rule unknown_dataset:
    input:
        unknown_dataset_error,
    output:
        "results/data/{dataset}/{artifact}",
    wildcard_constraints:
        dataset=UNKNOWN_DATASETS_RE,
    log:
        "results/logs/data/unknown_{dataset}_{artifact}.log",
    benchmark:
        "results/benchmarks/data/unknown_{dataset}_{artifact}.tsv"
    threads: 1
    resources:
        mem_mb=100,
        runtime=1,
    conda:
        "../envs/userdp.yaml"
    shell:
        "exit 1"
