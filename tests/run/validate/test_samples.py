"""validate: samples rows, of which only the usable columns are read: mistyped columns, null and
duplicate sample ids, text that is not UTF-8."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpolens.run.validate import ERROR, WARNING, validate_run

from tests.run.validate.helpers import SMP, TOK, only, rewrite


def _not_utf8(t: pa.Table, column: str, *rows: int) -> pa.Table:
    """``t`` with the values of ``column`` at ``rows`` replaced by bytes that are not UTF-8, stored in
    the string column as a foreign writer can."""
    raw = [s.encode() for s in t[column].to_pylist()]
    for row in rows:
        raw[row] = b"ab\xff\xfecd"
    arr = pa.Array.from_buffers(pa.string(), len(raw), pa.array(raw, pa.binary()).buffers())
    return t.set_column(t.schema.get_field_index(column), column, arr)


def test_a_mistyped_samples_column_is_one_error_whatever_it_holds(run):
    """group_id stored as int32 with two nulls: the wrong type is its one error. Its rows are not
    read (only the usable columns are), so its nulls are no second error."""
    def mistype(t):
        i = t.schema.get_field_index("group_id")
        col = pa.array(t.column("group_id").to_numpy(), pa.int32(), mask=np.arange(t.num_rows) < 2)
        return t.set_column(i, pa.field("group_id", pa.int32(), nullable=True), col)
    rewrite(run / SMP, mistype)
    assert pq.read_table(run / SMP)["group_id"].null_count == 2
    assert [(p.severity, p.path, p.column, p.message) for p in validate_run(run).problems] == [
        (ERROR, SMP, "group_id", "column has type int32, expected int64")]


def test_null_sample_ids_are_one_error_not_duplicates(run):
    """Two null sample_ids: one null error. The nulls are no ids, so they do not make a duplicate
    sample_id error (read as the same stand-in value they would); the token rows of the two
    samples whose ids are gone are orphans, a warning."""
    def null_two(t):
        i = t.schema.get_field_index("sample_id")
        col = pa.array(t.column("sample_id").to_numpy(), pa.int64(), mask=np.arange(t.num_rows) < 2)
        return t.set_column(i, pa.field("sample_id", pa.int64(), nullable=True), col)
    rewrite(run / SMP, null_two)
    report = validate_run(run)
    assert [(p.path, p.column, p.message) for p in report.errors] == [
        (SMP, "sample_id", "2 null values in a non-nullable column")]
    orphans = only(report, WARNING)
    assert (orphans.path, orphans.column) == (TOK, "sample_id") and "reference 2 sample_id(s)" in orphans.message


def test_a_duplicate_sample_id_beside_a_null_one_is_named_as_an_integer(run):
    """A samples file with a null sample_id (row 0) and an id another file already holds (row 1):
    the null error, and the duplicate named as the integer id it is."""
    first = "samples/step=00000000/rank=00000.parquet"
    reuse = pq.read_table(run / first)["sample_id"][0].as_py()

    def null_and_reuse(t):
        i = t.schema.get_field_index("sample_id")
        ids = [None, reuse, *t.column("sample_id").to_pylist()[2:]]
        return t.set_column(i, pa.field("sample_id", pa.int64(), nullable=True), pa.array(ids, pa.int64()))
    rewrite(run / SMP, null_and_reuse)
    assert [(p.path, p.column, p.message) for p in validate_run(run).errors] == [
        (SMP, "sample_id", "1 null values in a non-nullable column"),
        (SMP, "sample_id", f"1 duplicate sample_id values across the samples table (first: {reuse}, also in "
                           f"{first}); sample_id must be unique in a run")]


@pytest.mark.parametrize("bad_row", [1, 5])
def test_invalid_utf8_names_its_row_counting_every_record_batch_before(run, monkeypatch, bad_row):
    """Batches of 2 rows: row 1 is in the first batch, row 5 in the third, after 4 rows."""
    import grpolens.run.validate as v

    monkeypatch.setattr(v.validator, "_BATCH_ROWS", 2)
    monkeypatch.delenv("GRPOLENS_INVALID_UTF8", raising=False)
    rewrite(run / SMP, lambda t: _not_utf8(t, "completion", bad_row))
    assert pq.ParquetFile(run / SMP).metadata.num_rows > bad_row
    p = only(validate_run(run))
    assert (p.path, p.column) == (SMP, "completion")
    assert p.message.startswith(f"1 value(s) are not valid UTF-8 (first at row {bad_row});")


def test_invalid_utf8_in_several_record_batches_is_counted_over_all(run, monkeypatch):
    """Batches of 2 rows, bad bytes in rows 1 and 5 (the first and the third batch): 2 values,
    the first at row 1."""
    import grpolens.run.validate as v

    monkeypatch.setattr(v.validator, "_BATCH_ROWS", 2)
    monkeypatch.delenv("GRPOLENS_INVALID_UTF8", raising=False)
    rewrite(run / SMP, lambda t: _not_utf8(t, "completion", 1, 5))
    p = only(validate_run(run))
    assert (p.path, p.column) == (SMP, "completion")
    assert p.message.startswith("2 value(s) are not valid UTF-8 (first at row 1);")


def test_invalid_utf8_is_a_warning_when_the_user_chose_to_replace_it(run, monkeypatch):
    """Under --invalid-utf8 replace the text is readable (its bad bytes replaced): a warning only."""
    monkeypatch.setenv("GRPOLENS_INVALID_UTF8", "replace")
    rewrite(run / SMP, lambda t: _not_utf8(t, "prompt", 3))
    report = validate_run(run)
    assert report.errors == [] and report.ok
    p = only(report, WARNING)
    assert (p.path, p.column) == (SMP, "prompt")
    assert p.message.startswith("1 value(s) are not valid UTF-8 (first at row 3);")
