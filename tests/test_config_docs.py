"""config/README.md and the config schema document the same keys, with the same defaults.

The schema (workflow/schemas/config.schema.yaml) is what validation reads:
its keys, defaults and allowed values are the facts. Its `description`s are
short on purpose (userdp.config puts one into the error message of a bad
value); config/README.md holds the full text of each key, in tables
interleaved with the prose that explains how keys work together. So the
README is not generated from the schema: each fact that both state is
compared here instead, and a drift fails the suite:

- every key of the schema has a row in a key table of the README (or is
  documented as a whole by the row of the mapping that holds it, e.g.
  `audit.budget`), and every row names a key of the schema, once;
- a row's default is the schema's `default` (or, for the dataset keys whose
  defaults the loaders fill in, the `default X` that the schema's
  description states);
- every allowed value of an enum is named in the row;
- the `sources` column of the dataset keys (and the "(source, ...)" that
  opens a dataset key's schema description) is what the source registry
  (userdp.data.sources) lets each source read.

The tests at the end run the same checks on altered copies of the two files
to show that each kind of drift is caught.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from userdp.data.sources import SOURCES
from userdp.data.spec_keys import COMMON_KEYS

REPO = Path(__file__).resolve().parents[1]
README = REPO / "config" / "README.md"
SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"

#: A dataset's keys sit under this path (any name: the schema's `datasets` takes additionalProperties).
DATASET = "datasets.<name>"
#: Key tables whose rows name keys relative to a mapping, by the heading of the section that holds the table.
TABLE_PREFIXES = {
    "datasets: sources": DATASET,
    "Public (pretraining) corpus: `public` (every source)": DATASET,
    "Split, filters (every source)": DATASET,
    "Synthetic source (`source: synthetic`)": f"{DATASET}.synthetic",
}

MISSING = object()  # no default


# ---------------------------------------------------------------------------- the schema's keys


def _resolve(schema: dict, node: dict) -> dict:
    """`node` with a local `$ref` replaced by its target (the node's own keys win, as `default` next to a $ref)."""
    ref = node.get("$ref")
    if ref is None:
        return node
    target = schema
    for part in ref.removeprefix("#/").split("/"):
        target = target[part]
    return {**_resolve(schema, target), **{k: v for k, v in node.items() if k != "$ref"}}


def schema_keys(schema: dict) -> dict[str, dict]:
    """Dotted key -> its (resolved) subschema, for every key at any depth.

    Mappings are entered through `properties` (also under `then:`, as model.lora's keys); `datasets`
    through its additionalProperties, as `datasets.<name>`. Array items are values, not keys.
    """
    out: dict[str, dict] = {}

    def walk(node: dict, prefix: str) -> None:
        node = _resolve(schema, node)
        props = node.get("properties") or node.get("then", {}).get("properties") or {}
        for name, sub in props.items():
            path = f"{prefix}{name}"
            out[path] = _resolve(schema, sub)
            walk(sub, path + ".")
        extra = node.get("additionalProperties")
        if isinstance(extra, dict) and not props:
            walk(extra, prefix + "<name>.")

    walk(schema, "")
    return out


def _enum_values(sub: dict) -> list:
    """The allowed values an enum names (directly, in oneOf alternatives, or of an array's items)."""
    values = list(sub.get("enum", []))
    for alt in sub.get("oneOf", []):
        values += alt.get("enum", [])
    items = sub.get("items")
    if isinstance(items, dict):
        values += items.get("enum", [])
    return values


_DESCRIBED_DEFAULT = re.compile(r"\bdefault (\[[^\]]*\]|[^\s;,)]+)")


def schema_default(sub: dict) -> object:
    """The schema's `default`, else the `default X` its description states (the loaders' defaults), else MISSING."""
    if "default" in sub:
        return sub["default"]
    m = _DESCRIBED_DEFAULT.search(" ".join(str(sub.get("description", "")).split()))
    return yaml.safe_load(m.group(1).rstrip(".")) if m else MISSING


# ---------------------------------------------------------------------------- the README's key tables


@dataclass(frozen=True)
class Row:
    key: str  # dotted, with the table's prefix
    default: str  # the cell as written
    text: str  # the whole row
    sources: str | None  # the `sources` column, where the table has one
    line: int

    def __str__(self) -> str:
        return f"config/README.md:{self.line} `{self.key}`"


def _cells(line: str) -> list[str]:
    """The cells of a Markdown table line (`\\|` is a pipe inside a cell)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def readme_rows(text: str) -> list[Row]:
    """Every row of every table whose first column is `key`, its key resolved by TABLE_PREFIXES."""
    rows: list[Row] = []
    heading = ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"#+\s+(.*)", line)
        if m:
            heading = m.group(1).strip()
        header = _cells(line) if line.startswith("|") else []
        if header[:1] == ["key"]:
            prefix = TABLE_PREFIXES.get(heading)
            i += 2  # header and |---| line
            while i < len(lines) and lines[i].startswith("|"):
                cells = dict(zip(header, _cells(lines[i])))
                key = cells["key"].strip("`")
                rows.append(Row(f"{prefix}.{key}" if prefix else key, cells.get("default", ""), lines[i],
                                cells.get("sources"), i + 1))
                i += 1
            continue
        i += 1
    return rows


def _readme_default(cell: str) -> object:
    """The value of a default cell: its first `code` span read as YAML (`1e-6` as the float), MISSING if none."""
    m = re.search(r"`([^`]*)`", cell)
    if m is None:
        return MISSING
    value = yaml.safe_load(m.group(1))
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def _same(a: object, b: object) -> bool:
    """Equal as config values: 1 == 1.0, but a bool is not a number."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


# ---------------------------------------------------------------------------- the comparison


def _registry_sources(key: str) -> str | None:
    """What the `sources` column of dataset key `key` must say: `all`, or the sources that read it in order."""
    name = key.removeprefix(DATASET + ".")
    if name in COMMON_KEYS:
        return "all"
    readers = [s for s, kind in SOURCES.items() if name in kind.keys]
    return ", ".join(readers) if readers else None


def differences(schema: dict, readme_text: str) -> list[str]:
    """Every disagreement between the schema and the README's key tables, one line each (empty: they agree)."""
    keys = schema_keys(schema)
    rows = readme_rows(readme_text)
    out: list[str] = []
    documented: dict[str, Row] = {}
    for row in rows:
        if row.key in documented:
            out.append(f"{row}: documented twice (also line {documented[row.key].line}); keep one row")
        elif row.key not in keys:
            out.append(f"{row}: not a key of the schema (misspelt, removed, or in the wrong table: keys of "
                       f"tables under {sorted(TABLE_PREFIXES)} get that section's prefix)")
        documented.setdefault(row.key, row)

    def beneath(path: str) -> list[str]:
        return [k for k in documented if k.startswith(path + ".")]

    for key in keys:
        if key in documented or any(k.startswith(key + ".") for k in keys):
            continue  # documented, or a mapping whose keys are checked one by one
        # a leaf without a row: fine only if a mapping above it is documented as a whole (a row, no key beneath)
        parents = [key.rsplit(".", n)[0] for n in range(1, key.count(".") + 1)]
        if not any(p in documented and not beneath(p) for p in parents):
            out.append(f"`{key}`: in the schema, not in config/README.md (add a row to the section of "
                       f"`{key.split('.')[0]}`)")

    for key, row in documented.items():
        if key not in keys:
            continue
        sub = keys[key]
        want = schema_default(sub)
        have = _readme_default(row.default)
        if want is not MISSING and (have is MISSING or not _same(want, have)):
            out.append(f"{row}: README default {row.default or '(none)'}, schema default {want!r}")
        for value in _enum_values(sub):
            if not re.search(rf"(?<![\w-]){re.escape(str(value))}(?![\w-])", row.text):
                out.append(f"{row}: the schema allows {value!r}, which the row does not name")
        want_sources = _registry_sources(key) if key.startswith(DATASET + ".") else None
        if want_sources is not None and row.sources is not None and row.sources != want_sources:
            out.append(f"{row}: sources column says {row.sources!r}, userdp.data.sources says {want_sources!r}")
        # the schema's description of a dataset key may open with its sources too: "(stackoverflow) ..."
        m = re.match(r"\(([\w, ]+)\)", str(sub.get("description", "")))
        if want_sources is not None and m and set(m.group(1).split(", ")) <= set(SOURCES) \
                and m.group(1) != want_sources:
            out.append(f"schema `{key}`: description says ({m.group(1)}), userdp.data.sources says {want_sources!r}")
    return out


# ---------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def schema() -> dict:
    return yaml.safe_load(SCHEMA.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def readme() -> str:
    return README.read_text(encoding="utf-8")


def test_readme_and_schema_agree(schema, readme):
    diff = differences(schema, readme)
    assert not diff, "config/README.md and workflow/schemas/config.schema.yaml disagree:\n" + "\n".join(diff)


def test_readme_tables_are_found(schema, readme):
    """The parser sees the tables: one row per documented key, the dataset tables under their prefixes."""
    rows = {r.key: r for r in readme_rows(readme)}
    assert len(rows) > 140
    assert {"seed", "model.lora.r", f"{DATASET}.source", f"{DATASET}.public.hub_name",
            f"{DATASET}.split.validation", f"{DATASET}.synthetic.n_users", f"{DATASET}.synthetic.seed"} <= set(rows)
    assert rows["tokenizer.vocab_size"].default == "`4096`"
    assert rows[f"{DATASET}.path"].sources == "stackoverflow, cc_news, local, fortunes"


def _edit(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def test_a_key_missing_from_the_readme_is_caught(schema, readme):
    altered = _edit(readme, "| `training.checkpoint_every` | `25` | Steps between checkpoints. |\n", "")
    assert differences(schema, altered) == [
        "`training.checkpoint_every`: in the schema, not in config/README.md (add a row to the section of "
        "`training`)"]
    # a key of a mapping documented key by key (model.lora has its own row and one per key)
    altered = _edit(readme, "| `model.lora.r` | `8` | LoRA rank. |\n", "")
    assert [d.split(":")[0] for d in differences(schema, altered)] == ["`model.lora.r`"]
    # a mapping documented as a whole (audit.budget: compute and steps in its row) without its row
    altered = "\n".join(ln for ln in readme.splitlines() if not ln.startswith("| `audit.budget` |"))
    assert [d.split(":")[0] for d in differences(schema, altered)] == ["`audit.budget.compute`",
                                                                       "`audit.budget.steps`"]


def test_a_key_missing_from_the_schema_is_caught(schema, readme):
    altered = copy.deepcopy(schema)
    del altered["properties"]["training"]["properties"]["checkpoint_every"]
    (diff,) = differences(altered, readme)
    assert re.fullmatch(r"config/README\.md:\d+ `training\.checkpoint_every`: not a key of the schema .*", diff)
    # a key added to the schema, a dataset key (own prefix) and one of a mapping documented key by key
    altered = copy.deepcopy(schema)
    altered["$defs"]["dataset"]["properties"]["encoding"] = {"type": "string"}
    altered["properties"]["model"]["properties"]["lora"]["then"]["properties"]["bias"] = {"type": "boolean"}
    assert [d.split(":")[0] for d in differences(altered, readme)] == [
        f"`{DATASET}.encoding`", "`model.lora.bias`"]


def test_a_changed_default_is_caught(schema, readme):
    altered = copy.deepcopy(schema)
    altered["properties"]["training"]["properties"]["checkpoint_every"]["default"] = 50
    (diff,) = differences(altered, readme)
    assert diff.endswith("`training.checkpoint_every`: README default `25`, schema default 50")
    # the same in the README; and the default a dataset key's description states (the loader fills it in)
    (diff,) = differences(schema, _edit(readme, "| `split.test` | `0.1` |", "| `split.test` | `0.2` |"))
    assert "README default `0.2`, schema default 0.1" in diff
    (diff,) = differences(schema, _edit(readme, "| `include_title` | stackoverflow, cc_news | `false` |",
                                        "| `include_title` | stackoverflow, cc_news | `true` |"))
    assert diff.endswith("`datasets.<name>.include_title`: README default `true`, schema default False")


def test_a_new_allowed_value_is_caught(schema, readme):
    altered = copy.deepcopy(schema)
    altered["properties"]["training"]["properties"]["schedule"]["enum"].append("polynomial")
    (diff,) = differences(altered, readme)
    assert diff.endswith("`training.schedule`: the schema allows 'polynomial', which the row does not name")


def test_a_wrong_sources_column_and_a_duplicate_row_are_caught(schema, readme):
    row = "| `hub_split` | cc_news | `train` | Split of the hub dataset. |"
    (diff,) = differences(schema, _edit(readme, row, row.replace("cc_news", "cc_news, local")))
    assert diff.endswith("sources column says 'cc_news, local', userdp.data.sources says 'cc_news'")
    altered = copy.deepcopy(schema)
    altered["$defs"]["dataset"]["properties"]["hub_split"]["description"] = "(cc_news, local) split to load."
    (diff,) = differences(altered, readme)
    assert diff == ("schema `datasets.<name>.hub_split`: description says (cc_news, local), userdp.data.sources "
                    "says 'cc_news'")
    (diff,) = differences(schema, _edit(readme, row, row + "\n" + row))
    assert "`datasets.<name>.hub_split`: documented twice" in diff
