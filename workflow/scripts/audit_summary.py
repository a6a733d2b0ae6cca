"""Snakemake script (rule audit_summary): one row per audited cell, as Parquet, CSV and the report's HTML table."""

import userdp.errors
import userdp.logutil
from userdp.evaluation import audit
from userdp.io import atomic_path, read_json, write_parquet

log = userdp.logutil.setup_logging(snakemake.log[0])  # noqa: F821


def main() -> None:
    sm = snakemake  # noqa: F821
    df = audit.summary_rows([read_json(p) for p in sm.input.results])
    write_parquet(sm.output.summary, df)
    with atomic_path(sm.output.csv) as tmp:
        df.to_csv(tmp, index=False)
    with atomic_path(sm.output.table) as tmp:
        tmp.write_text(audit.summary_html(df, sm.wildcards.dataset), encoding="utf-8")
    for _, r in df.iterrows():
        log.info("%s claimed %.4g: empirical lower bound %.4g, AUC %.3f (loss) %.3f (LR)", r["method"],
                 r["epsilon_claimed"], r["epsilon_lower_bound"], r["loss_auc"], r["likelihood_ratio_auc"])
    bad = df[df["bound_exceeds_claim"]]
    if len(bad):
        log.error("the empirical lower bound exceeds the claimed epsilon for %s: the mechanism or its accounting "
                  "is wrong (docs/privacy.md, \"Auditing the released model\")",
                  ", ".join(f"{m} eps={e:g}" for m, e in zip(bad["method"], bad["epsilon_target"])))


userdp.errors.run_main(main, log)
