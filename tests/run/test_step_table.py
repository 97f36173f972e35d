"""Derived tables written step by step (grpolens/run/step_table.py) are the table that one
concat-and-sort of every piece gives: same columns in the same order, same types, same rows."""

import random

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from grpolens.run.step_table import StepSpill, write_step_table

SORT = ["step", "k", "score"]
DESC = [False, False, True]


def _piece(rng: random.Random, step: int, extra: bool) -> pl.DataFrame:
    n = rng.randint(1, 7)
    cols = {"step": [step] * n, "k": [rng.randint(0, 3) for _ in range(n)],
            "score": [rng.random() for _ in range(n)]}
    if extra:  # a column only some steps have, int in some and float in others
        cols["x"] = [rng.randint(0, 9) for _ in range(n)] if step % 2 else [rng.random() for _ in range(n)]
    return pl.DataFrame(cols)


def _one_pass(frames):
    return pl.concat(frames, how="diagonal_relaxed").sort(SORT, descending=DESC)


@pytest.mark.parametrize("hold_bytes", [0, 300, None], ids=["files", "some-held", "all-held"])
@pytest.mark.parametrize("seed", range(6))
def test_kept_and_new_steps_in_random_order_give_the_one_pass_table(tmp_path, seed, hold_bytes):
    """... whether the spilled steps are files, in memory (the first HOLD_BYTES), or some of each."""
    rng = random.Random(seed)
    steps = list(range(rng.randint(1, 30)))
    pieces = {s: _piece(rng, s, extra=rng.random() < 0.5) for s in steps}
    path = tmp_path / "t.parquet"
    _one_pass(list(pieces.values())).write_parquet(path)  # the earlier file, every step
    new_steps = set(rng.sample(steps, rng.randint(0, len(steps))))
    kept = set(steps) - new_steps
    fresh = {s: _piece(rng, s, extra=rng.random() < 0.5) for s in new_steps}
    with StepSpill(tmp_path / "cache", hold_bytes=hold_bytes) as spill:
        for s in rng.sample(sorted(new_steps), len(new_steps)):  # steps spilled in any order
            spill.put("t", s, fresh[s])
        on_disk = len(list((tmp_path / "cache").glob(".spill-*/t/*.parquet")))
        assert on_disk == (len(new_steps) if hold_bytes == 0 else 0 if hold_bytes is None else on_disk)
        write_step_table(path, spill.table("t"), kept, SORT, DESC, schemas=spill.table("t").schemas)
    expected = _one_pass([_one_pass(list(pieces.values())).filter(pl.col("step").is_in(sorted(kept))),
                          *(fresh[s] for s in sorted(new_steps))])
    got = pl.read_parquet(path)
    assert got.columns == expected.columns
    assert_frame_equal(got, expected)
    assert not list((tmp_path / "cache").glob(".spill-*"))


def test_an_unsorted_earlier_file_is_read_whole_and_sorted(tmp_path):
    path = tmp_path / "t.parquet"
    old = pl.DataFrame({"step": [3, 1, 2, 1], "k": [0, 0, 0, 1], "score": [0.1, 0.2, 0.3, 0.4]})
    old.write_parquet(path)
    new = {2: pl.DataFrame({"step": [2], "k": [5], "score": [0.9]})}
    write_step_table(path, new, {1, 3}, SORT, DESC)
    assert pl.read_parquet(path).rows() == [(1, 0, 0.2), (1, 1, 0.4), (2, 5, 0.9), (3, 0, 0.1)]


def test_no_rows_writes_the_empty_table_or_nothing(tmp_path):
    empty = pl.DataFrame(schema={"step": pl.Int64, "k": pl.Int64, "score": pl.Float64})
    assert write_step_table(tmp_path / "a.parquet", {}, set(), SORT, DESC) is False
    assert not (tmp_path / "a.parquet").exists()
    assert write_step_table(tmp_path / "b.parquet", {}, set(), SORT, DESC, empty=empty)
    assert pl.read_parquet(tmp_path / "b.parquet").schema == empty.schema


def test_an_unreadable_earlier_file_carries_nothing(tmp_path):
    path = tmp_path / "t.parquet"
    path.write_bytes(b"PAR1 not parquet")
    new = {4: pl.DataFrame({"step": [4], "k": [0], "score": [1.0]})}
    write_step_table(path, new, {1, 2}, SORT, DESC)
    assert pl.read_parquet(path).rows() == [(4, 0, 1.0)]


def test_many_steps_are_written_in_row_groups_not_one_per_step(tmp_path, monkeypatch):
    import pyarrow.parquet as pq
    from grpolens.run import step_table

    monkeypatch.setattr(step_table, "ROW_GROUP_ROWS", 10)
    new = {s: pl.DataFrame({"step": [s] * 3, "k": [0, 1, 2], "score": [0.0, 1.0, 2.0]}) for s in range(20)}
    write_step_table(tmp_path / "t.parquet", new, set(), SORT, DESC)
    md = pq.ParquetFile(tmp_path / "t.parquet").metadata
    assert md.num_rows == 60 and md.num_row_groups == 5  # 4 steps (12 rows) a group, steps never split
