"""The bad-input catalogue (tests/bad_input_catalogue.py) as tests: one per case, plus the table and its docs page.

Each case: the exit status, a message naming the file or key (no traceback, no wrong hint), no half-written
output or temporary file left, the user's own files unchanged. Known gaps are strict xfails (see the table).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bad_input_catalogue import CASES, KINDS, execute, listed_ids

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "catalogue.md"


def _param(case):
    marks = [pytest.mark.xfail(strict=True, reason=case.reason)] if case.xfail else []
    if getattr(case.run, "starts_snakemake", False):
        marks.append(pytest.mark.integration)
    return pytest.param(case, id=case.id, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_case(case, tmp_path):
    result = execute(case, tmp_path)
    out = result.text
    assert result.outcome.exit == case.exit, f"exit {result.outcome.exit}, expected {case.exit}; output:\n{out[-3000:]}"
    assert case.message in out, f"message lacks {case.message!r}; output:\n{out[-3000:]}"
    assert "Traceback (most recent call last)" not in out, f"a traceback, not a clean error:\n{out[-3000:]}"
    wrong = [u for u in case.unwanted if u in out]
    assert not wrong, f"the message holds {wrong}, a wrong hint:\n{out[-3000:]}"
    assert not result.leftovers, f"left behind: {list(result.leftovers)}"
    assert not result.changed, f"the user's file(s) {list(result.changed)} changed or were removed"


def test_the_table_has_at_least_100_distinct_cases_of_every_kind():
    ids = [c.id for c in CASES]
    assert len(ids) >= 100
    assert len(set(ids)) == len(ids), sorted({i for i in ids if ids.count(i) > 1})
    not_kebab = [i for i in ids if not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", i)]
    assert not not_kebab, not_kebab
    assert {c.kind for c in CASES} == set(KINDS)
    for c in CASES:
        assert c.message and c.what and c.exit != 0, c.id
        assert not c.xfail or c.reason, f"{c.id}: an xfail needs its reason"
    # no two rows are the same bad input under two names
    assert len({(c.kind, c.what) for c in CASES}) == len(CASES)


def test_the_checks_can_fail(tmp_path):
    """The harness sees a lost user file, a leftover and a temporary file (a test that cannot fail is a defect)."""
    from bad_input_catalogue import Case, Outcome, write

    def vandal(folder):
        (folder / "mine.csv").write_text("overwritten")
        (folder / "out.json").write_text("{}")
        (folder / "sub").mkdir()
        (folder / "sub" / ".out.json.abc123.tmp").write_text("")
        return Outcome(0, "")

    case = Case("vandal", "data", "a runner that loses the user's file", vandal, 2, "x",
                setup=write("mine.csv", "user_id,text\n"), absent=("out.json",), kept=("mine.csv",))
    result = execute(case, tmp_path)
    assert result.changed == ("mine.csv",)
    assert set(result.leftovers) == {"out.json", "sub/.out.json.abc123.tmp"}  # the second by TEMP_PATTERNS


def test_docs_list_exactly_the_table():
    """docs/catalogue.md is generated from the table; regenerate it with
    `python tests/bad_input_catalogue.py > docs/catalogue.md` after adding, renaming or removing a case."""
    assert DOC.exists(), "docs/catalogue.md is missing; run: python tests/bad_input_catalogue.py > docs/catalogue.md"
    listed = listed_ids(DOC.read_text(encoding="utf-8"))
    table = [c.id for c in CASES]
    assert sorted(listed) == sorted(table), (
        f"docs/catalogue.md is out of date (missing {sorted(set(table) - set(listed))}, stale "
        f"{sorted(set(listed) - set(table))}); run: python tests/bad_input_catalogue.py > docs/catalogue.md")
    assert len(listed) == len(set(listed))


def test_every_fault_names_a_test_that_exists():
    """The fault rows of the catalogue are run by their own tests; a renamed or removed test fails here."""
    import ast

    from bad_input_catalogue import FAULTS

    assert len({f.id for f in FAULTS}) == len(FAULTS) >= 10
    for fault in FAULTS:
        file, _, name = fault.test.partition("::")
        tree = ast.parse((REPO / file).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in names, f"{fault.id}: {fault.test} does not exist"
    listed = re.findall(r"^\| `([a-z0-9-]+)` \| .* \| `tests/", DOC.read_text(), re.M)
    assert listed == [f.id for f in FAULTS], "docs/catalogue.md is out of date; regenerate it"
