"""Snakemake script (rules tokenize and tokenize_public): token ids of examples or public text.

With threads > 1 the library encodes in spawned worker processes, which
import this script as `__mp_main__`: everything that does work is under the
`__name__ == "__main__"` guard so the workers only import it.
"""

import os
from pathlib import Path

import userdp.errors
import userdp.logutil
from userdp.untracked import untracked


def main() -> None:
    from userdp.data.tokenize import tokenize_examples, tokenize_public

    from userdp.privacy.targets import stats_private

    public = snakemake.rule == "tokenize_public"
    fn = tokenize_public if public else tokenize_examples
    # With DP contribution statistics the row and token counts of the private examples are not logged
    # (docs/privacy.md, "What is treated as public"); read from the config, no param: a log changes no result.
    config = untracked(snakemake.config, "tokenizer.batch_rows", "privacy.contribution_stats.private")
    private_counts = not public and stats_private(config)
    info = fn(
        snakemake.input.examples,
        Path(snakemake.input.tokenizer).parent,
        snakemake.output[0],
        int(snakemake.params.sequence_length),
        snakemake.params.long_examples,
        batch_rows=int(config["tokenizer"]["batch_rows"]),
        threads=int(snakemake.threads),
        **({"log_rows": False} if private_counts else {}),
    )
    if private_counts:
        info = {k: info[k] for k in ("sequence_length", "long_examples")}
    log.info("wrote %s: %s", snakemake.output[0], info)


if __name__ == "__main__":
    log = userdp.logutil.setup_logging(snakemake.log[0])
    # Rayon threads of the in-process path (one batch, or threads = 1); worker
    # processes set their own (one each).
    os.environ.setdefault("RAYON_NUM_THREADS", str(snakemake.threads))
    userdp.errors.run_main(main, log)
