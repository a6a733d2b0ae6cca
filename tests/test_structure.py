"""Structural contracts of the repository (no pipeline run, no model).

1. The pins agree: pyproject.toml's dependencies plus its `test` extra are
   exactly the pip lists of environment.yml and workflow/envs/userdp.yaml,
   name and version each (the editable install of the checkout aside).
2. The import graph of workflow/userdp is layered: no cycle between
   modules, and no module imports from a stage above its own (the stages are
   listed at STAGE_RANKS below). Every import counts, also those inside functions and under
   `if TYPE_CHECKING:`, because each one is a dependency between modules.
3. Every reference points inside the repository: no file cites the
   development notes kept outside it or a path of one particular machine.
4. The workflow scripts take their job from their rule: what changes a
   result is in the rule's params (a rerun trigger), input, output,
   wildcards, threads and resources. A script reads the config
   (`snakemake.config`) only through `userdp.untracked.untracked`, the keys
   that change no result (tests/test_rerun_triggers.py checks that changing
   them reruns nothing).
5. No module of the library names a private attribute of dp-accounting or
   Snakemake, but userdp/privacy/_dp_accounting_compat.py (behind its version
   guard); ruff's SLF001 (pyproject.toml, run by .ci/run) flags every other
   private access, and the few the library keeps are listed here.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = ROOT / "workflow" / "userdp"
PACKAGE = "userdp"

# ---------------------------------------------------------------------------- 1. pins

PIN_MIRRORS = ("environment.yml", "workflow/envs/userdp.yaml")
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)\s*$")


def _canonical(name: str) -> str:
    """PEP 503 normalised distribution name (case, runs of -_. are equal)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_pins(requirements: list[str], where: str) -> dict[str, str]:
    """name -> version of `name==version` requirement strings; anything else is an error naming it."""
    pins: dict[str, str] = {}
    for req in requirements:
        m = _REQUIREMENT.match(req)
        if m is None:
            raise AssertionError(f"{where}: {req!r} is not pinned as name==version")
        name = _canonical(m.group(1))
        if name in pins:
            raise AssertionError(f"{where}: {m.group(1)} is listed twice")
        pins[name] = m.group(2)
    return pins


def pyproject_pins(path: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """The project's dependencies plus its `test` extra, as name -> version."""
    project = tomllib.loads(path.read_text(encoding="utf-8"))["project"]
    reqs = list(project["dependencies"]) + list(project.get("optional-dependencies", {}).get("test", []))
    return parse_pins(reqs, path.name)


def conda_pip_pins(path: Path) -> dict[str, str]:
    """The pip list of a conda environment file, without pip options (`-e <checkout>`)."""
    env = yaml.safe_load(path.read_text(encoding="utf-8"))
    pip_lists = [d["pip"] for d in env.get("dependencies", []) if isinstance(d, dict) and "pip" in d]
    assert len(pip_lists) == 1, f"{path.relative_to(ROOT)}: expected one `pip:` list, found {len(pip_lists)}"
    reqs = [r for r in pip_lists[0] if not str(r).lstrip().startswith("-")]
    return parse_pins([str(r) for r in reqs], str(path.relative_to(ROOT)))


def pin_differences(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """Human-readable differences between two name -> version maps."""
    out = []
    for name in sorted(set(expected) | set(actual)):
        if name not in actual:
            out.append(f"{name}=={expected[name]} is missing")
        elif name not in expected:
            out.append(f"{name}=={actual[name]} is not in pyproject.toml")
        elif expected[name] != actual[name]:
            out.append(f"{name}: {actual[name]} here, {expected[name]} in pyproject.toml")
    return out


@pytest.mark.parametrize("mirror", PIN_MIRRORS)
def test_pins_agree_with_pyproject(mirror):
    path = ROOT / mirror
    assert path.exists(), f"{mirror} is missing"
    diff = pin_differences(pyproject_pins(), conda_pip_pins(path))
    assert not diff, f"{mirror} disagrees with pyproject.toml: " + "; ".join(diff)


def test_conda_files_install_the_checkout_editable():
    """Each conda file installs this checkout (`-e` + the path from the file to the repository root)."""
    for mirror in PIN_MIRRORS:
        path = ROOT / mirror
        env = yaml.safe_load(path.read_text(encoding="utf-8"))
        pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
        editable = [str(r).split(None, 1)[1] for r in pip if str(r).startswith("-e ")]
        assert len(editable) == 1, f"{mirror}: expected one `-e <checkout>` entry, found {editable}"
        assert (path.parent / editable[0]).resolve() == ROOT, f"{mirror}: `-e {editable[0]}` is not the repository root"


def test_pin_parser_catches_a_mismatch():
    """The comparison itself can fail: a changed version and a missing package are reported."""
    diff = pin_differences({"numpy": "2.4.6", "scipy": "1.17.1"}, {"numpy": "2.4.5"})
    assert diff == ["numpy: 2.4.5 here, 2.4.6 in pyproject.toml", "scipy==1.17.1 is missing"]
    with pytest.raises(AssertionError, match="not pinned"):
        parse_pins(["torch>=2"], "x")


# ---------------------------------------------------------------------------- 2. import layers

#: Rank of each stage, low to high. A module may import its own stage or lower
#: ones. The base modules sit below every stage and import none of them.
BASE_MODULES = ("io", "errors", "logutil", "seeding", "layout", "grid", "code_version", "workers", "untracked")
#: Top level: they may import every stage. config validates the whole config, so it reads each stage's
#: declarations (the data-source registry, the run settings); no stage imports it. snakemake_args is the
#: command line of `userdp run` (it starts the workflow); api, private_training (make_private), trainer
#: (UserDPTrainer), sft_trainer (UserDPSFTTrainer) and arguments (their typed settings) are the public Python
#: API (docs/api.md).
TOP_MODULES = ("config", "cli", "__main__", "snakemake_args", "api", "private_training", "arguments", "trainer",
               "sft_trainer")
STAGE_RANKS = {
    "base": 0,
    "data": 1,
    "privacy": 2,
    "training": 3,
    "experiments": 3,  # the mean-estimation study sits beside training
    "evaluation": 4,
    "plotting": 5,
    "top": 6,  # TOP_MODULES
}
#: Stages of equal rank that must still not import each other.
SIBLINGS_APART = {frozenset({"training", "experiments"})}


def stage_of(module: str) -> str:
    """The stage of a dotted module name of the package, or an AssertionError for an unplaced one."""
    parts = module.split(".")
    assert parts[0] == PACKAGE, module
    if len(parts) == 1:
        return "base"  # userdp/__init__.py: the package docstring and version
    head = parts[1]
    if head in BASE_MODULES:
        return "base"
    if head in TOP_MODULES:
        return "top"
    if head in STAGE_RANKS and head not in ("base", "top"):
        return head
    raise AssertionError(
        f"{module} is in no stage; place it in tests/test_structure.py (BASE_MODULES or STAGE_RANKS)"
    )


def package_modules(package_dir: Path = PACKAGE_DIR, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package (packages by their __init__)."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir).with_suffix("")
        parts = [package, *rel.parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` statement reads from."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported module of the package, line) for every import statement anywhere in the file.

    `from pkg import name` points at the submodule pkg.name when there is one,
    else at pkg itself (name is then an attribute of pkg).
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve_from(module, is_package, node)
            targets = []
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                targets.append(sub if sub in modules else source)
        else:
            continue
        for target in targets:
            if target != PACKAGE and not target.startswith(PACKAGE + "."):
                continue
            # `import a.b.c` names the deepest existing module of the package.
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != module:
                found.append((target, node.lineno))
    return found


def import_graph(package_dir: Path = PACKAGE_DIR, package: str = PACKAGE) -> tuple[dict[str, Path], dict]:
    """(modules, edges) where edges[a][b] is the first line of a that imports b."""
    modules = package_modules(package_dir, package)
    edges: dict[str, dict[str, int]] = {m: {} for m in modules}
    for module, path in modules.items():
        for target, line in imports_of(module, path, modules):
            edges[module].setdefault(target, line)
    return modules, edges


def _where(modules: dict[str, Path], module: str, line: int) -> str:
    """file:line, relative to the repository root when the file is in it."""
    path = modules[module]
    return f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line}"


def layer_violations(modules: dict[str, Path], edges: dict) -> list[str]:
    """Every import from a lower stage to a higher one (or between siblings kept apart), as file:line."""
    out = []
    for a, targets in edges.items():
        sa = stage_of(a)
        for b, line in targets.items():
            sb = stage_of(b)
            wrong = STAGE_RANKS[sb] > STAGE_RANKS[sa] or (sa != sb and frozenset({sa, sb}) in SIBLINGS_APART)
            if sa == "base" and sb != "base":
                wrong = True
            if wrong:
                out.append(f"{_where(modules, a, line)}: {a} ({sa}) imports {b} ({sb})")
    return sorted(out)


def import_cycles(modules: dict[str, Path], edges: dict) -> list[str]:
    """Each strongly connected set of two or more modules, with the import lines that close it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's algorithm (recursion depth <= number of modules)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    out = []
    for comp in sorted(components):
        members = set(comp)
        links = [f"{_where(modules, a, line)} imports {b}" for a in comp for b, line in sorted(edges[a].items())
                 if b in members]
        out.append("cycle " + " <-> ".join(comp) + ": " + "; ".join(links))
    return out


def test_every_module_has_a_stage():
    unplaced = []
    for module in package_modules():
        try:
            stage_of(module)
        except AssertionError as exc:
            unplaced.append(str(exc))
    assert not unplaced, "\n".join(unplaced)


def test_no_import_from_a_lower_stage_to_a_higher_one():
    modules, edges = import_graph()
    bad = layer_violations(modules, edges)
    assert not bad, "imports against the stage order:\n" + "\n".join(bad)


def test_no_import_cycle_between_modules():
    modules, edges = import_graph()
    cycles = import_cycles(modules, edges)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")


def test_the_graph_checks_can_fail(tmp_path):
    """A toy package with an upward import (inside a function) and a cycle is caught, with file:line."""
    pkg = tmp_path / "workflow" / "userdp"
    _write(pkg, {
        "__init__.py": "",
        "errors.py": "",
        "data/__init__.py": "",
        "data/prepare.py": "from ..errors import x\n\ndef f():\n    from ..training.engine import train\n",
        "training/__init__.py": "",
        "training/engine.py": "from . import pool\n",
        "training/pool.py": "import userdp.training.engine\n",
    })
    modules, edges = import_graph(pkg)
    assert edges["userdp.data.prepare"] == {"userdp.errors": 1, "userdp.training.engine": 4}
    bad = layer_violations(modules, edges)
    assert len(bad) == 1 and "data/prepare.py:4: userdp.data.prepare (data) imports userdp.training.engine" in bad[0]
    cycles = import_cycles(modules, edges)
    assert len(cycles) == 1 and "userdp.training.engine <-> userdp.training.pool" in cycles[0]


# ---------------------------------------------------------------------------- 3. references stay inside

# Assembled from parts so that this file does not match its own patterns.
FORBIDDEN_REFERENCES = (
    ("the development notes outside the repository", "shared" + "/reference"),
    ("a machine path", "/" + "work" + "/"),
)


def repository_files() -> list[Path]:
    """The files of the repository: tracked and untracked-but-not-ignored (git), else a walk without
    the ignored build and data folders."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, check=True,
        ).stdout.decode("utf-8")
        return sorted({ROOT / p for p in out.split("\0") if p and (ROOT / p).is_file()})
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", ".snakemake", "__pycache__", ".pytest_cache"}
        top_skip = {"results", "data", "build"}
        files = []
        for p in ROOT.rglob("*"):
            rel = p.relative_to(ROOT).parts
            ignored = set(rel) & skip or rel[0] in top_skip or any(part.endswith(".egg-info") for part in rel)
            if p.is_file() and not ignored:
                files.append(p)
        return sorted(files)


@pytest.mark.helper_process  # git ls-files
def test_no_reference_leaves_the_repository():
    hits = []
    for path in repository_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary files
        for lineno, line in enumerate(text.splitlines(), 1):
            for what, pattern in FORBIDDEN_REFERENCES:
                if pattern in line:
                    hits.append(f"{path.relative_to(ROOT)}:{lineno}: cites {what} ({line.strip()[:100]})")
    assert not hits, "references outside the repository:\n" + "\n".join(hits)


@pytest.mark.helper_process  # ruff --show-files
def test_the_linter_reads_every_library_module_and_no_output_folder(tmp_path):
    """ruff's excludes name the top-level output folders only: a bare `data` pattern matched the package
    workflow/userdp/data too, and `/data` anchors at the file system's root, not the project's. Checked on a
    copy of pyproject.toml without .gitignore (which hides results/ and data/ inside a git checkout only)."""
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text(encoding="utf-8"), encoding="utf-8")
    files = ["data/a.py", "results/b.py", "workflow/userdp/data/c.py", "workflow/userdp/d.py"]
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("x = 1\n", encoding="utf-8")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-respect-gitignore", "--show-files", "."],
                         cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    shown = [Path(line.strip()) for line in out.splitlines() if line.strip().endswith(".py")]
    seen = sorted(str(p.relative_to(tmp_path)) for p in shown)
    assert seen == sorted(files[2:]), seen


# ---------------------------------------------------------------------------- 4. scripts read the config untracked

SCRIPTS_DIR = ROOT / "workflow" / "scripts"


def config_reads(source: str, filename: str = "<script>") -> list[str]:
    """file:line of each read of the `snakemake` object's config in a script's source but the first argument of
    a call to `untracked` (userdp.untracked).

    Reads through an alias count (`sm = snakemake; sm.config`), and so do `getattr(snakemake, "config")` and
    `vars(snakemake)` / `snakemake.__dict__` (which reach it by another name).
    """
    tree = ast.parse(source, filename=filename)
    aliases = {"snakemake"}
    for node in ast.walk(tree):  # names bound to the snakemake object (one level of aliasing is what scripts use)
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and isinstance(node.value, ast.Name) \
                and node.value.id in aliases:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            aliases.update(t.id for t in targets if isinstance(t, ast.Name))

    def is_sm(node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id in aliases

    allowed = {id(call.args[0]) for call in ast.walk(tree) if isinstance(call, ast.Call)
               and isinstance(call.func, ast.Name) and call.func.id == "untracked" and call.args}
    hits: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if id(node) in allowed:
            continue
        if isinstance(node, ast.Attribute) and node.attr in ("config", "__dict__") and is_sm(node.value):
            hits.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args and is_sm(node.args[0]):
            name = node.func.id
            attr = node.args[1] if len(node.args) > 1 else None
            if name == "vars" or (name in ("getattr", "hasattr") and isinstance(attr, ast.Constant)
                                  and attr.value == "config"):
                hits.append((node.lineno, ast.unparse(node)))
    return [f"{filename}:{line}: {text}" for line, text in sorted(hits)]


def test_scripts_read_the_config_only_untracked():
    """A script's job comes from its rule (params, input, output, wildcards, threads, resources, log): a script
    that read `snakemake.config` but through `untracked` would depend on keys no rerun trigger covers
    (tests/test_rerun_triggers.py)."""
    scripts = sorted(SCRIPTS_DIR.glob("*.py"))
    assert len(scripts) >= 20, scripts
    hits = [h for path in scripts
            for h in config_reads(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))]
    assert not hits, ("scripts that read the config; pass what they read as params of their rule "
                      "(userdp.untracked.untracked for keys that change no result):\n" + "\n".join(hits))
    assert sum("untracked(" in p.read_text(encoding="utf-8") for p in scripts) >= 10


def test_the_config_read_check_can_fail():
    source = """
import snakemake as unrelated_module_name
sm = snakemake
x = sm.config["seed"]
y = snakemake.config.get("training")
z = getattr(snakemake, "config")
w = vars(sm)["config"]
ok = sm.params.config, untracked(sm.config, "training.device"), other.config
v = untracked(x, sm.config)
"""
    hits = config_reads(source, "s.py")
    assert [h.split(":")[1] for h in hits] == ["4", "5", "6", "7", "9"], hits


# ---------------------------------------------------------------------------- 5. private names of libraries

PRIVATE_LIBRARIES = ("dp_accounting", "snakemake")
COMPAT_MODULE = "userdp/privacy/_dp_accounting_compat.py"
#: `noqa: SLF001` lines the library keeps outside the compat module, per file: torch's in-place version counter
#: (clipping). None reaches into dp-accounting or Snakemake.
SLF001_KEPT = {"userdp/training/clipping.py": 2}


#: namedtuple's public methods, underscored so as not to clash with field names
NAMEDTUPLE_API = ("_asdict", "_fields", "_replace", "_make", "_field_defaults")


#: (module, name) of the private getattr lookups the library keeps: transformers' checkpointing function.
GETATTR_KEPT = {("userdp/training/clipping.py", "_gradient_checkpointing_func")}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) \
        and name not in NAMEDTUPLE_API


def private_library_references(source: str, filename: str = "<module>") -> list[str]:
    """file:line of each private name of PRIVATE_LIBRARIES a module's source reaches.

    Counted: a private module or name imported from them (`from dp_accounting.pld import _x`,
    `dp_accounting._x`), a private attribute of a name bound by such an import (`pld_pmf._MAX`), and
    `getattr`/`setattr`/`hasattr` with a private constant name (`getattr(scheduler, "_open_jobs")`: the object
    may come from them), but for GETATTR_KEPT.
    """
    tree = ast.parse(source, filename=filename)
    aliases: set[str] = set()
    hits: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PRIVATE_LIBRARIES:
                    aliases.add(a.asname or a.name.split(".")[0])
                    if any(_private(part) for part in a.name.split(".")):
                        hits.append((node.lineno, f"import {a.name}"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] in PRIVATE_LIBRARIES:
            for a in node.names:
                aliases.add(a.asname or a.name)
                if _private(a.name) or any(_private(part) for part in node.module.split(".")):
                    hits.append((node.lineno, f"from {node.module} import {a.name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in aliases:
                hits.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                and _private(node.args[1].value) and (filename, node.args[1].value) not in GETATTR_KEPT:
            hits.append((node.lineno, ast.unparse(node)))
    return [f"{filename}:{line}: {text}" for line, text in sorted(set(hits))]


def _library_sources() -> list[tuple[str, str]]:
    files = [*PACKAGE_DIR.rglob("*.py"), *SCRIPTS_DIR.glob("*.py"), *(ROOT / "workflow" / "rules").glob("*.smk"),
             ROOT / "Snakefile"]
    return [(str(p.relative_to(ROOT / "workflow") if p.is_relative_to(PACKAGE_DIR) else p.relative_to(ROOT)),
             p.read_text(encoding="utf-8")) for p in sorted(files)]


def test_no_private_dp_accounting_or_snakemake_name_outside_the_compat_module():
    hits = []
    for name, source in _library_sources():
        if name == COMPAT_MODULE:
            continue
        if name.endswith(".smk") or name == "Snakefile":  # Snakemake's own syntax: look at the Python lines
            source = "\n".join(line for line in source.splitlines()
                               if line.strip().startswith(("import ", "from ")) or "._" in line)
            try:
                ast.parse(source)
            except SyntaxError:
                hits += [f"{name}: {line.strip()}" for line in source.splitlines() if "._" in line]
                continue
        hits += private_library_references(source, name)
    assert not hits, ("private names of dp-accounting or Snakemake outside " + COMPAT_MODULE + ":\n"
                      + "\n".join(hits))


def test_private_accesses_are_kept_where_listed():
    counts = {}
    for name, source in _library_sources():
        n = source.count("noqa: SLF001")
        if n:
            counts[name] = n
    assert counts == SLF001_KEPT
    ruff = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert "SLF001" in ruff["select"]
    exempt = sorted(f for f, rules in ruff["per-file-ignores"].items() if "SLF001" in rules)
    assert exempt == ["benchmarks/**", "tests/**", "workflow/" + COMPAT_MODULE]


def test_the_private_name_check_can_fail():
    source = """
import dp_accounting
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import _hidden
from snakemake.scheduling import job_scheduler as js
x = pld_pmf._MAX_PMF_SPARSE_SIZE
y = dp_accounting.pld._private.thing
z = getattr(scheduler, "_schedule_reevalutation")
ok = pld_pmf.DensePLDPmf, obj._own, getattr(x, "__name__"), self._x
"""
    hits = private_library_references(source, "m.py")
    assert [h.split(":")[1] for h in hits] == ["4", "6", "7", "8"], hits
    from userdp.privacy import _dp_accounting_compat as compat

    with pytest.raises(Exception, match=r"dp-accounting 0\.7\.0 is installed.*pip install dp-accounting==0\.6\.0"):
        compat.check_version("0.7.0")
    assert compat.check_version() == compat.VERSION == "0.6.0"
