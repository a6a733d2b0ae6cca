"""Snakemake script (rule audit_mechanism_table): the white-box audit of the mechanism, one row per audited cell."""

import userdp.errors
import userdp.logutil
from userdp.evaluation import mechanism_audit

log = userdp.logutil.setup_logging(snakemake.log[0])


def main() -> None:
    sm = snakemake
    import torch

    torch.set_num_threads(max(1, int(sm.threads)))
    rows = mechanism_audit.run_audit(sm.params.audit, sm.wildcards.dataset, threads=int(sm.threads))
    mechanism_audit.write_table(rows, sm.output[0])
    for r in rows:
        if r["bound_exceeds_claim"]:
            log.error("%s eps %g: the empirical lower bound %.4g exceeds the claimed epsilon %.4g: the mechanism or "
                      "its accounting is wrong (docs/audits.md, \"White-box audit of the mechanism\")", r["method"],
                      r["epsilon_target"], r["epsilon_lower_bound"], r["epsilon_claimed"])


userdp.errors.run_main(main, log)
