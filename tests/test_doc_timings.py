"""A timing in the docs is written by the benchmark that measures it.

Benchmarks write their figures between ``<!-- NAME: begin (written by benchmarks/SCRIPT.py ...) -->``
and ``<!-- NAME: end -->`` (``benchmarks/doc_block.py``), headed by the command, the machine and the
date. A timing or throughput anywhere else in README.md or docs/ fails this test unless ``ALLOWED``
names it with the reason it is not a measurement of this project's code, or not one a script
could rewrite.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: generated from the code (options' help, config defaults): no measurement in them
GENERATED_PAGES = {"docs/cli.md", "docs/metrics.md"}

#: a number with a unit of time, or a rate per unit of time
TIMING = re.compile(
    r"(?<![\w.\-])~?\d[\d,.]*\s?(?:–\s?\d[\d,.]*\s?)?(?:ns|µs|us|ms|s|sec|seconds?|min|minutes?|h|hours?)\b(?!-)"
    r"|\d[\d,.]*\s?(?:k|M|G)?\s?(?:rows|tokens|token rows|B|bytes|kB|MB|GB)?\s?(?:/s\b|per (?:CPU-)?second)")

#: (page, a heading or the text around the figures) -> why they may stand outside a generated block;
#: a heading ("## ...") allows its whole section, any other text the figures whose context holds it
ALLOWED = {
    ("README.md", "the whole suite took 16 min 39 s"):
        "the test suite's own duration in CI (`bash .ci/run` in a fresh clone), dated in the sentence",
    ("README.md", "(3 min 37 s on a busy machine)"): "the quick run's duration, beside its command",
    ("docs/export.md", "trackers into the development environment took 2 min 8 s"):
        "pip's install time for third-party trackers, with the `/usr/bin/time -v pip install` command",
    ("docs/mutation-testing.md", "5 to 50 s per mutant"):
        "mutmut's pace on a shared machine, to plan a run's length; it times mutmut's test runs, not grpolens",
    ("docs/distributed.md", "prefixes every 15 s and"):
        "serve --watch's polling interval, a constant of grpolens/serve/watch.py (REMOTE_EVERY), not a measurement",
    ("docs/distributed.md", "is given up after 10 s"):
        "--ray-address's connect limit, a constant of grpolens/metrics/engine_ray.py (CONNECT_TIMEOUT_S), not a measurement",
    ("docs/serve.md", "a local run is looked at every 5 s"):
        "serve --watch's polling interval, a constant of grpolens/serve/watch.py (LOCAL_EVERY), not a measurement",
    ("docs/serve.md", "run is listed every 15 s"):
        "serve --watch's polling interval, a constant of grpolens/serve/watch.py (REMOTE_EVERY), not a measurement",
}

BLOCK = re.compile(r"<!-- ([\w-]+): begin \(written by (benchmarks/[\w/]+\.py|tests/[\w/]+\.py) [^)]*\) -->"
                   r"(.*?)<!-- \1: end -->", re.S)
#: code blocks other than ```text: snippets run by tests/test_doc_snippets.py (which normalises the
#: timings they print) and configuration files (``min = 0.0`` is no timing)
CODE = re.compile(r"^```(?!text\n)[\w-]+\n.*?^```", re.M | re.S)


def pages() -> list[Path]:
    return [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").rglob("*.md"))
                                  if str(p.relative_to(ROOT)) not in GENERATED_PAGES)]


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of each Markdown section, the text before the first heading under ""."""
    parts = re.split(r"^(#{1,6} .*)$", text, flags=re.M)
    return [("", parts[0]), *zip(parts[1::2], parts[2::2])]


def figures(page: Path) -> list[tuple[str, str, str]]:
    """(figure, its context, its section heading) of every timing outside generated blocks and code."""
    out = []
    for heading, body in sections(page.read_text(encoding="utf-8")):
        flat = re.sub(r"\s+", " ", CODE.sub("", BLOCK.sub("", body)))
        out += [(m.group(0), flat[max(0, m.start() - 80): m.end() + 40], heading.strip())
                for m in TIMING.finditer(flat)]
    return out


def allowed_by(page: str, context: str, heading: str) -> tuple[str, str] | None:
    for p, around in ALLOWED:
        if p == page and (around == heading if around.startswith("#") else around in context):
            return p, around
    return None


def test_no_timing_outside_a_block_its_benchmark_writes():
    loose = []
    for page in pages():
        rel = str(page.relative_to(ROOT))
        loose += [f"{rel}: {fig!r} in …{ctx}…" for fig, ctx, heading in figures(page)
                  if not allowed_by(rel, ctx, heading)]
    assert not loose, ("timings outside a block written by its benchmark (benchmarks/doc_block.py), "
                       "or add them to ALLOWED with the reason:\n" + "\n".join(loose))


def test_allowed_entries_still_name_a_figure():
    found = {allowed_by(str(p.relative_to(ROOT)), ctx, heading) for p in pages() for _, ctx, heading in figures(p)}
    found.discard(None)
    assert found == set(ALLOWED), f"ALLOWED names figures the docs no longer show: {set(ALLOWED) - found}"


def test_every_block_names_its_command_machine_and_date():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for m in BLOCK.finditer(page.read_text(encoding="utf-8")):
            name, script, body = m.groups()
            assert (ROOT / script).is_file(), f"{page.name}: block {name} names {script}, which does not exist"
            assert "--write-" in (ROOT / script).read_text(encoding="utf-8"), f"{script} cannot write block {name}"
            if body.strip():
                assert re.search(r"\b20\d\d-\d\d-\d\d\b", body), f"{page.name}: block {name} has no date"
                assert f"python {script}" in body, f"{page.name}: block {name} does not show its command"


def test_the_pattern_catches_timings_and_leaves_other_numbers():
    caught = [m.group(0) for m in TIMING.finditer(
        "took 326 s; 1.4–1.5 ms per call; 3.3 M tokens per CPU-second; 0.62 M rows/s; ~2 min; 44.9 s")]
    assert caught == ["326 s", "1.4–1.5 ms", "3.3 M tokens per CPU-second", "0.62 M rows/s", "~2 min", "44.9 s"]
    assert not TIMING.search("24 steps, 2 ranks, 195 MiB, 68/68 values, step 12, 3 levels, TRL 1.16s-era")
