"""validate: the key columns (micro_batch, sample_id, pos): duplicates, order across files and
record batches, duplicate sample ids."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpolens.run.validate import check_before_reading, validate_run

from tests.run.validate.helpers import SMP, TOK, only, rewrite


def test_duplicate_keys_in_sorted_file(run):
    def dup(t):  # rows 5, 6, 7 each twice in a row: still sorted, 3 duplicates
        return t.take(np.r_[np.arange(5), 5, 5, 6, 6, 7, 7, np.arange(8, t.num_rows)])
    rewrite(run / TOK, dup)
    p = only(validate_run(run))
    assert p.path == TOK and p.message.startswith("3 duplicate")


def test_duplicate_keys_appended_unsorted(run):
    rewrite(run / TOK, lambda t: pa.concat_tables([t, t.slice(0, 4)]))
    msgs = sorted(p.message for p in validate_run(run).errors)
    assert len(msgs) == 2
    assert msgs[0].startswith("4 duplicate") and "not sorted" in msgs[1]


@pytest.mark.parametrize("micro_batch, sample_id, pos", [
    ([0, 0], [1, 0], [5, 5]),  # one-token sequences at the same pos: two keys, not a duplicate
    ([1, 0], [0, 0], [0, 0]),  # the same sample id and pos in two micro-batches
])
def test_unsorted_rows_sharing_a_pos_are_not_duplicates(micro_batch, sample_id, pos):
    """An unsorted shard's duplicates are counted on the whole (micro_batch, sample_id, pos) key."""
    from grpolens.run.validate import key_order_problems, unsorted_message

    got = key_order_problems(np.array(micro_batch), np.array(sample_id), np.array(pos))
    assert got == [unsorted_message(1)]
    both = key_order_problems(np.array(micro_batch * 2), np.array(sample_id * 2), np.array(pos * 2))
    assert both == [unsorted_message(1), "2 duplicate (step, rank, micro_batch, sample_id, pos) keys"]


@pytest.mark.parametrize("micro_batch, sample_id, pos", [
    ([0, 1], [0, 0], [0, 0]),  # one-token sequences of the same sample id in two micro-batches
    ([0, 0], [0, 1], [5, 5]),  # two one-token sequences at the same pos
])
def test_sorted_rows_sharing_a_pos_are_not_duplicates(micro_batch, sample_id, pos):
    """A sorted shard's duplicates are counted on the whole (micro_batch, sample_id, pos) key too."""
    from grpolens.run.validate import key_order_problems

    assert key_order_problems(np.array(micro_batch), np.array(sample_id), np.array(pos)) == []


def test_key_order_problems_name_the_first_row_out_of_order():
    from grpolens.run.validate import key_order_problems, unsorted_message

    got = key_order_problems(np.zeros(5, int), np.zeros(5, int), np.array([0, 1, 3, 2, 4]))
    assert got == [unsorted_message(3)] and "row 3)" in got[0]


def test_extra_columns_are_allowed_whatever_their_name_or_type(run):
    """Columns outside the format are ignored, first in the file or not; only samples' reward/...
    columns are typed."""
    def first(name):
        return lambda t: t.add_column(0, pa.field(name, pa.string()), pa.array(["x"] * t.num_rows))
    rewrite(run / TOK, first("reward/note"))
    rewrite(run / SMP, first("note"))
    assert validate_run(run).problems == []
    assert check_before_reading(run).ok
    # the columns after an extra one are still checked
    rewrite(run / SMP, lambda t: t.set_column(t.schema.get_field_index("group_id"), "group_id",
                                               t.column("group_id").cast(pa.int32())))
    p = only(validate_run(run))
    assert (p.path, p.column, p.message) == (SMP, "group_id", "column has type int32, expected int64")


def test_unsorted_file(run):
    def swap(t):  # exchange two adjacent rows of one sequence
        idx = np.arange(t.num_rows)
        idx[[2, 3]] = idx[[3, 2]]
        return t.take(idx)
    rewrite(run / TOK, swap)
    p = only(validate_run(run))
    assert p.path == TOK and "not sorted by (micro_batch, sample_id, pos)" in p.message and "row 3" in p.message


@pytest.mark.parametrize("first", [
    4,  # rows 4 and 5 swapped: the out-of-order pair straddles the first batch boundary
    5,  # both in the second batch
    11,  # both in the third batch: the row number counts every batch before
])
def test_unsorted_across_record_batches(run, monkeypatch, first):
    import grpolens.run.validate as v

    monkeypatch.setattr(v.validator, "_BATCH_ROWS", 5)
    rewrite(run / TOK, lambda t: t.take(np.r_[np.arange(first), first + 1, first, np.arange(first + 2, t.num_rows)]))
    p = only(validate_run(run))
    assert p.message == f"rows are not sorted by (micro_batch, sample_id, pos) as the writer promises " \
                        f"(first out of order at row {first + 1})"


@pytest.mark.parametrize("batch_rows", [4, 1 << 20])
def test_problems_of_an_early_record_batch_are_counted_whatever_follows(run, monkeypatch, batch_rows):
    """A duplicate, a null, a positive log-prob and a rejected token in the loss, all in the first
    4 rows: with batches of 4 rows they lie in the first of many batches, and count as in one batch."""
    import grpolens.run.validate as v

    monkeypatch.setattr(v.validator, "_BATCH_ROWS", batch_rows)

    def damage(t):
        t = t.take(np.r_[0, 0, np.arange(1, t.num_rows)])  # row 0 twice: still sorted, one duplicate
        n = t.num_rows
        mask = t.column("mask").to_numpy(zero_copy_only=False).copy()
        mask[2] = True
        rejected = np.zeros(n, bool)
        rejected[2] = True
        logp = t.column("logp").to_numpy().copy()
        logp[3] = 0.5
        t = t.set_column(t.schema.get_field_index("mask"), t.schema.field("mask"), pa.array(mask))
        t = t.set_column(t.schema.get_field_index("logp"), t.schema.field("logp"), pa.array(logp, pa.float32()))
        adv = t.column("advantage").to_numpy().copy()
        t = t.set_column(t.schema.get_field_index("advantage"), pa.field("advantage", pa.float32(), nullable=True),
                         pa.array(adv, pa.float32(), mask=np.arange(n) == 1))
        return t.append_column(pa.field("rollout_rejected", pa.bool_()), pa.array(rejected))
    rewrite(run / TOK, damage)
    assert pq.ParquetFile(run / TOK).metadata.num_rows > 3 * 4
    got = sorted((p.column or "", p.message.split(";")[0]) for p in validate_run(run).errors)
    assert got == [("", "1 duplicate (step, rank, micro_batch, sample_id, pos) keys"),
                   ("advantage", "1 null values in a non-nullable column"),
                   ("logp", "1 positive log-probabilities (> 0.001)"),
                   ("rollout_rejected", "1 rows are rollout_rejected and still in the loss (mask true)")]


def test_duplicate_sample_ids(run):
    """Ids 2 and 7 (written at step 0, ranks 0 and 1) again at step 1 rank 1 and step 2 rank 0: the
    error names the file of the lowest id's second occurrence and the file that held it first."""
    def add(sample_id):
        def fn(t):
            i = t.schema.get_field_index("sample_id")
            return pa.concat_tables([t, t.slice(0, 1).set_column(i, t.schema.field(i), pa.array([sample_id], pa.int64()))])
        return fn
    rewrite(run / "samples/step=00000001/rank=00001.parquet", add(2))
    rewrite(run / "samples/step=00000002/rank=00000.parquet", add(7))
    assert 2 in pq.read_table(run / "samples/step=00000000/rank=00000.parquet")["sample_id"].to_pylist()
    assert 7 in pq.read_table(run / "samples/step=00000000/rank=00001.parquet")["sample_id"].to_pylist()
    p = only(validate_run(run))
    assert (p.path, p.column) == ("samples/step=00000001/rank=00001.parquet", "sample_id")
    assert p.message == ("2 duplicate sample_id values across the samples table (first: 2, also in "
                         "samples/step=00000000/rank=00000.parquet); sample_id must be unique in a run")


@pytest.mark.parametrize("which", [0, -1])
def test_a_duplicate_sample_id_among_many_is_named_at_its_later_file(run, which):
    """The last samples file gets a completion reusing the first file's first or last id, then 1,000
    more: among that many ids too (where an unstable sort may swap the two; numpy 2.4's default
    quicksort swaps the first id's pair here), the error names the later file and the one that held
    the id first."""
    first, last = "samples/step=00000000/rank=00000.parquet", "samples/step=00000002/rank=00001.parquet"
    reuse = pq.read_table(run / first)["sample_id"][which].as_py()
    top = max(max(pq.read_table(f)["sample_id"].to_pylist()) for f in (run / "samples").rglob("*.parquet"))

    def grow(t):
        i = t.schema.get_field_index("sample_id")
        extra = t.take([0] * 1001)
        ids = pa.array([reuse, *range(top + 1, top + 1001)], pa.int64())
        return pa.concat_tables([t, extra.set_column(i, t.schema.field(i), ids)])
    rewrite(run / last, grow)
    p = only(validate_run(run))
    assert (p.path, p.column, p.message) == (last, "sample_id", (
        f"1 duplicate sample_id values across the samples table (first: {reuse}, also in {first}); sample_id must "
        "be unique in a run"))
