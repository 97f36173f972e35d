"""ShardWriter: exact types, ordering, parts, never-overwrite, atomicity under kill, back-pressure, errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpolens.run import format as fmt
from grpolens.capture import writer as writer_mod
from grpolens.capture.writer import RunExistsError, ShardWriter, WriterError

HELPER = Path(__file__).parents[1] / "helpers" / "kill_writer.py"


def token_chunk(rng, n_seq=3, max_len=7, first_id=0, shuffle=True, **extra):
    """Random token columns for one loss call: ragged sequences, rows optionally shuffled."""
    lens = rng.integers(1, max_len + 1, n_seq)
    sid = np.repeat(np.arange(first_id, first_id + n_seq, dtype=np.int64), lens)
    pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lens])
    n = len(sid)
    cols = {"sample_id": sid, "pos": pos, "logp": -rng.random(n).astype(np.float32),
            "advantage": rng.standard_normal(n).astype(np.float32), "mask": rng.random(n) < 0.8, **extra}
    if shuffle:
        perm = rng.permutation(n)
        cols = {k: (v[perm] if isinstance(v, np.ndarray) else v) for k, v in cols.items()}
    return cols


def read_all(run, table=fmt.TOKENS):
    shards = fmt.list_shards(run, table)
    return shards, [pq.read_table(s.path) for s in shards]


def test_single_file_exact_schema_and_types(tmp_path):
    rng = np.random.default_rng(0)
    cols = token_chunk(rng)
    n = len(cols["pos"])
    # Inputs in "wrong" dtypes on purpose: the writer converts to the format's exact types.
    cols = {**cols, "pos": cols["pos"].astype(np.int64), "logp": cols["logp"].astype(np.float64),
            "mask": cols["mask"].astype(np.int8), "token_id": rng.integers(0, 50000, n),
            "old_logp": rng.random(n), "entropy": None}
    with ShardWriter(tmp_path, rank=3, world_size=4) as w:
        w.add_tokens(7, 0, cols)
        w.end_step(7)
    path = tmp_path / "tokens/step=00000007/rank=00003.parquet"
    assert [s.path for s in fmt.list_shards(tmp_path)] == [path]
    schema = pq.read_schema(path)
    expected = fmt.arrow_schema(fmt.TOKENS, ["step", "rank", "micro_batch", "sample_id", "pos", "token_id", "logp",
                                             "old_logp", "advantage", "mask"])
    assert schema.equals(expected, check_metadata=False), schema
    t = pq.read_table(path)
    assert t.column("step").to_pylist() == [7] * n and t.column("rank").to_pylist() == [3] * n
    # Independent reference: python-sorted rows of the input.
    ref = sorted(zip(cols["sample_id"].tolist(), cols["pos"].tolist(), cols["logp"].astype(np.float32).tolist(),
                     (cols["mask"] != 0).tolist(), cols["token_id"].tolist()))
    got = list(zip(*(t.column(c).to_pylist() for c in ("sample_id", "pos", "logp", "mask", "token_id"))))
    assert got == ref


def test_rows_sorted_by_micro_batch_sample_pos_stable(tmp_path):
    rng = np.random.default_rng(1)
    calls = {}
    with ShardWriter(tmp_path) as w:
        for mb in (2, 0, 1):  # out of order
            c = token_chunk(rng, n_seq=4, first_id=10 - 3 * mb)
            # duplicate (sample_id, pos) keys inside a call: their arrival order must be kept
            c = {k: np.concatenate([v, v]) for k, v in c.items()}
            c["logp"] = np.arange(len(c["logp"]), dtype=np.float32)  # arrival index as payload
            calls[mb] = c
            w.add_tokens(0, mb, c)
        w.end_step(0)
    (t,) = read_all(tmp_path)[1]
    ref = sorted((mb, int(s), int(p), float(i)) for mb, c in calls.items()
                 for s, p, i in zip(c["sample_id"], c["pos"], c["logp"]))  # ties broken by arrival: stable
    got = list(zip(*(t.column(k).to_pylist() for k in ("micro_batch", "sample_id", "pos", "logp"))))
    assert got == ref


def test_optional_column_present_in_some_calls_is_null_elsewhere(tmp_path):
    rng = np.random.default_rng(2)
    a, b = token_chunk(rng, shuffle=False), token_chunk(rng, first_id=100, shuffle=False)
    a["ref_logp"] = np.full(len(a["pos"]), -1.5)
    with ShardWriter(tmp_path) as w:
        w.add_tokens(0, 0, a)
        w.add_tokens(0, 1, b)
    (t,) = read_all(tmp_path)[1]
    ref = t.column("ref_logp").to_pylist()
    assert ref == [-1.5] * len(a["pos"]) + [None] * len(b["pos"])
    assert "old_logp" not in t.column_names and "entropy" not in t.column_names


def test_parts_split_only_between_loss_calls(tmp_path):
    rng = np.random.default_rng(3)
    limit = 40
    sizes = {}
    with ShardWriter(tmp_path, max_part_rows=limit) as w:
        for mb in range(12):
            c = token_chunk(rng, n_seq=int(rng.integers(1, 8)), max_len=9, first_id=mb * 100)
            sizes[mb] = len(c["pos"])
            w.add_tokens(5, mb, c)
        w.end_step(5)
    shards, tables = read_all(tmp_path)
    assert [s.part for s in shards] == list(range(len(shards))) and len(shards) > 2
    assert all(s.path.name == f"rank=00000-{s.part:04d}.parquet" for s in shards)
    owner = {}
    for s, t in zip(shards, tables):
        mbs = set(t.column("micro_batch").to_pylist())
        for mb in mbs:
            assert mb not in owner, f"micro_batch {mb} in two parts"
            owner[mb] = s.part
            assert t.column("micro_batch").to_pylist().count(mb) == sizes[mb]
        assert t.num_rows <= limit or len(mbs) == 1
    assert sorted(owner) == list(range(12))
    # Greedy: a part was closed only because the next call would not fit.
    for t, nxt in zip(tables, tables[1:]):
        first_next = min(nxt.column("micro_batch").to_pylist())
        assert t.num_rows + sizes[first_next] > limit


def test_end_step_twice_and_a_second_writer_never_overwrite(tmp_path):
    rng = np.random.default_rng(4)
    chunks = [token_chunk(rng, first_id=i * 10) for i in range(4)]
    with ShardWriter(tmp_path) as w:
        w.add_tokens(1, 0, chunks[0])
        w.end_step(1)
        w.flush()
        first = (tmp_path / "tokens/step=00000001/rank=00000.parquet").read_bytes()
        w.add_tokens(1, 1, chunks[1])
        w.end_step(1)
        w.add_tokens(1, 2, chunks[2])
        w.add_tokens(1, 3, chunks[3])
        w.flush()
        w.end_step(1)
    shards, tables = read_all(tmp_path)
    # the lone file became part 0 (unchanged) when part 1 arrived: one unsuffixed file or only parts
    assert [s.path.name for s in shards] == ["rank=00000-0000.parquet", "rank=00000-0001.parquet",
                                             "rank=00000-0002.parquet"]
    assert shards[0].path.read_bytes() == first
    assert [sorted(set(t.column("micro_batch").to_pylist())) for t in tables] == [[0], [1], [2, 3]]
    # a second writer (a relaunched process) is refused rather than adding parts to the run
    with pytest.raises(RunExistsError, match="already holds a grpolens run"):
        ShardWriter(tmp_path)


def test_flush_writes_open_steps_as_parts(tmp_path):
    rng = np.random.default_rng(5)
    w = ShardWriter(tmp_path)
    w.add_tokens(0, 0, token_chunk(rng))
    assert w.bytes_pending > 0
    w.flush()
    assert w.bytes_pending == 0
    assert [s.path.name for s in fmt.list_shards(tmp_path)] == ["rank=00000-0000.parquet"]
    w.add_tokens(0, 1, token_chunk(rng))
    w.close()
    w.close()  # idempotent
    assert [s.path.name for s in fmt.list_shards(tmp_path)] == ["rank=00000-0000.parquet", "rank=00000-0001.parquet"]
    with pytest.raises(RuntimeError, match="closed"):
        w.add_tokens(0, 2, token_chunk(rng))


def test_samples_rewards_text_and_nulls(tmp_path):
    with ShardWriter(tmp_path) as w:
        w.add_samples(3, {"sample_id": np.array([5, 6, 7]), "group_id": [1, 1, 2], "completion_len": [4, 0, 9],
                          "truncated": [False, False, True], "reward": np.array([1.0, np.nan, 0.5]),
                          "reward/format": [1.0, 0.0, 1.0], "reward/acc": np.array([np.nan, 1.0, 0.0]),
                          "completion": ["a", None, "<b>[red]x"], "prompt_len": np.array([3, 3, 8], np.uint16)})
        w.end_step(3)
    (t,) = read_all(tmp_path, fmt.SAMPLES)[1]
    expected = fmt.arrow_schema(fmt.SAMPLES, ["step", "rank", "sample_id", "group_id", "prompt_len", "completion_len",
                                              "truncated", "reward", "completion", "reward/format", "reward/acc"])
    assert t.schema.equals(expected, check_metadata=False), t.schema
    assert t.column("reward").to_pylist() == [1.0, None, 0.5]
    assert t.column("reward/acc").to_pylist() == [None, 1.0, 0.0]
    assert t.column("completion").to_pylist() == ["a", None, "<b>[red]x"]
    assert t.column_names[-2:] == ["reward/acc", "reward/format"]


def test_text_that_is_not_unicode_is_replaced_and_pandas_never_imported(tmp_path):
    # A separate interpreter: pa.array() would import pandas (a second holding the GIL) on first use;
    # and the writer must work without torch.
    code = f"""
import sys
from grpolens.capture.writer import ShardWriter
with ShardWriter({str(tmp_path)!r}) as w:
    w.add_samples(0, {{"sample_id": [1, 2], "group_id": [0, 0], "completion_len": [1, 2], "truncated": [0, 1],
                      "completion": ["ok \\ud800 \\u00e9", None], "reward": [0.5, None]}})
    w.add_tokens(0, 0, {{"sample_id": [1], "pos": [0], "logp": [-1.0], "advantage": [0.5], "mask": [True]}})
assert "pandas" not in sys.modules, "pandas was imported"
assert "torch" not in sys.modules, "the numpy writer imported torch"
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    (t,) = read_all(tmp_path, fmt.SAMPLES)[1]
    assert t.column("completion").to_pylist() == ["ok ? \u00e9", None]
    assert t.column("truncated").to_pylist() == [False, True] and t.column("reward").to_pylist() == [0.5, None]


@pytest.mark.parametrize("bad, message", [
    ({"pos": None}, "missing required column\\(s\\) 'pos'"),
    ({"logpp": np.zeros(3)}, "unknown column 'logpp'"),
    ({"step": np.zeros(3)}, "column 'step' is filled in by the writer"),
    ({"logp": np.zeros(4)}, "column 'logp' has 4 rows but column 'sample_id' has 3"),
    ({"logp": np.zeros((3, 1))}, "column 'logp' must be 1-D"),
    ({"logp": np.array(["a", "b", "c"])}, "column 'logp' must be float"),
])
def test_add_tokens_rejects_bad_columns_naming_them(tmp_path, bad, message):
    good = {"sample_id": np.zeros(3, np.int64), "pos": np.arange(3), "logp": np.zeros(3, np.float32),
            "advantage": np.zeros(3, np.float32), "mask": np.ones(3, bool)}
    with ShardWriter(tmp_path) as w:
        with pytest.raises(ValueError, match=message):
            w.add_tokens(0, 0, {**good, **bad})
        w.add_tokens(0, 0, good)
        with pytest.raises(ValueError, match="micro_batch 0 of step 0 was already written"):
            w.add_tokens(0, 0, good)


def test_manifest_written_by_rank_zero_only(tmp_path):
    m = fmt.Manifest(run_name="r", world_size=2, config={"epsilon": 0.3})
    ShardWriter(tmp_path / "one", rank=1, world_size=2, manifest=m).close()
    assert not (tmp_path / "one" / fmt.MANIFEST_NAME).exists()
    ShardWriter(tmp_path / "zero", rank=0, world_size=2, manifest=m).close()
    got = fmt.read_manifest(tmp_path / "zero")
    assert (got.run_name, got.world_size, got.config) == ("r", 2, {"epsilon": 0.3})


def test_background_exception_surfaces_on_next_call_and_on_close(tmp_path):
    rng = np.random.default_rng(6)
    (tmp_path / "tokens").mkdir()
    (tmp_path / "tokens" / "step=00000001").write_text("a file where the step directory should be")
    w = ShardWriter(tmp_path)
    w.add_tokens(1, 0, token_chunk(rng))
    w.end_step(1)
    with pytest.raises(WriterError) as info:  # flush waits for the failed write
        w.flush()
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(WriterError):
        w.add_tokens(2, 0, token_chunk(rng))
    with pytest.raises(WriterError):
        w.close()
    w.close()  # already closed: nothing more to report


def test_error_in_deferred_load_surfaces(tmp_path):
    def load():
        raise KeyError("boom")

    w = ShardWriter(tmp_path)
    w.add_tokens_deferred(0, 0, load, nbytes=10)
    deadline = time.monotonic() + 10
    with pytest.raises(WriterError, match="boom"):
        while time.monotonic() < deadline:  # the next call after the failure raises
            w.end_step(0)
            time.sleep(0.01)
    with pytest.raises(WriterError, match="boom"):
        w.close()


def test_back_pressure_keeps_pending_bytes_bounded(tmp_path, monkeypatch):
    real_write = writer_mod.atomic_write_table
    writes = []

    def slow_write(path, table, compression="zstd"):
        time.sleep(0.05)
        writes.append(table.num_rows)
        real_write(path, table, compression)

    monkeypatch.setattr(writer_mod, "atomic_write_table", slow_write)
    rng = np.random.default_rng(7)
    chunk = token_chunk(rng, n_seq=50, max_len=40, shuffle=False)
    chunk_bytes = sum(v.nbytes for v in chunk.values())
    bound = 3 * chunk_bytes
    w = ShardWriter(tmp_path, max_queue_bytes=bound)
    seen, stop = [], threading.Event()
    monitor = threading.Thread(target=lambda: [seen.append(w.bytes_pending) or time.sleep(0.002)
                                               for _ in iter(stop.is_set, True)])
    monitor.start()
    for step in range(12):
        w.add_tokens(step, 0, {k: v.copy() for k, v in chunk.items()})
        w.end_step(step)
        seen.append(w.bytes_pending)
    written_when_producer_done = len(writes)
    w.close()
    stop.set()
    monitor.join()
    assert max(seen) <= bound
    assert 12 * chunk_bytes > bound  # without back-pressure the queue would have held more than the bound
    # Adding takes microseconds and each write 50 ms: the producer can only have finished this far ahead
    # of the writer because it was made to wait (at most 3 chunks fit in the bound).
    assert written_when_producer_done >= 12 - 3
    assert len(writes) == 12 and len(fmt.list_shards(tmp_path)) == 12


def test_memory_bound_splits_an_open_step_instead_of_deadlocking(tmp_path):
    rng = np.random.default_rng(8)
    chunk = token_chunk(rng, n_seq=20, shuffle=False)
    nbytes = sum(v.nbytes for v in chunk.values())
    with ShardWriter(tmp_path, max_queue_bytes=int(2.5 * nbytes)) as w:
        for mb in range(10):  # one step, far more than the bound, no end_step until close
            w.add_tokens(0, mb, {k: v.copy() for k, v in chunk.items()})
            assert w.bytes_pending <= 2.5 * nbytes
    shards, tables = read_all(tmp_path)
    assert len(shards) > 1 and all(s.part >= 0 for s in shards)
    mbs = [sorted(set(t.column("micro_batch").to_pylist())) for t in tables]
    assert sorted(m for ms in mbs for m in ms) == list(range(10))  # every call in exactly one part


def _check_complete(run, steps_expected_min=0):
    """Every final-named shard is a complete, readable file holding exactly what the helper wrote."""
    sys.path.insert(0, str(HELPER.parent))
    try:
        from kill_writer import expected_step
    finally:
        sys.path.pop(0)
    shards = fmt.list_shards(run, complete_only=False)
    # readers see every step but, at most, the one being written when the kill came (no marker yet)
    unmarked = {s.step for s in shards} - {s.step for s in fmt.list_shards(run)}
    assert unmarked <= {max(s.step for s in shards)}, unmarked
    for s in shards:
        t = pq.read_table(s.path)  # raises on a truncated file
        exp = expected_step(s.step)
        assert t.num_rows == len(exp["logp"])
        np.testing.assert_array_equal(t.column("logp").to_numpy(), exp["logp"])
    steps = sorted(s.step for s in shards)
    assert steps == list(range(len(steps))), "shards are written in step order; none may be missing"
    assert len(steps) >= steps_expected_min
    leftovers = [p for p in Path(run, "tokens").rglob("*") if p.is_file() and p not in {s.path for s in shards}]
    assert all(p.name.startswith(".") and p.name.endswith(".tmp") for p in leftovers), leftovers
    return steps, leftovers


def test_kill_during_fsync_leaves_only_complete_shards(tmp_path):
    # The helper stops inside the fsync of step 3's temp file and says so: the kill lands mid-write.
    proc = subprocess.Popen([sys.executable, str(HELPER), str(tmp_path), "--stall-at-step", "3"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "started"
        assert proc.stdout.readline().strip() == "stalled"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    steps, leftovers = _check_complete(tmp_path)
    assert steps == [0, 1, 2]
    assert len(leftovers) == 1 and leftovers[0].parent.name == "step=00000003"  # the temp file, ignored by readers
    from grpolens.run.validate import validate_run

    assert validate_run(tmp_path).errors == []  # the leftover is a warning, the run is usable


def test_kill_at_random_moments_leaves_only_complete_shards(tmp_path):
    rng = np.random.default_rng(9)
    for trial in range(3):
        run = tmp_path / f"run{trial}"
        proc = subprocess.Popen([sys.executable, str(HELPER), str(run)], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "started"
            deadline = time.monotonic() + 20
            while len(fmt.list_shards(run)) < 2 and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(float(rng.uniform(0, 0.1)))
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        _check_complete(run, steps_expected_min=2)


def test_an_exception_leaves_the_open_step_unmarked_and_the_run_unfinished(tmp_path):
    """Leaving the ``with`` block by an exception writes the rows of the open step but does not
    mark it complete, nor the run finished: readers skip it."""
    from grpolens.run.format import read_completion

    rng = np.random.default_rng(9)
    with pytest.raises(KeyError):
        with ShardWriter(tmp_path, manifest=fmt.Manifest("r")) as w:
            w.add_tokens(0, 0, token_chunk(rng))
            w.end_step(0)
            w.add_tokens(1, 0, token_chunk(rng))
            raise KeyError("training failed in step 1")
    c = read_completion(tmp_path)
    assert c.complete_steps == [0] and not c.run_finished
    assert fmt.list_steps(tmp_path, complete_only=False) == [0, 1] and fmt.list_steps(tmp_path) == [0]
    # a normal close() of the same sequence marks the open step and the finish
    with ShardWriter(tmp_path / "ok", manifest=fmt.Manifest("r")) as w:
        w.add_tokens(0, 0, token_chunk(rng))
        w.end_step(0)
        w.add_tokens(1, 0, token_chunk(rng))
    c = read_completion(tmp_path / "ok")
    assert c.complete_steps == [0, 1] and c.run_finished


@pytest.mark.parametrize("mode", ["sideways", None, 1])
def test_unknown_mode_is_refused(tmp_path, mode):
    with pytest.raises(ValueError, match="mode must be one of new, resume, overwrite"):
        ShardWriter(tmp_path, mode=mode)
