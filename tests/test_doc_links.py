"""Links and file references in README.md and docs/ resolve inside the repository.

A reader of the repository can open every relative link (and its #anchor), every repository path
the prose names in backticks, and nothing outside it (the research notes the project grew from are
not shipped, so the docs must not send readers there).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
REPO_PATH = re.compile(r"^(?:grpolens|tests|docs|benchmarks|sample_runs|\.ci)/[\w./-]*[\w/]$")
FENCE = re.compile(r"^(```|~~~)")


def _prose(text: str) -> str:
    """The page without fenced code blocks (commands there are run by the examples tests)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        out.append("" if fenced else line)
    return "\n".join(out)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    h = re.sub(r"`|\*|_(?=\w)|(?<=\w)_", "", heading.strip().lower())
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(page.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        s = _slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def _ids(page: Path):
    return page.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_relative_links_and_anchors_resolve(page):
    bad = []
    for target in LINK.findall(_prose(page.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
            continue
        try:
            dest.relative_to(ROOT)
        except ValueError:
            bad.append(f"{target}: outside the repository")
            continue
        if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{_ids(page)}: " + "; ".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_named_repository_paths_exist(page):
    bad = []
    for span in CODE_SPAN.findall(_prose(page.read_text(encoding="utf-8"))):
        for word in span.split():
            word = word.rstrip(".,:;)").split("::")[0]
            # grpolens/... also names a run's output folder (RUN/grpolens/metrics.parquet): only
            # source paths (.py or a folder) are repository paths there
            source_like = not word.startswith("grpolens/") or word.endswith((".py", "/"))
            if REPO_PATH.match(word) and source_like and not any(ch in word for ch in "<*{"):
                if not (ROOT / word).exists():
                    bad.append(word)
    assert not bad, f"{_ids(page)} names files that are not in the repository: {sorted(set(bad))}"


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_no_reference_outside_the_repository(page):
    text = page.read_text(encoding="utf-8")
    hits = [m.group(0) for m in re.finditer(r"(?:\.\./)+shared/\S*|\bshared/reference\S*", text)]
    assert not hits, f"{_ids(page)} cites files a reader of the repository cannot open: {hits}"


def test_checker_catches_broken_links(tmp_path):
    page = ROOT / "docs" / "__probe__.md"
    try:
        page.write_text("# Title\n\n[a](missing.md) [b](#no-such) [c](check.md#no-such-anchor)\n")
        with pytest.raises(AssertionError) as e:
            test_relative_links_and_anchors_resolve(page)
        msg = str(e.value)
        assert "missing.md: no such file" in msg and "#no-such" in msg and "no-such-anchor" in msg
    finally:
        page.unlink()


def test_every_page_is_linked_from_another():
    """A page under docs/ that no other page links to is one a reader never finds (a new page is
    checked by every test here without being named; this makes sure it is also reachable)."""
    linked = set()
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" not in target:
                linked.add((page.parent / target).resolve())
    orphans = [_ids(p) for p in PAGES if p != ROOT / "README.md" and p.resolve() not in linked]
    assert not orphans, f"no page links to {orphans}: link each from README.md or a page that covers its topic"


def _test_names() -> dict[str, set[str]]:
    """tests/<path>.py -> the test functions it defines."""
    return {p.relative_to(ROOT).as_posix(): set(re.findall(r"^\s*(?:async )?def (test_\w+)\(", p.read_text(encoding="utf-8"), re.M))
            for p in (ROOT / "tests").rglob("test_*.py")}


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_named_tests_exist(page):
    """A test the prose names is defined: `tests/f.py::test_x` in that file, a bare `test_x` (or
    `test_x[param]`) somewhere under tests/."""
    defined = _test_names()
    everywhere = set().union(*defined.values())
    bad = []
    for span in CODE_SPAN.findall(_prose(page.read_text(encoding="utf-8"))):
        m = re.fullmatch(r"(?:(tests/[\w/]+\.py)::)?(test_\w+)(?:\[[^\]]*\])?(?:\(\))?", span)
        if m and m.group(2) not in (defined.get(m.group(1), set()) if m.group(1) else everywhere):
            bad.append(span)
    assert not bad, f"{_ids(page)} names tests that do not exist: {bad}"
