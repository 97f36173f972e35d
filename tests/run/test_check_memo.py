"""recompute remembers which files passed the pre-read check (RUN/grpolens/cache/checked.json).

A re-run opens no Parquet footer of an unchanged file; a changed, new or replaced file is checked
as if there were no memo, and run-wide rules (unique sample_id, completion markers) still see every
file. Each test drives the real check through ``recompute`` on a synthetic run; "not opened" is
shown by a file damaged behind the memo's back (same size, time and inode) that a memoised re-run
does not notice while ``--full`` and every other command do.
"""

from __future__ import annotations

import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpolens.adapters.synth import synth_run
from grpolens.analysis.recompute import recompute
from grpolens.errors import RunFormatError
from grpolens.run import format as fmt
from grpolens.run.tree import tree_digest
from grpolens.run.validate import check_before_reading, validate_run

TOK1 = "tokens/step=00000001/rank=00000.parquet"
SMP2 = "samples/step=00000002/rank=00000.parquet"


@pytest.fixture
def run(tmp_path):
    return synth_run(tmp_path / "run", steps=3, ranks=1, groups=2, generations=3, max_len=16, seed=1)


def _memo(run) -> dict:
    return json.loads((fmt.derived_dir(run) / "cache" / "checked.json").read_text())


def _damage_in_place(path) -> None:
    """Garbage of the same size, written into the same inode, with the old times put back."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.write(b"\0" * st.st_size)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_first_recompute_remembers_every_file_and_marker(run):
    recompute(run)
    memo = _memo(run)
    on_disk = {sh.relpath() for t in fmt.TABLES for sh in fmt.list_shards(run, t)}
    assert set(memo["files"]) == on_disk
    assert len(memo["markers"]) == 3  # one per (step, rank)


def test_rerun_does_not_open_unchanged_files_but_full_and_other_commands_do(run):
    recompute(run)
    _damage_in_place(run / TOK1)
    # nothing new: the memo vouches for the file, and the cached rows need no read of it
    recompute(run)
    with pytest.raises(RunFormatError, match="unreadable or truncated Parquet file") as e:
        recompute(run, incremental=False)  # --full: every file checked again
    assert e.value.path.endswith(TOK1)
    with pytest.raises(RunFormatError, match="unreadable or truncated Parquet file"):
        check_before_reading(run)  # what tokens, completions, check, serve, ... run


def test_a_rewritten_file_is_checked_again(run):
    recompute(run)
    t = pq.read_table(run / TOK1)
    logp = pa.array([0.5] * t.num_rows, pa.float32())  # positive log-probs: an error
    pq.write_table(t.set_column(t.schema.get_field_index("logp"), "logp", logp), run / TOK1)
    with pytest.raises(RunFormatError, match="positive log-probabilities"):
        recompute(run)


def test_memoised_samples_still_take_part_in_the_unique_sample_id_rule(run):
    # a samples part without rows (remembered with no ids) keeps the ids integers
    empty = "samples/step=00000001/rank=00000-0001.parquet"
    pq.write_table(pq.read_table(run / "samples/step=00000001/rank=00000.parquet").slice(0, 0), run / empty)
    marker = run / fmt.marker_relpath(1, 0)
    marker.write_text(json.dumps({**json.loads(marker.read_text()),
                                  "files": sorted([*json.loads(marker.read_text())["files"], empty])}))
    recompute(run)
    assert _memo(run)["files"][empty][-1] == []
    # a rewritten step whose samples reuse an id of step 0 (a memoised, unopened file)
    smp1 = pq.read_table(run / "samples/step=00000000/rank=00000.parquet")
    t = pq.read_table(run / SMP2)
    ids = t.column("sample_id").to_pylist()
    ids[0] = smp1.column("sample_id")[0].as_py()
    pq.write_table(t.set_column(t.schema.get_field_index("sample_id"), "sample_id",
                                pa.array(ids, t.schema.field("sample_id").type)), run / SMP2)
    with pytest.raises(RunFormatError) as e:
        recompute(run)
    # named by the remembered file's path, as validate names it
    assert (e.value.path, e.value.column) == (str(run / SMP2), "sample_id")
    assert e.value.message == (f"1 duplicate sample_id values across the samples table (first: {ids[0]}, also in "
                               "samples/step=00000000/rank=00000.parquet); sample_id must be unique in a run")


def test_a_new_step_is_checked_and_remembered(run, tmp_path):
    longer = synth_run(tmp_path / "longer", steps=4, ranks=1, groups=2, generations=3, max_len=16, seed=1)
    recompute(run)
    before = _memo(run)
    # the fourth step (3) of the same seed, added as a writer would add it (shards, then its marker)
    for rel in ("tokens/step=00000003", "samples/step=00000003"):
        shutil.copytree(longer / rel, run / rel)
    marker = fmt.marker_relpath(3, 0)
    shutil.copy2(longer / marker, run / marker)
    recompute(run)
    after = _memo(run)
    assert {k: v for k, v in after["files"].items() if k in before["files"]} == before["files"]
    assert set(after["files"]) - set(before["files"]) == {
        "tokens/step=00000003/rank=00000.parquet", "samples/step=00000003/rank=00000.parquet"}


def test_a_failed_recompute_writes_no_memo(run, monkeypatch):
    monkeypatch.setenv("GRPOLENS_INCOMPLETE", "fail")
    (run / fmt.marker_relpath(2, 0)).unlink()  # step 2 incomplete: refused under the fail policy
    with pytest.raises(RunFormatError):
        recompute(run)
    assert not (fmt.derived_dir(run) / "cache" / "checked.json").exists()


@pytest.mark.parametrize("junk", [b"{not json", b"[]", b'{"checker": "another grpolens", "files": {}, "markers": {}}'])
def test_a_damaged_or_foreign_memo_trusts_nothing_and_is_rewritten(run, junk):
    recompute(run)
    path = fmt.derived_dir(run) / "cache" / "checked.json"
    path.write_bytes(junk)
    recompute(run)
    assert TOK1 in _memo(run)["files"]  # rewritten whole
    path.write_bytes(junk)
    _damage_in_place(run / TOK1)
    with pytest.raises(RunFormatError, match="unreadable or truncated"):
        recompute(run)  # nothing trusted: the damaged file is found


# -- the memo through the API (recompute keeps one; so may any caller) ---------------------------

def _first_check(run, memo):
    report = check_before_reading(run, memo)
    report.memo.save(memo)
    return report


def test_a_memo_records_the_run_tree_every_file_and_every_marker(run, tmp_path):
    memo = tmp_path / "not" / "yet" / "checked.json"  # save makes its folders
    first = _first_check(run, memo)  # no tree given: the check takes the run's digest itself
    assert first.memo.changed and first.memo.tree == tree_digest(run)
    on_disk = {sh.relpath(): t for t in fmt.TABLES for sh in fmt.list_shards(run, t)}
    assert {rel: entry[3] for rel, entry in first.memo.files.items()} == on_disk
    assert all(len(entry) == 6 for entry in first.memo.files.values())
    assert set(first.memo.markers) == {fmt.marker_relpath(step, 0) for step in range(3)}
    again = check_before_reading(run, memo)  # not one entry changed: nothing is opened
    assert again.ok and again.run == run and not again.memo.changed
    assert (again.memo.tree, again.memo.files, again.memo.markers) == (first.memo.tree, first.memo.files,
                                                                       first.memo.markers)


def test_unchanged_files_and_markers_are_recalled_when_another_entry_changed(run, tmp_path):
    """A new entry changes the run's digest: the remembered files and markers are still not
    opened (damaged in place, unnoticed), and their row counts come from the memo."""
    memo = tmp_path / "checked.json"
    rows = _first_check(run, memo).rows
    assert rows == validate_run(run).rows
    _damage_in_place(run / TOK1)
    _damage_in_place(run / fmt.marker_relpath(1, 0))
    (run / "notes.txt").write_text("not part of the run")  # a warning of its own
    report = check_before_reading(run, memo)
    assert report.ok and report.rows == rows and report.files == {"tokens": 3, "samples": 3}
    assert report.memo.changed and report.memo.tree == tree_digest(run)


def test_a_new_part_that_splits_a_remembered_loss_call_is_refused(run, tmp_path):
    """The remembered part's micro_batch range takes part in the split check like a new file's."""
    memo = tmp_path / "checked.json"
    _first_check(run, memo)
    t = pq.read_table(run / TOK1)
    late = TOK1.replace(".parquet", "-0001.parquet")
    pq.write_table(t.slice(0, 1), run / late)
    with pytest.raises(RunFormatError) as e:
        check_before_reading(run, memo)
    assert (e.value.column, e.value.message.split(";")[0]) == (
        "micro_batch", f"micro_batch 0 of step 1 rank 0 is split across part files {TOK1}, {late}")


@pytest.mark.parametrize("edit", [
    lambda m: m.update(checker="another grpolens"),
    lambda m: m.update(files=list(m["files"])),
    lambda m: m.update(markers=list(m["markers"])),
])
def test_a_memo_of_another_checker_or_shape_trusts_nothing(run, tmp_path, edit):
    memo = tmp_path / "checked.json"
    _first_check(run, memo)
    data = json.loads(memo.read_text())
    edit(data)
    memo.write_text(json.dumps(data))
    _damage_in_place(run / TOK1)
    with pytest.raises(RunFormatError, match="unreadable or truncated Parquet file"):
        check_before_reading(run, memo)


@pytest.mark.parametrize("with_memo", [False, True])
def test_a_marker_problem_is_refused_with_validates_message(run, tmp_path, with_memo):
    late = "samples/step=00000001/rank=00000-0001.parquet"  # no rows: its only problem is the marker's
    pq.write_table(pq.read_table(run / "samples/step=00000001/rank=00000.parquet").slice(0, 0), run / late)
    with pytest.raises(RunFormatError) as e:
        check_before_reading(run, tmp_path / "checked.json" if with_memo else None)
    assert e.value.path == str(run / late)
    assert e.value.message.startswith("not named by the completion marker of step 1 rank 0: written after it")
