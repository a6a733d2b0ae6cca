"""The front page and the docs hold together (no pipeline run, no model).

1. Every relative link of README.md and docs/*.md, text or image, points at a
   file or folder of the repository, and every `#anchor` at a heading of the
   target Markdown file (GitHub's slugs: lowercase; every character but
   letters, digits, `_`, `-` and spaces dropped; spaces become `-`; a
   repeated heading gets `-1`, `-2`, ...). Links inside code are not links.
2. README.md is a front page: at most 150 lines, and its first two fenced
   bash blocks are the two commands CI and the acceptance run, byte for byte:
   the main job on the embedded default, then the test command of .ci/run.
3. docs/design.md has the four "where to add" recipes.

Each check has a case here that makes it fail, so that a checker that finds
nothing is itself caught.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 150

#: The first command of the README: sets up and runs the main job on the embedded default (CI, acceptance).
MAIN_COMMAND = ("python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && .venv/bin/snakemake --cores 2 "
                "&& .venv/bin/snakemake --cores 2 --report results/report.html")
#: The headings of docs/design.md's recipes (each one: files to touch, the test to write).
RECIPE_HEADINGS = (
    "### Add a data source",
    "### Add a figure",
    "### Add a layer type",
    "### Add an optimizer",
)


def linked_docs() -> list[Path]:
    """The Markdown files whose links are checked: README.md and docs/*.md."""
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


# ---------------------------------------------------------------------------- Markdown parsing

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target "title") and ![alt](target); the text may hold one level of brackets ([`x`] or an image).
_INLINE_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\](?:\([^)]*\))?)*)\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
_HTML_ID = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            continue
        if fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not m.group(2).strip():
                fence = None
            continue
        out.append((number, line))
    return out


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, content) of every fenced code block, in order."""
    blocks, fence, info, body = [], None, "", []
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence is None:
            if m:
                fence, info, body = m.group(1), m.group(2).strip(), []
            continue
        if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not m.group(2).strip():
            blocks.append((info, "\n".join(body)))
            fence = None
        else:
            body.append(line)
    return blocks


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text (inline links reduced to their text)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LMN")
    return kept.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a Markdown file defines: its headings' slugs (repeats numbered) and HTML ids."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in prose_lines(text):
        m = _HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
        out.update(_HTML_ID.findall(line))
    return out


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every inline or reference link and image outside code."""
    out = []
    for number, line in prose_lines(text):
        line = _CODE_SPAN.sub(lambda m: "x" * len(m.group(0)), line)  # code is not a link
        out += [(number, m.group(2).strip("<>")) for m in _INLINE_LINK.finditer(line)]
        m = _REFERENCE_DEF.match(line)
        if m:
            out.append((number, m.group(1).strip("<>")))
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """`file:line: target (why)` for each relative link of `path` that leads nowhere."""
    text = path.read_text(encoding="utf-8")
    out = []
    cache: dict[Path, set[str]] = {}
    for number, target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
            continue  # http:, https:, mailto: ...: not a file of the repository
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not dest.is_relative_to(root.resolve()):
            out.append(f"{where} (outside the repository)")
            continue
        if not dest.exists():
            out.append(f"{where} (no such file)")
            continue
        if anchor:
            if dest.suffix.lower() != ".md" or not dest.is_file():
                out.append(f"{where} (an anchor into a file that is not Markdown)")
                continue
            if dest not in cache:
                cache[dest] = anchors(dest.read_text(encoding="utf-8"))
            if unquote(anchor).lower() not in cache[dest]:
                out.append(f"{where} (no heading #{anchor} in {dest.relative_to(root.resolve())})")
    return out


# ---------------------------------------------------------------------------- 1. links


@pytest.mark.parametrize("doc", linked_docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    bad = broken_links(doc)
    assert not bad, "links that lead nowhere:\n" + "\n".join(bad)


def test_the_link_check_can_fail(tmp_path):
    """A missing file, a missing heading and a missing image are each reported; code, URLs and good links are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# B page\n\n## Set-up: `snakemake`, SLURM (v2)\n\n## Notes\n## Notes\n")
    (tmp_path / "docs" / "fig.png").write_bytes(b"\x89PNG")
    (tmp_path / "README.md").write_text(
        "# Front\n\n## Local part\n\n"
        "[ok](docs/b.md) [ok](docs/b.md#set-up-snakemake-slurm-v2) [ok](docs/b.md#notes-1) [ok](#local-part)\n"
        "![ok](docs/fig.png) [web](https://example.org/x.md#nothing) `[code](nowhere.md)`\n"
        "[gone](docs/missing.md)\n"
        "[bad anchor](docs/b.md#setup)\n"
        "![no image](docs/figures/none.png)\n"
        "[self](#nowhere)\n"
        "```\n[fenced](nowhere.md)\n```\n"
        "[ref]: docs/gone-too.md\n",
        encoding="utf-8")
    bad = broken_links(tmp_path / "README.md", tmp_path)
    assert [b.split(" (")[0] for b in bad] == [
        "README.md:7: docs/missing.md",
        "README.md:8: docs/b.md#setup",
        "README.md:9: docs/figures/none.png",
        "README.md:10: #nowhere",
        "README.md:14: docs/gone-too.md",
    ], bad


def test_slugs_follow_github():
    assert slug("Running on a SLURM cluster") == "running-on-a-slurm-cluster"
    assert slug("The study's datasets and scale") == "the-studys-datasets-and-scale"
    assert slug("Downloads: `data/{dataset}/`") == "downloads-datadataset"
    assert slug("1. Privacy unit, neighbouring datasets, delta") == "1-privacy-unit-neighbouring-datasets-delta"
    assert slug("datasets: synthetic and split") == "datasets-synthetic-and-split"
    assert slug("Its run (2026-12-03): 46 min 47 s") == "its-run-2026-12-03-46-min-47-s"
    assert slug("See [api](docs/api.md) now") == "see-api-now"


# ---------------------------------------------------------------------------- 2. the front page


def readme_problems(text: str, test_command: str) -> list[str]:
    """Why `text` is not the front page: too long, or its first two bash blocks are not the two commands."""
    out = []
    n = len(text.splitlines())
    if n > README_MAX_LINES:
        out.append(f"README.md has {n} lines, more than {README_MAX_LINES}: move detail to docs/")
    bash = [body for info, body in fenced_blocks(text) if info.split()[:1] == ["bash"]]
    want = [MAIN_COMMAND, test_command]
    for i, (what, expected) in enumerate(zip(("main job", "test"), want)):
        got = bash[i] if i < len(bash) else None
        if got != expected:
            out.append(f"README.md's bash block {i + 1} is not the {what} command:\n  want {expected!r}\n  got  {got!r}")
    return out


def ci_test_command() -> str:
    """The last line of .ci/run: the command CI runs, the README's test command."""
    lines = [line for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines() if line.strip()]
    return lines[-1]


def test_readme_is_a_front_page_with_the_two_commands_first():
    problems = readme_problems(README.read_text(encoding="utf-8"), ci_test_command())
    assert not problems, "\n".join(problems)


def test_the_front_page_check_can_fail():
    test_command = ci_test_command()
    good = f"# t\n\n```bash\n{MAIN_COMMAND}\n```\n\n```bash\n{test_command}\n```\n"
    assert readme_problems(good, test_command) == []
    swapped = f"# t\n\n```bash\n{test_command}\n```\n\n```bash\n{MAIN_COMMAND}\n```\n"
    assert len(readme_problems(swapped, test_command)) == 2
    changed = good.replace("--cores 2 &&", "--cores 4 &&")
    assert [p.split("'s ")[1][:12] for p in readme_problems(changed, test_command)] == ["bash block 1"]
    assert "more than 150" in readme_problems(good + "x\n" * 150, test_command)[0]
    assert len(readme_problems("# t\n", test_command)) == 2


# ---------------------------------------------------------------------------- 3. the design page


def test_design_has_the_four_recipes():
    lines = set((ROOT / "docs" / "design.md").read_text(encoding="utf-8").splitlines())
    missing = [h for h in RECIPE_HEADINGS if h not in lines]
    assert not missing, f"docs/design.md lacks the recipe heading(s) {missing}"
