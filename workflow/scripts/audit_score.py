"""Snakemake script (rule audit_score): score every canary with the audited model and the reference model.

Writes the per-canary scores and the cell's audit result (AUC, TPR at 1% FPR,
empirical epsilon lower bound) next to the claimed epsilon of the run ledger.
"""

import os

import torch

import userdp.errors
import userdp.logutil
from userdp.evaluation import audit
from userdp.evaluation.targets import EVALUATE_UNTRACKED_KEYS
from userdp.io import read_json
from userdp.untracked import untracked

log = userdp.logutil.setup_logging(snakemake.log[0])


def main() -> None:
    sm = snakemake
    torch.set_num_threads(max(1, int(sm.threads)))
    settings = untracked(sm.config, *EVALUATE_UNTRACKED_KEYS)
    result = audit.audit_cell(
        dataset=sm.wildcards.dataset, model=os.path.dirname(sm.input.model[0]), reference=str(sm.params.reference),
        local_reference=bool(sm.params.local_reference), ledger=read_json(sm.input.ledger),
        canaries=str(sm.input.canaries), scores_out=str(sm.output.scores), result_out=str(sm.output.result),
        confidence=float(sm.params.audit["confidence"]), guess_fractions=list(sm.params.audit["guess_fractions"]),
        # from the config, no params: they change no score beyond float rounding
        batch_size=int(settings["evaluation"]["batch_size"]), device=settings["training"]["device"],
        audit_delta=sm.params.audit["delta"],
    )
    log.info("%s eps=%s: claimed epsilon %.4g at delta %.3g; empirical lower bounds (%.0f%%) %.4g ((eps, delta), "
             "ceiling %.4g) and %.4g (f-DP, ceiling %.4g); AUC loss %.3f / LR %.3f; exposure %.2f bits (excluded "
             "%.2f); extracted %.1f%% (excluded %.1f%%)",
             result["method"], result["epsilon_target"], result["epsilon_claimed"], result["delta"],
             100 * result["confidence"], result["epsilon_lower_bound"], result["epsilon_lower_bound_ceiling"],
             result["epsilon_lower_bound_fdp"], result["epsilon_lower_bound_fdp_ceiling"], result["loss_auc"],
             result["likelihood_ratio_auc"], result["exposure_included_mean"], result["exposure_excluded_mean"],
             100 * result["extraction_rate_included"], 100 * result["extraction_rate_excluded"])


userdp.errors.run_main(main, log)
