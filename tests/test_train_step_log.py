"""The per-step log: noise-free per-step values stay out of train logs, cell logs and rule logs by default.

training.debug_step_log (userdp.training.step_log) turns them on. The default
columns are post-processing of the privatised update (checked against the
update the engine applied).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pandas as pd
import pytest

from train_fixtures import ConstantGradients, plan_for, run_settings, tiny_model
from userdp.evaluation.aggregate import build_summary
from userdp.evaluation.select import copy_train_log
from userdp.training import engine, run_seeds, run_state, step_log


def fake_epsilon(event, delta):
    return 1.0


@pytest.fixture(scope="module")
def pool():
    from train_fixtures import train_pool

    return train_pool(30, 7)


def _settings(**kw):
    return run_settings(**({"checkpoint_every": 3} | kw))  # a progress line at every step


def _run(pool, path, method="uls", **kw):
    plan = plan_for(pool, method, expected=3.0, steps=5, sigma=0.8, clip=0.5)
    seeds = run_seeds.run_seeds(0, 0, "tiny", method, "8", 100, 3, 0.01)
    return engine.train(tiny_model(), pool, plan, _settings(**kw), run_state.RunPaths(path), seeds, 0,
                        compute_epsilon=fake_epsilon)  # the real ClippedGradients: real batch losses


def _numbers(frame: pd.DataFrame) -> np.ndarray:
    return np.concatenate([frame[c].to_numpy(dtype=float) for c in frame.columns]) if len(frame.columns) else []


@pytest.mark.parametrize("method", ["els", "uls"])
def test_default_run_writes_no_per_step_batch_loss(tmp_path, pool, caplog, method):
    """Scan train_log.parquet, the cell's copy, the ledger and the rule log for every step's batch loss."""
    caplog.set_level(logging.INFO, logger="userdp")
    out = _run(pool, tmp_path / "run", method)
    losses = out.log["loss"].to_numpy()
    losses = losses[np.isfinite(losses)]  # a Poisson step may sample nobody (its loss is NaN)
    assert out.complete and len(set(losses)) > 1  # there is something to find
    log = pd.read_parquet(tmp_path / "run" / "train_log.parquet")
    assert list(log.columns) == step_log.GUARANTEED_COLUMNS
    copy_train_log(tmp_path / "run" / "train_log.parquet", tmp_path / "cell.parquet", debug_step_log=False)
    cell = pd.read_parquet(tmp_path / "cell.parquet")
    ledger_text = (tmp_path / "run" / "ledger.json").read_text()
    for value in losses:
        for frame in (log, cell):
            assert not np.isclose(_numbers(frame), value, rtol=1e-6, atol=0).any()
        for text in (f"{value:.4f}", f"{value:.6g}", repr(float(value))[:8]):
            assert text not in caplog.text and text not in ledger_text
    assert "step: 5/5 (100.0%)" in caplog.text  # progress is still logged
    for col in ("seconds", "realised_examples", "clipped_fraction"):
        assert col not in log.columns and col not in cell.columns


def test_debug_step_log_writes_them_and_says_they_are_outside_the_guarantee(tmp_path, pool, caplog):
    caplog.set_level(logging.INFO, logger="userdp")
    out = _run(pool, tmp_path / "run", debug_step_log=True)
    log = pd.read_parquet(tmp_path / "run" / "train_log.parquet")
    assert list(log.columns) == step_log.LOG_COLUMNS
    np.testing.assert_array_equal(log["loss"].to_numpy(), out.log["loss"].to_numpy())
    assert f"{out.log['loss'].iloc[-1]:.4f}" in caplog.text and "outside the guarantee" in caplog.text
    # the cell keeps them only when the option is on (a run trained with it on, released with it off: stripped)
    copy_train_log(tmp_path / "run" / "train_log.parquet", tmp_path / "on.parquet", debug_step_log=True)
    copy_train_log(tmp_path / "run" / "train_log.parquet", tmp_path / "off.parquet", debug_step_log=False)
    assert list(pd.read_parquet(tmp_path / "on.parquet").columns) == step_log.LOG_COLUMNS
    assert list(pd.read_parquet(tmp_path / "off.parquet").columns) == step_log.GUARANTEED_COLUMNS


@pytest.mark.parametrize("sigma", [0.0, 4.0])
def test_update_norms_are_those_of_the_privatised_update(tmp_path, pool, sigma):
    """Every unit adds 1 to each of the d coordinates, so u = (r 1 + z) / E with r the realised units.

    update_norm = ||u||; update_signal_norm^2 = ||u||^2 - d (sigma C / E)^2 estimates d (r / E)^2.
    """
    C, E, T = 0.5, 4.0, 6
    model = tiny_model()
    d = sum(p.numel() for p in model.parameters() if p.requires_grad)
    plan = plan_for(pool, "els", expected=E, steps=T, sigma=sigma, clip=C)
    applied = []

    def grab(step, row):
        applied.append(math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters())))

    out = engine.train(model, pool, plan, _settings(optimizer="sgd"), run_state.RunPaths(tmp_path),
                       run_seeds.run_seeds(0, 0, "tiny", "els", "8", 100, 3), 0, gradient_source=ConstantGradients,
                       compute_epsilon=fake_epsilon, on_step=grab)
    log = out.log
    np.testing.assert_allclose(log["update_norm"], applied, rtol=1e-9)  # the norm of what the optimizer used
    signal_sq = d * (log["realised_units"].to_numpy() / E) ** 2
    noise_sq = d * (sigma * C / E) ** 2
    if sigma == 0:
        np.testing.assert_allclose(log["update_signal_norm"], np.sqrt(signal_sq), rtol=1e-9)
        np.testing.assert_allclose(log["update_norm"], log["update_signal_norm"], rtol=0)
    else:
        # ||u||^2 = signal + 2 <r1, z>/E^2 + ||z||^2/E^2: the cross term's sd is 2 sqrt(d) (r/E)(sigma C/E)
        sd = 2 * math.sqrt(d) * np.sqrt(signal_sq / d) * (sigma * C / E) + math.sqrt(2 * d) * (sigma * C / E) ** 2
        est = log["update_signal_norm"].to_numpy() ** 2
        assert (np.abs(est - signal_sq) < 5 * sd).all()
        assert (np.abs(log["update_norm"].to_numpy() ** 2 - signal_sq - noise_sq) < 5 * sd).all()
        # the correction is large against the tolerance of a typical step: it is really tested
        assert noise_sq > 10 * np.median(sd)


def test_signal_norm_formula():
    assert step_log.signal_norm(25.0, 4, 3.0, 2.0) == pytest.approx(math.sqrt(25 - 4 * 2.25))
    assert step_log.signal_norm(1.0, 100, 1.0, 1.0) == 0.0  # below the noise's share: clipped at 0


def test_summary_curves_without_loss_use_the_update_signal_norm(aggregate_cells, tmp_path):
    """aggregate: curves from a default log have loss NaN and the guaranteed curve; the figure plots it."""
    from userdp.plotting import lm

    cfg = aggregate_cells.config
    for cell in aggregate_cells.cells:  # replace the fixture's logs by default-mode logs
        pd.DataFrame({"step": range(1, 6), "learning_rate": 0.01, "update_norm": [9, 8, 7, 6, 5.0],
                      "update_signal_norm": [5, 4, 3, 2, 1.0]}).to_parquet(tmp_path / cell.run_dir / "train_log.parquet")
    summary, curves = build_summary(cfg, aggregate_cells.inputs)
    assert curves["loss"].isna().all() and curves["update_signal_norm"].notna().all()
    assert summary["train_final_loss"].isna().all() and (summary["train_steps_logged"] == 5).all()
    fig = lm.training_curves(curves, "toy")
    assert "update signal norm" in fig.axes[0].get_ylabel()
    assert "privatised update" in fig._suptitle.get_text()
    assert list(fig.axes[0].get_lines()[0].get_ydata()) != []
