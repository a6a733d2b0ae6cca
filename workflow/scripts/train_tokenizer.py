"""Snakemake script (rule train_tokenizer): a BPE trained on PUBLIC text only, or a named tokenizer."""

import os
from pathlib import Path

import userdp.errors
import userdp.logutil
from userdp.untracked import untracked

log = userdp.logutil.setup_logging(snakemake.log[0])
# before the tokenizers library is imported: Rayon reads it when its pool starts
os.environ.setdefault("RAYON_NUM_THREADS", str(snakemake.threads))


def main() -> None:
    from userdp.data.tokenize import load_named, train_bpe

    out_dir = Path(snakemake.output.tokenizer).parent
    name = snakemake.params.name
    if name:
        info = load_named(name, out_dir)
    else:
        # Only the public corpus is an input of this rule: never private text.
        info = train_bpe(snakemake.input.public, int(snakemake.params.vocab_size), out_dir,
                         batch_rows=int(untracked(snakemake.config, "tokenizer.batch_rows")["tokenizer"]["batch_rows"]))
    log.info("tokenizer written to %s: %s", out_dir, info)


userdp.errors.run_main(main, log)
