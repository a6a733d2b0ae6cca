"""Checkpoints hold the secret noise state: private permissions, no unpickling of arbitrary objects, loud deletion.

Resume itself (bit-identical to an uninterrupted run, also with secret
seeds) is tested in tests/test_train_engine.py.
"""

from __future__ import annotations

import os
import stat

import pytest
import torch

from train_fixtures import SEQ, ConstantGradients, plan_for, tiny_model
from userdp.errors import DataError
from userdp.training import checkpoint as ckpt
from userdp.training import engine, run_seeds, run_state
from userdp.training.settings import TrainSettings


def fake_epsilon(event, delta):
    return 1.0


@pytest.fixture(scope="module")
def pool():
    from train_fixtures import train_pool

    return train_pool(24, 5)


@pytest.fixture
def permissive_umask():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _train(pool, path, **kw):
    plan = plan_for(pool, "els", expected=3.0, steps=4, sigma=0.7, clip=0.5)
    settings = TrainSettings(learning_rate=1e-2, physical_batch_size=8, sequence_length=SEQ, checkpoint_every=2,
                             device="cpu", log_every_s=0.0)
    secret = run_seeds.run_seeds(0, 0, "tiny", "els", "8", 100, 3, 0.01, secret=True)
    return engine.train(tiny_model(), pool, plan, settings, run_state.RunPaths(path), secret, 0,
                        gradient_source=ConstantGradients, compute_epsilon=fake_epsilon, **kw)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_checkpoint_is_private_whatever_the_umask(tmp_path, pool, permissive_umask):
    """Folder 0700 and state.pt 0600 with umask 022 (which would give 0755 / 0644), also for an existing folder."""
    (tmp_path / "checkpoint").mkdir(mode=0o755)
    os.chmod(tmp_path / "checkpoint", 0o755)
    out = _train(pool, tmp_path, max_steps=2)
    assert not out.complete
    assert _mode(tmp_path / "checkpoint") == 0o700
    assert _mode(tmp_path / "checkpoint" / "state.pt") == 0o600
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["state.pt"]  # no temporary left
    # the run's other outputs keep the umask's permissions (they are not secret)
    done = _train(pool, tmp_path)
    assert done.complete and done.ledger["resumed_at_steps"] == [2]
    assert _mode(tmp_path / "ledger.json") == 0o644
    assert not (tmp_path / "checkpoint").exists()


class _RunsCode:
    """Unpickling this calls open(marker, "w"): code that runs at load time."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_checkpoint_with_a_malicious_pickle_is_refused(tmp_path, pool):
    marker = tmp_path / "code_ran"
    folder = tmp_path / "run" / "checkpoint"
    folder.mkdir(parents=True)
    torch.save({"fingerprint": "x", "step": 1, "payload": _RunsCode(marker)}, folder / "state.pt")
    with pytest.raises(DataError, match=r"checkpoint .*state\.pt holds objects other than tensors") as err:
        ckpt.load_checkpoint(folder, "x")
    assert str(folder) in str(err.value) and "Delete the folder" in str(err.value)
    assert not marker.exists()
    # the training engine refuses it too, before any step
    with pytest.raises(DataError, match="holds objects other than tensors"):
        _train(pool, tmp_path / "run")
    assert not marker.exists()
    # the payload is real: the unsafe loader runs it
    torch.load(folder / "state.pt", weights_only=False)
    assert marker.exists()


def test_checkpoint_the_engine_writes_loads_safely(tmp_path, pool):
    """Every object in a real checkpoint (RNG states, optimizer, scheduler, log rows) passes weights_only."""
    _train(pool, tmp_path, max_steps=2)
    state = torch.load(tmp_path / "checkpoint" / "state.pt", map_location="cpu", weights_only=True)
    assert state["step"] == 2 and len(state["log"]) == 2
    assert isinstance(state["sampler"]["seed"], int) and state["sampler"]["step"] == 2


def test_failed_checkpoint_deletion_fails_the_run(tmp_path, pool):
    """rmtree refuses a symbolic link: the error names the folder instead of being ignored."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint").symlink_to(target, target_is_directory=True)
    with pytest.raises(DataError, match=r"could not delete the checkpoint folder .*checkpoint") as err:
        _train(pool, run)
    assert str(run / "checkpoint") in str(err.value)
    assert (target / "state.pt").exists()  # what was not deleted
    # a folder that was never written is not an error
    ckpt.remove_checkpoint(tmp_path / "never_written")


def test_remove_checkpoint_raises_on_os_errors(tmp_path, monkeypatch):
    folder = tmp_path / "checkpoint"
    folder.mkdir()

    def refuse(path, *a, **k):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(ckpt.shutil, "rmtree", refuse)
    with pytest.raises(DataError, match="Permission denied"):
        ckpt.remove_checkpoint(folder)
