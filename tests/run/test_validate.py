"""``grpolens validate``: every listed problem is found, on broken copies of a good synthetic run."""

from __future__ import annotations

import json
import shutil
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from grpolens.run import format as fmt
from grpolens.adapters.synth import synth_run
from grpolens.run.validate import ERROR, WARNING, Problem, check_before_reading, validate_run

TOK = "tokens/step=00000001/rank=00000.parquet"
SMP = "samples/step=00000001/rank=00000.parquet"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return synth_run(tmp_path_factory.mktemp("good") / "run", steps=3, ranks=2, micro_batches=2, groups=2,
                     generations=3, max_len=16, seed=1, texts=True)


@pytest.fixture
def run(good, tmp_path):
    return shutil.copytree(good, tmp_path / "run")


def _rewrite(path, fn):
    t = pq.read_table(path)
    pq.write_table(fn(t), path)


def remark(run):
    """Make every completion marker name the shard files now on disk, as the writer would have had
    it written them: for tests that restructure files to exercise other checks."""
    for marker in (run / fmt.COMPLETE_DIR).glob("step=*.json"):
        data = json.loads(marker.read_text())
        data["files"] = sorted(str(sh.path.relative_to(run)) for t in fmt.TABLES
                               for sh in fmt.list_shards(run, t, [data["step"]], complete_only=False)
                               if sh.rank == data["rank"])
        marker.write_text(json.dumps(data))


def _only(report, severity=ERROR):
    probs = [p for p in report.problems if p.severity == severity]
    assert len(probs) == 1, report.problems
    return probs[0]


def test_good_run_is_clean(good):
    report = validate_run(good)
    assert report.problems == [] and report.ok
    assert report.files == {"tokens": 6, "samples": 6}
    n = sum(pq.ParquetFile(s.path).metadata.num_rows for s in fmt.list_shards(good))
    assert report.rows["tokens"] == n and report.rows["samples"] == 3 * 2 * 2 * 3


# -- manifest ---------------------------------------------------------------------------------

@pytest.mark.parametrize("breakit, message", [
    (lambda p: p.unlink(), "manifest missing"),
    (lambda p: p.write_text("{oops"), "not valid JSON"),
    (lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "version": 99})), "newer than this grpolens"),
    (lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "world_size": "two"})), "world_size"),
])
def test_manifest_problems(run, breakit, message):
    breakit(run / fmt.MANIFEST_NAME)
    p = _only(validate_run(run))
    assert p.path == fmt.MANIFEST_NAME and message in p.message


def test_rank_outside_world_size(run):
    m = json.loads((run / fmt.MANIFEST_NAME).read_text())
    (run / fmt.MANIFEST_NAME).write_text(json.dumps({**m, "world_size": 1}))
    probs = validate_run(run).errors
    assert len(probs) == 9 and all("world_size 1" in p.message and "rank=00001" in p.path for p in probs)
    assert sum("completion marker of rank 1" in p.message for p in probs) == 3  # one per step


# -- columns ----------------------------------------------------------------------------------

def test_missing_required_column(run):
    _rewrite(run / TOK, lambda t: t.drop_columns(["logp"]))
    p = _only(validate_run(run))
    assert (p.path, p.column) == (TOK, "logp") and "required column missing" in p.message


@pytest.mark.parametrize("table, column, to", [
    (TOK, "pos", pa.int64()), (TOK, "mask", pa.int8()), (TOK, "entropy", pa.float64()),
    (SMP, "group_id", pa.int32()), (SMP, "reward/format", pa.float32()), (SMP, "prompt", pa.binary()),
])
def test_mistyped_column(run, table, column, to):
    _rewrite(run / table, lambda t: t.set_column(t.schema.get_field_index(column), column, t.column(column).cast(to)))
    p = _only(validate_run(run))
    assert (p.path, p.column) == (table, column) and f"type {to}" in p.message


@pytest.mark.parametrize("to", [pa.large_string(), pa.string_view(), pa.dictionary(pa.int32(), pa.string())])
def test_other_string_encodings_of_text_are_accepted(run, to):
    _rewrite(run / SMP, lambda t: t.set_column(t.schema.get_field_index("prompt"), "prompt",
                                               t.column("prompt").cast(to)))
    assert pq.read_schema(run / SMP).field("prompt").type == to
    assert validate_run(run).problems == []


def test_dictionary_of_the_wrong_value_type_is_mistyped(run):
    to = pa.dictionary(pa.int32(), pa.string())
    _rewrite(run / SMP, lambda t: t.set_column(t.schema.get_field_index("group_id"), "group_id",
                                               t.column("group_id").cast(pa.string()).cast(to)))
    p = _only(validate_run(run))
    assert (p.path, p.column, p.message) == (SMP, "group_id", f"column has type {to}, expected int64")


@pytest.mark.parametrize("table, column", [(TOK, "advantage"), (TOK, "sample_id"), (SMP, "truncated")])
def test_nulls_in_non_nullable_column(run, table, column):
    def null_two(t):
        i = t.schema.get_field_index(column)
        mask = np.zeros(t.num_rows, bool)
        mask[[0, 3]] = True
        col = pc.if_else(pa.array(mask), pa.scalar(None, t.schema.field(i).type), t.column(column))
        return t.set_column(i, pa.field(column, t.schema.field(i).type, nullable=True), col)
    _rewrite(run / table, null_two)
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
    _rewrite(run / table, null_row_3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor a numpy warning on the way (a null read as NaN and cast)
        assert validate_run(run).problems == [Problem(ERROR, table, column, "1 null values in a non-nullable column")]


@pytest.mark.parametrize("column", ["step", "rank", "micro_batch", "sample_id", "pos"])
def test_a_key_column_of_nulls_only_is_one_error(run, column):
    """Every row of a key column null: a record batch with no value left of it is still the one
    null error (no key of the file is read from a batch that holds none)."""
    n = pq.ParquetFile(run / TOK).metadata.num_rows
    _rewrite(run / TOK, lambda t: t.set_column(t.schema.get_field_index(column),
                                               pa.field(column, t.schema.field(column).type, nullable=True),
                                               pa.nulls(t.num_rows, t.schema.field(column).type)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert validate_run(run).problems == [Problem(ERROR, TOK, column, f"{n:,} null values in a non-nullable column")]


@pytest.mark.parametrize("column, to", [("old_entropy", pa.float64()), ("rollout_rejected", pa.int8())])
def test_mistyped_optional_verl_column(run, column, to):
    _rewrite(run / TOK, lambda t: t.append_column(column, pa.array(np.zeros(t.num_rows)).cast(to)))
    p = _only(validate_run(run))
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
    _rewrite(run / TOK, add)
    p = _only(validate_run(run))
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
    _rewrite(run / TOK, add)
    p = _only(validate_run(run))
    assert (p.path, p.column) == (TOK, "mask") and "1 null" in p.message


# -- keys and order -----------------------------------------------------------------------------

def test_duplicate_keys_in_sorted_file(run):
    def dup(t):  # rows 5, 6, 7 each twice in a row: still sorted, 3 duplicates
        return t.take(np.r_[np.arange(5), 5, 5, 6, 6, 7, 7, np.arange(8, t.num_rows)])
    _rewrite(run / TOK, dup)
    p = _only(validate_run(run))
    assert p.path == TOK and p.message.startswith("3 duplicate")


def test_duplicate_keys_appended_unsorted(run):
    _rewrite(run / TOK, lambda t: pa.concat_tables([t, t.slice(0, 4)]))
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
    _rewrite(run / TOK, first("reward/note"))
    _rewrite(run / SMP, first("note"))
    assert validate_run(run).problems == []
    assert check_before_reading(run).ok
    # the columns after an extra one are still checked
    _rewrite(run / SMP, lambda t: t.set_column(t.schema.get_field_index("group_id"), "group_id",
                                               t.column("group_id").cast(pa.int32())))
    p = _only(validate_run(run))
    assert (p.path, p.column, p.message) == (SMP, "group_id", "column has type int32, expected int64")


def test_unsorted_file(run):
    def swap(t):  # exchange two adjacent rows of one sequence
        idx = np.arange(t.num_rows)
        idx[[2, 3]] = idx[[3, 2]]
        return t.take(idx)
    _rewrite(run / TOK, swap)
    p = _only(validate_run(run))
    assert p.path == TOK and "not sorted by (micro_batch, sample_id, pos)" in p.message and "row 3" in p.message


@pytest.mark.parametrize("first", [
    4,  # rows 4 and 5 swapped: the out-of-order pair straddles the first batch boundary
    5,  # both in the second batch
    11,  # both in the third batch: the row number counts every batch before
])
def test_unsorted_across_record_batches(run, monkeypatch, first):
    import grpolens.run.validate as v

    monkeypatch.setattr(v.validator, "_BATCH_ROWS", 5)
    _rewrite(run / TOK, lambda t: t.take(np.r_[np.arange(first), first + 1, first, np.arange(first + 2, t.num_rows)]))
    p = _only(validate_run(run))
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
    _rewrite(run / TOK, damage)
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
    _rewrite(run / "samples/step=00000001/rank=00001.parquet", add(2))
    _rewrite(run / "samples/step=00000002/rank=00000.parquet", add(7))
    assert 2 in pq.read_table(run / "samples/step=00000000/rank=00000.parquet")["sample_id"].to_pylist()
    assert 7 in pq.read_table(run / "samples/step=00000000/rank=00001.parquet")["sample_id"].to_pylist()
    p = _only(validate_run(run))
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
    _rewrite(run / last, grow)
    p = _only(validate_run(run))
    assert (p.path, p.column, p.message) == (last, "sample_id", (
        f"1 duplicate sample_id values across the samples table (first: {reuse}, also in {first}); sample_id must "
        "be unique in a run"))


# -- joins, non-finite values -----------------------------------------------------------------

def test_token_rows_without_samples_row_is_a_warning(cli, run):
    rows = pq.ParquetFile(run / TOK).metadata.num_rows
    (run / SMP).unlink()
    remark(run)
    report = validate_run(run)
    assert report.ok
    w = _only(report, WARNING)
    assert (w.path, w.column) == (TOK, "sample_id") and w.message.startswith(f"{rows:,} token rows reference 6 ")
    assert cli("validate", run).code == 0


def test_orphan_token_rows_are_summed_over_files_and_name_the_first(run):
    """Both ranks of step 1 lose their samples (6 completions each): one warning counts the token
    rows of both files and the 12 ids, naming the first file and the first id in it."""
    other = TOK.replace("rank=00000", "rank=00001")
    rows = sum(pq.ParquetFile(run / f).metadata.num_rows for f in (TOK, other))
    first = pq.read_table(run / TOK)["sample_id"][0].as_py()
    shutil.rmtree((run / SMP).parent)  # both ranks' samples of step 1
    remark(run)
    w = _only(validate_run(run), WARNING)
    assert (w.path, w.column) == (TOK, "sample_id")
    assert w.message == (f"{rows:,} token rows reference 12 sample_id(s) with no samples row (first: {first} "
                         f"in this file); per-sample metrics (rewards, lengths) will miss them")


def test_an_orphan_id_cut_by_record_batches_is_counted_once(run, monkeypatch):
    """Token files are read in record batches: a sequence that spans two of them is one id."""
    from grpolens.run import validate

    monkeypatch.setattr(validate.validator, "_BATCH_ROWS", 7)  # smaller than a completion: every id is cut
    other = TOK.replace("rank=00000", "rank=00001")
    rows = sum(pq.ParquetFile(run / f).metadata.num_rows for f in (TOK, other))
    shutil.rmtree((run / SMP).parent)
    remark(run)
    w = _only(validate_run(run), WARNING)
    assert w.message.startswith(f"{rows:,} token rows reference 12 sample_id(s) with no samples row")


def test_orphan_ids_above_every_known_id_are_counted(run):
    """The join looks each id up among the sorted known ids: an id above them all is past the end."""
    tok, smp = (f"{t}/step=00000002/rank=00001.parquet" for t in ("tokens", "samples"))
    orphans = np.unique(pq.read_table(run / tok)["sample_id"].to_numpy())
    (run / smp).unlink()
    remark(run)
    known = np.concatenate([pq.read_table(f)["sample_id"].to_numpy() for f in (run / "samples").rglob("*.parquet")])
    assert orphans.min() > known.max()
    rows = pq.ParquetFile(run / tok).metadata.num_rows
    report = validate_run(run)
    assert report.ok and _only(report, WARNING).message.startswith(
        f"{rows:,} token rows reference {len(orphans)} sample_id(s) with no samples row (first: {orphans[0]} in this file)")


def test_orphan_rows_are_the_orphan_ids_own_wherever_it_sits(run):
    """The orphan id is the shard's last (after a known id); then a completion trained on again in a
    later loss call follows it (its id recurs in the shard after others): the rows counted are the
    orphan's own either way."""
    t = pq.read_table(run / TOK)
    ids = t["sample_id"].to_numpy()
    first, last = int(ids[0]), int(ids[-1])
    _rewrite(run / SMP, lambda s: s.filter(pc.not_equal(s["sample_id"], last)))
    message = f"{int((ids == last).sum()):,} token rows reference 1 sample_id(s) with no samples row (first: {last} in"
    for recurs in (False, True):
        if recurs:
            again = t.filter(pc.equal(t["sample_id"], first))
            i = t.schema.get_field_index("micro_batch")
            later = pa.array(np.full(again.num_rows, pc.max(t["micro_batch"]).as_py() + 1), t.schema.field(i).type)
            pq.write_table(pa.concat_tables([t, again.set_column(i, t.schema.field(i), later)]), run / TOK)
        report = validate_run(run)
        assert report.ok and _only(report, WARNING).message.startswith(message), recurs


def test_unreadable_samples_file_does_not_orphan_token_rows(run):
    (run / SMP).write_bytes(b"junk")
    p = _only(validate_run(run))  # the broken file, and no spurious join warning
    assert p.path == SMP and validate_run(run).warnings == []


def test_run_without_samples_is_a_warning(run):
    shutil.rmtree(run / "samples")
    remark(run)
    report = validate_run(run)
    assert report.ok and _only(report, WARNING) == Problem(
        WARNING, "samples", None, "no samples shards: rewards, lengths and groups are unknown to analysis")


def test_non_finite_values_counted_per_column(run):
    def poison(t):
        cols = {}
        for name, bad in (("logp", [np.nan, np.inf, -np.inf]), ("ref_logp", [np.nan])):
            a = t.column(name).to_numpy().copy()
            a[: len(bad)] = bad
            cols[name] = pa.array(a, pa.float32())
        for name, a in cols.items():
            t = t.set_column(t.schema.get_field_index(name), t.schema.field(name), a)
        return t
    _rewrite(run / TOK, poison)
    _rewrite(run / "tokens/step=00000002/rank=00001.parquet", poison)
    report = validate_run(run)
    assert report.ok
    by_col = {p.column: p for p in report.warnings}
    assert set(by_col) == {"logp", "ref_logp"}
    assert by_col["logp"].message.startswith("6 non-finite values (2 NaN, 2 +inf, 2 -inf) in 2 file(s)")
    assert by_col["ref_logp"].message.startswith("2 non-finite values (2 NaN, 0 +inf, 0 -inf)")
    assert by_col["logp"].path == TOK


def test_nulls_in_nullable_log_prob_columns_are_fine(run):
    """old_logp and ref_logp may be null (a trainer without a reference model): neither a
    non-finite value nor a positive log-prob, and no error."""
    def null_three(t):  # old_logp null in 3 rows, ref_logp in all (its statistics have no min/max)
        for name, rows in (("old_logp", 3), ("ref_logp", t.num_rows)):
            t = t.set_column(t.schema.get_field_index(name), t.schema.field(name),
                             pa.array(t.column(name).to_numpy(), pa.float32(), mask=np.arange(t.num_rows) < rows))
        return t
    _rewrite(run / TOK, null_three)
    assert pq.read_table(run / TOK)["old_logp"].null_count == 3
    assert validate_run(run).problems == []
    assert check_before_reading(run).ok


def test_tokenizer_file_that_does_not_load_is_a_warning_naming_the_error(run):
    """tokenizer.json that the tokenizers library loads: no problem; one it cannot load: a warning
    with the library's first line of error, as views then show token ids."""
    tokenizers = pytest.importorskip("tokenizers")
    from grpolens.run.decode import TOKENIZER_FILE

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.save(str(run / TOKENIZER_FILE))
    assert validate_run(run).problems == []
    (run / TOKENIZER_FILE).write_text("{oops")
    with pytest.raises(Exception) as e:
        tokenizers.Tokenizer.from_file(str(run / TOKENIZER_FILE))
    first = str(e.value).splitlines()[0]
    w = _only(validate_run(run), WARNING)
    assert (w.path, w.column) == (TOKENIZER_FILE, None)
    assert w.message == f"not a tokenizers JSON file ({first}): views show token ids instead of text"



def _panicking_tokenizer_json() -> str:
    """A tokenizer.json whose Precompiled normalizer holds no charsmap: the tokenizers library
    (0.23) panics in Rust while loading it, which pyo3 raises as a BaseException."""
    return json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                       "normalizer": {"type": "Precompiled", "precompiled_charsmap": ""},
                       "pre_tokenizer": None, "post_processor": None, "decoder": None,
                       "model": {"type": "WordLevel", "vocab": {"[UNK]": 0}, "unk_token": "[UNK]"}})


def test_a_tokenizer_file_that_panics_the_library_is_a_warning_not_a_crash(run):
    """The library's own panic (not an ``Exception``) is a failure to load like any other: a
    warning naming its first line, from validate and from the check every reading command makes."""
    tokenizers = pytest.importorskip("tokenizers")
    from grpolens.run.decode import TOKENIZER_FILE, make_decoder

    (run / TOKENIZER_FILE).write_text(_panicking_tokenizer_json())
    with pytest.raises(BaseException) as e:  # noqa: PT011 - whatever the library raises
        tokenizers.Tokenizer.from_file(str(run / TOKENIZER_FILE))
    first = str(e.value).splitlines()[0]
    assert first
    w = _only(validate_run(run), WARNING)
    assert (w.path, w.column) == (TOKENIZER_FILE, None)
    assert w.message == f"not a tokenizers JSON file ({first}): views show token ids instead of text"
    assert check_before_reading(run).ok
    assert make_decoder(run, {})[1] == "ids"  # the views show ids


def test_a_tokenizer_error_without_a_message_is_named_by_its_class(run, monkeypatch):
    """An exception without a message (Python's MemoryError when an allocation fails has none):
    the warning names its class rather than an empty pair of parentheses."""
    tokenizers = pytest.importorskip("tokenizers")
    from grpolens.run.decode import TOKENIZER_FILE

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.save(str(run / TOKENIZER_FILE))

    def no_memory(path):
        raise MemoryError()

    monkeypatch.setattr(tokenizers.Tokenizer, "from_file", staticmethod(no_memory))
    w = _only(validate_run(run), WARNING)
    assert (w.path, w.column) == (TOKENIZER_FILE, None)
    assert w.message == "not a tokenizers JSON file (MemoryError): views show token ids instead of text"


# -- files and layout -------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_unreadable_or_truncated_parquet(run, damage):
    p = run / TOK
    data = p.read_bytes()
    p.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"PAR1 not really", "empty": b""}[damage])
    err = _only(validate_run(run))
    assert err.path == TOK and "unreadable or truncated Parquet file" in err.message


def _break_a_data_page(p):
    """Overwrite the header of sample_id's first data page: the footer still reads."""
    md = pq.ParquetFile(p).metadata
    names = [md.row_group(0).column(i).path_in_schema for i in range(md.num_columns)]
    at = md.row_group(0).column(names.index("sample_id")).data_page_offset
    data = bytearray(p.read_bytes())
    data[at:at + 12] = b"\xff" * 12
    p.write_bytes(bytes(data))
    pq.ParquetFile(p)


@pytest.mark.parametrize("rel", [TOK, SMP])
def test_corrupt_data_page_is_reported_not_raised(run, rel):
    """The footer reads, the pages do not: one error naming the file (a samples file that gave no
    ids leaves the token rows of its completions alone: no orphan warning)."""
    _break_a_data_page(run / rel)
    report = validate_run(run)  # a problem and not an exception
    (problem,) = report.problems
    assert (problem.severity, problem.path, problem.column) == (ERROR, rel, None)
    assert problem.message.startswith("unreadable or truncated Parquet file: ")


@pytest.mark.parametrize("damage", ["junk", "page"])
def test_unreadable_files_leave_the_join_off_for_the_rest_of_the_run(run, damage):
    """An unreadable samples file (step 2) makes the join skip every token row; an unreadable
    tokens file read after it (step 0: junk, or a broken data page) does not turn the join back on."""
    smp2 = "samples/step=00000002/rank=00000.parquet"
    (run / smp2).write_bytes(b"junk")
    tok0 = run / TOK.replace("step=00000001", "step=00000000")
    if damage == "junk":
        tok0.write_bytes(b"junk")
    else:
        _break_a_data_page(tok0)
    report = validate_run(run)
    assert report.warnings == [] and len(report.errors) == 2


@pytest.mark.parametrize("damage", ["mistyped", "missing"])
def test_a_samples_file_without_usable_ids_orphans_no_token_rows(run, damage):
    """Its sample_id column is mistyped or missing: that is its one error; the token rows of its
    completions are not reported as orphans (their samples row exists, its id is unreadable)."""
    def fn(t):
        if damage == "missing":
            return t.drop_columns(["sample_id"])
        return t.set_column(t.schema.get_field_index("sample_id"), "sample_id", t["sample_id"].cast(pa.int32()))
    _rewrite(run / SMP, fn)
    report = validate_run(run)
    (problem,) = report.problems
    assert (problem.severity, problem.path, problem.column) == (ERROR, SMP, "sample_id")


@pytest.mark.parametrize("column", ["micro_batch", "sample_id", "pos"])
def test_negative_key_values(run, column):
    def negate(t):  # every value minus a constant: order and uniqueness kept, the values negative
        i = t.schema.get_field_index(column)
        return t.set_column(i, t.schema.field(i), pc.subtract(t[column], pa.scalar(10_000, t.schema.field(i).type)))
    _rewrite(run / TOK, negate)
    if column == "sample_id":
        _rewrite(run / SMP, negate)  # the same ids in the samples: no orphan rows, and an error there too
        assert [(p.path, p.column, p.message) for p in validate_run(run).errors] == [
            (path, column, "negative values (must be >= 0)") for path in (SMP, TOK)]
        return
    p = _only(validate_run(run))
    assert (p.path, p.column, p.message) == (TOK, column, "negative values (must be >= 0)")


def test_stray_files(run):
    (run / "tokens/step=00000001/notes.txt").write_text("x")
    (run / "tokens/step=00000001/rank=1.parquet").write_bytes(b"")
    (run / "tokens/misc").mkdir()
    (run / "samples/step=00000001/sub").mkdir()
    (run / "tokens/step=00000001/.rank=00000.parquet.abc123.tmp").write_bytes(b"")
    (run / "README.txt").write_text("hi")
    report = validate_run(run)
    errs = sorted(p.path for p in report.errors)
    assert errs == ["samples/step=00000001/sub", "tokens/misc", "tokens/step=00000001/notes.txt",
                    "tokens/step=00000001/rank=1.parquet"]
    assert sorted(p.path for p in report.warnings) == ["README.txt", "tokens/step=00000001/.rank=00000.parquet.abc123.tmp"]
    assert "interrupted write" in report.warnings[-1].message or "interrupted write" in report.warnings[0].message


def test_layout_problems_say_what_was_expected(run):
    """Each entry outside the layout, with the message a user reads (severity, path, text)."""
    (run / "tokens/step=00000001/notes.txt").write_text("x")
    (run / "tokens/step=00000001/.rank=00000.parquet.abc123.tmp").write_bytes(b"")
    (run / "tokens/misc").mkdir()
    (run / "samples/step=00000003").mkdir()
    (run / ".grpolens.json.x1.tmp").write_text("")
    (run / "README.txt").write_text("hi")
    got = sorted((p.severity, p.path, p.column, p.message) for p in validate_run(run).problems)
    assert got == sorted([
        (WARNING, ".grpolens.json.x1.tmp", None, "leftover temporary file from an interrupted write"),
        (WARNING, "README.txt", None, "not part of the run layout (ignored by grpolens)"),
        (WARNING, "samples/step=00000003", None, "empty step directory"),
        (ERROR, "tokens/misc", None, "stray entry: expected a directory step=<8 digits>; readers ignore it"),
        (WARNING, "tokens/step=00000001/.rank=00000.parquet.abc123.tmp", None,
         "leftover temporary file from an interrupted write (safe to delete)"),
        (ERROR, "tokens/step=00000001/notes.txt", None,
         "stray file: expected rank=<5 digits>[-<4 digits>].parquet; readers ignore it"),
    ])
    shutil.rmtree(run / "samples")
    (run / "samples").write_text("")
    assert (ERROR, "samples", None, "'samples' must be a directory") in [
        (p.severity, p.path, p.column, p.message) for p in validate_run(run).problems]


def test_completion_directory_problems_are_named(run):
    """What ``complete/`` may hold: markers of ranks below world_size and finished records."""
    complete = run / fmt.COMPLETE_DIR
    (complete / ".step=00000001.rank=00000.json.x1.tmp").write_text("")
    (complete / "notes.txt").write_text("")
    shutil.copy(complete / "step=00000001.rank=00000.json", complete / "step=00000001.rank=00002.json")
    for f in complete.glob("finished.*"):
        f.unlink()
    got = [(p.severity, p.path, p.column, p.message) for p in validate_run(run).problems]
    assert sorted(got) == sorted([
        (WARNING, "complete/.step=00000001.rank=00000.json.x1.tmp", None,
         "leftover temporary file from an interrupted write"),
        (ERROR, "complete/notes.txt", None,
         "stray entry: expected step=<8 digits>.rank=<5 digits>.json or finished.rank=<5 digits>.json"),
        (ERROR, "complete/step=00000001.rank=00002.json", None, "completion marker of rank 2, outside world_size 2"),
        (WARNING, "complete", None,
         "no finished record for rank(s) 0, 1: still training, or stopped before the writer was closed"),
    ])


def test_markers_that_disagree_with_the_files_are_named(run):
    """A marker lists the shard files of its (step, rank): one it does not name, one it names that
    is missing, and a marker whose list is not of names: each an error naming the file."""
    def edit(step, fn):
        marker = run / fmt.marker_relpath(step, 0)
        data = json.loads(marker.read_text())
        data["files"] = fn(data["files"])
        marker.write_text(json.dumps(data))

    late = "tokens/step=00000000/rank=00000-0001.parquet"
    shutil.copy(run / "tokens/step=00000000/rank=00000.parquet", run / late)
    edit(1, lambda files: [*files, "samples/step=00000001/rank=00000-0001.parquet"])
    edit(2, lambda files: [1, 2])
    got = [(p.severity, p.path, p.column, p.message) for p in validate_run(run).problems]
    for problem in [
        (ERROR, late, None, "not named by the completion marker of step 0 rank 0: written after it (a second run "
         "into the same folder?); readers would count its rows twice"),
        (ERROR, fmt.marker_relpath(1, 0), None, "names samples/step=00000001/rank=00000-0001.parquet, which is missing"),
        (ERROR, fmt.marker_relpath(2, 0), None, "unreadable completion marker: files must be strings"),
    ]:
        assert problem in got, got


def test_a_missing_marker_or_rank_is_named_and_the_other_ranks_are_still_checked(run):
    """Step 1 rank 0 lost its marker, step 2 rank 0 everything; rank 1's markers of those steps
    name a file that is missing: each problem is reported, by validate and, but for the
    incomplete steps that readers skip, by the footer check. Step 0 rank 1 wrote no rows: its
    marker names no file, which is fine."""
    complete = run / fmt.COMPLETE_DIR
    (complete / "step=00000001.rank=00000.json").unlink()
    (complete / "step=00000002.rank=00000.json").unlink()
    for step, rank in ((2, 0), (0, 1)):
        for table in fmt.TABLES:
            (run / fmt.shard_relpath(table, step, rank)).unlink()

    def edit(step, rank, files):
        marker = run / fmt.marker_relpath(step, rank)
        marker.write_text(json.dumps({**json.loads(marker.read_text()), "files": files}))
    edit(0, 1, [])
    missing = {step: f"samples/step=0000000{step}/rank=00001-0001.parquet" for step in (1, 2)}
    for step in (1, 2):
        edit(step, 1, [f for t in fmt.TABLES for f in [fmt.shard_relpath(t, step, 1)]] + [missing[step]])
    got = sorted((p.severity, p.path, p.column, p.message) for p in validate_run(run).problems)
    assert got == sorted([
        (ERROR, fmt.marker_relpath(1, 0), None, "step 1 rank 0: shards without a completion marker (its writer "
         "stopped before the step ended); readers skip step 1"),
        (ERROR, fmt.marker_relpath(2, 0), None, "step 2 rank 0: missing (no shards and no completion marker, "
         "world_size 2); readers skip step 2"),
        (ERROR, fmt.marker_relpath(1, 1), None, f"names {missing[1]}, which is missing"),
        (ERROR, fmt.marker_relpath(2, 1), None, f"names {missing[2]}, which is missing"),
    ])
    with pytest.raises(fmt.RunFormatError) as e:
        check_before_reading(run)
    assert (e.value.path, e.value.message) == (
        str(run / fmt.marker_relpath(1, 1)), f"names {missing[1]}, which is missing (and 1 more problems: run "
        f"`grpolens validate {run}`)")


def test_a_run_whose_complete_folder_is_gone_names_every_step_and_rank(run):
    shutil.rmtree(run / fmt.COMPLETE_DIR)
    got = sorted((p.severity, p.path, p.column, p.message) for p in validate_run(run).problems)
    assert got == sorted([
        (ERROR, fmt.marker_relpath(step, rank), None, f"step {step} rank {rank}: shards without a completion "
         f"marker (its writer stopped before the step ended); readers skip step {step}")
        for step in range(3) for rank in range(2)] + [
        (WARNING, fmt.COMPLETE_DIR, None, "no finished record for rank(s) 0, 1: still training, or stopped "
         "before the writer was closed")])


def test_a_run_written_without_completion_markers_is_a_warning(run):
    shutil.rmtree(run / fmt.COMPLETE_DIR)
    m = json.loads((run / fmt.MANIFEST_NAME).read_text())
    m["completion_markers"] = False
    (run / fmt.MANIFEST_NAME).write_text(json.dumps(m))
    assert [(p.severity, p.path, p.column, p.message) for p in validate_run(run).problems] == [
        (WARNING, fmt.MANIFEST_NAME, None, "written without completion markers (before grpolens wrote them, or by "
         "another tool): a step cut short by a killed writer, or missing a rank, cannot be told from a whole one; "
         "readers take every step as it is")]


def test_no_token_shards(run):
    shutil.rmtree(run / "tokens")
    remark(run)
    report = validate_run(run)
    assert not report.errors  # a samples-only (imported) run is valid
    assert Problem(WARNING, "tokens", None, "no token shards: a samples-only run; per-token (policy, KL, clip, "
                   "mismatch) metrics are unavailable") in report.warnings
    shutil.rmtree(run / "samples")
    shutil.rmtree(run / fmt.COMPLETE_DIR)
    assert _only(validate_run(run)) == Problem(
        ERROR, "tokens", None, "no token or samples shards: expected tokens/step=<8 digits>/rank=<5 digits>.parquet")


@pytest.mark.parametrize("table", [TOK, SMP])
@pytest.mark.parametrize("column", ["step", "rank"])
def test_content_disagrees_with_path(run, column, table):
    def shift(t):
        i = t.schema.get_field_index(column)
        return t.set_column(i, t.schema.field(i), pc.add(t.column(column), pa.scalar(1, t.schema.field(i).type)))
    _rewrite(run / table, shift)
    p = _only(validate_run(run))
    assert (p.path, p.column) == (table, column) and f"{column}={2 if column == 'step' else 1}" in p.message
    assert f"path says {column}={1 if column == 'step' else 0}" in p.message


def test_content_disagreeing_with_the_path_is_counted_over_record_batches(run, monkeypatch):
    """Batches of 4 rows: step 5 in row 1 (first batch), step 7 in row 9 (third): both counted, the
    first named."""
    import grpolens.run.validate as v

    monkeypatch.setattr(v.validator, "_BATCH_ROWS", 4)

    def steps(t):
        values = t["step"].to_pylist()
        values[1], values[9] = 5, 7
        return t.set_column(t.schema.get_field_index("step"), t.schema.field("step"),
                            pa.array(values, t.schema.field("step").type))
    _rewrite(run / TOK, steps)
    assert validate_run(run).problems == [Problem(ERROR, TOK, "step", "2 rows hold step=5 (or another value) but "
                                                  "the path says step=1")]


def test_micro_batch_split_across_parts(run):
    t = pq.read_table(run / TOK)
    (run / TOK).unlink()
    mb0 = int(np.sum(t.column("micro_batch").to_numpy() == 0))
    pq.write_table(t.slice(0, mb0 // 2), run / "tokens/step=00000001/rank=00000-0000.parquet")
    pq.write_table(t.slice(mb0 // 2), run / "tokens/step=00000001/rank=00000-0001.parquet")
    remark(run)
    p = _only(validate_run(run))
    assert p.column == "micro_batch" and "micro_batch 0 of step 1 rank 0 is split" in p.message
    with pytest.raises(fmt.RunFormatError) as e:  # the footers' micro_batch ranges show it too
        check_before_reading(run)
    assert (e.value.column, e.value.message) == ("micro_batch", p.message)


def test_a_micro_batch_of_one_row_split_across_parts(run):
    """Part 0 ends with the first row of micro_batch 1, part 1 holds the rest of it."""
    t = pq.read_table(run / TOK)
    (run / TOK).unlink()
    cut = int(np.sum(t.column("micro_batch").to_numpy() == 0)) + 1
    parts = [f"tokens/step=00000001/rank=00000-000{i}.parquet" for i in (0, 1)]
    pq.write_table(t.slice(0, cut), run / parts[0])
    pq.write_table(t.slice(cut), run / parts[1])
    remark(run)
    (problem,) = validate_run(run).problems
    assert problem == Problem(ERROR, parts[1], "micro_batch", (
        f"micro_batch 1 of step 1 rank 0 is split across part files {parts[0]}, {parts[1]}; the writer keeps a "
        "loss call in one part"))
    with pytest.raises(fmt.RunFormatError) as e:  # the footers' ranges 0..1 and 1..1 show it too
        check_before_reading(run)
    assert (e.value.path, e.value.column, e.value.message) == (str(run / parts[1]), "micro_batch", problem.message)


def test_a_micro_batch_split_across_three_parts_is_named_at_the_last_in_part_order(run):
    """The unsuffixed file is the first part (it sorts after "-0001" by name): the message lists
    the parts in the writer's order and names the last."""
    t = pq.read_table(run / TOK)
    n = int(np.sum(t.column("micro_batch").to_numpy() == 0))
    parts = [TOK, TOK.replace(".parquet", "-0001.parquet"), TOK.replace(".parquet", "-0002.parquet")]
    cuts = [0, n // 3, 2 * n // 3, t.num_rows]
    for part, lo, hi in zip(parts, cuts, cuts[1:]):
        pq.write_table(t.slice(lo, hi - lo), run / part)
    remark(run)
    assert validate_run(run).problems == [Problem(ERROR, parts[2], "micro_batch", (
        f"micro_batch 0 of step 1 rank 0 is split across part files {', '.join(parts)}; the writer keeps a loss "
        "call in one part"))]


def test_duplicates_across_parts_are_counted_past_an_unreadable_part(run):
    """Three parts hold micro_batch 0: the first lacks pos (its keys cannot be read), the other
    two are the same rows: every one of those rows is a duplicate, named at the first part."""
    t = pq.read_table(run / TOK)
    (run / TOK).unlink()
    parts = [TOK.replace(".parquet", f"-000{i}.parquet") for i in range(3)]
    pq.write_table(t.drop_columns(["pos"]), run / parts[0])
    for part in parts[1:]:
        pq.write_table(t, run / part)
    remark(run)
    errors = validate_run(run).errors
    assert Problem(ERROR, parts[0], "pos", "required column missing (expected int32)") in errors
    assert Problem(ERROR, parts[0], None, f"{t.num_rows:,} duplicate (step, rank, micro_batch, sample_id, pos) "
                   "keys across the part files of step 1 rank 0") in errors


def test_a_duplicate_within_one_part_is_not_counted_across_parts(run):
    """micro_batch 0 split across two parts, the second repeating one of its own rows: the split,
    and the duplicate of that part; no key is in both parts, so no duplicate across them."""
    t = pq.read_table(run / TOK)
    (run / TOK).unlink()
    half = int(np.sum(t.column("micro_batch").to_numpy() == 0)) // 2
    parts = [TOK.replace(".parquet", f"-000{i}.parquet") for i in (0, 1)]
    pq.write_table(t.slice(0, half), run / parts[0])
    pq.write_table(t.take(np.r_[half, np.arange(half, t.num_rows)]), run / parts[1])
    remark(run)
    assert sorted((p.path, p.column or "", p.message.split(";")[0]) for p in validate_run(run).problems) == [
        (parts[1], "", "1 duplicate (step, rank, micro_batch, sample_id, pos) keys"),
        (parts[1], "micro_batch", f"micro_batch 0 of step 1 rank 0 is split across part files {parts[0]}, {parts[1]}")]


def test_null_keys_take_no_part_in_the_split_and_cross_part_checks(run):
    """Two parts repeat one loss call, each with a null micro_batch in row 3 and a null pos in row 5:
    the nulls are their errors; a null micro_batch is no micro_batch split across the parts, and a
    row with a null key is no duplicate across them."""
    t = pq.read_table(run / TOK)
    (run / TOK).unlink()

    def null(t, column, row):
        i = t.schema.get_field_index(column)
        values = t[column].to_pylist()
        values[row] = None
        return t.set_column(i, pa.field(column, t.schema.field(i).type, nullable=True),
                            pa.array(values, t.schema.field(i).type))
    parts = [TOK.replace(".parquet", f"-000{i}.parquet") for i in (0, 1)]
    for part in parts:
        pq.write_table(null(null(t, "micro_batch", 3), "pos", 5), run / part)
    remark(run)
    got = sorted((p.path, p.column or "", p.message.split(";")[0]) for p in validate_run(run).problems)
    assert got == sorted(
        [(parts[1], "micro_batch", f"micro_batch {mb} of step 1 rank 0 is split across part files {parts[0]}, "
          f"{parts[1]}") for mb in sorted(set(t["micro_batch"].to_pylist()))] +
        [(part, c, "1 null values in a non-nullable column") for part in parts for c in ("micro_batch", "pos")] +
        [(parts[0], "", f"{t.num_rows - 2:,} duplicate (step, rank, micro_batch, sample_id, pos) keys across the "
          "part files of step 1 rank 0")])
    first = validate_run(run).errors[0]
    with pytest.raises(fmt.RunFormatError) as e:  # the footer check reads these parts' rows: the same errors
        check_before_reading(run)
    assert (e.value.path, e.value.message) == (str(run / first.path), first.message + (
        f" (and {len(got) - 1} more problems: run `grpolens validate {run}`)"))


def test_parts_repeating_a_loss_call_are_split_and_duplicated(run):
    t = pq.read_table(run / TOK)
    (run / TOK).unlink()
    pq.write_table(t, run / "tokens/step=00000001/rank=00000-0000.parquet")
    pq.write_table(t, run / "tokens/step=00000001/rank=00000-0001.parquet")
    msgs = [p.message for p in validate_run(run).errors]
    assert sum("is split across part files" in m for m in msgs) == 2  # micro-batches 0 and 1
    assert any(m.startswith(f"{t.num_rows} duplicate") and "across the part files" in m for m in msgs)


def test_parts_that_keep_loss_calls_whole_are_fine(run):
    t = pq.read_table(run / TOK)
    (run / TOK).unlink()
    mb0 = int(np.sum(t.column("micro_batch").to_numpy() == 0))
    pq.write_table(t.slice(0, mb0), run / "tokens/step=00000001/rank=00000.parquet")  # unsuffixed + later part
    pq.write_table(t.slice(mb0), run / "tokens/step=00000001/rank=00000-0001.parquet")
    remark(run)
    assert validate_run(run).problems == []


def test_every_problem_is_reported_at_once(run):
    (run / fmt.MANIFEST_NAME).unlink()
    _rewrite(run / TOK, lambda t: t.drop_columns(["mask"]))
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


# -- the command --------------------------------------------------------------------------------

def test_cli_exit_codes_and_output(cli, run, tmp_path):
    r = cli("validate", run)
    assert r.code == 0 and "OK" in r.err
    _rewrite(run / TOK, lambda t: t.drop_columns(["advantage"]))
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


# -- samples rows: only the usable columns are read ---------------------------------------------

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
    _rewrite(run / SMP, mistype)
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
    _rewrite(run / SMP, null_two)
    report = validate_run(run)
    assert [(p.path, p.column, p.message) for p in report.errors] == [
        (SMP, "sample_id", "2 null values in a non-nullable column")]
    orphans = _only(report, WARNING)
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
    _rewrite(run / SMP, null_and_reuse)
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
    _rewrite(run / SMP, lambda t: _not_utf8(t, "completion", bad_row))
    assert pq.ParquetFile(run / SMP).metadata.num_rows > bad_row
    p = _only(validate_run(run))
    assert (p.path, p.column) == (SMP, "completion")
    assert p.message.startswith(f"1 value(s) are not valid UTF-8 (first at row {bad_row});")


def test_invalid_utf8_in_several_record_batches_is_counted_over_all(run, monkeypatch):
    """Batches of 2 rows, bad bytes in rows 1 and 5 (the first and the third batch): 2 values,
    the first at row 1."""
    import grpolens.run.validate as v

    monkeypatch.setattr(v.validator, "_BATCH_ROWS", 2)
    monkeypatch.delenv("GRPOLENS_INVALID_UTF8", raising=False)
    _rewrite(run / SMP, lambda t: _not_utf8(t, "completion", 1, 5))
    p = _only(validate_run(run))
    assert (p.path, p.column) == (SMP, "completion")
    assert p.message.startswith("2 value(s) are not valid UTF-8 (first at row 1);")


def test_invalid_utf8_is_a_warning_when_the_user_chose_to_replace_it(run, monkeypatch):
    """Under --invalid-utf8 replace the text is readable (its bad bytes replaced): a warning only."""
    monkeypatch.setenv("GRPOLENS_INVALID_UTF8", "replace")
    _rewrite(run / SMP, lambda t: _not_utf8(t, "prompt", 3))
    report = validate_run(run)
    assert report.errors == [] and report.ok
    p = _only(report, WARNING)
    assert (p.path, p.column) == (SMP, "prompt")
    assert p.message.startswith("1 value(s) are not valid UTF-8 (first at row 3);")
