"""A finished run's outputs, kept so that no finished training is ever redone.

Snakemake records a job's outputs only after the job exits. If snakemake is
killed (kill -9, a lost login node) while a fine-tuning job runs, the job
still finishes and writes its outputs, but snakemake marks them incomplete;
after `--unlock`, `--rerun-incomplete` deletes them and runs the job again,
and the checkpoint is gone (a finished run deletes it: it holds the secret
noise state). Without this module that run would be trained again from
scratch.

So a finished run also records `{run_dir}/finished/`: hard links (copies on
file systems without links) to its released outputs (model folder, per-step
log, ledger) and `manifest.json` with each file's size and SHA-256 and the
run's key. The key is the checkpoint fingerprint (mechanism, result-changing
settings, public seeds, base model and pool content; `run_state.run_fingerprint`),
the plan without its wall time, debug_step_log and the adapter's settings
(engine.train), plus the digest of the userdp code and the versions of
PACKAGES. When the job runs again and the key and every file match, the
outputs are linked back into place instead of training (the log says so);
anything else (a different key, a missing or edited file) removes the record
and the run trains.

The record holds only files the run releases anyway (never the checkpoint)
and, as hard links, no extra disk space while the outputs exist. To force a
retraining with unchanged config and code, delete the run folder or its
`finished/` folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Iterable

from ..code_version import package_digest
from ..io import atomic_dir, remove_stale_temps, sha256_file, temp_prefix

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
#: A hard link to the finishing attempt's log file: it keeps the lines written after the record too, and
#: survives snakemake deleting the log of a job it reruns; a restore appends it to the new attempt's log.
ATTEMPT_LOG = "attempt.log"
#: Library versions that change a run's outputs with unchanged userdp code (the model; the ledger's epsilon).
PACKAGES = ("torch", "transformers", "peft", "dp-accounting", "numpy", "scipy")


def run_key(fingerprint: str) -> str:
    """The key a record must match: the run's fingerprint (from engine.train: the resume fingerprint, the whole
    plan, every setting, the adapter's settings), the userdp code and the libraries' versions."""
    return hashlib.sha256(f"{fingerprint}|{package_digest(PACKAGES)}".encode()).hexdigest()


def _files(run_dir: Path, outputs: Iterable[Path]) -> list[str]:
    """The files of `outputs` (files, or folders taken recursively) relative to run_dir, sorted."""
    out: list[str] = []
    for path in outputs:
        path = Path(path)
        items = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        out += [str(p.relative_to(run_dir)) for p in items]
    return sorted(out)


def _link(src: Path, dst: Path) -> None:
    """dst becomes a hard link to src (a copy where links are not possible), replacing dst atomically."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(dst)
    tmp = dst.parent / f"{temp_prefix(dst)}link.tmp"
    tmp.unlink(missing_ok=True)
    try:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copy2(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def record(run_dir: str | os.PathLike, outputs: Iterable[Path], fingerprint: str,
           log_file: str | os.PathLike | None = None) -> Path:
    """Record the run's finished `outputs` (inside run_dir) under `{run_dir}/finished/`, replacing an old record.

    log_file: the job's log, linked as ATTEMPT_LOG (not part of the verified files).
    """
    run_dir = Path(run_dir)
    outputs = [Path(p) for p in outputs]
    folder = run_dir / "finished"
    files = _files(run_dir, outputs)
    with atomic_dir(folder, chmod_files=False) as tmp:  # the files are links to the outputs: their modes stay
        for rel in files:
            _link(run_dir / rel, tmp / rel)
        manifest = {"key": run_key(fingerprint), "outputs": sorted(str(p.relative_to(run_dir)) for p in outputs),
                    "files": {rel: {"size": (run_dir / rel).stat().st_size, "sha256": sha256_file(run_dir / rel)}
                              for rel in files}}
        if log_file is not None and Path(log_file).is_file():
            try:
                os.link(log_file, tmp / ATTEMPT_LOG)
            except OSError:  # no hard links here: the lines up to now
                shutil.copy2(log_file, tmp / ATTEMPT_LOG)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8")
    return folder


def _same_file(a: Path, b: str | os.PathLike) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _discard(folder: Path, why: str) -> None:
    log.warning("not restoring the finished outputs in %s: %s; the run trains", folder, why)
    shutil.rmtree(folder, ignore_errors=True)


def restore(run_dir: str | os.PathLike, fingerprint: str, log_file: str | os.PathLike | None = None) -> bool:
    """Link a matching record's files back into run_dir and return True; False (record removed) otherwise.

    log_file: this attempt's log; the finished attempt's log (ATTEMPT_LOG) is appended to it.
    """
    run_dir = Path(run_dir)
    folder = run_dir / "finished"
    if not folder.is_dir():
        return False
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        files, key, outputs = manifest["files"], manifest["key"], manifest["outputs"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        _discard(folder, f"its {MANIFEST} cannot be read ({exc})")
        return False
    if key != run_key(fingerprint):
        _discard(folder, "it was made by another plan, config, base model, training data, code or library version")
        return False
    for rel, meta in files.items():
        path = folder / rel
        if not path.is_file() or path.stat().st_size != meta["size"] or sha256_file(path) != meta["sha256"]:
            _discard(folder, f"{rel} is missing or was changed since the run finished")
            return False
    try:
        for rel in outputs:  # whole outputs: a model folder gets exactly the recorded files
            path = run_dir / rel
            if path.is_dir():
                shutil.rmtree(path)
        for rel in files:
            _link(folder / rel, run_dir / rel)
    except OSError as exc:  # the run trains and replaces whatever was linked back
        _discard(folder, f"linking its files back failed ({exc})")
        return False
    earlier = folder / ATTEMPT_LOG
    if log_file is not None and earlier.is_file() and not _same_file(earlier, log_file):
        with open(log_file, "a", encoding="utf-8") as out:
            out.write(f"===== log of the attempt that finished this run (kept in {earlier}) =====\n")
            out.write(earlier.read_text(encoding="utf-8", errors="replace"))
            out.write("===== end of that attempt's log =====\n")
    log.warning("restored the finished outputs of an earlier attempt of this run from %s instead of training "
                "again (same plan, config, data, base model and code; snakemake had not recorded them, e.g. it "
                "was killed while the job ran). Delete %s to force retraining.", folder, folder)
    return True
