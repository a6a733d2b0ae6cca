"""Config validation: defaults, clear errors naming the key, canonical numbers, grid."""

import copy
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from userdp.config import Cell, fmt_num, iter_cells, load_config, validate_config
from userdp.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def minimal():
    return {"datasets": {"synth": {"source": "synthetic"}}}


def test_default_config_validates_and_fills_defaults():
    cfg = load_config(REPO / "config" / "config.yaml")
    assert cfg["privacy"]["delta_exponent"] == 1.1
    assert cfg["training"]["optimizer"] == "adam"
    assert cfg["grid"]["methods"] == ["els", "uls"]


def test_paper_config_validates():
    base = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    paper = yaml.safe_load((REPO / "config" / "paper.yaml").read_text())
    base["datasets"].update(paper.pop("datasets"))
    for k, v in paper.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            base[k].update(v)
        else:
            base[k] = v
    validate_config(base)


def test_minimal_config_gets_every_section():
    cfg = validate_config(minimal())
    for section in ["tokenizer", "model", "privacy", "grid", "training", "evaluation", "mean_estimation"]:
        assert isinstance(cfg[section], dict)
    assert cfg["model"]["pretrain"]["steps"] > 0


def test_unknown_key_names_key_and_allowed():
    cfg = minimal()
    cfg["privacy"] = {"clip_nrom": 1.0}
    with pytest.raises(ConfigError) as exc:
        validate_config(cfg)
    msg = str(exc.value)
    assert "clip_nrom" in msg and "clip_norm" in msg and "privacy" in msg


def test_wrong_enum_lists_allowed_values():
    cfg = minimal()
    cfg["training"] = {"optimizer": "rmsprop"}
    with pytest.raises(ConfigError) as exc:
        validate_config(cfg)
    msg = str(exc.value)
    assert "training.optimizer" in msg and "adam" in msg and "rmsprop" in msg


def test_unknown_dataset_source():
    cfg = {"datasets": {"x": {"source": "reddit"}}}
    with pytest.raises(ConfigError) as exc:
        validate_config(cfg)
    assert "datasets.x.source" in str(exc.value) and "stackoverflow" in str(exc.value)


def test_negative_fraction():
    cfg = minimal()
    cfg["datasets"]["synth"]["split"] = {"validation": -0.1}
    with pytest.raises(ConfigError) as exc:
        validate_config(cfg)
    assert "datasets.synth.split.validation" in str(exc.value)


def test_fractions_leaving_no_train_users():
    cfg = minimal()
    cfg["datasets"]["synth"]["split"] = {"validation": 0.6, "test": 0.5}
    with pytest.raises(ConfigError, match="no train users"):
        validate_config(cfg)


def test_grid_unknown_dataset():
    cfg = minimal()
    cfg["grid"] = {"datasets": ["nope"]}
    with pytest.raises(ConfigError, match="nope"):
        validate_config(cfg)


def test_group_size_rule_accepts_int_or_rule():
    cfg = minimal()
    cfg["privacy"] = {"group_size": {"els": 4, "uls": "snr"}}
    validate_config(cfg)
    bad = minimal()
    bad["privacy"] = {"group_size": {"els": 0}}
    with pytest.raises(ConfigError, match="privacy.group_size.els"):
        validate_config(bad)


def test_snr_for_els_is_refused_before_any_job():
    bad = minimal()
    bad["privacy"] = {"group_size": {"els": "snr"}}
    with pytest.raises(ConfigError, match=r"privacy.group_size.els is 'snr', a rule for ULS only"):
        validate_config(bad)


def test_yaml_exponent_without_dot_gets_a_spelling_hint():
    """PyYAML reads 1e-6 as a string; the error says how to write it."""
    cfg = minimal()
    cfg.update(yaml.safe_load("privacy: {delta: 1e-6}\ntraining: {learning_rates: [1e-3]}"))
    assert cfg["privacy"]["delta"] == "1e-6"  # the YAML behaviour the hint is about
    with pytest.raises(ConfigError, match=r"'privacy.delta' is the string '1e-6'.*e\.g\. 1\.0e-6") as exc:
        validate_config(cfg)
    assert "training.learning_rates.0' is the string '1e-3'" in str(exc.value)
    cfg["privacy"]["delta"] = yaml.safe_load("1.0e-6")
    cfg["training"]["learning_rates"] = [1.0e-3]
    validate_config(cfg)


def test_load_config_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    p = tmp_path / "bad.yaml"
    p.write_text("datasets: [unclosed\n")
    with pytest.raises(ConfigError, match=str(p)):
        load_config(p)


@pytest.mark.parametrize(
    "value,text", [(1, "1"), (1.0, "1"), ("4.0", "4"), (0.5, "0.5"), (1e-5, "1e-05"), (math.inf, "inf"), (16, "16")]
)
def test_fmt_num_is_canonical(value, text):
    assert fmt_num(value) == text


def test_iter_cells_covers_grid_and_references():
    cfg = validate_config(minimal())
    cfg["grid"].update(epsilons=[1, 8.0], seeds=[0, 1], group_size_sweep=[2, 4], nonprivate=True)
    cells = list(iter_cells(cfg))
    main = [c for c in cells if c.group_size is None]
    sweep = [c for c in cells if c.group_size is not None]
    # 2 methods x (2 eps + inf) x 1 budget x 2 seeds
    assert len(main) == 2 * 3 * 1 * 2
    assert len(sweep) == 2 * 2 * 2
    paths = {c.plan_path for c in main}
    assert "results/plan/synth/method~els/eps~8/budget~8000.json" in paths
    assert "results/plan/synth/method~uls/eps~inf/budget~8000.json" in paths
    assert all(c.epsilon == 1 for c in sweep)
    assert Cell("d", "uls", 1.0, 10, 5, 0, 4).run_dir == "results/runs/d/method~uls/eps~1/budget~10/group~4/seed~0"


def test_snakemake_reports_bad_config_key(tmp_path):
    """The workflow stops at start-up with a message naming the wrong key."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("training:\n  optimiser: adam\n")
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--configfile", str(bad)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "optimiser" in proc.stdout + proc.stderr


def test_target_of_an_unknown_dataset_is_a_clear_error(tmp_path):
    """Asking for results/data/<name>/... of a dataset the config lacks names it and the fix."""
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "results/data/nope/contributions.json", "-n", "--cores", "1",
         "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path),
         "--configfile", str(REPO / "config" / "config.yaml")],
        capture_output=True, text=True, timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "dataset 'nope' is not defined" in out and "synth" in out
    # a configured dataset still resolves to its real rules
    ok = subprocess.run(
        [sys.executable, "-m", "snakemake", "results/data/fortunes/contributions.json", "-n", "--cores", "1",
         "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path),
         "--configfile", str(REPO / "config" / "config.yaml")],
        capture_output=True, text=True, timeout=120,
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "prepare_data" in ok.stdout + ok.stderr
