"""Config validation: defaults, clear errors naming the key, canonical numbers, grid."""

import copy
import logging
import math
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from userdp import layout
from userdp.config import load_config, validate_config
from userdp.layout import fmt_num
from userdp.grid import Cell, iter_cells
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
    with pytest.raises(ConfigError, match=r"'privacy.delta' is the string '1e-6'.*Write it as 1\.0e-6") as exc:
        validate_config(cfg)
    assert "training.learning_rates.0' is the string '1e-3'" in str(exc.value)
    # every suggested spelling is one PyYAML reads as the same float
    from userdp.config import _with_dot

    for text in ("1e-6", "1e3", "1.0e3", "2E+5", "5e0", "-3e2"):
        fixed = yaml.safe_load(f"x: {_with_dot(text)}")["x"]
        assert isinstance(fixed, float) and fixed == float(text), text
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


@pytest.mark.integration
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


@pytest.mark.integration
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


# ---------------------------------------------------------------- checks before any job runs


def with_(**sections):
    """minimal() with the given sections (dicts) set."""
    cfg = minimal()
    cfg.update(copy.deepcopy(sections))
    return cfg


@pytest.mark.parametrize("path", ["config/config.yaml", "tests/configs/tiny.yaml", "tests/slurm/config.yaml"])
def test_repo_configs_validate_without_warnings(path, caplog):
    caplog.set_level(logging.WARNING, logger="userdp.config")
    load_config(REPO / path)
    assert not [r for r in caplog.records if r.name == "userdp.config"]


def test_model_name_needs_tokenizer_name(tmp_path):
    cfg = with_(model={"name": "gpt2-medium"})
    with pytest.raises(ConfigError) as exc:
        validate_config(cfg)
    assert "model.name is set, so set tokenizer.name to the model's tokenizer (usually the same name)" in str(exc.value)
    validate_config(with_(model={"name": "gpt2-medium"}, tokenizer={"name": "gpt2-medium"}))
    # a local model folder that brings its own tokenizer is refused too ...
    (tmp_path / "hub_copy").mkdir()
    (tmp_path / "hub_copy" / "config.json").write_text("{}")
    (tmp_path / "hub_copy" / "tokenizer.json").write_text("{}")
    (tmp_path / "hub_copy" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="set tokenizer.name"):
        validate_config(with_(model={"name": str(tmp_path / "hub_copy")}))
    # ... but a folder without tokenizer files (a model this pipeline trained) uses the pipeline's BPE
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "config.json").write_text("{}")
    (tmp_path / "ours" / "model.safetensors").write_bytes(b"")
    validate_config(with_(model={"name": str(tmp_path / "ours")}))


def test_tiny_model_heads_must_divide_width():
    with pytest.raises(ConfigError) as exc:
        validate_config(with_(model={"n_embd": 30, "n_head": 4}))
    msg = str(exc.value)
    assert "model.n_embd (30) must be divisible by model.n_head (4)" in msg and "model.n_head: 3" in msg
    # not checked for a named model (its own config decides)
    validate_config(with_(model={"name": "gpt2", "n_embd": 30, "n_head": 4}, tokenizer={"name": "gpt2"}))


def test_budgets_with_the_same_compute_are_refused():
    budgets = [{"compute": 800, "steps": 10}, {"compute": 800, "steps": 20}]
    with pytest.raises(ConfigError) as exc:
        validate_config(with_(grid={"budgets": budgets}))
    msg = str(exc.value)
    assert "grid.budgets has two entries with compute 800 (steps 10 and 20)" in msg and "budget~K" in msg
    with pytest.raises(ConfigError, match="mean_estimation.budgets has two entries with compute 800"):
        validate_config(with_(mean_estimation={"budgets": budgets}))


def test_budget_below_one_example_per_step_is_refused():
    with pytest.raises(ConfigError) as exc:
        validate_config(with_(grid={"budgets": [{"compute": 30, "steps": 50}]}))
    msg = str(exc.value)
    assert "grid.budgets has {compute: 30, steps: 50}" in msg and "less than one example per step" in msg
    assert "compute >= steps" in msg
    validate_config(with_(grid={"budgets": [{"compute": 50, "steps": 50}]}))  # exactly one is fine
    with pytest.raises(ConfigError, match=r"mean_estimation.budgets has \{compute: 5, steps: 10\}"):
        validate_config(with_(mean_estimation={"budgets": [{"compute": 5, "steps": 10}]}))


def test_dataset_keys_are_checked_per_source_at_validation(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.csv").write_text("u,text\n1,a\n")
    cfg = {"datasets": {"tiny": {"source": "local", "path": "x.csv", "user_colum": "author"}}}
    with pytest.raises(ConfigError) as exc:
        validate_config(cfg)
    msg = str(exc.value)
    assert "datasets.tiny.user_colum" in msg and "user_column" in msg and "'local'" in msg
    # a key of another source
    with pytest.raises(ConfigError, match=r"datasets\.f\.hub_name: not a key of source 'fortunes'"):
        validate_config({"datasets": {"f": {"source": "fortunes", "hub_name": "x/y"}}})
    # the synthetic generator's block is a synthetic key only
    with pytest.raises(ConfigError, match=r"datasets\.s\.synthetic: not a key of source 'stackoverflow'"):
        validate_config({"datasets": {"s": {"source": "stackoverflow", "synthetic": {"n_users": 3}}}})
    for source, spec in [("synthetic", {"synthetic": {"n_users": 50}}), ("stackoverflow", {"splits": ["train"]}),
                         ("cc_news", {"hub_name": "a/b", "streaming": True}),
                         ("local", {"path": "x.csv", "user_column": "u"}), ("fortunes", {"path": "f"})]:
        validate_config({"datasets": {"d": {"source": source, "max_examples": 5, **spec}}})


def test_public_corpus_keys_are_checked_at_validation():
    with pytest.raises(ConfigError, match=r"datasets\.so\.public\.pth: not a key of a public corpus"):
        validate_config({"datasets": {"so": {"source": "stackoverflow", "public": {"pth": "c4.parquet"}}}})
    with pytest.raises(ConfigError, match=r"datasets\.so\.public has both of"):
        validate_config({"datasets": {"so": {"source": "stackoverflow",
                                             "public": {"path": "c4.parquet", "hub_name": "allenai/c4"}}}})
    validate_config({"datasets": {"so": {"source": "stackoverflow", "public": {"path": "c4.parquet"}}}})


def test_explicit_uls_group_must_fit_the_micro_batch():
    cfg = with_(privacy={"group_size": {"uls": 32}}, training={"physical_batch_size": 16})
    with pytest.raises(ConfigError) as exc:
        validate_config(cfg)
    msg = str(exc.value)
    assert "training.physical_batch_size is 16 but ULS needs whole users in one micro-batch" in msg
    assert "up to 32 examples" in msg and "privacy.group_size.uls" in msg and "physical_batch_size >= 32" in msg
    # k examples per user bound the largest user
    validate_config(with_(privacy={"group_size": {"uls": 32}},
                          training={"physical_batch_size": 16, "uls_examples_per_user": 8}))
    with pytest.raises(ConfigError, match=r"up to 20 examples.*uls_examples_per_user = 20"):
        validate_config(with_(privacy={"group_size": {"uls": 32}},
                              training={"physical_batch_size": 16, "uls_examples_per_user": 20}))
    # the G sweep runs ULS too
    with pytest.raises(ConfigError, match=r"G = 64 from grid.group_size_sweep.*drop 64 from grid.group_size_sweep"):
        validate_config(with_(grid={"group_size_sweep": [1, 64]}, training={"physical_batch_size": 16}))
    # ELS packs examples, not users: no constraint
    validate_config(with_(grid={"methods": ["els"], "group_size_sweep": [64]}, training={"physical_batch_size": 16}))


def test_group_sweep_epsilon_must_be_a_mean_estimation_epsilon():
    with pytest.raises(ConfigError) as exc:
        validate_config(with_(mean_estimation={"epsilons": [1, 4], "group_sweep_epsilon": 2}))
    msg = str(exc.value)
    assert "mean_estimation.group_sweep_epsilon is 2" in msg and "mean_estimation.epsilons [1, 4]" in msg
    validate_config(with_(mean_estimation={"epsilons": [1, 4], "group_sweep_epsilon": 4.0}))


def test_private_contribution_stats_need_epsilon_below_every_grid_epsilon():
    cfg = with_(privacy={"contribution_stats": {"private": True, "epsilon": 0.5}}, grid={"epsilons": [0.5, 8]})
    with pytest.raises(ConfigError) as exc:
        validate_config(cfg)
    msg = str(exc.value)
    assert "privacy.contribution_stats.epsilon = 0.5 is >= the smallest grid epsilon 0.5" in msg
    assert "privacy.contribution_stats.private: false" in msg
    # off: the key is not used
    validate_config(with_(privacy={"contribution_stats": {"private": False, "epsilon": 0.5}}, grid={"epsilons": [0.5]}))
    validate_config(with_(privacy={"contribution_stats": {"private": True, "epsilon": 0.05}}, grid={"epsilons": [0.5]}))


def _config_warnings(caplog, cfg) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="userdp.config"):
        validate_config(cfg)
    return [r.getMessage() for r in caplog.records if r.name == "userdp.config" and r.levelno == logging.WARNING]


def test_ignored_settings_log_warnings(caplog):
    assert _config_warnings(caplog, minimal()) == []
    two = [{"compute": 800, "steps": 50}, {"compute": 8000, "steps": 100}]
    w = _config_warnings(caplog, with_(training={"warmup_steps": 50}, grid={"budgets": two}))
    assert len(w) == 1 and "training.warmup_steps (50) >= 50" in w[0] and "warmup" in w[0]
    assert _config_warnings(caplog, with_(training={"warmup_steps": 49}, grid={"budgets": two})) == []
    w = _config_warnings(caplog, with_(privacy={"group_size": {"uls": 4}}, training={"uls_examples_per_user": 8}))
    assert len(w) == 1 and "training.uls_examples_per_user (8) > privacy.group_size.uls (G = 4)" in w[0]
    w = _config_warnings(caplog, with_(training={"precision": "bf16", "device": "cpu"}))
    assert len(w) == 1 and "bf16" in w[0] and "fp32" in w[0]
    assert _config_warnings(caplog, with_(training={"precision": "bf16", "device": "cuda"})) == []
    w = _config_warnings(caplog, with_(training={"gpus": 2, "device": "cpu"}))
    assert len(w) == 1 and "training.gpus is 2 with training.device: cpu" in w[0] and "meant for tests" in w[0]


def test_key_order_does_not_change_the_validated_config():
    """Snakemake compares params by repr: reordered keys must not rerun anything."""
    a = {"seed": 1,
         "datasets": {"b": {"source": "fortunes"}, "a": {"source": "synthetic", "split": {"test": 0.2, "validation": 0.1}}},
         "training": {"threads": 1, "learning_rates": [0.01, 0.001]}, "grid": {"epsilons": [8, 1], "seeds": [0]},
         "tokenizer": {"vocab_size": 300, "public_dataset": "a"}}  # null would depend on the datasets' order

    def reverse(obj):
        if isinstance(obj, dict):
            return {k: reverse(obj[k]) for k in reversed(list(obj))}
        return obj

    b = reverse(copy.deepcopy(a))
    assert list(b) != list(a)
    inner = a["datasets"]
    out = validate_config(a)
    assert out is a and a["datasets"] is inner  # snakemake's config object stays the same dict
    validate_config(b)
    assert repr(a) == repr(b)
    assert list(a) == sorted(a) and list(a["training"]) == sorted(a["training"])
    assert a["training"]["learning_rates"] == [0.01, 0.001] and a["grid"]["epsilons"] == [8, 1]  # lists keep order
    # validating again changes nothing
    before = repr(a)
    validate_config(a)
    assert repr(a) == before


def test_null_public_dataset_keeps_its_config_order_meaning():
    """null = first dataset in config order with a public part, even though keys get sorted."""
    cfg = {"datasets": {"zeta": {"source": "fortunes"}, "alpha": {"source": "synthetic"}}}
    validate_config(cfg)
    assert list(cfg["datasets"]) == ["alpha", "zeta"]
    assert cfg["tokenizer"]["public_dataset"] == "zeta"
    named = validate_config({"datasets": {"zeta": {"source": "fortunes"}}, "tokenizer": {"name": "gpt2"},
                             "model": {"name": "gpt2"}})
    assert named["tokenizer"]["public_dataset"] is None  # no BPE is trained


def _rule_regex(name: str) -> str:
    """The rules' wildcard constraint of `name` (common.smk applies userdp.layout.WILDCARD_RES)."""
    return layout.WILDCARD_RES[name]


@pytest.mark.parametrize("value", [1e16, 2.5e20, 1e-7, 1e15, 0.001])
def test_fmt_num_text_matches_the_wildcard_patterns(value):
    text = fmt_num(value)
    assert "+" not in text and float(text) == value
    assert re.fullmatch(_rule_regex("eps"), text) and re.fullmatch(_rule_regex("lr"), text)


def test_huge_or_infinite_grid_epsilon_is_refused():
    for eps in [1e16, math.inf]:
        with pytest.raises(ConfigError) as exc:
            validate_config(with_(grid={"epsilons": [1, eps]}))
        msg = str(exc.value)
        assert "grid.epsilons" in msg and "for the non-private reference (eps = inf) do not list it" in msg.lower()
        assert "grid.nonprivate: true" in msg


def test_same_number_twice_in_a_path_list_is_refused():
    with pytest.raises(ConfigError, match=r"grid.epsilons lists the same number twice \(1 and 1.0, both eps~1\)"):
        validate_config(with_(grid={"epsilons": [1, 1.0]}))
    with pytest.raises(ConfigError, match=r"training.learning_rates lists the same number twice.*lr~0.001"):
        validate_config(with_(training={"learning_rates": [0.001, 1.0e-3]}))


def test_local_dataset_path_is_checked_at_start_up(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"datasets\.mine\.path is required for source 'local'"):
        validate_config({"datasets": {"mine": {"source": "local"}}})
    with pytest.raises(ConfigError, match=r"datasets\.mine\.path is data/posts\.csv, which does not exist"):
        validate_config({"datasets": {"mine": {"source": "local", "path": "data/posts.csv"}}})
    (tmp_path / "data").mkdir()
    with pytest.raises(ConfigError, match=r"data \(datasets\.mine\.path\) is a folder without \.parquet files"):
        validate_config({"datasets": {"mine": {"source": "local", "path": "data"}}})
    (tmp_path / "data" / "posts.csv").write_text("user_id,text\n1,a\n")
    validate_config({"datasets": {"mine": {"source": "local", "path": "data/posts.csv"}}})
    with pytest.raises(ConfigError, match=r"posts\.csv \(datasets\.mine, format csv\): the file is empty"):
        (tmp_path / "data" / "posts.csv").write_text("")
        validate_config({"datasets": {"mine": {"source": "local", "path": "data/posts.csv"}}})
    pq.write_table(pa.table({"user_id": ["1"], "text": ["a"]}), tmp_path / "data" / "p.parquet")
    validate_config({"datasets": {"mine": {"source": "local", "path": "data"}}})  # a folder of Parquet files


@pytest.mark.parametrize("section, key, value, where", [
    ("grid", "epsilons", [1, math.nan], "grid.epsilons.1' is NaN"),
    ("privacy", "clip_norm", math.nan, "privacy.clip_norm' is NaN"),
    ("privacy", "delta", math.inf, "privacy.delta' is infinite"),
    ("training", "learning_rates", [-math.inf], "training.learning_rates.0' is -infinite"),
    ("audit", "epsilons", [math.inf], "audit.epsilons.0' is infinite"),
])
def test_nan_and_infinite_numbers_are_refused_naming_the_key(section, key, value, where):
    with pytest.raises(ConfigError, match=re.escape(where)) as exc:
        validate_config(with_(**{section: {key: value}}))
    if "epsilons" in key and "NaN" not in where:
        assert "grid.nonprivate: true" in str(exc.value)  # where the non-private reference comes from


def test_the_string_inf_gets_the_non_private_hint():
    with pytest.raises(ConfigError, match="is the string 'inf', not a number") as exc:
        validate_config(with_(grid={"epsilons": ["inf"]}))
    assert "grid.nonprivate: true" in str(exc.value) and "with a dot" not in str(exc.value)


def test_a_local_model_folder_that_does_not_exist_says_so(tmp_path):
    """Not "set tokenizer.name to the same path" (which then fails with the hub's repo-id message)."""
    missing = str(tmp_path / "my-llama")
    with pytest.raises(ConfigError, match=r"model\.name is .*my-llama, a local path that does not exist"):
        validate_config(with_(model={"name": missing}, tokenizer={"name": missing}))
    (tmp_path / "my-llama").mkdir()
    with pytest.raises(ConfigError, match=r"a folder without config\.json"):
        validate_config(with_(model={"name": missing}, tokenizer={"name": missing}))
    (tmp_path / "my-llama" / "config.json").write_text('{"model_type": "llama",')  # cut off by a failed copy
    with pytest.raises(ConfigError, match=r"my-llama/config\.json is not valid JSON"):
        validate_config(with_(model={"name": missing}, tokenizer={"name": missing}))
    (tmp_path / "my-llama" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConfigError, match=r"a folder with config\.json but no weights"):
        validate_config(with_(model={"name": missing}, tokenizer={"name": missing}))
    (tmp_path / "my-llama" / "model-00001-of-00002.safetensors").write_bytes(b"")
    (tmp_path / "my-llama" / "tokenizer.json").write_text("{}")
    validate_config(with_(model={"name": missing}, tokenizer={"name": missing}))  # sharded weights: accepted
    (tmp_path / "tok.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"tokenizer\.name is .*tok\.json, which is a file, not a folder"):
        validate_config(with_(tokenizer={"name": str(tmp_path / "tok.json")}))


def test_check_config_names_file_and_line_of_a_yaml_syntax_error(tmp_path, capsys):
    """snakemake parses --configfile files itself and says only 'Config file is not valid JSON or YAML'."""
    from userdp.cli import main

    bad = tmp_path / "mine.yaml"
    bad.write_text("grid:\n  epsilons: [1, 2\n  seeds: [0]\n")
    assert main(["check-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"config file {bad} is not valid YAML at line 3, column 8" in err and "indentation" in err
    typo = tmp_path / "typo.yaml"
    typo.write_text("grid:\n  seedz: [0]\n")
    assert main(["check-config", str(typo)]) == 2
    assert "unknown config key(s) ['seedz'] under 'grid'" in capsys.readouterr().err
    good = tmp_path / "good.yaml"
    good.write_text("grid:\n  seeds: [0, 1]\n")
    assert main(["check-config", str(good)]) == 0 and "valid" in capsys.readouterr().out
    # alone (as with --replace-workflow-config) the file lacks the required sections
    assert main(["check-config", str(good), "--default", "none"]) == 2
    assert "datasets" in capsys.readouterr().err


@pytest.mark.integration
def test_snakemake_names_file_and_line_of_a_broken_default_config(tmp_path):
    import subprocess
    import sys

    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text("seed: 0\ngrid:\n\tepsilons: [1]\n")  # a tab
    res = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory",
                          str(tmp_path), "-n"], capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "config file config/config.yaml is not valid YAML at line 3, column 1" in out


def test_yaml_merge_keys_and_distinct_keys_are_not_duplicates(tmp_path):
    from userdp.config import read_config_file

    f = tmp_path / "c.yaml"
    f.write_text("base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  y: 3\nflags: {1: a, true: b}\n")
    assert read_config_file(f) == {"base": {"x": 1, "y": 2}, "other": {"x": 1, "y": 3}, "flags": {1: "b"}}  # 1 and true: one Python key
    f.write_text("grid: {epsilons: [1]}\ntraining: {optimizer: sgd}\ngrid: {seeds: [0, 1]}\n")
    with pytest.raises(ConfigError, match=r"(?s)line 3, column 1: .*the key 'grid' appears twice \(first at line 1\)"):
        read_config_file(f)


def test_config_files_merge_as_snakemake_merges_them():
    """snakemake merges all --configfile files into one override, then that over the default (check-config does
    the same): a null in the first file and a partial mapping in the second keep the default's other keys."""
    from userdp.config import merge_configs

    default = {"model": {"lora": {"r": 8, "alpha": 16, "dropout": 0.0}, "n_layer": 2}}
    override = merge_configs(merge_configs({}, {"model": {"lora": None}}), {"model": {"lora": {"r": 4}}})
    assert merge_configs(default, override)["model"] == {"lora": {"r": 4, "alpha": 16, "dropout": 0.0}, "n_layer": 2}
    assert merge_configs({"a": 1}, {"a": {"b": 2}}) == {"a": {"b": 2}}  # a mapping over a scalar replaces it
