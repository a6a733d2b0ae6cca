"""Snakemake script (rule audit_score): score every canary with the audited model and the reference model.

Writes the per-canary scores and the cell's audit result (AUC, TPR at 1% FPR,
empirical epsilon lower bound) next to the claimed epsilon of the run ledger.
"""

import os

import torch

import userdp.errors
import userdp.logutil
from userdp.evaluation import audit
from userdp.io import read_json

log = userdp.logutil.setup_logging(snakemake.log[0])  # noqa: F821


def main() -> None:
    sm = snakemake  # noqa: F821
    torch.set_num_threads(max(1, int(sm.threads)))
    untracked = sm.params.untracked
    result = audit.audit_cell(
        dataset=sm.wildcards.dataset, model=os.path.dirname(sm.input.model[0]), reference=str(sm.params.reference),
        local_reference=bool(sm.params.local_reference), ledger=read_json(sm.input.ledger),
        canaries=str(sm.input.canaries), scores_out=str(sm.output.scores), result_out=str(sm.output.result),
        confidence=float(sm.params.audit["confidence"]), guess_fractions=list(sm.params.audit["guess_fractions"]),
        # Untracked: they change no score beyond float rounding.
        batch_size=int(untracked["evaluation"]["batch_size"]), device=untracked["training"]["device"],
    )
    if result["epsilon_lower_bound_ceiling"] < 1.0:
        log.warning("this audit cannot show an epsilon above %.3g even if every guess is right (%d canaries, "
                    "delta %.3g, level %.3g per guess set): use more canaries (audit.canaries) or a smaller delta.",
                    result["epsilon_lower_bound_ceiling"], result["canaries"], result["delta"],
                    result["level_per_guess_set"])
    log.info("%s eps=%s: claimed epsilon %.4g, empirical lower bound %.4g (%.0f%%), AUC loss %.3f / LR %.3f",
             result["method"], result["epsilon_target"], result["epsilon_claimed"], result["epsilon_lower_bound"],
             100 * result["confidence"], result["loss_auc"], result["likelihood_ratio_auc"])


userdp.errors.run_main(main, log)
