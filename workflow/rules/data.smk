# Data stage: download -> prepare (clean, users, split, contribution stats)
# -> contribution figure; public text -> tokenizer -> tokens.
#
# Every rule is keyed by {dataset} alone, so asking for one dataset's
# artifacts (e.g. results/data/<new>/contributions.json from a --configfile)
# builds that dataset only. Whether a dataset has a public (pretraining) part
# is decided from the config: its source type or a `public` key
# (userdp.data.prepare.has_public_part), so public.parquet / public_tokens.parquet rules exist only
# for such datasets and no checkpoint is needed.
from userdp.data.targets import (
    datasets_regex,
    public_datasets_regex,
    tokenizer_inputs,
    unknown_datasets_regex,
    unknown_dataset_error,
)

DATASETS_RE = datasets_regex(config)
PUBLIC_DATASETS_RE = public_datasets_regex(config)
UNKNOWN_DATASETS_RE = unknown_datasets_regex(config)
DATA_RUNTIME = 240  # minutes; the full Stack Overflow corpus takes hours, the default seconds
# tokenizer.batch_rows is read by the scripts from the config, not passed as a
# param: it bounds memory but changes no output, so it must not trigger reruns.


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
    threads: 1
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
    wildcard_constraints:
        dataset=DATASETS_RE,
    log:
        "results/logs/data/prepare_{dataset}.log",
    threads: 1
    resources:
        mem_mb=config["resources"]["data_mem_mb"],
        runtime=DATA_RUNTIME,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/prepare_data.py"


rule prepare_public:
    input:
        "data/{dataset}/download.json",
    output:
        "results/data/{dataset}/public.parquet",
    params:
        spec=lambda wildcards: config["datasets"][wildcards.dataset],
        seed=config["seed"],
    wildcard_constraints:
        dataset=PUBLIC_DATASETS_RE,
    log:
        "results/logs/data/prepare_public_{dataset}.log",
    threads: 1
    resources:
        mem_mb=config["resources"]["data_mem_mb"],
        runtime=60,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/prepare_public.py"


rule plot_contributions:
    input:
        "results/data/{dataset}/contributions.json",
    output:
        png=report(
            "results/figures/contributions_{dataset}.png",
            caption="../report/contributions.rst",
            category="Data",
            labels={"figure": "contributions", "dataset": "{dataset}"},
        ),
        pdf="results/figures/contributions_{dataset}.pdf",
    wildcard_constraints:
        dataset=DATASETS_RE,
    log:
        "results/logs/figures/contributions_{dataset}.log",
    threads: 1
    resources:
        mem_mb=1000,
        runtime=10,
    conda:
        "../envs/userdp.yaml"
    script:
        "../scripts/plot_contributions.py"


rule train_tokenizer:
    input:
        unpack(lambda wildcards: tokenizer_inputs(config)),
    output:
        tokenizer="results/tokenizer/tokenizer.json",
        info="results/tokenizer/tokenizer_info.json",
    params:
        name=config["tokenizer"]["name"],
        vocab_size=config["tokenizer"]["vocab_size"],
    log:
        "results/logs/data/tokenizer.log",
    threads: 2
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
    threads: config["tokenizer"]["threads"]
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


# A target under results/data/ that names a dataset the config does not
# define gets a clear error at DAG-building time instead of "no rule".
rule unknown_dataset:
    input:
        lambda wildcards: unknown_dataset_error(config, wildcards.dataset),
    output:
        "results/data/{dataset}/{artifact}",
    wildcard_constraints:
        dataset=UNKNOWN_DATASETS_RE,
    log:
        "results/logs/data/unknown_{dataset}_{artifact}.log",
    threads: 1
    resources:
        mem_mb=100,
        runtime=1,
    conda:
        "../envs/userdp.yaml"
    shell:
        "exit 1"
