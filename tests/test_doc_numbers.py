"""Numbers and claims in the docs that are not timings are checked against the code that makes them.

(Timings are written by the benchmark scripts, which print the command beside each figure.)
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRL_TINY = ROOT / "sample_runs" / "trl-tiny"
PAGES_QUOTING_PARITY = [ROOT / "README.md", ROOT / "docs" / "integrations" / "trl.md"]


def test_parity_count_of_the_bundled_run_is_the_one_the_docs_quote(tmp_path):
    run = tmp_path / "trl-tiny"
    copy_sample_run("trl-tiny", run)
    r = subprocess.run([sys.executable, "-m", "grpolens.cli", "parity", str(run)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    measured = re.findall(r"(\d+/\d+) logged values reproduced", r.stdout + r.stderr)
    assert measured, r.stdout
    for page in PAGES_QUOTING_PARITY:
        quoted = set(re.findall(r"(\d+/\d+) logged values reproduced", page.read_text(encoding="utf-8")))
        assert quoted == {measured[-1]}, f"{page.relative_to(ROOT)} quotes {sorted(quoted)}; parity says {measured[-1]}"


def test_tests_the_docs_call_slow_are_marked_slow():
    claims = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = re.sub(r"\s+", " ", page.read_text(encoding="utf-8"))
        for path in re.findall(r"`(tests/[\w/]+\.py)`\s*\(marked `slow`\)", text):
            claims.append((page.relative_to(ROOT), path))
    wrong = [f"{page}: {path}" for page, path in claims
             if "mark.slow" not in (ROOT / path).read_text(encoding="utf-8")]
    assert not wrong, f"the docs call these tests slow, but they are not marked slow: {wrong}"


def test_step_count_of_the_bundled_run_is_the_one_the_docs_quote():
    steps = len(list((TRL_TINY / "tokens").glob("step=*")))
    quoted = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = re.sub(r"\s+", " ", page.read_text(encoding="utf-8"))
        # "sample_runs/trl-tiny (real TRL training, 24 steps", "... bundled run (24 steps recorded ..."
        for m in re.finditer(r"trl-tiny[^.;]{0,80}?\b(\d+) steps (?:of real TRL|recorded)|trl-tiny`? \(real TRL "
                             r"training, (\d+) steps|bundled run \((\d+) steps recorded", text):
            quoted.append((page.relative_to(ROOT), int(next(g for g in m.groups() if g))))
    assert len(quoted) >= 3, quoted  # README, check.md and the TRL page say it
    assert all(n == steps for _, n in quoted), f"sample_runs/trl-tiny has {steps} steps; the docs say {quoted}"


# ---------------------------------------------------------------------------------------------------
# Ratios and counts in prose.
#
# A ratio ("7.5×", "0.86×", "3 %", "3 times"), a count ("283 of 327", "401 quantiles", "16 earlier
# steps"), a size ("2 KB", "50 M rows") or a value given to four significant digits or more (a
# measurement: "2.30922e-4") in README.md or docs/ outside a block a script writes is either
# checked by a test against the code (CHECKED names the test) or listed in ALLOWED_NUMBERS with the
# reason it needs no check.
# Formulas ("10 × early", spaced), code spans and code blocks are not prose; generated pages are
# generated. A new page under docs/ is scanned without being named here.

from tests.test_doc_timings import BLOCK, CODE, GENERATED_PAGES, pages, sections  # noqa: E402
from tests.sample_runs import copy_sample_run

INLINE_CODE = re.compile(r"`[^`]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
COUNTED = (r"values|trainers|metrics|keys|profiles|tests|rules|pages|configurations|packages|quantiles|bins|files|mutants|"
           r"families|modes|columns|checks|survivors|equivalents|logs|steps|tokens|completions|shards|commands|"
           r"options|examples|snippets|links|points|characters|requests|visitors|ranks|processes")
NUMBER_WORDS = r"[Tt]wo|[Tt]hree|[Ff]our|[Ff]ive|[Ss]ix|[Ss]even|[Ee]ight|[Nn]ine|[Tt]en|[Ee]leven|[Tt]welve"
WORD_VALUES = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve".split())}
RATIO_OR_COUNT = re.compile(
    r"(?<![\w.\-/])~?\d[\d,.]*(?:e-?\d+)?(?:×|x\b|\s?%|\s+times\b)"            # 7.5×, 2.5x, 3 %, 3 times
    r"|(?<![\w.\-/])\d[\d,]*\s+of\s+\d[\d,]*"                                # 283 of 327
    r"|(?:(?<![\w.\-/=])\d[\d,]*|\b(?:" + NUMBER_WORDS + r"))(?:\s+[\w'-]+){0,2}?\s+(?:" + COUNTED + r")\b"
    # ... 401 quantiles, 16 earlier steps, four log-prob columns
    r"|(?<![\w.\-])~?\d[\d,.]*\s?(?:k|M|G)?\s?(?:B|bytes|KiB|MiB|GiB|kB|KB|MB|GB)\b"  # sizes: 2 KB, 195 MiB (not UTF-8 bytes)
    r"|(?<![\w.])\d[\d,.]*\s?(?:M|k) (?:token rows|rows|tokens)\b"                 # 50 M rows
    r"|(?<![\w.\-])\d*\.0*[1-9]\d{3,}(?:e[-+]?\d+)?(?![\w.])")                       # measured: 2.30922e-4

_STEPS = "tests/test_doc_numbers.py::test_step_count_of_the_bundled_run_is_the_one_the_docs_quote"
_LOGS = "tests/test_doc_numbers.py::test_logs_of_the_bundled_run_are_the_ones_the_docs_quote"
_CLIPS = "tests/test_doc_numbers.py::test_clip_fractions_of_the_bundled_run_are_the_ones_the_docs_quote"
_SYNTH = "tests/test_doc_numbers.py::test_synth_page_quotes_the_generators_fractions"
_RULES = "tests/test_doc_lists.py::test_builtin_check_rules_are_in_the_table"
#: (page, text around the number) -> the test that checks it against the code or the repository
CHECKED = {
    ("README.md", "bundled run (24 steps recorded"): _STEPS,
    ("docs/check.md", "(real TRL training, 24 steps"): _STEPS,
    ("docs/integrations/trl.md", "such a run (24 steps of real TRL"): _STEPS,
    ("docs/integrations/trl.md", "(3 logs: steps 10 and 20"): _LOGS,
    ("docs/check.md", "first 20 % of steps"): _RULES,
    ("docs/check.md", "10× leaves room"): _RULES,
    ("docs/check.md", "2 of any 4 consecutive steps"): _RULES,
    ("docs/check.md", "keep their floor of 5 points"): _RULES,
    ("docs/check.md", "2 of some 4 consecutive steps"): _RULES,
    ("docs/check.md", "clips 50 of its 330 tokens"): _CLIPS,
    # the reference test writes the count it measured into the failure message; the key is the text
    # before it, so that a new count does not make this entry stale
    ("docs/profiles.md", "with the reason (verl 0.9.1, "): "tests/reference/test_verl_reference.py::test_docs_quote_the_count",
    ("docs/profiles.md", "298 of 298 over 18"): "tests/reference/test_twinkle_reference.py::test_docs_quote_the_count",
    ("docs/profiles.md", "ms-swift 4.6.0, "): "tests/reference/test_swift_reference.py::test_docs_quote_the_count",
    ("docs/integrations/swift.md", "ms-swift 4.6.0 via SwiftCapture, "):
        "tests/reference/test_swift_reference.py::test_capture_docs_quote_the_count",
    ("docs/synth.md", "(about 5 %)"): _SYNTH,
    ("docs/distributed.md", "an idle poll is 3 LIST requests"):
        "tests/distributed/test_s3_commands.py::test_serve_watch_picks_up_a_new_step_in_the_bucket",
    ("docs/synth.md", "about 3 % of tokens"): _SYNTH,
    ("docs/synth.md", "About 4 % of tokens"): _SYNTH,
}

#: (page, a heading or the text around the number) -> why it needs no check
ALLOWED_NUMBERS = {
    ("docs/check.md", "moved ~3× since sampling (k3 > 1)"):
        "arithmetic on the rule's threshold in the same row (k3 > 1 means a probability ratio beyond e^1.15)",
    ("docs/check.md", "differ ~1e4× between engine and trainer"):
        "the meaning of a veto (its bound), explaining the rule in the same row",
    ("docs/check.md", "misses a drift of 8–10 %"): "arithmetic on the bundled run's clip fractions quoted before it",
    ("docs/distributed.md", "Ray 2.5x turns token authentication"): "a Ray release series, not a ratio",
    ("docs/distributed.md", "one LIST request per 1,000 shards"):
        "S3's page size (a listing returns at most 1,000 keys); the listing block measures it",
    ("docs/distributed.md", "S3 returns at most 1,000 keys"):
        "S3's page size (a listing returns at most 1,000 keys); the listing block measures it",
    ("docs/distributed.md", "(one more per 1,000 keys)"):
        "S3's page size (a listing returns at most 1,000 keys); the listing block measures it",
    ("docs/distributed.md", "(one LIST per 1,000 keys)"):
        "S3's page size (a listing returns at most 1,000 keys); the layers' block measures it",
    ("docs/hook.md", "one micro-batch is never in two files"): "not a count: one micro-batch never spans files",
    ("docs/integrations/trl.md", "two processes"):
        "a configuration of the tests (`torchrun --nproc_per_node 2`, trl_tiny's `ddp` cases), named where it is used",
    ("docs/integrations/trl.md", "(one generation batch spans two optimizer steps)"):
        "what `steps_per_generation=2`, named beside it, means",
    ("docs/profiles.md", "Two verl values need what its driver computes"): "the two values are named in the same sentence",
    ("docs/rollout-is.md", "the three conventions trainers use"): "the table that follows lists the three, one row each",
    ("docs/run-format.md", "Two optional config keys only change"): "the two keys are named in the same sentence",
    ("docs/export.md", "and 253 MB of site-packages"):
        "what pip installed for the trackers, beside the `/usr/bin/time -v pip install` command that shows it",
    ("docs/export.md", "(about 55 packages here)"):
        "what pip installed for the trackers, beside the `/usr/bin/time -v pip install` command that shows it",
    ("docs/synth.md", "(time constant 300 steps)"): "a parameter of the generator (grpolens/adapters/synth.py), described",
    ("docs/synth.md", "≈1 % of each loss call's tokens"): "a parameter of the `nan@S` pathology (grpolens/adapters/synth.py), described",
    ("docs/synth.md", "(70 % of groups all right"):
        "a parameter of the `advantage-collapse@S` pathology (grpolens/adapters/synth.py), described",
    ("docs/synth.md", "completions 1.5× longer at S"): "a parameter of the `length-growth@S` pathology (grpolens/adapters/synth.py), described",
    ("docs/synth.md", "then 5 % more per step"): "a parameter of the `length-growth@S` pathology (grpolens/adapters/synth.py), described",
    ("docs/synth.md", "shrink to 30 % of their length"):
        "a parameter of the `reward-hacking@S` pathology (grpolens/adapters/synth.py), described",
    ("docs/synth.md", "judged right 70 % of the time"):
        "a parameter of the `reward-hacking@S` pathology (grpolens/adapters/synth.py), described",
    ("docs/mutation-testing.md", "### Seventh run, 2026-11-25 (small hours): the functions changed since the sixth, and its eleven open ones"):
        "mutmut's results, dated, with the commands that reproduce them; a run takes days, so no test re-runs it",
    ("docs/mutation-testing.md", "### Sixth run, 2026-11-24 (late night): the functions changed since, the modules the fifth run did not reach"):
        "mutmut's results, dated, with the commands that reproduce them; a run takes days, so no test re-runs it",
    ("docs/mutation-testing.md", "### Fifth run, 2026-11-24 (night): the fourth run's open ones, the Ray engine, the modules not reached"):
        "mutmut's results, dated, with the commands that reproduce them; a run takes days, so no test re-runs it",
    ("docs/mutation-testing.md", "### Fourth run, 2026-11-24 (evening): the fast pass repaired, the modules not run before, the open ones"):
        "mutmut's results, dated, with the commands that reproduce them; a run takes days, so no test re-runs it",
    ("docs/mutation-testing.md", "### Third run, 2026-11-24 (afternoon): the open mutants, and modules the second run had not reached"):
        "mutmut's results, dated, with the commands that reproduce them; a run takes days, so no test re-runs it",
    ("docs/mutation-testing.md", "### Second run, 2026-11-24: every module of the scope"):
        "mutmut's results, dated, with the configuration that reproduces them; a run takes days, so no test re-runs it",
    ("docs/mutation-testing.md", "### First run, 2026-11-23 and 2026-11-24: clip.py, kl.py and parts of the others"):
        "mutmut's results, dated, with the command that reproduces them; a run takes hours, so no test re-runs it",
    ("docs/mutation-testing.md", "[mutmut] (3.x)"): "a release series, not a ratio",
    ("docs/mutation-testing.md", "32, 33, 64, 128 and 256 masked tokens"):
        "the inputs of tests/metrics/test_boundaries.py that this sentence describes, not a result",
    ("docs/mutation-testing.md", "a module of 250 mutants"): "a planning example (a module's size), not a result",
    ("README.md", "many small steps of ~130 K tokens"):
        "the shapes of the benchmark's input runs (benchmarks/bench_recompute.py makes them), not a result",
    ("docs/serve.md", "some 2,500 hostile requests"):
        "the rough size of a test's workload, to plan a run of the suite, not a result",
    ("docs/serve.md", "held by its top 0.1 %, 1 % and 10 % of tokens"):
        "the shares explain reports (its keys top_0.1%_tokens, top_1%_tokens, top_10%_tokens), named, not measured",
    ("docs/architecture.md", "runs the plan in six steps"):
        "the six are the sentence's own semicolon-separated clauses, each naming its module",
    ("docs/architecture.md", "Rollout importance sampling is two mirrored packages"):
        "the two packages are linked in the same sentence",
}

#: (page, the doc's phrase with the number as its group, the code's value): prose quoting a constant,
#: checked by test_constants_the_docs_quote_are_the_codes (phrases hold no code span: the scan
#: replaces those)
DOC_CONSTANTS = [
    ("docs/distributed.md", r"at least (\d+) steps and \d+ MiB of shards per worker",
     lambda: __import__("grpolens.analysis.step_workers", fromlist=["x"]).MIN_STEPS_PER_WORKER),
    ("docs/distributed.md", r"at least \d+ steps and (\d+) MiB of shards per worker",
     lambda: __import__("grpolens.analysis.step_workers", fromlist=["x"]).MIN_BYTES_PER_WORKER / 2**20),
    ("docs/distributed.md", r"at most (\d+) queued per worker",
     lambda: __import__("grpolens.analysis.step_workers", fromlist=["x"]).IN_FLIGHT),
    ("docs/distributed.md", r"default the CPU count, at most (\d+)\)",
     lambda: __import__("grpolens.analysis.step_workers", fromlist=["x"]).MAX_DEFAULT_WORKERS),
    ("docs/distributed.md", r"one per group of at most (\d+) shards",
     lambda: __import__("grpolens.metrics.engine_ray", fromlist=["x"]).SHARDS_PER_TASK),
    ("docs/distributed.md", r"retried by Ray, up to (\d+) times",
     lambda: __import__("grpolens.metrics.engine_ray", fromlist=["x"]).MAX_RETRIES),
    ("docs/distributed.md", r"At most (\d+) × \(cluster CPUs\) tasks are in flight",
     lambda: __import__("grpolens.metrics.engine_ray", fromlist=["x"]).TASKS_PER_CPU),
    ("docs/distributed.md", r"holds the pieces of up to (\d+) × CPUs tasks in flight",
     lambda: __import__("grpolens.metrics.engine_ray", fromlist=["x"]).TASKS_PER_CPU),
    ("docs/distributed.md", r"alpha = ([\d.]+) %", lambda: 100 * _histogram().DEFAULT_ALPHA),
    ("docs/distributed.md", r"A histogram has ([\d,]+) bins", lambda: _histogram().LogBins().size),
    ("docs/distributed.md", r"at ([\d,]+) quantiles each", lambda: int(re.search(
        r"np\.linspace\(0, 1, (\d+)\)", (ROOT / "tests/metrics/test_histogram.py").read_text()).group(1))),
    ("docs/rollout-is.md", r"within ([\d.]+) % of the exact lower median", lambda: 100 * _histogram().DEFAULT_ALPHA),
    ("docs/rollout-is.md", r"≥ (\d+) % of tokens lie on its side",
     lambda: 100 * __import__("grpolens.metrics.rollout_is", fromlist=["x"]).OFFSET_MIN_AGREEMENT),
    ("docs/serve.md", r"padded by (\d+)%", lambda: 100 * __import__("grpolens.serve.figures", fromlist=["x"]).ROBUST_PAD),
    ("docs/serve.md", r"at most (\d+) evenly spaced steps", lambda: __import__("inspect").signature(
        __import__("grpolens.serve.data.mismatch", fromlist=["x"]).is_heatmap).parameters["max_steps"].default),
    ("docs/serve.md", r"curves of more than (\d+) points",
     lambda: __import__("grpolens.serve.figures", fromlist=["x"]).GL_THRESHOLD),
    ("docs/serve.md", r"downsamples them to ([\d,]+) points",
     lambda: __import__("grpolens.serve.data.curves", fromlist=["x"]).CURVE_POINTS),
    ("docs/serve.md", r"free text is cut to (\d+) characters",
     lambda: __import__("grpolens.serve.urlstate", fromlist=["x"]).MAX_TEXT),
    ("docs/serve.md", r"completion text first \(cut to (\d+) characters\)",
     lambda: __import__("grpolens.serve.data.completions", fromlist=["x"]).PREVIEW_CHARS),
    ("docs/run-format.md", r"\(in any of the (\w+) log-prob columns\)",
     lambda: sum(c.name.endswith("logp") for c in __import__("grpolens.run.format", fromlist=["x"]).TOKEN_COLUMNS)),
    ("docs/hook.md", r"\(default (\d+) MiB\); a call that would exceed it", lambda: _writer_default("max_queue_bytes") / 2**20),
    ("docs/hook.md", r"\(default (\d+) M rows\) is split into", lambda: _writer_default("max_part_rows") / 1e6),
    ("docs/sidecars.md", r"at most (\d+) earlier steps",
     lambda: __import__("grpolens.analysis.sidecars", fromlist=["x"]).REUSE_LOOKBACK),
    ("docs/export.md", r"cut to its first (\d+) steps", lambda: int(re.search(
        r"^CUT = (\d+)$", (ROOT / "tests/export/test_export.py").read_text(), re.M).group(1))),
    ("docs/serve.md", r"a table's filter row \| at most (\d+) characters", lambda: _serve("urlstate").MAX_TEXT),
    ("docs/serve.md", r"at most (\d+) columns, each a column name", lambda: _serve("inputs").MAX_SORT),
    ("docs/serve.md", r"a page path of at most (\d+) characters", lambda: _serve("inputs").MAX_SHORT),
    ("docs/serve.md", r"a query string of at most (\d+) kB", lambda: _serve("urlstate").MAX_QUERY / 1024),
    ("docs/serve.md", r"the request body \| (\d+) MiB", lambda: _serve("app").MAX_REQUEST_BYTES / 2**20),
    ("docs/serve.md", r"each downsampled to ([\d,]+) points per run", lambda: _serve("data.curves").CURVE_POINTS),
    ("docs/serve.md", r"a page of at most (\d+) completions", lambda: _serve("inputs").BOUNDS["page size"][1]),
    ("docs/integrations/trl.md", r"completions of ≤ (\d+) tokens to stay fast",
     lambda: _trl_tiny().SIZES["max_completion_length"]),
    ("docs/integrations/trl.md", r"over (\d+) steps\), also under",
     lambda: int(_trl_tiny().WINDOW[_trl_tiny().WINDOW.index("--max-steps") + 1])),
]


def _serve(module: str):
    import importlib

    return importlib.import_module(f"grpolens.serve.{module}")


def _histogram():
    from grpolens.functional import histogram

    return histogram


def _writer_default(option: str):
    import inspect

    from grpolens.capture.writer import ShardWriter

    return inspect.signature(ShardWriter).parameters[option].default


def _trl_tiny():
    from tests.integration import trl_tiny

    return trl_tiny


def prose_numbers(page: Path) -> list[tuple[str, str, str]]:
    """(number, its context, its section heading) of every ratio or count in PAGE's prose."""
    out = []
    for heading, body in sections(page.read_text(encoding="utf-8")):
        flat = re.sub(r"\s+", " ", LINK_TARGET.sub("]", CODE.sub("", BLOCK.sub("", body))))
        flat = INLINE_CODE.sub("`…`", flat)
        out += [(m.group(0), flat[max(0, m.start() - 60): m.end() + 40], heading.strip())
                for m in RATIO_OR_COUNT.finditer(flat)]
    return out


def _covered(page: str, context: str, heading: str, table: dict) -> tuple[str, str] | None:
    for p, around in table:
        if p == page and (around == heading if around.startswith("#") else around in context):
            return p, around
    return None


def test_no_ratio_or_count_in_prose_that_nothing_checks():
    loose = []
    for page in pages():
        rel = str(page.relative_to(ROOT))
        constants = [phrase for p, phrase, _ in DOC_CONSTANTS if p == rel]
        loose += [f"{rel}: {num!r} in …{ctx}…" for num, ctx, heading in prose_numbers(page)
                  if not _covered(rel, ctx, heading, CHECKED) and not _covered(rel, ctx, heading, ALLOWED_NUMBERS)
                  and not any(re.search(phrase, ctx) for phrase in constants)]
    assert not loose, ("ratios or counts in prose that no test checks: move them into a block the measuring "
                       "script writes, check them in a test (CHECKED), or say in ALLOWED_NUMBERS why not:\n"
                       + "\n".join(loose))


def test_checked_and_allowed_entries_still_name_a_number_and_a_test():
    entries = set(CHECKED) | set(ALLOWED_NUMBERS)
    found = {entry for p in pages() for _, ctx, h in prose_numbers(p) for entry in entries
             if _covered(str(p.relative_to(ROOT)), ctx, h, {entry: None})}
    stale = entries - found
    assert not stale, f"CHECKED / ALLOWED_NUMBERS name numbers the docs no longer show: {sorted(stale)}"
    for test in set(CHECKED.values()):
        path, name = test.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(encoding="utf-8"), f"{test} does not exist"


def test_the_pattern_catches_ratios_and_counts_and_leaves_formulas():
    text = ("costs ~7.5× the CPU, 0.86× its CPU, 9× less; about 3 % of tokens; retried up to 3 times; "
            "283 of 327 values; at 401 quantiles; over at most 16 earlier steps; about 2 KB; at 50 M rows; "
            "the four log-prob columns; TRL logged 2.30922e-4 and 0.151515")
    assert [m.group(0) for m in RATIO_OR_COUNT.finditer(text)] == [
        "~7.5×", "0.86×", "9×", "3 %", "3 times", "283 of 327", "401 quantiles", "16 earlier steps", "2 KB", "50 M rows",
        "four log-prob columns", "2.30922e-4", "0.151515"]
    assert not RATIO_OR_COUNT.search("≤ 10 × early + 0.05; step 12; TRL 1.16; lr 1e-6; k3 > 1; rank 0 writes; "
                                     "≤ 2 b + 0.0005; TRL 0.29.0 and 1.16.0; at most 255 UTF-8 bytes")


def test_generated_pages_are_left_to_their_generators():
    assert {"docs/cli.md", "docs/metrics.md"} <= GENERATED_PAGES
    assert not {str(p.relative_to(ROOT)) for p in pages()} & GENERATED_PAGES


@pytest.mark.parametrize("page,phrase,value", DOC_CONSTANTS, ids=[f"{p}:{ph[:30]}" for p, ph, _ in DOC_CONSTANTS])
def test_constants_the_docs_quote_are_the_codes(page, phrase, value):
    text = re.sub(r"\s+", " ", (ROOT / page).read_text(encoding="utf-8"))
    m = re.search(phrase, text)
    assert m, f"{page} no longer says {phrase!r}: update DOC_CONSTANTS with the page"
    quoted = WORD_VALUES.get(m.group(1).lower()) or float(m.group(1).replace(",", ""))
    assert quoted == pytest.approx(value()), \
        f"{page} says {m.group(0)!r}; the code's value is {value()}"


def test_logs_of_the_bundled_run_are_the_ones_the_docs_quote():
    import json

    steps = [json.loads(line)["step"] for line in (TRL_TINY / "grpolens" / "trl_log.jsonl").read_text().splitlines()]
    text = re.sub(r"\s+", " ", (ROOT / "docs" / "integrations" / "trl.md").read_text(encoding="utf-8"))
    m = re.search(r"\((\d+) logs: steps (\d+) and (\d+), and the summary at (\d+)\)", text)
    assert m, "docs/integrations/trl.md no longer says which logs the bundled run has"
    assert [int(g) for g in m.groups()] == [len(steps), *steps], f"trl_log.jsonl logs steps {steps}"


def test_clip_fractions_of_the_bundled_run_are_the_ones_the_docs_quote(tmp_path):
    """check.md: odd steps clip nothing (on-policy after each generation), step 2 clips N of its M
    loss tokens low, step 4 a smaller fraction."""
    import grpolens

    run = tmp_path / "trl-tiny"
    copy_sample_run("trl-tiny", run)
    rows = {r["step"]: r for r in grpolens.recompute(run, write=False).to_dicts()}
    text = re.sub(r"\s+", " ", (ROOT / "docs" / "check.md").read_text(encoding="utf-8"))
    m = re.search(r"the clip fractions are 0 on every odd step.*? step (\d+) clips (\d+) of its (\d+) tokens low "
                  r"\(([\d.]+)\) and step (\d+) only ([\d.]+)", text)
    assert m, "docs/check.md no longer quotes the bundled run's clip fractions"
    step_a, clipped, tokens, frac_a, step_b, frac_b = m.groups()
    assert all(rows[s]["clip/low"] == 0.0 for s in rows if s % 2), "an odd step clips"
    assert rows[int(step_a)]["health/masked_tokens"] == int(tokens)
    assert rows[int(step_a)]["clip/low"] * int(tokens) == pytest.approx(int(clipped))
    assert round(rows[int(step_a)]["clip/low"], 2) == float(frac_a)
    assert round(rows[int(step_b)]["clip/low"], 2) == float(frac_b)


def test_synth_page_quotes_the_generators_fractions():
    """synth.md's "about N %" are the generator's rates: measured here on many draws, rounded."""
    import numpy as np

    from grpolens.adapters.synth import SynthSpec, generate_samples, generate_tokens

    spec = SynthSpec(steps=4, groups=32, generations=8, max_len=256, micro_batches=1, seed=5)
    truncated, outside, masked = [], [], []
    for step in range(4):
        s = generate_samples(spec, step, 0)
        t = generate_tokens(spec, step, 0, 0, s)
        truncated.append(np.asarray(s["truncated"], dtype=float))
        ratio = np.exp(t["logp"].astype(np.float64) - t["old_logp"])
        outside.append(((ratio < 0.8) | (ratio > 1.28)).astype(float))
        masked.append(~np.asarray(t["mask"], dtype=bool))
    text = re.sub(r"\s+", " ", (ROOT / "docs" / "synth.md").read_text(encoding="utf-8"))
    quoted = {
        "truncated": (r"are cut at L with `truncated = true` \(about (\d+) %\)", truncated),
        "outside the ratio band": (r"about (\d+) % of tokens fall outside the `\[0\.8, 1\.28\]` ratio band", outside),
        "masked": (r"About (\d+) % of tokens have `mask = false`", masked),
    }
    for what, (phrase, draws) in quoted.items():
        m = re.search(phrase, text)
        assert m, f"docs/synth.md no longer quotes the {what} fraction"
        rate = 100 * float(np.mean(np.concatenate(draws)))
        assert abs(rate - int(m.group(1))) <= 1.0, f"docs/synth.md says about {m.group(1)} % {what}; measured {rate:.1f} %"
