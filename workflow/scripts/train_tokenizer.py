"""Snakemake script (rule train_tokenizer): a BPE trained on PUBLIC text only, or a named tokenizer."""

from userdp.jobserver import delegate

delegate(snakemake)  # noqa: F821 (runs this job in the job fork server if there is one: userdp.jobserver)

import os
from pathlib import Path

import userdp.errors
import userdp.logutil

log = userdp.logutil.setup_logging(snakemake.log[0])  # noqa: F821
os.environ.setdefault("RAYON_NUM_THREADS", str(snakemake.threads))  # noqa: F821

from userdp.data.tokenize import load_named, train_bpe  # noqa: E402


def main() -> None:
    out_dir = Path(snakemake.output.tokenizer).parent  # noqa: F821
    name = snakemake.params.name  # noqa: F821
    if name:
        info = load_named(name, out_dir)
    else:
        # Only the public corpus is an input of this rule: never private text.
        info = train_bpe(snakemake.input.public, int(snakemake.params.vocab_size), out_dir,  # noqa: F821
                         batch_rows=int(snakemake.params.untracked["tokenizer"]["batch_rows"]))  # noqa: F821
    log.info("tokenizer written to %s: %s", out_dir, info)


userdp.errors.run_main(main, log)
