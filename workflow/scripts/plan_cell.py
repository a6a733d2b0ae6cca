"""Snakemake script (rules plan, plan_group_sweep): one grid cell -> its plan JSON."""

import userdp
import userdp.errors
import userdp.io
import userdp.logutil
import userdp.privacy.planner
from userdp.layout import parse_num
from userdp.privacy.contribution_stats import NoisyHistogram
from userdp.privacy.planner import read_counts

log = userdp.logutil.setup_logging(snakemake.log[0])


def main() -> None:
    sm = snakemake
    w = sm.wildcards
    inputs = {k: str(v) for k, v in sm.input.items()}
    counts, source = read_counts(users=inputs.get("users"), tokens=inputs.get("tokens"))
    contributions = userdp.io.read_json(sm.input.contributions)
    # Evaluation (learning-rate choice on validation users, metrics on test
    # users) needs both splits: fail here, before any training, not after it.
    userdp.privacy.planner.check_evaluation_users(contributions, w.dataset, str(sm.input.contributions))
    stats = None
    if "contributions_dp" in inputs:
        stats = NoisyHistogram.from_release(userdp.io.read_json(inputs["contributions_dp"]), inputs["contributions_dp"])
    plan = userdp.plan(
        w.method, parse_num(w.eps), counts=counts, compute=int(w.budget), steps=int(sm.params.steps),
        privacy=sm.params.privacy, group_size=sm.params.group_size, dataset=w.dataset,
        reference_epsilon=sm.params.reference_epsilon, contribution_stats=stats, selection=sm.params.selection,
    )
    # The exact median is a statistic of private data: left out when the G
    # rules use the DP statistics instead.
    plan = plan.replace(median_train=contributions.get("median_train") if stats is None else None,
                        contribution_counts=source if "tokens" in inputs else None)
    plan.write(sm.output[0])
    log.info(
        "%s: G=%d (%s), q=%.5g, expected batch %.4g %s, sigma=%.5g, eps achieved %s",
        sm.output[0], plan.group_size, plan.group_size_rule, plan.sampling_rate,
        plan.expected_batch, plan.expected_batch_unit, plan.noise_multiplier, plan.epsilon_achieved,
    )


userdp.errors.run_main(main, log)
