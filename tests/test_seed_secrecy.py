"""privacy.secret_seeds: secret by default for every non-synthetic dataset, and derived seeds say so everywhere.

Where the seeds are derived from the config, the ledger, the DP statistics
release (and the plan's record of it), the summary table and the report's
figures carry `seeds_mode: derived` and the `guarantee_caveat`.
"""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd
import pyarrow.compute as pc
import pytest

from train_fixtures import SEQ, ConstantGradients, plan_for, tiny_model, tokens_table
from userdp.config import validate_config
from userdp.data.sources import SOURCES
from userdp.errors import ConfigError
from userdp.privacy import seed_secrecy
from userdp.privacy.contribution_stats import NoisyHistogram, release_for_dataset
from userdp.training import engine, run_seeds, run_state
from userdp.training.ledger import RunFacts, build_ledger
from userdp.training.pool import build_pool
from userdp.training.settings import TrainSettings


def fake_epsilon(event, delta):
    return 1.0


def _cfg(secret, source):
    return {"privacy": {"secret_seeds": secret}, "datasets": {"x": {"source": source}}}


def test_default_is_secret_for_every_source_but_synthetic():
    assert set(SOURCES) >= {"synthetic", "fortunes", "local", "stackoverflow", "cc_news"}
    for name in SOURCES:
        assert seed_secrecy.secret_seeds(_cfg(None, name), "x") is (name != "synthetic"), name
        for explicit in (True, False):
            assert seed_secrecy.secret_seeds(_cfg(explicit, name), "x") is explicit
    with pytest.raises(ConfigError, match="dataset 'y' is not in 'datasets'"):
        seed_secrecy.secret_seeds(_cfg(None, "synthetic"), "y")


def test_schema_defaults_and_the_warning_for_derived_seeds_on_real_data(caplog):
    base = {"datasets": {"f": {"source": "fortunes"}, "s": {"source": "synthetic"}},
            "grid": {"datasets": ["f", "s"]}}
    cfg = validate_config(dict(base))
    assert cfg["privacy"]["secret_seeds"] is None and cfg["training"]["debug_step_log"] is False
    assert "secret_seeds is false" not in caplog.text
    with caplog.at_level(logging.WARNING):
        validate_config(dict(base, privacy={"secret_seeds": False}))
    assert "privacy.secret_seeds is false" in caplog.text and "['f']" in caplog.text


@pytest.fixture(scope="module")
def pool():
    t = tokens_table(20, seed=2)
    train = t.filter(pc.equal(t["split"], "train")).select(["user_id", "example_id", "input_ids"])
    return build_pool(train, 3, seed=0)


@pytest.mark.parametrize("secret", [False, True])
def test_ledger_says_whether_seeds_are_derived(tmp_path, pool, secret):
    plan = plan_for(pool, "els", expected=3.0, steps=2, sigma=0.7, clip=0.5)
    settings = TrainSettings(learning_rate=1e-2, physical_batch_size=8, sequence_length=SEQ, device="cpu")
    seeds = run_seeds.run_seeds(0, 0, "tiny", "els", "8", 100, 3, 0.01, secret=secret)
    out = engine.train(tiny_model(), pool, plan, settings, run_state.RunPaths(tmp_path), seeds, 0,
                       gradient_source=ConstantGradients, compute_epsilon=fake_epsilon)
    if secret:
        assert out.ledger["seeds_mode"] == "secret" and out.ledger["guarantee_caveat"] is None
    else:
        assert out.ledger["seeds_mode"] == "derived"
        assert "anyone holding the config" in out.ledger["guarantee_caveat"]


def test_dp_statistics_release_plan_record_and_ledger_carry_the_mode(pool):
    counts = np.array([1, 2, 2, 3, 5, 8, 13, 40])
    derived = release_for_dataset(counts, {"epsilon": 0.5}, 0, dataset="d", source="users", secret=False)
    secret = release_for_dataset(counts, {"epsilon": 0.5}, 0, dataset="d", source="users", secret=True)
    assert derived["seeds_mode"] == "derived" and derived["guarantee_caveat"] == seed_secrecy.DERIVED_CAVEAT
    assert secret["seeds_mode"] == "secret" and secret["guarantee_caveat"] is None
    record = NoisyHistogram.from_release(derived, "f.json").record()  # what the plan stores
    assert record["seeds_mode"] == "derived" and record["guarantee_caveat"] == seed_secrecy.DERIVED_CAVEAT
    # a run with secret training seeds over a histogram drawn from derived seeds is still "derived"
    plan = plan_for(pool, "els", expected=3.0, steps=2, sigma=0.7, clip=0.5).replace(contribution_stats=record)
    ledger = build_ledger(plan, RunFacts(steps_completed=2, expected_batch=3.0, n_train_users=pool.n_users,
                                         n_pool_examples=pool.n_examples, examples_processed=6, users_processed=3,
                                         learning_rate=0.01, training={},
                                         seeds={"secret": True, "sampler": "secret"}),
                          compute_epsilon=fake_epsilon)
    assert ledger["seeds_mode"] == "derived" and ledger["contribution_stats"]["seeds_mode"] == "derived"
    plan = plan.replace(contribution_stats=NoisyHistogram.from_release(secret, "f.json").record())
    ledger = build_ledger(plan, RunFacts(steps_completed=2, expected_batch=3.0, n_train_users=pool.n_users,
                                         n_pool_examples=pool.n_examples, examples_processed=6, users_processed=3,
                                         learning_rate=0.01, training={},
                                         seeds={"secret": True, "sampler": "secret"}),
                          compute_epsilon=fake_epsilon)
    assert ledger["seeds_mode"] == "secret" and ledger["guarantee_caveat"] is None


def test_summary_columns_and_figure_footnote(aggregate_cells, tmp_path):
    from eval_builders import fake_summary
    from userdp.evaluation.aggregate import build_summary
    from userdp.io import read_json, write_json
    from userdp.plotting import lm

    cfg, cells = aggregate_cells.config, aggregate_cells.cells
    for i, cell in enumerate(cells):  # one ledger in secret mode, one written before the fields existed
        path = tmp_path / cell.run_dir / "ledger.json"
        led = read_json(path)
        if i == 0:
            led |= {"seeds": {"secret": True}, **seed_secrecy.seeds_fields(True)}
        elif i == 1:
            led |= {"seeds": {"secret": False}}
        else:
            led |= seed_secrecy.seeds_fields(False)
        write_json(path, led)
    summary, _ = build_summary(cfg, aggregate_cells.inputs)
    assert "ledger_seeds_mode" not in summary.columns and "ledger_guarantee_caveat" not in summary.columns
    by_dir = summary.set_index("run_dir")
    first = by_dir.loc[cells[0].run_dir]
    assert first["seeds_mode"] == "secret" and pd.isna(first["guarantee_caveat"])
    for cell in cells[1:]:
        assert by_dir.loc[cell.run_dir, "seeds_mode"] == "derived"
        assert by_dir.loc[cell.run_dir, "guarantee_caveat"] == seed_secrecy.DERIVED_CAVEAT

    s = fake_summary(epsilons=(1, 8), budgets=((8000, 50),), seeds=(0,), sweep=())
    notes = lambda fig: [t.get_text() for t in fig.texts]  # noqa: E731
    assert lm.DERIVED_SEEDS_NOTE not in notes(lm.loss_vs_epsilon(s.assign(seeds_mode="secret"), None, "synth"))
    for fig in (lm.loss_vs_epsilon(s.assign(seeds_mode="derived"), None, "synth"),
                lm.loss_vs_budget(s.assign(seeds_mode="derived"), None, "synth")):
        assert lm.DERIVED_SEEDS_NOTE in notes(fig)
