"""Config validation (JSON schema with defaults) and the grid of cells.

The schema lives in workflow/schemas/config.schema.yaml; validation fills in
defaults and turns schema violations into `ConfigError`s that name the key,
the offending value and what is allowed. Snakemake's own `validate` runs the
same schema in the Snakefile; this module is what scripts, the CLI and tests
use.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import yaml

from .errors import ConfigError

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "schemas" / "config.schema.yaml"


def load_schema() -> dict:
    with open(SCHEMA_PATH, encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def _extend_with_default(validator_class):
    validate_props = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for prop, sub in properties.items():
                if "default" in sub and prop not in instance:
                    instance[prop] = copy.deepcopy(sub["default"])
        yield from validate_props(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


_Validator = _extend_with_default(jsonschema.Draft202012Validator)


def _key_path(err: jsonschema.ValidationError) -> str:
    parts = [str(p) for p in err.absolute_path]
    return ".".join(parts) if parts else "(top level)"


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _with_dot(text: str) -> str:
    """'1e-6' -> '1.0e-6' (the spelling YAML reads as a float)."""
    mant, _, exp = text.lower().partition("e")
    if exp and "." not in mant:
        return f"{mant}.0e{exp}"
    return text


def _describe(err: jsonschema.ValidationError) -> str:
    key = _key_path(err)
    sch = err.schema if isinstance(err.schema, dict) else {}
    if err.validator == "additionalProperties":
        allowed = sorted(sch.get("properties", {}))
        extra = sorted(set(err.instance) - set(allowed)) if isinstance(err.instance, dict) else []
        where = f"under '{key}'" if key != "(top level)" else "at the top level"
        return (
            f"unknown config key(s) {extra} {where}; allowed keys: {allowed}. "
            "Check the spelling against config/README.md."
        )
    if err.validator == "enum":
        return f"config key '{key}' is {err.instance!r}; allowed values: {err.validator_value}."
    if err.validator == "oneOf":
        opts = []
        for s in err.validator_value:
            opts.append(str(s.get("enum")) if "enum" in s else s.get("type", "?") + (f" >= {s['minimum']}" if "minimum" in s else ""))
        return f"config key '{key}' is {err.instance!r}; it must be one of: {' or '.join(opts)}."
    if err.validator == "required":
        return f"config key '{key}' misses required key(s): {err.message}."
    if err.validator == "type" and isinstance(err.instance, str) and _looks_numeric(err.instance):
        # PyYAML (YAML 1.1) reads 1e-6 or 1e3 without a dot as a string
        return (
            f"config key '{key}' is the string {err.instance!r}, not a number: YAML reads exponent notation "
            f"without a decimal point as text. Write it with a dot, e.g. {_with_dot(err.instance)}."
        )
    desc = sch.get("description")
    hint = f" ({desc})" if desc else ""
    return f"config key '{key}' is invalid: {err.message}{hint}. See config/README.md."


def validate_config(config: dict, source: str = "config") -> dict:
    """Validate `config` in place against the schema, filling defaults; return it.

    Raises ConfigError naming the first offending key (sorted by path).
    """
    schema = load_schema()
    errors = sorted(_Validator(schema).iter_errors(config), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        msgs = "; ".join(_describe(e) for e in errors[:5])
        raise ConfigError(f"{source}: {msgs}")
    _check_semantics(config, source)
    return config


def _check_semantics(config: dict, source: str) -> None:
    """Checks a JSON schema cannot express."""
    for name, spec in config["datasets"].items():
        split = spec.get("split") or {}
        total = float(split.get("validation", 0)) + float(split.get("test", 0))
        if total >= 1:
            raise ConfigError(
                f"{source}: datasets.{name}.split: validation + test = {total:g} leaves no train users; "
                "make the two fractions sum to less than 1."
            )
    grid = config["grid"]
    if grid["datasets"] is not None:
        unknown = [d for d in grid["datasets"] if d not in config["datasets"]]
        if unknown:
            raise ConfigError(
                f"{source}: grid.datasets names unknown dataset(s) {unknown}; "
                f"defined datasets: {sorted(config['datasets'])}."
            )
    if (config["privacy"].get("group_size") or {}).get("els") == "snr":
        raise ConfigError(
            f"{source}: privacy.group_size.els is 'snr', a rule for ULS only (it predicts the utility of "
            "user-level sampling); use 'median' (the study's ELS heuristic) or an integer G."
        )
    public = config["tokenizer"]["public_dataset"]
    if public is not None and public not in config["datasets"]:
        raise ConfigError(
            f"{source}: tokenizer.public_dataset is {public!r}, which is not a dataset in 'datasets' "
            f"(defined: {sorted(config['datasets'])})."
        )


def load_config(path: str | Path) -> dict:
    """Read a YAML config file and validate it."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as fh:
            config = yaml.safe_load(fh)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} does not exist") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, not {type(config).__name__}")
    return validate_config(config, source=str(path))


# ---------------------------------------------------------------- numbers in paths


def fmt_num(x: float | int | str) -> str:
    """Canonical text of a number for artifact paths: 4, 0.5, 1e-05, inf.

    `1` and `1.0` give the same text, so one cell never gets two paths.
    """
    v = float(x)
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(v)


def parse_num(text: str) -> float:
    return float(text)


# ---------------------------------------------------------------- the grid


@dataclass(frozen=True)
class Cell:
    """One fine-tuning grid cell. `group_size` is set only for G-sweep cells."""

    dataset: str
    method: str
    epsilon: float
    compute: int
    steps: int
    seed: int
    group_size: int | None = None

    @property
    def eps_text(self) -> str:
        return fmt_num(self.epsilon)

    @property
    def plan_path(self) -> str:
        base = f"results/plan/{self.dataset}/method~{self.method}/eps~{self.eps_text}/budget~{self.compute}"
        return base + (f"/group~{self.group_size}.json" if self.group_size else ".json")

    @property
    def run_dir(self) -> str:
        base = f"results/runs/{self.dataset}/method~{self.method}/eps~{self.eps_text}/budget~{self.compute}"
        if self.group_size:
            base += f"/group~{self.group_size}"
        return base + f"/seed~{self.seed}"


def grid_datasets(config: dict) -> list[str]:
    ds = config["grid"]["datasets"]
    return list(config["datasets"]) if ds is None else list(ds)


def steps_for_budget(config: dict, compute: int | str) -> int:
    for b in config["grid"]["budgets"]:
        if int(b["compute"]) == int(compute):
            return int(b["steps"])
    raise ConfigError(
        f"no grid.budgets entry has compute {compute}; configured: {[b['compute'] for b in config['grid']['budgets']]}"
    )


def iter_cells(config: dict) -> Iterator[Cell]:
    """Every fine-tuning cell of the grid: private cells, eps=inf references, G sweep."""
    grid = config["grid"]
    epsilons = [float(e) for e in grid["epsilons"]]
    if grid["nonprivate"]:
        epsilons.append(math.inf)
    for dataset in grid_datasets(config):
        for method in grid["methods"]:
            for eps in epsilons:
                for b in grid["budgets"]:
                    for seed in grid["seeds"]:
                        yield Cell(dataset, method, eps, int(b["compute"]), int(b["steps"]), int(seed))
            b0 = grid["budgets"][0]
            for g in grid["group_size_sweep"]:
                for seed in grid["seeds"]:
                    yield Cell(dataset, method, epsilons[0], int(b0["compute"]), int(b0["steps"]), int(seed), int(g))
