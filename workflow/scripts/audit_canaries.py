"""Snakemake script (rule audit_canaries): the canary users and the table the audit trains on."""

import userdp.errors
import userdp.logutil
from userdp.data import canaries as canaries_lib
from userdp.io import streaming_parquet, write_parquet
from userdp.seeding import derive_seed

log = userdp.logutil.setup_logging(snakemake.log[0])


def main() -> None:
    sm = snakemake
    p = dict(sm.params.canaries)
    spec = canaries_lib.CanarySpec(int(p["canaries"]), int(p["examples_per_canary"]), int(p["secret_length"]),
                                   int(p["seed"]), str(p["canary_design"]), int(p["prefix_length"]),
                                   int(p["exposure_candidates"]))
    meta = canaries_lib.tokens_meta(streaming_parquet(sm.input.tokens).schema_arrow, str(sm.input.tokens))
    corpus = None
    if spec.needs_corpus:
        sources = [str(sm.input.tokens)] + ([str(sm.input.public)] if "public" in sm.input.keys() else [])
        corpus = canaries_lib.corpus_stats(sources, int(meta["vocab_size"]))
        log.info("corpus %s: %d of %d tokens and %d bigrams occur", " + ".join(sources),
                 int((corpus.counts > 0).sum()), corpus.vocab_size, corpus.bigrams.size)
    table = canaries_lib.make_canaries(spec, meta, int(p["config_seed"]), sm.wildcards.dataset, corpus)
    max_users = p["max_train_users"]
    counts = canaries_lib.write_audit_tokens(
        sm.input.tokens, table, sm.output.tokens, max_train_users=None if max_users is None else int(max_users),
        seed=derive_seed(int(p["config_seed"]), sm.wildcards.dataset, int(p["seed"]), "audit-users"))
    write_parquet(sm.output.canaries, table)
    # No count of the dataset's train rows: with privacy.contribution_stats.private that total is an exact
    # statistic of the train users' contributions (docs/privacy.md).
    log.info("%s canaries: %d (%d included, %d examples each): %d canary rows added to the train rows of %s train "
             "users of %s", spec.design, counts["canaries"], counts["canaries_included"], spec.examples_per_canary,
             counts["canary_rows"], counts["dataset_train_users"] or "all", sm.input.tokens)


userdp.errors.run_main(main, log)
