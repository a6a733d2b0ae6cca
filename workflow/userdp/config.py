"""Config validation: the JSON schema with defaults, the checks it cannot express, warnings.

The schema lives in workflow/schemas/config.schema.yaml; validation fills in
defaults and turns schema violations into `ConfigError`s that name the key,
the offending value and what is allowed. Snakemake's own `validate` runs the
same schema in the Snakefile; this module is what scripts, the CLI and tests
use. Paths, their numbers and the grid of cells are userdp.layout's.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from .errors import ConfigError
from .layout import fmt_num
from .io import sort_keys_in_place
from .training.settings import check_uls_fits

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "schemas" / "config.schema.yaml"

log = logging.getLogger("userdp.config")

# grid.epsilons from here on are refused: nobody needs them, and the
# non-private reference is eps~inf (grid.nonprivate).
MAX_FINITE_EPSILON = 1e15


def _schema() -> dict:
    """The parsed schema, shared: read once per process and again only when the file changes.

    Parsing the 29 kB YAML takes ~0.15 s; validate_config runs many times in the CLI, the API and the tests
    (the test suite spent over a minute re-reading it). Callers must not change the returned dict.
    """
    st = SCHEMA_PATH.stat()
    return _parse_schema(str(SCHEMA_PATH), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=1)
def _parse_schema(path: str, mtime_ns: int, size: int) -> dict:
    with open(path, encoding="utf-8") as fh:
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
    """'1e-6' -> '1.0e-6', '1e3' / '1.0e3' -> '1.0e+3' (the spelling PyYAML reads as a float: a dot in the
    mantissa and a sign in the exponent)."""
    mant, _, exp = text.strip().lower().partition("e")
    if not exp:
        return text
    if "." not in mant:
        mant += ".0"
    if exp[0] not in "+-":
        exp = "+" + exp
    return f"{mant}e{exp}"


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
        opts = [str(s.get("enum")) if "enum" in s else s.get("type", "?") + (f" >= {s['minimum']}" if "minimum" in s else "")
                for s in err.validator_value]
        return f"config key '{key}' is {err.instance!r}; it must be one of: {' or '.join(opts)}."
    if err.validator == "required":
        return f"config key '{key}' misses required key(s): {err.message}."
    if err.validator == "type" and isinstance(err.instance, str) and _looks_numeric(err.instance):
        if not math.isfinite(float(err.instance)):
            return (f"config key '{key}' is the string {err.instance!r}, not a number, and no number there may be "
                    f"infinite or NaN. {NONPRIVATE_HINT}")
        if "e" not in err.instance.lower():
            return (f"config key '{key}' is the string {err.instance!r}, not a number: it is in quotes. Write it "
                    f"without them: {err.instance.strip()}.")
        # PyYAML (YAML 1.1) reads 1e-6, 1e3 and even 1.0e3 as strings: a float needs a dot and a signed exponent
        return (
            f"config key '{key}' is the string {err.instance!r}, not a number: YAML reads exponent notation "
            f"without a decimal point and a signed exponent as text. Write it as {_with_dot(err.instance)}."
        )
    desc = sch.get("description")
    hint = f" ({desc})" if desc else ""
    return f"config key '{key}' is invalid: {err.message}{hint}. See config/README.md."


#: How to get the non-private reference, for messages about infinite epsilons.
NONPRIVATE_HINT = ("For the non-private reference (eps = inf) do not list it: grid.nonprivate: true (the default) "
                   "adds it to every method and budget (audit.nonprivate for the audit).")


def _check_finite(obj: Any, source: str, path: str = "") -> None:
    """Refuse NaN and +-inf anywhere in the config (YAML's .nan / .inf): every number of it must be finite.

    The schema cannot: NaN passes every minimum/maximum (its comparisons are false) and would surface later as
    eps~nan paths or a silent wrong computation.
    """
    if isinstance(obj, float) and not math.isfinite(obj):
        what = "NaN (.nan)" if math.isnan(obj) else f"{'-' if obj < 0 else ''}infinite (.inf)"
        hint = NONPRIVATE_HINT if not math.isnan(obj) and "epsilon" in path else "Give a finite number."
        raise ConfigError(f"{source}: config key '{path}' is {what}; every number in the config must be finite. "
                          f"{hint} See config/README.md.")
    if isinstance(obj, dict):
        for k, v in obj.items():
            _check_finite(v, source, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_finite(v, source, f"{path}.{i}")


def validate_config(config: dict, source: str = "config") -> dict:
    """Validate `config` in place against the schema, filling defaults; return it.

    Then: checks the schema cannot express (`_check_semantics`, ConfigError),
    warnings for settings that would be silently ignored, `tokenizer.public_dataset:
    null` resolved to the dataset it means, and every mapping's keys sorted in
    place (`sort_keys_in_place`). Raises ConfigError naming the first offending
    key (sorted by path). Idempotent: validating a validated config changes nothing.
    """
    _check_against_schema(config, source)
    _check_semantics(config, source)
    _check_options(config, source)
    _warn_ignored_settings(config, source)
    _resolve_public_dataset(config)
    sort_keys_in_place(config)
    return config


def _check_against_schema(config: dict, source: str) -> None:
    """NaN/inf refused, then the schema: defaults filled in, ConfigError naming the first offending keys."""
    _check_finite(config, source)
    schema = _schema()  # read only: the validator copies the defaults it fills in
    errors = sorted(_Validator(schema).iter_errors(config), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        msgs = "; ".join(_describe(e) for e in errors[:5])
        raise ConfigError(f"{source}: {msgs}")


def option_config(config: dict, option: str) -> dict:
    """The config grid.options.<option>'s cells run with: its privacy and training keys merged over the base's
    (a mapping merges key by key, e.g. privacy.adaptive), without grid.options."""
    spec = config["grid"]["options"][option]
    merged = merge_configs(config, {"privacy": spec.get("privacy") or {}, "training": spec.get("training") or {}})
    merged["grid"]["options"] = {}
    return merged


def _check_options(config: dict, source: str) -> None:
    """Each grid.options entry: its methods are grid methods; merged over the base it is a valid config; and for
    each of its methods it changes what a private cell's plan or runs read (privacy.targets.plan_privacy_params,
    training.targets.finetune_params), else those cells would repeat the grid's."""
    from .grid import grid_datasets, option_methods
    from .privacy.targets import plan_privacy_params
    from .training.targets import finetune_params

    grid_methods = config["grid"]["methods"]
    for name in config["grid"]["options"]:
        key = f"grid.options.{name}"
        methods = option_methods(config, name)
        unknown = [m for m in config["grid"]["options"][name].get("methods") or [] if m not in grid_methods]
        if unknown:
            raise ConfigError(f"{source}: {key}.methods names {unknown}, which grid.methods {grid_methods} does not "
                              "run; an option runs a copy of the grid's own cells. Remove them from the option.")
        merged = option_config(config, name)
        where = f"{source}: {key} (its keys merged over the config's)"
        _check_against_schema(merged, where)
        _check_semantics(merged, where)
        if merged["training"] != config["training"]:
            _warn_ignored_settings(merged, where)
        eps, dataset = fmt_num(config["grid"]["epsilons"][0]), grid_datasets(config)[0]
        same_training = finetune_params(merged, dataset) == finetune_params(config, dataset)
        same = [m for m in methods if same_training
                and plan_privacy_params(merged, m, eps) == plan_privacy_params(config, m, eps)]
        if same:
            fix = (f"run it with `methods: {[m for m in methods if m not in same]}` only" if len(same) < len(methods)
                   else "give it a privacy or training value that changes the cells")
            raise ConfigError(
                f"{source}: {key} changes nothing in its {'/'.join(m.upper() for m in same)} cells: their plans and "
                "training settings would be the grid's (privacy.correlated_noise applies to ULS only, "
                f"privacy.adaptive only with clipping: adaptive), so they would repeat the grid's runs; {fix}.")


def _resolve_public_dataset(config: dict) -> None:
    """Write down which dataset `tokenizer.public_dataset: null` means.

    null means "the first dataset, in config order, with a public part"; the
    keys of `datasets` are about to be sorted, which would change that choice.
    """
    tok = config["tokenizer"]
    if tok["name"] is not None or tok["public_dataset"] is not None:
        return
    from .data.sources import has_public_part  # lazy: keeps loading the Snakefile light

    for name, spec in config["datasets"].items():
        if has_public_part(spec):
            tok["public_dataset"] = name
            return


def _check_semantics(config: dict, source: str) -> None:
    """Checks a JSON schema cannot express; each raises ConfigError naming the key and the fix."""
    for name, spec in config["datasets"].items():
        split = spec.get("split") or {}
        total = float(split.get("validation", 0)) + float(split.get("test", 0))
        if total >= 1:
            raise ConfigError(
                f"{source}: datasets.{name}.split: validation + test = {total:g} leaves no train users; "
                "make the two fractions sum to less than 1."
            )
    _check_dataset_keys(config, source)
    grid = config["grid"]
    _check_known_datasets(config, "grid.datasets", source)
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
    # Its public text trains the tokenizer (tokenizer.name null) and pretrains the model (model.name null).
    if public is not None and (config["tokenizer"]["name"] is None or config["model"]["name"] is None):
        from .data.sources import has_public_part

        spec = config["datasets"][public]
        if not has_public_part(spec):
            raise ConfigError(
                f"{source}: tokenizer.public_dataset is {public!r}, but that dataset (source "
                f"{spec.get('source')!r}) has no public part to train the tokenizer and pretrain on; name a dataset "
                "with public text (a synthetic or fortunes dataset) or set tokenizer.name (and model.name)."
            )
    _check_model(config, source)
    _check_budgets(grid["budgets"], "grid.budgets", "its artifact paths (budget~K)", source)
    _check_budgets(config["mean_estimation"]["budgets"], "mean_estimation.budgets",
                   "its rows of the results (compute_budget)", source)
    _check_path_numbers(config, source)
    _check_uls_fits(config, source)
    _check_contribution_stats(config, source)
    _check_mean_estimation(config, source)
    _check_audit(config, source)


# ---------------------------------------------------------------- semantic checks


def _check_audit(config: dict, source: str) -> None:
    """audit.datasets are defined datasets; a canary example (bos + secret + eos) fits the sequence length."""
    audit = config["audit"]
    _check_known_datasets(config, "audit.datasets", source)
    seq = int(config["tokenizer"]["sequence_length"])
    prefix = int(audit["prefix_length"])
    if prefix + 3 > seq:
        raise ConfigError(
            f"{source}: audit.prefix_length is {prefix}, but a canary example is bos + prefix + secret + eos (a "
            f"secret of at least 1 token) and tokenizer.sequence_length is {seq}; set audit.prefix_length to at most "
            f"{seq - 3}.")
    if audit["secret_length"] is not None and int(audit["secret_length"]) + prefix + 2 > seq:
        raise ConfigError(
            f"{source}: audit.secret_length is {audit['secret_length']}, but a canary example is bos + prefix + "
            f"secret + eos, audit.prefix_length is {prefix} and tokenizer.sequence_length is {seq}; set "
            f"audit.secret_length to at most {seq - 2 - prefix} (or null: the longest that fits, up to 16)."
        )
    if audit["budget"] is not None:
        _check_budgets([audit["budget"]], "audit.budget", "the audited runs' paths (budget~K)", source)


def _check_known_datasets(config: dict, key: str, source: str) -> None:
    """The datasets `key` (grid.datasets or audit.datasets; null: all of them) names are defined in `datasets`."""
    section, field = key.split(".")
    unknown = [d for d in config[section][field] or [] if d not in config["datasets"]]
    if unknown:
        raise ConfigError(f"{source}: {key} names unknown dataset(s) {unknown}; defined datasets: "
                          f"{sorted(config['datasets'])}.")


def _check_dataset_keys(config: dict, source: str) -> None:
    """Per-source keys of every dataset (and of its `public` corpus), as the loaders check them.

    The schema's dataset definition lists the keys of every source, so
    `datasets.x.user_colum` or `hub_name` on a local dataset would otherwise
    only fail when the job that reads the dataset runs. The keys of each
    source are declared in userdp.data.sources (imported lazily: config is
    below the stages; reading the registry imports no loader).
    """
    from .data.sources import source_keys
    from .data.spec_keys import check_keys

    for name, spec in config["datasets"].items():
        try:
            check_keys(name, spec, source_keys(spec["source"]))
            if spec.get("public") is not None:
                from .data.public import check_public_spec

                check_public_spec(name, spec["public"])
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        if spec["source"] == "local":
            _check_local_path(name, spec, source)


def _check_local_path(name: str, spec: dict, source: str) -> None:
    """A local dataset's file or folder must be given, exist and be of a kind the reader reads before anything
    runs (not when its job starts): userdp.data.tables.TableFile's format and check.

    Relative paths are relative to the working directory (Snakemake's --directory), as the loader reads them.
    """
    from .data.local import FORMATS
    from .data.tables import TableFile
    from .errors import DataError

    path = spec.get("path")
    if not path:
        raise ConfigError(f"{source}: datasets.{name}.path is required for source 'local': the data file (Parquet, "
                          "CSV, TSV, JSON Lines) or folder with one row per example (config/README.md, 'Your own "
                          "data').")
    p = Path(str(path)).expanduser()
    if not p.exists():
        raise ConfigError(f"{source}: datasets.{name}.path is {path}, which does not exist (looked in "
                          f"{p.resolve()}); fix the path (relative paths start at the working directory).")
    try:
        TableFile(p, f"datasets.{name}", spec.get("format"), spec.get("separator"), FORMATS).check()
    except (ConfigError, DataError) as exc:
        raise ConfigError(f"{source}: {exc}") from None


# Files that come with a saved Hugging Face tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model")


def _is_folder_without_tokenizer(name: str) -> bool:
    """Whether `name` is a local model folder that holds no tokenizer (e.g. one this pipeline saved)."""
    path = Path(name).expanduser()
    return path.is_dir() and not any((path / f).exists() for f in _TOKENIZER_FILES)


def _looks_like_path(name: str) -> bool:
    """A model/tokenizer name meant as a local folder rather than a hub id ("org/name"): absolute, ./, ../, ~,
    or an existing path."""
    return name.startswith(("/", "./", "../", "~")) or Path(name).exists()


# Weight files save_pretrained writes (whole or sharded, with its index), in any of the frameworks HF loads.
_WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin", "*.index.json", "tf_model.h5", "flax_model.msgpack")


def _check_model_folder(p: Path, name: str, source: str) -> None:
    """A local model.name folder must be a saved model: a readable config.json and weights (or a LoRA adapter)."""
    if (p / "adapter_config.json").exists():
        return  # a LoRA adapter folder: its base model is checked when it loads
    cfg = p / "config.json"
    if not cfg.exists():
        raise ConfigError(f"{source}: model.name is {name}, a folder without config.json, so not a model "
                          "saved with save_pretrained; point it at the folder that holds config.json and "
                          "the weights (*.safetensors).")
    try:
        json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{source}: model.name is {name}, whose {cfg} is not valid JSON ({exc}); copy the "
                          "model folder again (config.json is written by save_pretrained).") from None
    if not any(any(p.glob(g)) for g in _WEIGHT_GLOBS):
        raise ConfigError(f"{source}: model.name is {name}, a folder with config.json but no weights (no "
                          "*.safetensors or pytorch_model*.bin); copy the weight files into it too, or point "
                          "model.name at the folder that holds them.")


def _check_model(config: dict, source: str) -> None:
    model, tok = config["model"], config["tokenizer"]
    for key, name in (("model.name", model["name"]), ("tokenizer.name", tok["name"])):
        if name is not None and _looks_like_path(str(name)):
            p = Path(str(name)).expanduser()
            if not p.exists():
                raise ConfigError(f"{source}: {key} is {name}, a local path that does not exist (looked in "
                                  f"{p.resolve()}); fix the path to the folder you saved with save_pretrained, or "
                                  "give a Hugging Face model id such as gpt2-medium.")
            if not p.is_dir():
                raise ConfigError(f"{source}: {key} is {name}, which is a file, not a folder; give the folder "
                                  "that save_pretrained wrote (config.json and the weights, or tokenizer.json).")
            if key == "model.name":
                _check_model_folder(p, name, source)
    if model["name"] is None:
        n_embd, n_head = int(model["n_embd"]), int(model["n_head"])
        if n_embd % n_head:
            fits = [h for h in range(1, n_head + 1) if n_embd % h == 0][-1]
            raise ConfigError(
                f"{source}: model.n_embd ({n_embd}) must be divisible by model.n_head ({n_head}): the model "
                f"built from the config splits its width evenly over the heads. Fix: e.g. model.n_head: {fits}, "
                f"or model.n_embd: {n_embd + (-n_embd) % n_head}."
            )
        return
    # A hub model (or a local copy with its tokenizer) reads its own token ids;
    # the BPE the pipeline trains when tokenizer.name is null has other ids,
    # which would be fed to the model's embeddings without any error. The one
    # legitimate case is a local folder with no tokenizer (a model this
    # pipeline trained, e.g. a copy of results/model/pretrained): its ids are
    # the pipeline's BPE.
    if tok["name"] is None and not _is_folder_without_tokenizer(str(model["name"])):
        raise ConfigError(
            f"{source}: model.name is set, so set tokenizer.name to the model's tokenizer (usually the same "
            f"name): tokenizer.name: {model['name']}. With tokenizer.name null the pipeline trains its own "
            f"BPE tokenizer, whose token ids mean nothing to {model['name']!r}'s embeddings. (Only a local model "
            "folder without tokenizer files, e.g. a model this pipeline pretrained, may use the pipeline's BPE.)"
        )


def _check_budgets(budgets: list[dict], key: str, identity: str, source: str) -> None:
    """Each budget has K >= T (a batch of at least one example per step) and its own K."""
    seen: dict[int, int] = {}
    for b in budgets:
        compute, steps = int(b["compute"]), int(b["steps"])
        if compute < steps:
            raise ConfigError(
                f"{source}: {key} has {{compute: {compute}, steps: {steps}}}: the expected batch K/T = "
                f"{compute / steps:.3g} is less than one example per step. Fix: compute >= steps (more compute "
                f"or at most {compute} steps)."
            )
        if compute in seen:
            raise ConfigError(
                f"{source}: {key} has two entries with compute {compute} (steps {seen[compute]} and {steps}); a "
                f"budget is identified by its compute K in {identity}, so one of them would be silently "
                "dropped. Keep one of them, or give them different compute values."
            )
        seen[compute] = steps


def _check_path_numbers(config: dict, source: str) -> None:
    """Epsilons and learning rates become path text (eps~, lr~): finite, plain and distinct."""
    for eps in config["grid"]["epsilons"]:
        if float(eps) >= MAX_FINITE_EPSILON:
            raise ConfigError(
                f"{source}: grid.epsilons has {fmt_num(eps)}; epsilons of 1e15 and above are not supported (no "
                f"study needs them). {NONPRIVATE_HINT}"
            )
    for key, prefix, values in (("grid.epsilons", "eps~", config["grid"]["epsilons"]),
                                ("training.learning_rates", "lr~", config["training"]["learning_rates"])):
        by_text: dict[str, Any] = {}
        for v in values:
            text = fmt_num(v)
            if text in by_text:
                raise ConfigError(
                    f"{source}: {key} lists the same number twice ({by_text[text]!r} and {v!r}, both "
                    f"{prefix}{text}); remove one of them."
                )
            by_text[text] = v


def _explicit_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _check_uls_fits(config: dict, source: str) -> None:
    """ULS keeps a user's examples in one micro-batch: explicit G (or k) must fit physical_batch_size.

    The config-time use of userdp.training.settings.check_uls_fits (the same
    message), for the G the config states; G chosen from the data (median,
    snr) is checked when the run starts.
    """
    if "uls" not in config["grid"]["methods"]:
        return
    training = config["training"]
    pbs, k = int(training["physical_batch_size"]), training["uls_examples_per_user"]
    k = None if k is None else int(k)
    uls = _explicit_int(config["privacy"]["group_size"]["uls"])
    if uls is not None:  # check_uls_fits' default key and fix are privacy.group_size.uls's
        check_uls_fits(uls, pbs, k, source=source)
    for g in config["grid"]["group_size_sweep"]:
        check_uls_fits(int(g), pbs, k, key="grid.group_size_sweep", smaller=f"drop {g} from grid.group_size_sweep",
                       source=source)


def _check_contribution_stats(config: dict, source: str) -> None:
    stats = config["privacy"]["contribution_stats"]
    if not stats["private"]:
        return
    smallest = min(float(e) for e in config["grid"]["epsilons"])
    if float(stats["epsilon"]) >= smallest:
        raise ConfigError(
            f"{source}: privacy.contribution_stats.epsilon = {float(stats['epsilon']):g} is >= the smallest grid "
            f"epsilon {smallest:g} (grid.epsilons), so the DP contribution statistics alone would spend that "
            f"cell's whole budget. Set privacy.contribution_stats.epsilon well below it (e.g. {smallest / 10:g}, "
            "a tenth), or turn the option off (privacy.contribution_stats.private: false)."
        )


def _check_mean_estimation(config: dict, source: str) -> None:
    me = config["mean_estimation"]
    sweep = me["group_sweep_epsilon"]
    if sweep is not None and float(sweep) not in [float(e) for e in me["epsilons"]]:
        raise ConfigError(
            f"{source}: mean_estimation.group_sweep_epsilon is {float(sweep):g}, which is not one of "
            f"mean_estimation.epsilons {list(me['epsilons'])}; pick one of them or null (the middle one)."
        )


def _warn_ignored_settings(config: dict, source: str) -> None:
    """log.warning for settings that are valid but have no effect (or not the expected one)."""
    training = config["training"]
    warmup = int(training["warmup_steps"])
    shortest = min(int(b["steps"]) for b in config["grid"]["budgets"])
    if warmup and warmup >= shortest:
        log.warning(
            "%s: training.warmup_steps (%d) >= %d, the steps of the shortest grid.budgets entry: those runs end "
            "inside the linear warmup, so they never train at the full learning rate and training.schedule "
            "(%s) never starts. Use fewer warmup steps.", source, warmup, shortest, training["schedule"],
        )
    k = training["uls_examples_per_user"]
    uls = _explicit_int(config["privacy"]["group_size"]["uls"])
    if k is not None and uls is not None and int(k) > uls and "uls" in config["grid"]["methods"]:
        log.warning(
            "%s: training.uls_examples_per_user (%d) > privacy.group_size.uls (G = %d): a user keeps at most G "
            "examples, so every sampled user contributes all of them and uls_examples_per_user has no effect.",
            source, int(k), uls,
        )
    if training["device"] == "cpu" and training["precision"] == "bf16":
        log.warning(
            "%s: training.precision is bf16 but training.device is cpu: bf16 autocast is used on CUDA only, so "
            "the runs train in fp32. Set training.precision: fp32 (or device: cuda/auto).", source,
        )
    if config["privacy"].get("secret_seeds") is False:
        from .data.sources import SOURCES
        from .grid import grid_datasets

        real = [d for d in grid_datasets(config)
                if not SOURCES[config["datasets"][d]["source"]].synthetic]
        if real:
            log.warning(
                "%s: privacy.secret_seeds is false and grid dataset(s) %s are not synthetic: their Poisson samples "
                "and noise derive from `seed`, so anyone holding the config can regenerate the noise and the "
                "guarantee does not hold against them (ledgers and summaries say so in guarantee_caveat). Leave "
                "privacy.secret_seeds unset (null: secret for non-synthetic datasets) for models you release.",
                source, real,
            )
    gpus = int(training["gpus"])
    if training["device"] == "cpu" and gpus > 1:
        log.warning(
            "%s: training.gpus is %d with training.device: cpu: every finetune job requests %d GPUs (resource "
            "gpu) but runs its %d data-parallel processes on CPU with gloo, which is meant for tests. Set "
            "training.gpus: 0 for CPU training, or training.device: cuda (or auto) to use the GPUs.",
            source, gpus, gpus, gpus,
        )


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key written twice in one mapping (safe_load silently keeps the last, so a
    second `grid:` section would drop the first one's settings)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` merges another mapping: not a key
                continue
            key = self.construct_object(key_node, deep=deep)
            key = (type(key).__name__, key) if isinstance(key, (str, int, float, bool)) else None
            if key is not None and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"the key {key[1]!r} appears twice (first at line {seen[key] + 1}); YAML keeps only the last, "
                    "so merge the two into one", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def read_config_file(path: str | Path) -> dict:
    """The mapping in a YAML (or JSON) config file; a ConfigError naming the file, and for a syntax error the
    line and column, otherwise."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as fh:
            config = yaml.load(fh, Loader=_UniqueKeyLoader)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text ({exc}); save it as UTF-8.") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        fix = "" if "appears twice" in str(exc) else (" Check the indentation (spaces, no tabs), brackets and "
                                                      "quotes there.")
        raise ConfigError(f"config file {path} is not valid YAML{where}: {exc}.{fix}") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, not {type(config).__name__}")
    return config


def merge_configs(base: dict, override: dict) -> dict:
    """`override` on `base`, section by section, as snakemake merges --configfile files over the default."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict):  # snakemake's update_config: a mapping merges into what is there (or {})
            out[key] = merge_configs(out[key] if isinstance(out.get(key), dict) else {}, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_config(path: str | Path) -> dict:
    """Read a YAML config file and validate it."""
    return validate_config(read_config_file(path), source=str(path))


def load_config_files(files, default: str | None = None, overrides: dict | None = None) -> dict:
    """Parse each file (naming its line on a syntax error), merge them over the default, validate: as snakemake
    reads `--configfile FILES` (`--config` entries: `overrides`, merged last); a UserError names the mistake.

    `default`: the config the files override (None: the repository's config/config.yaml; "none": no default, as
    with --replace-workflow-config).
    """
    from .layout import DEFAULT_CONFIG

    files = [files] if isinstance(files, (str, Path)) else list(files)
    default = default or str(Path(__file__).resolve().parents[2] / DEFAULT_CONFIG)
    # as snakemake: the files are merged into one override first, which then goes over the default
    override: dict = {}
    for f in files:
        override = merge_configs(override, read_config_file(f))
    merged = merge_configs({} if default == "none" else read_config_file(default), override)
    sources = [str(f) for f in files] if default == "none" else [default, *map(str, files)]
    if overrides:
        merged = merge_configs(merged, overrides)
        sources.append("--config")
    return validate_config(merged, source=" + ".join(sources))


#: The dataset name of a run outside the pipeline (userdp.fine_tune): its seeds and artifacts carry it.
API_DATASET = "data"


def run_config(*, model: str | None = None, tokenizer: str | None = None, lora: dict | None = None, seed: int = 0,
               privacy: dict | None = None, training: dict | None = None, sequence_length: int | None = None,
               source: str = "userdp.fine_tune") -> dict:
    """A validated config for one run outside the pipeline (`userdp.fine_tune`): the schema's defaults (the
    pipeline's) under the given sections, so every key is checked and named as in a config file.

    model / tokenizer: model.name and tokenizer.name (default: the model folder's tokenizer; None with no model:
    only the other sections are wanted). The datasets and grid are placeholders nobody reads: the run's data
    comes as rows, its cell as arguments.
    """
    tok: dict[str, Any] = {"name": tokenizer or model}
    if sequence_length is not None:
        tok["sequence_length"] = sequence_length
    config = {
        "seed": seed,
        "datasets": {API_DATASET: {"source": "synthetic"}},
        "grid": {"datasets": [API_DATASET]},
        "tokenizer": tok,
        "model": {"name": model, "lora": lora},
        "privacy": copy.deepcopy(privacy or {}),
        "training": copy.deepcopy(training or {}),
    }
    return validate_config(config, source)
