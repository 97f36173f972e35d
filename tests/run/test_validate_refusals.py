"""Every reading command refuses a run that ``grpolens validate`` rejects, with validate's message.

Each case is a corrupted copy of a small synthetic run (written by grpolens.synth, then recomputed
once so that derived outputs exist): the exact inputs of issue #17 §2 (duplicate rows, unsorted
rows, logp stored as string, pos as float64, samples without group_id, a completion that is not
UTF-8, a manifest pointing outside the run, a positive log-prob). For each one and each command:
exit code 2, the message ``grpolens validate`` prints for it, no traceback, and not one byte of the
run (derived outputs included) changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from grpolens.run import format as fmt
from grpolens.analysis.recompute import recompute
from grpolens.errors import RunFormatError
from grpolens.adapters.synth import synth_run
from grpolens.run.validate import ERROR, WARNING, check_before_reading, validate_run

TOK = "tokens/step=00000001/rank=00000.parquet"
SMP = "samples/step=00000001/rank=00000.parquet"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    run = synth_run(tmp_path_factory.mktemp("good") / "run", steps=3, ranks=1, groups=2, generations=3,
                    max_len=16, seed=1, texts=True)
    recompute(run)  # derived outputs and cache exist: a refusing command must leave them as they are
    return run


def _rewrite(path: Path, fn) -> None:
    pq.write_table(fn(pq.read_table(path)), path)


def _set(t: pa.Table, name: str, values) -> pa.Table:
    return t.set_column(t.schema.get_field_index(name), name, values)


def duplicate_rows(run):  # row 4 twice in a row: still sorted, one duplicate key
    _rewrite(run / TOK, lambda t: pa.concat_tables([t.slice(0, 5), t.slice(4, 1), t.slice(5)]))


def unsorted_rows(run):  # the first two rows swapped
    _rewrite(run / TOK, lambda t: pa.concat_tables([t.slice(1, 1), t.slice(0, 1), t.slice(2)]))


def logp_as_string(run):
    _rewrite(run / TOK, lambda t: _set(t, "logp", pc.cast(t["logp"], pa.string())))


def pos_as_float64(run):
    _rewrite(run / TOK, lambda t: _set(t, "pos", pc.cast(t["pos"], pa.float64())))


def samples_without_group_id(run):
    _rewrite(run / SMP, lambda t: t.drop(["group_id"]))


def positive_logp(run):  # logp = +3 on one token
    _rewrite(run / TOK, lambda t: _set(t, "logp", pa.array([3.0] + t["logp"].to_pylist()[1:], pa.float32())))


def _bad_utf8_completion(t: pa.Table) -> pa.Table:
    raw = [s.encode() for s in t["completion"].to_pylist()]
    raw[1] = b"ab\xff\xfecd"  # not UTF-8: what a foreign writer can store in a Parquet string column
    arr = pa.Array.from_buffers(pa.string(), len(raw), pa.array(raw, pa.binary()).buffers())
    return _set(t, "completion", arr)


def non_utf8_completion(run):
    _rewrite(run / SMP, _bad_utf8_completion)


def _manifest(run, **config):
    m = json.loads((run / fmt.MANIFEST_NAME).read_text())
    m["config"].update(config)
    (run / fmt.MANIFEST_NAME).write_text(json.dumps(m))


def vocab_file_outside(run):
    (run.parent / "secret.json").write_text(json.dumps({"1": "SECRET"}))
    _manifest(run, vocab_file="../secret.json")


def vocab_file_absolute(run):
    (run.parent / "secret.json").write_text(json.dumps({"1": "SECRET"}))
    _manifest(run, vocab_file=str(run.parent / "secret.json"))


def vocab_file_symlink_out(run):
    (run.parent / "secret.json").write_text(json.dumps({"1": "SECRET"}))
    os.symlink(run.parent / "secret.json", run / "grpolens" / "vocab.json")
    _manifest(run, vocab_file="grpolens/vocab.json")


CASES = {
    "duplicate_rows": (duplicate_rows, TOK, None, "1 duplicate (step, rank, micro_batch, sample_id, pos) keys"),
    "unsorted_rows": (unsorted_rows, TOK, None, "rows are not sorted by (micro_batch, sample_id, pos)"),
    "logp_as_string": (logp_as_string, TOK, "logp", "column has type string, expected float"),
    "pos_as_float64": (pos_as_float64, TOK, "pos", "column has type double, expected int32"),
    "samples_without_group_id": (samples_without_group_id, SMP, "group_id", "required column missing (expected int64)"),
    "positive_logp": (positive_logp, TOK, "logp", "1 positive log-probabilities (> 0.001)"),
    "non_utf8_completion": (non_utf8_completion, SMP, "completion", "1 value(s) are not valid UTF-8 (first at row 1)"),
    "vocab_file_outside": (vocab_file_outside, fmt.MANIFEST_NAME, None, "config.vocab_file = '../secret.json' points outside the run directory"),
    "vocab_file_absolute": (vocab_file_absolute, fmt.MANIFEST_NAME, None, "points outside the run directory"),
    "vocab_file_symlink_out": (vocab_file_symlink_out, fmt.MANIFEST_NAME, None, "resolves outside the run directory"),
}
#: Commands that never read a step's rows (the footers are all they need) refuse everything the
#: footers show; the rest also refuse what only the rows show (key order, text).
ROW_CASES = {"duplicate_rows", "unsorted_rows", "non_utf8_completion"}
COMMANDS = {
    "recompute": ["recompute", "{run}", "-q", "--full"],
    "tokens": ["tokens", "{run}", "--step", "1"],
    "completions": ["completions", "{run}", "--step", "1"],
    "sidecars": ["sidecars", "{run}"],
    "check": ["check", "{run}"],
    "sweep": ["sweep", "{run}", "--param", "rollout_is.upper=2,3", "--quiet"],
    "serve": ["serve", "{run}", "--port", "1"],  # refused before it binds anything
}
NOT_READING_TEXT = {"tokens", "sweep", "serve"}  # they never read the prompt or completion columns


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root.parent)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.parent.rglob("*")) if p.is_file() and not p.is_symlink()}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpolens.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "GRPOLENS_INVALID_UTF8": "refuse", "COLUMNS": "1000"}, timeout=300)


@pytest.fixture
def corrupted(good, tmp_path, request):
    name = request.param
    breakit, path, column, message = CASES[name]
    run = shutil.copytree(good, tmp_path / "work" / "run", symlinks=True)
    breakit(run)
    return name, run, path, column, message


@pytest.mark.parametrize("corrupted", sorted(CASES), indirect=True)
def test_validate_names_file_column_and_problem(corrupted):
    name, run, path, column, message = corrupted
    errors = validate_run(run).errors
    assert len(errors) == 1, errors
    assert (errors[0].path, errors[0].column) == (path, column)
    assert message in errors[0].message
    r = _cli("validate", str(run))
    assert r.returncode == 1 and message in r.stdout + r.stderr and "Traceback" not in r.stderr


def _in_process(args: list[str], capsys) -> tuple[int, str]:
    """The CLI's own entry point in this process (a subprocess per case costs seconds each)."""
    from grpolens.cli import main

    capsys.readouterr()
    try:
        main(args)
        rc = 0
    except SystemExit as e:
        rc = e.code or 0
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("corrupted", sorted(CASES), indirect=True)
def test_reading_commands_refuse_with_validates_message(corrupted, capsys, monkeypatch):
    name, run, path, column, message = corrupted
    monkeypatch.setenv("GRPOLENS_INVALID_UTF8", "refuse")
    monkeypatch.setenv("COLUMNS", "1000")
    (problem,) = validate_run(run).errors
    expected = str(RunFormatError(run / problem.path, problem.message, column=problem.column))
    before = _snapshot(run)
    for command, args in COMMANDS.items():
        if name in ROW_CASES and command == "serve":
            continue  # serve reads rows per page, not at start: test_serve_pages_refuse_rows
        if name == "non_utf8_completion" and command in NOT_READING_TEXT:
            continue  # never reads text
        rc, err = _in_process([a.format(run=run) for a in args], capsys)
        assert rc == 2, (command, rc, err[-2000:])
        assert "Traceback" not in err
        assert expected in " ".join(err.split()), (command, err)
        assert _snapshot(run) == before, f"{command}: a refused command changed the run or its outputs"


@pytest.mark.parametrize("corrupted", ["duplicate_rows", "unsorted_rows"], indirect=True)
def test_serve_pages_refuse_rows(corrupted):
    from grpolens.analysis.drilldown import load_step

    name, run, path, column, message = corrupted
    with pytest.raises(RunFormatError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_step(run, 1)


def test_footer_check_agrees_with_validate_on_every_footer_case(good, tmp_path):
    """check_before_reading gives validate's first error for each case the footers can show."""
    for name, (breakit, path, column, message) in CASES.items():
        if name in ROW_CASES:
            continue
        run = shutil.copytree(good, tmp_path / name / "run", symlinks=True)
        breakit(run)
        (problem,) = validate_run(run).errors
        with pytest.raises(RunFormatError) as e:
            check_before_reading(run)
        assert (e.value.message, e.value.column) == (problem.message, problem.column), name
        assert Path(e.value.path) == run / problem.path


def test_good_run_passes_the_footer_check(good):
    report = check_before_reading(good)
    assert report.ok and report.files == {"tokens": 3, "samples": 3}
    assert report.rows == validate_run(good).rows  # counted from the footers


def test_file_without_statistics_gets_the_row_checks(good, tmp_path):
    """A foreign writer may leave out statistics: the footer check then reads the rows."""
    run = shutil.copytree(good, tmp_path / "run", symlinks=True)
    t = pq.read_table(run / TOK)
    t = _set(t, "logp", pa.array([3.0] + t["logp"].to_pylist()[1:], pa.float32()))
    pq.write_table(t, run / TOK, write_statistics=False)
    with pytest.raises(RunFormatError, match="1 positive log-probabilities"):
        check_before_reading(run)



@pytest.mark.parametrize("null", [False, True], ids=["clean", "null"])
def test_statistics_without_a_null_count_get_the_row_checks(good, tmp_path, null):
    """Another writer may leave a minimum and a maximum but no null count (pyarrow writes both):
    the footers cannot vouch for the non-nullable columns then, so the rows are read. A clean file
    passes; a null is refused with validate's message."""
    from tests.parquet_footer import drop_statistics_field

    run = shutil.copytree(good, tmp_path / "run", symlinks=True)
    if null:
        _rewrite(run / TOK, lambda t: _first_row("advantage", None, t))
    drop_statistics_field(run / TOK, 3)  # parquet.thrift: Statistics.null_count
    md = pq.ParquetFile(run / TOK).metadata
    stats = [md.row_group(0).column(i).statistics for i in range(md.num_columns)]
    assert all(s.has_min_max and not s.has_null_count for s in stats)
    if not null:
        assert validate_run(run).ok and check_before_reading(run).ok
        return
    (problem,) = validate_run(run).errors
    assert (problem.path, problem.column, problem.message) == (TOK, "advantage", "1 null values in a non-nullable column")
    with pytest.raises(RunFormatError) as e:
        check_before_reading(run)
    assert (Path(e.value.path), e.value.column, e.value.message) == (run / TOK, "advantage", problem.message)


def test_parts_with_overlapping_micro_batch_ranges_are_read_exactly(good, tmp_path):
    """Ranges from statistics overlap (0..2 and 1..1) but the sets do not: no false alarm."""
    run = shutil.copytree(good, tmp_path / "run", symlinks=True)
    t = pq.read_table(run / TOK)
    mb = pa.array([0 if i % 2 else 2 for i in range(t.num_rows)], pa.int32())
    t = _set(t, "micro_batch", mb)
    t = t.sort_by([("micro_batch", "ascending"), ("sample_id", "ascending"), ("pos", "ascending")])
    (run / TOK).unlink()
    pq.write_table(t, run / TOK.replace(".parquet", "-0000.parquet"))
    one = t.slice(0, 1)
    pq.write_table(_set(one, "micro_batch", pa.array([1], pa.int32())), run / TOK.replace(".parquet", "-0001.parquet"))
    marker = run / "complete" / "step=00000001.rank=00000.json"  # the step's marker names its new parts
    m = json.loads(marker.read_text())
    m["files"] = sorted([f for f in m["files"] if f != TOK] + [TOK.replace(".parquet", f"-000{i}.parquet") for i in (0, 1)])
    marker.write_text(json.dumps(m))
    assert validate_run(run).ok
    assert check_before_reading(run).ok


def test_replace_option_reads_the_text_with_replacement_characters(good, tmp_path):
    run = shutil.copytree(good, tmp_path / "work" / "run", symlinks=True)
    non_utf8_completion(run)
    r = subprocess.run([sys.executable, "-m", "grpolens.cli", "--invalid-utf8", "replace", "completions", str(run),
                        "--step", "1"], capture_output=True, text=True, env={**os.environ, "COLUMNS": "250"})
    assert r.returncode == 0, r.stderr
    assert "ab\ufffd\ufffdcd" in r.stdout
    # under 'replace' the run is readable: validate reports the bytes as a warning, not an error
    report = subprocess.run([sys.executable, "-m", "grpolens.cli", "--invalid-utf8", "replace", "validate", str(run)],
                            capture_output=True, text=True, env={**os.environ, "COLUMNS": "1000"})
    assert report.returncode == 0 and "not valid UTF-8" in report.stdout + report.stderr
    bad = subprocess.run([sys.executable, "-m", "grpolens.cli", "--invalid-utf8", "ignore", "validate", str(run)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--invalid-utf8" in bad.stderr and "Traceback" not in bad.stderr


def test_tokenizer_outside_the_run_is_refused(good, tmp_path):
    run = shutil.copytree(good, tmp_path / "run", symlinks=True)
    _manifest(run, tokenizer="../elsewhere")
    (problem,) = validate_run(run).errors
    assert problem.path == fmt.MANIFEST_NAME and "config.tokenizer" in problem.message
    _manifest(run, tokenizer="Qwen/Qwen2-0.5B")  # a hub name is a name, not a file of the run
    assert validate_run(run).ok


def test_nonfinite_log_probs_stay_warnings(good, tmp_path):
    """+inf is a non-finite value (reported as such), not a count of positive log-probs."""
    run = shutil.copytree(good, tmp_path / "run", symlinks=True)
    _rewrite(run / TOK, lambda t: _set(t, "logp", pa.array([float("inf")] + t["logp"].to_pylist()[1:], pa.float32())))
    report = validate_run(run)
    assert report.ok and [p.column for p in report.problems if p.severity == WARNING] == ["logp"]
    assert check_before_reading(run).ok


def test_tolerance_is_a_strict_bound(good, tmp_path):
    """The largest float32 not above the tolerance passes; the next float32 is an error."""
    import numpy as np

    from grpolens.run.validate import POSITIVE_LOGP_TOLERANCE as tol

    at = np.float32(tol)
    at = at if at <= tol else np.nextafter(at, np.float32(0))
    above = np.nextafter(at, np.float32(1))
    for value, ok in ((at, True), (above, False)):
        run = shutil.copytree(good, tmp_path / f"run{ok}", symlinks=True)
        _rewrite(run / TOK, lambda t: _set(t, "logp", pa.array([float(value)] + t["logp"].to_pylist()[1:], pa.float32())))
        assert validate_run(run).ok is ok, value
        if ok:
            assert check_before_reading(run).ok
        else:
            with pytest.raises(RunFormatError, match="1 positive log-probabilities"):
                check_before_reading(run)


def _first_row(name: str, value, table: pa.Table) -> pa.Table:
    """``table`` with row 0 of column ``name`` set to ``value`` (None: a null)."""
    field = table.schema.field(name)
    values = [value] + table[name].to_pylist()[1:]
    return table.set_column(table.schema.get_field_index(name), pa.field(name, field.type, nullable=True),
                            pa.array(values, field.type))


FOOTER_ROW_GROUP_CASES = {  # a problem in row 0 only, with the message validate gives for it
    "null_in_tokens": (TOK, "advantage", None, "1 null values in a non-nullable column"),
    "null_in_samples": (SMP, "truncated", None, "1 null values in a non-nullable column"),
    "negative_pos": (TOK, "pos", -1, "negative values (must be >= 0)"),
    "positive_old_logp": (TOK, "old_logp", 0.5, "1 positive log-probabilities (> 0.001)"),
    # below the path's step (the minimum differs), above its rank (the maximum differs)
    "step_below_path": (TOK, "step", 0, "1 rows hold step=0 (or another value) but the path says step=1"),
    "rank_above_path": (SMP, "rank", 1, "1 rows hold rank=1 (or another value) but the path says rank=0"),
}


@pytest.mark.parametrize("case", sorted(FOOTER_ROW_GROUP_CASES))
def test_footer_check_reads_the_statistics_of_every_row_group(good, tmp_path, case):
    """The problem lies in a one-row row group after an empty one, and the last row group is clean:
    the footer check still refuses the run, with validate's message, as it refuses a one-group file."""
    rel, column, value, message = FOOTER_ROW_GROUP_CASES[case]
    run = shutil.copytree(good, tmp_path / "run", symlinks=True)
    t = _first_row(column, value, pq.read_table(run / rel))
    with pq.ParquetWriter(run / rel, t.schema) as w:  # row groups of 0, 1 and the other rows
        for piece in (t.slice(0, 0), t.slice(0, 1), t.slice(1)):
            w.write_table(piece)
    assert [pq.ParquetFile(run / rel).metadata.row_group(g).num_rows for g in range(3)] == [0, 1, t.num_rows - 1]
    (problem,) = validate_run(run).errors
    assert (problem.path, problem.column) == (rel, column) and problem.message.startswith(message)
    with pytest.raises(RunFormatError) as e:
        check_before_reading(run)
    assert (Path(e.value.path), e.value.column, e.value.message) == (run / rel, column, problem.message)


def test_the_footer_check_reads_rows_only_where_the_statistics_are_suspicious(good, tmp_path, monkeypatch):
    """The footer check costs the footers: a file is read only when its statistics show a
    problem (then validate's row checks give the message). Nulls where the format allows them, an
    all-null column, a mistyped column (its type error comes from the schema): no row read."""
    from grpolens.run import validate

    read = []
    for name in ("check_token_rows", "check_sample_rows"):
        def spy(self, rel, *args, _orig=getattr(validate._Validator, name)):
            read.append(rel)
            return _orig(self, rel, *args)
        monkeypatch.setattr(validate._Validator, name, spy)
    run = shutil.copytree(good, tmp_path / "run", symlinks=True)
    assert check_before_reading(run).ok and read == []
    _rewrite(run / TOK, lambda t: _set(_first_row("old_logp", None, t), "ref_logp",
                                       pa.array([None] * t.num_rows, pa.float32())))
    t = pq.read_table(run / SMP)
    with pq.ParquetWriter(run / SMP, t.schema) as w:  # an empty row group first: no statistics to read
        for piece in (t.slice(0, 0), t):
            w.write_table(piece)
    assert pq.ParquetFile(run / SMP).metadata.row_group(0).num_rows == 0
    assert check_before_reading(run).ok and read == []
    for table, column, to in ((TOK, "pos", pa.float64()), (TOK, "micro_batch", pa.int64()),
                              (SMP, "rank", pa.int64()), (TOK, "step", pa.int32())):
        broken = shutil.copytree(good, tmp_path / f"{column}-{to}" / "run", symlinks=True)
        _rewrite(broken / table, lambda t: _set(t, column, pc.cast(t[column], to)))
        (problem,) = validate_run(broken).errors  # only the type; the footer check agrees
        read.clear()  # validate reads every file
        with pytest.raises(RunFormatError) as e:
            check_before_reading(broken)
        assert (e.value.column, e.value.message) == (column, problem.message) and read == [], column
    _rewrite(run / SMP, lambda t: _first_row("truncated", None, t))
    _rewrite(run / TOK, lambda t: _set(t, "logp", pa.array([3.0] + t["logp"].to_pylist()[1:], pa.float32())))
    with pytest.raises(RunFormatError):
        check_before_reading(run)
    assert sorted(read) == [SMP, TOK]


def test_a_part_file_without_rows_passes_both_checks(good, tmp_path):
    """A part with no rows (a loss call the writer opened and closed empty) has statistics
    without a minimum or maximum: nothing to check, and no micro_batch range."""
    run = shutil.copytree(good, tmp_path / "run", symlinks=True)
    empty = TOK.replace(".parquet", "-0001.parquet")
    pq.write_table(pq.read_table(run / TOK).slice(0, 0), run / empty)
    marker = run / fmt.marker_relpath(1, 0)
    m = json.loads(marker.read_text())
    m["files"] = sorted([*m["files"], empty])
    marker.write_text(json.dumps(m))
    assert validate_run(run).problems == []
    assert check_before_reading(run).ok


def test_parts_with_interleaved_micro_batch_ranges_are_read_exactly(good, tmp_path):
    """Parts holding micro-batches {0, 2} and {1, 3}: the ranges 0..2 and 1..3 overlap, the sets
    do not, so no loss call is split."""
    run = shutil.copytree(good, tmp_path / "run", symlinks=True)
    t = pq.read_table(run / TOK)
    ids = t["sample_id"].to_numpy()
    later = (ids != ids[0]).astype("int32")  # the first completion's rows, then the others
    (run / TOK).unlink()
    parts = [TOK.replace(".parquet", f"-000{i}.parquet") for i in (0, 1)]
    for i, part in enumerate(parts):  # the same rows in both parts, in other loss calls
        pq.write_table(_set(t, "micro_batch", pa.array(2 * later + i, pa.int32())), run / part)
    marker = run / fmt.marker_relpath(1, 0)
    m = json.loads(marker.read_text())
    m["files"] = sorted([f for f in m["files"] if f != TOK] + parts)
    marker.write_text(json.dumps(m))
    assert validate_run(run).problems == []
    assert check_before_reading(run).ok
