"""Snakemake script (rule audit_plan): the plan of one audited cell, by the planner of the grid's cells.

The counts are the rows per train user of the audit's training table (the
dataset's train users plus the included canaries): the dataset the audited
run trains on. delta is the grid cell's (privacy.delta, or the rule applied to
the dataset's number of train users). The audited model is ONE run (at
audit.learning_rate), released without a learning-rate selection, so it is
calibrated as one run: its claimed epsilon is its ledger's, and with several
training.learning_rates its sigma is below the grid cells' (each of those is
calibrated for the k runs composed).
"""

import userdp
import userdp.errors
import userdp.io
import userdp.logutil
from userdp.layout import parse_num
from userdp.privacy.contribution_stats import NoisyHistogram
from userdp.evaluation.audit_targets import CEILING_UNTRACKED_KEYS, grid_delta, plan_time_check
from userdp.privacy.planner import read_train_token_counts
from userdp.privacy.selection import Selection
from userdp.untracked import untracked

log = userdp.logutil.setup_logging(snakemake.log[0])


def main() -> None:
    sm = snakemake
    w = sm.wildcards
    inputs = {k: str(v) for k, v in sm.input.items()}
    counts = read_train_token_counts(inputs["tokens"])
    # delta is the grid's: from the dataset's train users (a public size), not the audit's smaller table
    privacy, delta_rule = grid_delta(dict(sm.params.privacy), userdp.io.read_json(inputs["contributions"]))
    # What this audit can show at all, before anything is planned or trained: refuse an audit that can only report 0.
    ceiling, warning = plan_time_check(untracked(sm.config, *CEILING_UNTRACKED_KEYS)["audit"], float(privacy["delta"]), dataset=w.dataset,
                                       method=w.method, eps=w.eps)
    if warning:
        log.warning("%s", warning)
    log.info("the most this audit can show at delta %.3g: %.4g ((epsilon, delta) one-run bound), %.4g (f-DP bound)",
             ceiling["delta"], ceiling["epsilon_lower_bound_ceiling"], ceiling["epsilon_lower_bound_fdp_ceiling"])
    stats = None
    if "contributions_dp" in inputs:
        stats = NoisyHistogram.from_release(userdp.io.read_json(inputs["contributions_dp"]), inputs["contributions_dp"])
    plan = userdp.plan(  # one run, released without a selection: calibrated alone
        w.method, parse_num(w.eps), counts=counts, compute=int(w.budget), steps=int(sm.params.steps),
        privacy=privacy, dataset=w.dataset, reference_epsilon=sm.params.reference_epsilon, contribution_stats=stats,
        selection=Selection("composed", 1),
    )
    plan = plan.replace(median_train=None, delta_rule=delta_rule, contribution_counts=(
        "audit tokens.parquet rows per train user (dataset train users plus included canaries)"))
    plan.write(sm.output[0])
    log.info("%s: G=%d (%s), q=%.5g, sigma=%.5g, eps achieved %s", sm.output[0], plan.group_size,
             plan.group_size_rule, plan.sampling_rate, plan.noise_multiplier, plan.epsilon_achieved)


userdp.errors.run_main(main, log)
