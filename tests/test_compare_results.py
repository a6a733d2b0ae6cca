"""benchmarks/compare_results.py: the behaviour check of refactors finds what differs and only that."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compare_results():
    spec = importlib.util.spec_from_file_location("compare_results", ROOT / "benchmarks" / "compare_results.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def _tree(root: Path, *, loss: float = 2.5, seconds: float = 1.0, weights: bytes = b"w0") -> Path:
    (root / "plan").mkdir(parents=True)
    (root / "plan" / "calibration.json").write_text(json.dumps({"sigma": 1.25, "seconds": seconds}))
    (root / "summary").mkdir()
    pd.DataFrame({"run": ["a", "b"], "loss": [loss, 3.0], "wall_seconds": [seconds, 2.0]}).to_parquet(
        root / "summary" / "runs.parquet")
    (root / "runs" / "r1").mkdir(parents=True)
    (root / "runs" / "r1" / "model.safetensors").write_bytes(weights)
    (root / "benchmarks" / "data").mkdir(parents=True)
    (root / "benchmarks" / "data" / f"download_{seconds}.tsv").write_text("s\n1.0\n")
    (root / "logs").mkdir()
    (root / "logs" / "x.log").write_text(f"took {seconds}\n")
    return root


def test_identical_trees_apart_from_timing_pass(compare_results, tmp_path, capsys):
    a, b = _tree(tmp_path / "a"), _tree(tmp_path / "b", seconds=9.0)
    assert compare_results.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "compared: {'json': 1, 'parquet': 1, 'weights': 1}" in out
    assert "0 differences" in out


@pytest.mark.parametrize("change, where", [
    ({"loss": 2.6}, "summary/runs.parquet"),
    ({"weights": b"w1"}, "runs/r1/model.safetensors: SHA-256 differs"),
])
def test_a_changed_output_is_a_difference(compare_results, tmp_path, capsys, change, where):
    a, b = _tree(tmp_path / "a"), _tree(tmp_path / "b", **change)
    assert compare_results.main([str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "1 differences" in out and where in out


def test_json_field_and_missing_file(compare_results, tmp_path, capsys):
    a, b = _tree(tmp_path / "a"), _tree(tmp_path / "b")
    (b / "plan" / "calibration.json").write_text(json.dumps({"sigma": 1.5, "seconds": 1.0}))
    shutil.rmtree(b / "runs")
    assert compare_results.main([str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "plan/calibration.json: .sigma: 1.25 != 1.5" in out
    assert "runs/r1/model.safetensors: only in A" in out


def test_a_missing_tree_is_refused(compare_results, tmp_path, capsys):
    a = _tree(tmp_path / "a")
    assert compare_results.main([str(a), str(tmp_path / "nope")]) == 2
    assert "B = " in capsys.readouterr().err
