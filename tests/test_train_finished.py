"""A finished run's outputs are recorded and restored, never retrained (snakemake killed before recording them).

The unit level: engine.train records `finished/`; a second train() of the same run in the same folder, after the
outputs were deleted (what `--rerun-incomplete` does), links them back without a step; any change of plan,
settings, code or of a recorded file makes it train. The real snakemake kill -9 scenario:
tests/test_fault_kills.py.
"""

from __future__ import annotations

import os
import shutil

import pytest

from train_fixtures import ConstantGradients, constant_epsilon, plan_for, run_settings, tiny_model, train_pool
from userdp.training import engine, finished, run_seeds, run_state


@pytest.fixture(scope="module")
def pool():
    return train_pool(30, 5)


def run(tmp_path, pool, steps=3, lr=1e-2, counter=None, plan_extra=None, **setting):
    plan = plan_for(pool, "els", expected=4.0, steps=steps, sigma=1.0, clip=1.0).replace(**(plan_extra or {}))
    return engine.train(tiny_model(), pool, plan, run_settings(learning_rate=lr, **setting), run_state.RunPaths(tmp_path),
                        run_seeds.run_seeds(0, 0, "tiny", "els", "8", 100, 3), 0, gradient_source=ConstantGradients,
                        compute_epsilon=constant_epsilon,
                        on_step=None if counter is None else (lambda step, row: counter.append(step)))


def outputs(paths: run_state.RunPaths) -> dict[str, bytes]:
    files = [paths.ledger, paths.train_log, *sorted(p for p in paths.model_dir.rglob("*") if p.is_file())]
    return {str(p.relative_to(paths.run_dir)): p.read_bytes() for p in files}


def delete_outputs(paths: run_state.RunPaths) -> None:
    """What snakemake does before rerunning a job: its declared outputs go (the model folder's files too)."""
    paths.ledger.unlink()
    paths.train_log.unlink()
    shutil.rmtree(paths.model_dir)


def test_a_finished_run_is_recorded_as_hard_links(tmp_path, pool):
    run(tmp_path, pool)
    paths = run_state.RunPaths(tmp_path)
    rec = tmp_path / "finished"
    assert (rec / finished.MANIFEST).is_file() and not paths.checkpoint_dir.exists()
    for rel in outputs(paths):
        assert os.path.samefile(tmp_path / rel, rec / rel), rel  # no extra disk space


def test_rerun_after_outputs_deleted_restores_without_training(tmp_path, pool, caplog):
    first = run(tmp_path, pool)
    paths = run_state.RunPaths(tmp_path)
    before = outputs(paths)
    delete_outputs(paths)
    steps: list[int] = []
    with caplog.at_level("WARNING"):
        again = run(tmp_path, pool, counter=steps)
    assert steps == [] and again.complete and again.steps_completed == first.steps_completed == 3
    assert outputs(paths) == before and again.ledger == first.ledger
    assert "restored the finished outputs" in caplog.text and "Delete" in caplog.text
    # the restored outputs are hard links again, and a third rerun restores as well
    delete_outputs(paths)
    run(tmp_path, pool, counter=steps)
    assert steps == [] and outputs(paths) == before


@pytest.mark.parametrize("change", ["learning_rate", "steps", "debug_step_log", "plan_field", "code", "edited_file",
                                    "manifest"])
def test_any_change_makes_the_run_train(tmp_path, pool, monkeypatch, change, caplog):
    run(tmp_path, pool)
    paths = run_state.RunPaths(tmp_path)
    delete_outputs(paths)
    kw = {}
    if change == "learning_rate":
        kw["lr"] = 2e-2
    elif change == "steps":
        kw["steps"] = 4
    elif change == "debug_step_log":  # decides which noise-free columns are released: never restore across it
        kw["debug_step_log"] = True
    elif change == "plan_field":  # a plan field the resume fingerprint leaves out but the ledger copies
        kw["plan_extra"] = {"epsilon_target_of": "something else"}
    elif change == "code":
        monkeypatch.setattr(finished, "package_digest", lambda packages: "other code")
    elif change == "edited_file":
        ledger = tmp_path / "finished" / paths.ledger.name
        ledger.write_text(ledger.read_text().replace("{", "{ ", 1))
    else:
        (tmp_path / "finished" / finished.MANIFEST).write_text("{not json")
    steps: list[int] = []
    with caplog.at_level("WARNING"):
        out = run(tmp_path, pool, counter=steps, **kw)
    assert steps and out.complete and "not restoring the finished outputs" in caplog.text
    assert (tmp_path / "finished" / finished.MANIFEST).is_file()  # the new run's record replaced the old one


def test_restore_leaves_no_stale_model_files_and_removes_a_checkpoint(tmp_path, pool):
    run(tmp_path, pool)
    paths = run_state.RunPaths(tmp_path)
    before = outputs(paths)
    delete_outputs(paths)
    paths.model_dir.mkdir()
    (paths.model_dir / "stale.bin").write_bytes(b"x")  # e.g. left by something else in the folder
    paths.checkpoint_dir.mkdir()
    (paths.checkpoint_dir / "state.pt").write_bytes(b"secret")
    run(tmp_path, pool)
    assert outputs(paths) == before and not paths.checkpoint_dir.exists()


def test_the_finished_attempts_log_survives_its_deletion(tmp_path, pool):
    """snakemake deletes the log of a job it reruns; the record keeps it and the restore appends it."""
    import logging

    log_file = tmp_path / "job.log"
    handler = logging.FileHandler(log_file, mode="a", encoding="utf-8")
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    try:
        plan = plan_for(pool, "els", expected=4.0, steps=3, sigma=1.0, clip=1.0)
        args = (pool, plan, run_settings(), run_state.RunPaths(tmp_path / "run", log_file),
                run_seeds.run_seeds(0, 0, "tiny", "els", "8", 100, 3), 0)
        kw = dict(gradient_source=ConstantGradients, compute_epsilon=constant_epsilon)
        engine.train(tiny_model(), *args, **kw)
        handler.flush()
        first = log_file.read_text()
        assert "run complete: 3 steps" in first
        delete_outputs(run_state.RunPaths(tmp_path / "run"))
        log_file.unlink()  # what snakemake does to an incomplete job's log
        handler.close()
        engine.train(tiny_model(), *args, **kw)
        handler.flush()
        text = log_file.read_text()
        assert "restored the finished outputs" in text and "run complete: 3 steps" in text
        assert "log of the attempt that finished this run" in text
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()


def test_a_failed_record_does_not_fail_the_finished_run(tmp_path, pool, monkeypatch, caplog):
    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(finished, "record", broken)
    with caplog.at_level("WARNING"):
        out = run(tmp_path, pool)
    paths = run_state.RunPaths(tmp_path)
    assert out.complete and paths.ledger.is_file() and not paths.checkpoint_dir.exists()  # the secret is gone
    assert "could not record the finished outputs" in caplog.text
