"""The accountant memo (userdp.privacy.memo): same numbers, keyed by everything that determines them."""

import json
import math
from pathlib import Path

import pytest

from userdp.privacy import accounting as A
from userdp.privacy import memo

from privacy_helpers import mech


@pytest.fixture
def memo_dir(tmp_path, monkeypatch):
    d = tmp_path / "memo"
    monkeypatch.setenv(memo.ENV, str(d))
    return d


def event(sigma=1.2, q=0.02, T=40, G=4):
    return mech("els", q, T, G).dp_event(sigma)


def test_without_the_variable_nothing_is_stored(tmp_path, monkeypatch):
    monkeypatch.delenv(memo.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    A.epsilon(event(), 1e-6, 1e-3)
    assert list(tmp_path.iterdir()) == []


def test_a_stored_result_is_the_computed_one_and_is_reused(memo_dir, monkeypatch):
    first = A.epsilon(event(), 1e-6, 1e-3)
    files = list(memo_dir.glob("*.json"))
    assert len(files) == 1
    monkeypatch.delenv(memo.ENV)
    assert A.epsilon(event(), 1e-6, 1e-3) == first  # the same number computed afresh
    monkeypatch.setenv(memo.ENV, str(memo_dir))

    def boom(*a, **k):
        raise AssertionError("recomputed")

    monkeypatch.setattr(A, "_steps_epsilon", boom)
    assert A.epsilon(event(), 1e-6, 1e-3) == first


@pytest.mark.parametrize("change", [dict(sigma=1.3), dict(q=0.03), dict(T=41), dict(G=5), "delta", "discretization"])
def test_every_input_is_part_of_the_key(memo_dir, change):
    A.epsilon(event(), 1e-6, 1e-3)
    if change == "delta":
        A.epsilon(event(), 1e-5, 1e-3)
    elif change == "discretization":
        A.epsilon(event(), 1e-6, 2e-3)
    else:
        A.epsilon(event(**change), 1e-6, 1e-3)
    assert len(list(memo_dir.glob("*.json"))) == 2


def test_runs_composed_share_the_key_of_the_same_steps(memo_dir):
    # Two runs of T steps are 2T steps of the same step: the plan's calibration and selection's composition meet.
    from userdp.privacy.mechanism import compose

    two = A.epsilon(compose([event(T=40), event(T=40)]), 1e-6, 1e-3)
    assert A.epsilon(event(T=80), 1e-6, 1e-3) == two
    assert len(list(memo_dir.glob("*.json"))) == 1


def test_the_code_version_is_part_of_the_key():
    k = memo.key("pld", 1, 2)
    assert memo._code_version() in k
    assert len(memo._code_version()) == 64


@pytest.mark.parametrize("damage", ["garbage", "wrong key", "no value"])
def test_a_damaged_entry_is_recomputed_and_rewritten(memo_dir, damage):
    first = A.epsilon(event(), 1e-6, 1e-3)
    (path,) = memo_dir.glob("*.json")
    rec = json.loads(path.read_text())
    if damage == "garbage":
        path.write_text("{not json")
    elif damage == "wrong key":
        path.write_text(json.dumps({"key": rec["key"] + "x", "value": 0.001}))
    else:
        path.write_text(json.dumps({"key": rec["key"]}))
    assert A.epsilon(event(), 1e-6, 1e-3) == first
    assert json.loads(path.read_text()) == rec


def test_infinity_round_trips(memo_dir):
    k = memo.key("test", "x")
    assert memo.lookup(k) is None
    memo.store(k, math.inf)
    assert memo.lookup(k) == math.inf
    memo.store(k, 0.25)
    assert memo.lookup(k) == 0.25
    assert not list(memo_dir.glob(".memo-*"))  # no temporary file left


def test_an_unwritable_folder_only_skips_the_memo(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv(memo.ENV, str(blocker / "memo"))  # a folder under a file cannot be made
    assert A.epsilon(event(), 1e-6, 1e-3) > 0


def test_the_code_version_covers_every_module_the_accountant_imports():
    """A change to any privacy module accounting.py uses (directly or through another) changes every key: a memo
    entry is never served for numbers that code no longer computes."""
    import ast

    here = Path(memo.__file__).parent
    seen, todo = set(), ["accounting.py"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for node in ast.walk(ast.parse((here / name).read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = [node.module] if node.module else [a.name for a in node.names]
                todo += [f"{n}.py" for n in names if (here / f"{n}.py").is_file()]
    assert {"pld_arrays.py", "_dp_accounting_compat.py", "memo.py"} <= seen  # the walk finds the imports
    assert seen <= set(memo._SOURCES), sorted(seen - set(memo._SOURCES))
