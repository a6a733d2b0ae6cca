"""Snakemake script (rule audit_summary): one row per audited cell, as Parquet, CSV and the report's HTML table."""

import userdp.errors
import userdp.logutil
from userdp.evaluation import audit_report
from userdp.io import atomic_path, read_json, write_parquet

log = userdp.logutil.setup_logging(snakemake.log[0])


def main() -> None:
    sm = snakemake
    df = audit_report.summary_rows([read_json(p) for p in sm.input.results])
    write_parquet(sm.output.summary, df)
    with atomic_path(sm.output.csv) as tmp:
        df.to_csv(tmp, index=False)
    with atomic_path(sm.output.table) as tmp:
        tmp.write_text(audit_report.summary_html(df, sm.wildcards.dataset), encoding="utf-8")
    for _, r in df.iterrows():
        log.info("%s claimed %.4g: empirical lower bounds %.4g ((eps, delta), ceiling %.4g) and %.4g (f-DP, ceiling "
                 "%.4g), AUC %.3f (loss) %.3f (LR), exposure %.2f bits, extracted %.1f%%", r["method"],
                 r["epsilon_claimed"], r["epsilon_lower_bound"], r["epsilon_lower_bound_ceiling"],
                 r["epsilon_lower_bound_fdp"], r["epsilon_lower_bound_fdp_ceiling"], r["loss_auc"],
                 r["likelihood_ratio_auc"], r["exposure_included_mean"], 100 * r["extraction_rate_included"])
    fdp = df[df["fdp_bound_exceeds_claim"] & ~df["bound_exceeds_claim"]]
    if len(fdp):
        log.warning("the f-DP lower bound exceeds the claimed epsilon for %s: a contradiction if the mechanism's "
                    "trade-off curve is Gaussian (DP-SGD's is close to it); investigate (docs/audits.md)",
                    ", ".join(f"{m} eps={e:g}" for m, e in zip(fdp["method"], fdp["epsilon_target"])))
    bad = df[df["bound_exceeds_claim"]]
    if len(bad):
        log.error("the empirical lower bound exceeds the claimed epsilon for %s: the mechanism or its accounting "
                  "is wrong (docs/audits.md, \"Auditing the released model\")",
                  ", ".join(f"{m} eps={e:g}" for m, e in zip(bad["method"], bad["epsilon_target"])))


userdp.errors.run_main(main, log)
