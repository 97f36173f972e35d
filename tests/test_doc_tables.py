"""Every Markdown table in README.md, docs/ and sample_runs/README.md renders as the table its
source shows.

The pages are parsed by a CommonMark parser with GitHub's table extension (markdown-it-py), as a
reader's renderer would: a source line that starts with ``|`` must be a row of a rendered table (a
blank line inside a table ends it, and the rows after it render as a paragraph of pipes), and each
row must have as many cells as its header (a renderer drops the extra cells, or pads the missing
ones, without a word).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "sample_runs" / "README.md"]


def _parser() -> MarkdownIt:
    return MarkdownIt("commonmark").enable("table")


def table_problems(text: str) -> list[str]:
    """Each table row in the source that does not render as one, with its line number (1-based)."""
    tokens = _parser().parse(text)
    lines = text.splitlines()
    in_table, in_code, problems = set(), set(), []
    for tok in tokens:
        if tok.map and tok.type in ("fence", "code_block", "html_block"):
            in_code.update(range(*tok.map))
        if tok.type == "table_open":
            in_table.update(range(*tok.map))
            header = _cells(lines[tok.map[0]])
            problems += [f"line {n + 1}: {_cells(lines[n])} cells under a header of {header}"
                         for n in range(tok.map[0] + 2, tok.map[1]) if _cells(lines[n]) != header]
    for n, line in enumerate(lines):
        if line.lstrip().startswith("|") and n not in in_table and n not in in_code:
            problems.append(f"line {n + 1}: {line[:60]!r} renders as text, not as a table row "
                            "(a blank line or a paragraph line above it ends the table)")
    return problems


def _cells(line: str) -> int:
    """The cells of a source row: its unescaped pipes split it, inside code spans too (GitHub's
    rule: a pipe in a cell is written ``\\|``)."""
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") and not body.endswith("\\|") else body
    cells, k = 1, 0
    while k < len(body):
        if body[k] == "\\":
            k += 2
            continue
        cells += body[k] == "|"
        k += 1
    return cells


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_tables_render_as_written(page):
    problems = table_problems(page.read_text(encoding="utf-8"))
    assert not problems, f"{page.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_the_check_sees_a_broken_table():
    whole = "| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |\n"
    assert table_problems(whole) == []
    split = "| a | b |\n|---|---|\n| 1 | 2 |\n\n| 3 | 4 |\n"
    assert [p.split(":")[0] for p in table_problems(split)] == ["line 5"]
    extra = "| a | b |\n|---|---|\n| 1 | 2 | 3 |\n"
    assert table_problems(extra) == ["line 3: 3 cells under a header of 2"]
    assert table_problems("```text\n| not | a table |\n```\n") == []
    assert table_problems("| a | b |\n|---|---|\n| `x \\| y` | 2 |\n") == []
