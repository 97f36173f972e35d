"""validate: files and layout: unreadable or truncated Parquet, stray files, completion markers,
content that disagrees with its path, micro-batches split across parts."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from grpolens.run import format as fmt
from grpolens.run.validate import ERROR, WARNING, Problem, check_before_reading, validate_run

from tests.run.validate.helpers import SMP, TOK, only, rewrite, remark


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_unreadable_or_truncated_parquet(run, damage):
    p = run / TOK
    data = p.read_bytes()
    p.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"PAR1 not really", "empty": b""}[damage])
    err = only(validate_run(run))
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
    rewrite(run / SMP, fn)
    report = validate_run(run)
    (problem,) = report.problems
    assert (problem.severity, problem.path, problem.column) == (ERROR, SMP, "sample_id")


@pytest.mark.parametrize("column", ["micro_batch", "sample_id", "pos"])
def test_negative_key_values(run, column):
    def negate(t):  # every value minus a constant: order and uniqueness kept, the values negative
        i = t.schema.get_field_index(column)
        return t.set_column(i, t.schema.field(i), pc.subtract(t[column], pa.scalar(10_000, t.schema.field(i).type)))
    rewrite(run / TOK, negate)
    if column == "sample_id":
        rewrite(run / SMP, negate)  # the same ids in the samples: no orphan rows, and an error there too
        assert [(p.path, p.column, p.message) for p in validate_run(run).errors] == [
            (path, column, "negative values (must be >= 0)") for path in (SMP, TOK)]
        return
    p = only(validate_run(run))
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
    assert only(validate_run(run)) == Problem(
        ERROR, "tokens", None, "no token or samples shards: expected tokens/step=<8 digits>/rank=<5 digits>.parquet")


@pytest.mark.parametrize("table", [TOK, SMP])
@pytest.mark.parametrize("column", ["step", "rank"])
def test_content_disagrees_with_path(run, column, table):
    def shift(t):
        i = t.schema.get_field_index(column)
        return t.set_column(i, t.schema.field(i), pc.add(t.column(column), pa.scalar(1, t.schema.field(i).type)))
    rewrite(run / table, shift)
    p = only(validate_run(run))
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
    rewrite(run / TOK, steps)
    assert validate_run(run).problems == [Problem(ERROR, TOK, "step", "2 rows hold step=5 (or another value) but "
                                                  "the path says step=1")]


def test_micro_batch_split_across_parts(run):
    t = pq.read_table(run / TOK)
    (run / TOK).unlink()
    mb0 = int(np.sum(t.column("micro_batch").to_numpy() == 0))
    pq.write_table(t.slice(0, mb0 // 2), run / "tokens/step=00000001/rank=00000-0000.parquet")
    pq.write_table(t.slice(mb0 // 2), run / "tokens/step=00000001/rank=00000-0001.parquet")
    remark(run)
    p = only(validate_run(run))
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
