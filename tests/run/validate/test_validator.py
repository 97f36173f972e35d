"""``grpolens validate`` (``grpolens.run.validate``): a good run is clean, the manifest and the
columns, every problem reported at once, how a problem reads, and the command's exit codes. Keys,
joins, files and samples rows are in the modules beside this one."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from grpolens.run import format as fmt
from grpolens.run.validate import ERROR, WARNING, Problem, check_before_reading, validate_run

from tests.run.validate.helpers import SMP, TOK, only, rewrite


def test_good_run_is_clean(good):
    report = validate_run(good)
    assert report.problems == [] and report.ok
    assert report.files == {"tokens": 6, "samples": 6}
    n = sum(pq.ParquetFile(s.path).metadata.num_rows for s in fmt.list_shards(good))
    assert report.rows["tokens"] == n and report.rows["samples"] == 3 * 2 * 2 * 3


# -- manifest --------------------------------------------------------------------------------------

@pytest.mark.parametrize("breakit, message", [
    (lambda p: p.unlink(), "manifest missing"),
    (lambda p: p.write_text("{oops"), "not valid JSON"),
    (lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "version": 99})), "newer than this grpolens"),
    (lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "world_size": "two"})), "world_size"),
])
def test_manifest_problems(run, breakit, message):
    breakit(run / fmt.MANIFEST_NAME)
    p = only(validate_run(run))
    assert p.path == fmt.MANIFEST_NAME and message in p.message


def test_rank_outside_world_size(run):
    m = json.loads((run / fmt.MANIFEST_NAME).read_text())
    (run / fmt.MANIFEST_NAME).write_text(json.dumps({**m, "world_size": 1}))
    probs = validate_run(run).errors
    assert len(probs) == 9 and all("world_size 1" in p.message and "rank=00001" in p.path for p in probs)
    assert sum("completion marker of rank 1" in p.message for p in probs) == 3  # one per step


# -- columns ---------------------------------------------------------------------------------------

def test_missing_required_column(run):
    rewrite(run / TOK, lambda t: t.drop_columns(["logp"]))
    p = only(validate_run(run))
    assert (p.path, p.column) == (TOK, "logp") and "required column missing" in p.message


@pytest.mark.parametrize("table, column, to", [
    (TOK, "pos", pa.int64()), (TOK, "mask", pa.int8()), (TOK, "entropy", pa.float64()),
    (SMP, "group_id", pa.int32()), (SMP, "reward/format", pa.float32()), (SMP, "prompt", pa.binary()),
])
def test_mistyped_column(run, table, column, to):
    rewrite(run / table, lambda t: t.set_column(t.schema.get_field_index(column), column, t.column(column).cast(to)))
    p = only(validate_run(run))
    assert (p.path, p.column) == (table, column) and f"type {to}" in p.message


@pytest.mark.parametrize("to", [pa.large_string(), pa.string_view(), pa.dictionary(pa.int32(), pa.string())])
def test_other_string_encodings_of_text_are_accepted(run, to):
    rewrite(run / SMP, lambda t: t.set_column(t.schema.get_field_index("prompt"), "prompt",
                                               t.column("prompt").cast(to)))
    assert pq.read_schema(run / SMP).field("prompt").type == to
    assert validate_run(run).problems == []


def test_dictionary_of_the_wrong_value_type_is_mistyped(run):
    to = pa.dictionary(pa.int32(), pa.string())
    rewrite(run / SMP, lambda t: t.set_column(t.schema.get_field_index("group_id"), "group_id",
                                               t.column("group_id").cast(pa.string()).cast(to)))
    p = only(validate_run(run))
    assert (p.path, p.column, p.message) == (SMP, "group_id", f"column has type {to}, expected int64")


@pytest.mark.parametrize("table, column", [(TOK, "advantage"), (TOK, "sample_id"), (SMP, "truncated")])
def test_nulls_in_non_nullable_column(run, table, column):
    def null_two(t):
        i = t.schema.get_field_index(column)
        mask = np.zeros(t.num_rows, bool)
        mask[[0, 3]] = True
        col = pc.if_else(pa.array(mask), pa.scalar(None, t.schema.field(i).type), t.column(column))
        return t.set_column(i, pa.field(column, t.schema.field(i).type, nullable=True), col)
    rewrite(run / table, null_two)
    report = validate_run(run)
    nulls = [p for p in report.errors if "null values" in p.message]
    assert len(nulls) == 1 and (nulls[0].path, nulls[0].column) == (table, column) and "2 null" in nulls[0].message


@pytest.mark.parametrize("table, column", [(TOK, c) for c in ("step", "rank", "micro_batch", "sample_id", "pos")] +
                         [(SMP, c) for c in ("step", "rank")])
def test_a_null_key_is_one_error_not_a_made_up_value(run, table, column):
    """A null step, rank or key is its null error only: not a row holding another step or rank
    than the path's, not rows out of order, not a token row of an unknown sample (the value a null
    is read as, -1, is no value of the run)."""
    def null_row_3(t):
        i = t.schema.get_field_index(column)
        values = t[column].to_pylist()
        values[3] = None
        return t.set_column(i, pa.field(column, t.schema.field(i).type, nullable=True),
                            pa.array(values, t.schema.field(i).type))
    rewrite(run / table, null_row_3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor a numpy warning on the way (a null read as NaN and cast)
        assert validate_run(run).problems == [Problem(ERROR, table, column, "1 null values in a non-nullable column")]


@pytest.mark.parametrize("column", ["step", "rank", "micro_batch", "sample_id", "pos"])
def test_a_key_column_of_nulls_only_is_one_error(run, column):
    """Every row of a key column null: a record batch with no value left of it is still the one
    null error (no key of the file is read from a batch that holds none)."""
    n = pq.ParquetFile(run / TOK).metadata.num_rows
    rewrite(run / TOK, lambda t: t.set_column(t.schema.get_field_index(column),
                                               pa.field(column, t.schema.field(column).type, nullable=True),
                                               pa.nulls(t.num_rows, t.schema.field(column).type)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert validate_run(run).problems == [Problem(ERROR, TOK, column, f"{n:,} null values in a non-nullable column")]


@pytest.mark.parametrize("column, to", [("old_entropy", pa.float64()), ("rollout_rejected", pa.int8())])
def test_mistyped_optional_verl_column(run, column, to):
    rewrite(run / TOK, lambda t: t.append_column(column, pa.array(np.zeros(t.num_rows)).cast(to)))
    p = only(validate_run(run))
    assert (p.path, p.column) == (TOK, column) and f"type {to}" in p.message


def test_rollout_rejected_token_in_the_loss(run):
    """rollout_rejected marks tokens the trainer took out of the loss: with mask true it is an error
    (two such rows here); rejected rows with mask false and nulls are fine."""
    def add(t):
        mask = t.column("mask").to_numpy(zero_copy_only=False)
        inside, outside = np.flatnonzero(mask)[:2], np.flatnonzero(~mask)[:3]
        rej = np.zeros(t.num_rows, bool)
        rej[inside] = rej[outside] = True
        nulls = np.zeros(t.num_rows, bool)
        nulls[np.flatnonzero(mask)[2]] = True
        return t.append_column(pa.field("rollout_rejected", pa.bool_()), pa.array(rej, mask=nulls))
    rewrite(run / TOK, add)
    p = only(validate_run(run))
    assert (p.path, p.column) == (TOK, "rollout_rejected") and p.message.startswith("2 rows are rollout_rejected")


def test_rejected_row_whose_mask_is_null_is_not_counted_as_in_the_loss(run):
    """A null mask is an error of its own (a null in a non-nullable column); it does not make a
    rejected row "in the loss (mask true)": the only error is the null."""
    def add(t):
        mask = t.column("mask").to_numpy(zero_copy_only=False)
        row = int(np.flatnonzero(mask)[0])
        rej = np.zeros(t.num_rows, bool)
        rej[row] = True
        nulls = np.zeros(t.num_rows, bool)
        nulls[row] = True
        i = t.schema.get_field_index("mask")
        t = t.set_column(i, pa.field("mask", pa.bool_(), nullable=True), pa.array(mask, mask=nulls))
        return t.append_column(pa.field("rollout_rejected", pa.bool_()), pa.array(rej))
    rewrite(run / TOK, add)
    p = only(validate_run(run))
    assert (p.path, p.column) == (TOK, "mask") and "1 null" in p.message


# -- the report ------------------------------------------------------------------------------------

def test_every_problem_is_reported_at_once(run):
    (run / fmt.MANIFEST_NAME).unlink()
    rewrite(run / TOK, lambda t: t.drop_columns(["mask"]))
    (run / "tokens/step=00000002/rank=00001.parquet").write_bytes(b"junk")
    (run / "tokens/step=00000000/stray.bin").write_bytes(b"")
    report = validate_run(run)
    assert len(report.errors) == 4
    assert {p.path for p in report.errors} == {fmt.MANIFEST_NAME, TOK, "tokens/step=00000002/rank=00001.parquet",
                                               "tokens/step=00000000/stray.bin"}
    with pytest.raises(fmt.RunFormatError, match=r"and 3 more problems"):
        report.raise_for_errors()


def test_the_first_error_raised_names_how_many_more_there_are(run):
    (run / "tokens/step=00000000/stray.bin").write_bytes(b"")
    only = validate_run(run)
    with pytest.raises(fmt.RunFormatError) as e:
        only.raise_for_errors()
    assert e.value.path == str(run / "tokens/step=00000000/stray.bin") and "more problems" not in e.value.message
    (run / "tokens/step=00000001/stray.bin").write_bytes(b"")
    two = validate_run(run)
    with pytest.raises(fmt.RunFormatError) as e:
        two.raise_for_errors()
    assert e.value.message.endswith(f" (and 1 more problems: run `grpolens validate {run}`)")


@pytest.mark.parametrize("check", [validate_run, check_before_reading])
def test_a_path_that_is_not_a_run_directory_is_refused_naming_it(check, tmp_path):
    missing, file = tmp_path / "nope", tmp_path / "file"
    file.write_text("")
    for path, message in ((missing, "run directory does not exist"),
                          (file, "not a directory (a run is a directory with grpolens.json)")):
        with pytest.raises(fmt.RunFormatError) as e:
            check(path)
        assert (e.value.path, e.value.message, e.value.column) == (str(path), message, None)


def test_a_problem_reads_as_one_line_naming_its_file_and_column():
    """``str(problem)``, for a Python caller that prints a report's problems."""
    assert str(Problem(ERROR, TOK, "logp", "3 null values")) == f"error: {TOK} (column 'logp'): 3 null values"
    assert str(Problem(WARNING, ".", None, "stray")) == "warning: .: stray"


# -- the command -----------------------------------------------------------------------------------

def test_cli_exit_codes_and_output(cli, run, tmp_path):
    r = cli("validate", run)
    assert r.code == 0 and "OK" in r.err
    rewrite(run / TOK, lambda t: t.drop_columns(["advantage"]))
    (run / "[bold]x.txt").write_text("")  # names are shown verbatim, not as markup
    r = cli("validate", run)
    assert r.code == 1 and "advantage" in r.out and "FAILED" in r.err and "[bold]x.txt" in r.out
    r = cli("validate", "--json", run)
    assert r.code == 1
    lines = [json.loads(line) for line in r.out.splitlines()]
    assert {"severity": ERROR, "path": TOK, "column": "advantage",
            "message": "required column missing (expected float)"} in lines
    r = cli("validate", tmp_path / "nope")
    assert r.code == 2 and "does not exist" in r.err and "Traceback" not in r.err
    (tmp_path / "file").write_text("")
    r = cli("validate", tmp_path / "file")
    assert r.code == 2 and "not a directory" in r.err and "Traceback" not in r.err
