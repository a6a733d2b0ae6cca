"""The privacy ledger: the mechanism a run actually executed, and its epsilon.

Training records WHAT ran (method, sampling rate, noise multiplier, clip
norm, G, steps completed, delta, and the dp-accounting event of those
steps); epsilon is then recomputed from the event by the accountant alone,
as dp-accounting separates events from accountants. `epsilon` of a run's
ledger is that run's own guarantee: for a complete run it must equal the
plan's `epsilon_per_run`; a mismatch means training ran a different mechanism
than was planned. The released model of a cell is chosen among its
learning-rate runs: its ledger (written by evaluation.select) has `epsilon` =
the guarantee of that selection (`guarantee_epsilon` with the cell's
`privacy.selection`).
When the plan spent part of its epsilon on DP contribution statistics
(`contribution_stats`), the ledger records that release too and its epsilon
composes it with the steps, as the plan's calibration did.
"""

from __future__ import annotations

import dataclasses
import math
import platform
from importlib import metadata
from typing import Any, Callable, Mapping

#: Ledger fields that define the mechanism a run executed: runs that differ in any of them are different
#: mechanisms (learning-rate selection refuses to compose such runs as one cell's).
MECHANISM_FIELDS = (
    "method", "sampling_rate", "noise_multiplier", "clip_norm", "clipping", "group_size", "delta", "accountant",
    "steps_completed",
)


def library_versions() -> dict[str, str]:
    """Versions of the libraries that determine the mechanism and the model."""
    out = {"python": platform.python_version()}
    for dist, key in (("torch", "torch"), ("transformers", "transformers"), ("dp-accounting", "dp_accounting"),
                      ("userdp", "userdp"), ("numpy", "numpy"), ("peft", "peft")):
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[key] = "unknown"
    return out


def run_event(record: dict[str, Any]) -> Any:
    """The dp-accounting event of the steps a ledger (or a plan) records.

    The ledger's `dp_event` when it has one; a ledger written before events
    were recorded is read from its mechanism fields (method, sampling rate,
    noise multiplier, G, steps completed).
    """
    from ..privacy import mechanism

    if record.get("dp_event") is not None:
        return mechanism.event_from_json(record["dp_event"], "ledger dp_event")
    if not float(record.get("noise_multiplier") or 0.0) > 0:
        return mechanism.NON_PRIVATE  # a run without noise has no guarantee
    steps_key = "steps_completed" if "steps_completed" in record else "steps"
    return mechanism.from_record(record, steps_key).dp_event(float(record.get("noise_multiplier") or 0.0))


def guarantee_epsilon(run_events: list, delta: float | None, contribution_stats: dict | None = None,
                      accountant: Callable[..., float] | None = None, selection: Any = None) -> float:
    """Epsilon at delta of the released model: its runs' events under `selection`, with the DP statistics once.

    contribution_stats: the plan's record of the statistics release; it was
    spent once, whatever the number of runs or steps. selection: a
    `privacy.selection.Selection` (default: the runs composed). accountant:
    `(event, delta) -> epsilon` (default the selection's: the PLD accountant,
    RDP for random stopping; tests inject a fast stand-in).
    """
    from ..privacy.contribution_stats import events_from_record
    from ..privacy.mechanism import NON_PRIVATE
    from ..privacy.selection import Selection

    if any(e == NON_PRIVATE for e in run_events):
        return math.inf  # a run without noise has no guarantee, whatever else is composed with it
    selection = selection or Selection("composed", len(run_events))
    event = selection.released_event(run_events, events_from_record(contribution_stats))
    return float((accountant or selection.epsilon)(event, float(delta)))


@dataclasses.dataclass(frozen=True)
class RunFacts:
    """What a run did, beside its spec: the ledger's run-dependent fields (docs/artifacts.md, "Runs").

    Sizes that are statistics of the train users' counts (`n_pool_examples`, `examples_processed`,
    `users_processed`, `n_examples_before_bounding`) are None when the plan's sizes come from the DP
    contribution statistics; `nonfinite_units` is None unless training.debug_step_log releases it.
    """

    steps_completed: int
    expected_batch: float            # the divisor the noisy sums were divided by
    n_train_users: int
    learning_rate: float
    training: Mapping[str, Any]      # TrainSettings as a dict
    seeds: Mapping[str, Any]         # public seeds (secret ones masked)
    resumed_at: tuple[int, ...] = ()
    n_pool_examples: int | None = None
    examples_processed: int | None = None
    users_processed: int | None = None
    n_examples_before_bounding: int | None = None
    device: str = "cpu"
    precision: str = "fp32"
    processes: int = 1
    trainable_parameters: int | None = None
    adapter: Mapping[str, Any] | None = None
    nonfinite_units: int | None = None
    loss_tokens: str | None = None   # "answers" for chat / instruction data (a loss mask); None: every token
    adaptive_clipping: Mapping[str, Any] | None = None  # adaptive clipping's settings, noises and final C


def build_ledger(spec: Any, facts: RunFacts, compute_epsilon: Callable[..., float] | None = None) -> dict[str, Any]:
    """The ledger.json record of a run of `spec` (a RunSpec; fields: docs/artifacts.md, "Runs").

    `dp_event` is the event of the steps that ran (the spec's mechanism for
    `facts.steps_completed` steps); `epsilon` is recomputed from it by the
    accountant (`compute_epsilon`: `(event, delta) -> epsilon`), composed with
    the DP contribution statistics when the plan spent part of its budget on them.
    """
    from ..code_version import package_digest
    from ..privacy import mechanism, seed_secrecy

    stats = spec.contribution_stats
    event = spec.event_of_steps(facts.steps_completed)
    eps = guarantee_epsilon([event], spec.delta, stats, compute_epsilon)
    budget, done = spec.compute_budget, facts.examples_processed
    training = facts.training
    ledger = {
        "method": spec.method,
        "sampling_rate": float(spec.sampling_rate),
        "noise_multiplier": float(spec.noise_multiplier),
        "clip_norm": spec.clip_norm,
        "clipping": spec.clipping,
        "group_size": int(spec.group_size),
        "steps_completed": int(facts.steps_completed),
        "steps_planned": int(spec.steps),
        "complete": int(facts.steps_completed) == int(spec.steps),
        "delta": float(spec.delta),
        "accountant": spec.accountant,
        "epsilon": eps,
        "dp_event": mechanism.event_to_json(event),
        "epsilon_planned": spec.epsilon,
        "epsilon_plan_achieved": spec.epsilon_achieved,
        "epsilon_plan_per_run": spec.epsilon_of_one_run,
        "epsilon_target_of": spec.epsilon_target_of or "each learning-rate run",
        "selection": None if spec.selection is None else spec.selection.record(),
        "expected_batch": float(facts.expected_batch),
        "expected_batch_planned": spec.expected_batch,
        "n_train_users": int(facts.n_train_users),
        "n_pool_examples": _int_or_none(facts.n_pool_examples),  # None: DP statistics
        # None with DP contribution statistics: with q and T they would give back N_G (docs/privacy.md)
        "examples_processed": _int_or_none(done),
        "users_processed": _int_or_none(facts.users_processed),
        "compute_budget": budget,
        "compute_ratio": (done / float(budget)) if budget and done is not None else None,
        "learning_rate": float(facts.learning_rate),
        **{k: training.get(k) for k in ("optimizer", "schedule", "warmup_steps", "physical_batch_size",
                                        "uls_examples_per_user")},
        "seed": facts.seeds.get("run"),
        "seeds": dict(facts.seeds),
        # seeds_mode / guarantee_caveat (userdp.privacy.seed_secrecy): "derived" when the run's samples and noise
        # (or the DP statistics' noise) come from the config seed, which voids the guarantee against its holders
        **seed_secrecy.combined_fields(seed_secrecy.seeds_mode(bool(facts.seeds.get("secret"))),
                                       (stats or {}).get("seeds_mode")),
        "resumed_at_steps": list(facts.resumed_at),
        "versions": {**library_versions(), "userdp_code": package_digest()[:16]},
    }
    if stats:
        # The DP contribution statistics release is part of the run's guarantee:
        # `epsilon` above composes its event with the steps (docs/privacy.md).
        ledger["contribution_stats"] = {k: stats.get(k) for k in ("private", "mechanism", "epsilon", "dp_event", "file",
                                                                  "seeds_mode")}
    ledger.update({
        "n_examples_before_bounding": _int_or_none(facts.n_examples_before_bounding),
        "device": facts.device,
        "precision": facts.precision,
        "processes": int(facts.processes),
        # What trained: every parameter, or LoRA adapters (noise and clipping cover exactly these coordinates).
        "trainable_parameters": facts.trainable_parameters,
        "adapter": None if facts.adapter is None else dict(facts.adapter),
        # Units dropped for a NaN/inf gradient (they contributed zero): a noise-free count of the sampled
        # users' data, released only with training.debug_step_log (like the per-step log).
        "nonfinite_units": facts.nonfinite_units,
    })
    if facts.adaptive_clipping is not None:  # only adaptive clipping's runs: other ledgers are as they were
        # noise_multiplier above is the accounted sigma of gradient and count together; the gradient's own
        # (larger) multiplier and the count's noise are here (userdp.privacy.adaptive)
        ledger["adaptive_clipping"] = dict(facts.adaptive_clipping)
    if spec.correlated_noise is not None:  # only banded DP-FTRL's runs (userdp.privacy.banded)
        from ..privacy.banded import rounds

        cn = spec.banded
        ledger["correlated_noise"] = {**cn.record(), "coefficients": [float(c) for c in cn.coefficients],
                                      "rounds_per_user": rounds(facts.steps_completed, cn.bands),
                                      "sampling": f"cyclic Poisson over {cn.bands} partitions of the users"}
    if facts.loss_tokens is not None:  # only chat and instruction runs: text runs' ledgers are as they were
        ledger["loss_tokens"] = facts.loss_tokens
    return ledger


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)
