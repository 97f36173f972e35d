"""A count the prose announces ("Three things ...:", "the 4 steps below:") is the number of items in
the list or table that follows it.

The pages are parsed as rendered (markdown-it-py): a paragraph whose last sentence names a count and
ends with a colon introduces the block right after it; a list counts its top-level items, a table
its body rows. (Counts of other things, the code's or a run's, are checked by test_doc_numbers.py.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from tests.test_doc_timings import BLOCK

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "sample_runs" / "README.md"]

WORDS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve".split())}
#: a number (a word or digits) and, within three words, a plural noun: "Three things", "the 4 new steps"
COUNT = re.compile(r"(?<![\w.,/-])(" + "|".join(list(WORDS)[2:]) + r"|\d+)((?:\s+[\w'-]+){0,3}?\s+[a-z][\w-]*[^s\W]s)\b",
                   re.I)


def announced_counts(text: str) -> list[tuple[int, str, int, int]]:
    """(line, the counting phrase, the number announced, the number of items that follow) for each
    paragraph ending with a colon whose last sentence counts, followed by a list or a table."""
    # a block a benchmark writes is its own ("on AMD EPYC, 2 cores, 24 GiB ...:" heads a table)
    text = BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    out = []
    for i, tok in enumerate(tokens):
        if tok.type != "inline" or tokens[i - 1].type != "paragraph_open" or not tok.content.rstrip().endswith(":"):
            continue
        nxt = i + 2  # paragraph_close, then the next block
        if nxt >= len(tokens) or tokens[nxt].type not in ("bullet_list_open", "ordered_list_open", "table_open"):
            continue
        sentence = re.split(r"(?<=[.;])\s+(?=[A-Z`(])", " ".join(tok.content.split()))[-1]
        sentence = re.sub(r"`[^`]*`", "`…`", sentence)
        found = list(COUNT.finditer(sentence))
        if not found:
            continue
        m = found[-1]  # the count nearest the colon
        announced = WORDS.get(m.group(1).lower()) or int(m.group(1))
        out.append((tok.map[0] + 1, m.group(0), announced, _items(tokens, nxt)))
    return out


def _items(tokens, start: int) -> int:
    """Top-level items of the list, or body rows of the table, opening at tokens[start]."""
    opener = tokens[start]
    close = opener.type.replace("_open", "_close")
    level, n = opener.level, -1 if opener.type == "table_open" else 0  # a table's header row
    for t in tokens[start + 1:]:
        if t.type == close and t.level == level:
            break
        if opener.type == "table_open":
            n += t.type == "tr_open" and t.level == level + 2  # table > thead|tbody > tr
        else:
            n += t.type == "list_item_open" and t.level == level + 1
    return n


#: (page, the counting phrase) -> why the items that follow are not what it counts
COUNTS_OTHER_THINGS = {
    ("docs/mutation-testing.md", "eleven open ones"): "counts mutants; each item is one function and names its mutants",
}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_announced_counts_match_what_follows(page):
    rel = str(page.relative_to(ROOT))
    wrong = [f"line {line}: {phrase!r} announces {n}, and {items} follow"
             for line, phrase, n, items in announced_counts(page.read_text(encoding="utf-8"))
             if n != items and (rel, phrase) not in COUNTS_OTHER_THINGS]
    assert not wrong, f"{page.relative_to(ROOT)}:\n" + "\n".join(wrong)


def test_the_check_counts_lists_and_tables():
    five = "Three things it does not know:\n\n- a\n- b\n\n- c\n  - nested\n- d\n- e\n"
    assert announced_counts(five) == [(1, "Three things", 3, 5)]
    rows = "The two modes, with `x` and `y`:\n\n| mode | what |\n|---|---|\n| a | 1 |\n| b | 2 |\n"
    assert [c[2:] for c in announced_counts(rows)] == [(2, 2)]
    assert [c[2:] for c in announced_counts("It has 3 new steps:\n\n1. a\n2. b\n3. c\n")] == [(3, 3)]
    # no colon, no block, or no count: nothing announced
    assert announced_counts("Three things matter.\n\n- a\n") == []
    assert announced_counts("Pick one of these:\n\n- a\n- b\n") == []
    assert announced_counts("Most of the 424 after the pass:\n\n- a\n") == []


def test_exceptions_still_name_a_count():
    found = {(str(p.relative_to(ROOT)), c[1]) for p in PAGES for c in announced_counts(p.read_text(encoding="utf-8"))}
    assert not set(COUNTS_OTHER_THINGS) - found, set(COUNTS_OTHER_THINGS) - found
