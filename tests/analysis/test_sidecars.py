"""Rich-completion sidecars and completions.parquet: hand-worked content, JSON bytes, the reader,
and the per-sequence token columns against a numpy reference on padded arrays."""

import json
import math

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import grpolens
from grpolens.run import format as fmt
from grpolens.analysis import sidecars
from tests.refdata import LossCall, approx, widen_world, random_calls, write_run

COLS = ["step", "prompt_index", "completion_index", "group_size", "reward_rank_desc", "prompt", "completion",
        "reward_total", "advantage", "q_mass", "update_weight_raw", "update_mass_proxy", "reward/acc", "reward/fmt"]
NAN, INF = float("nan"), float("inf")


def _samples(rows: list[dict]) -> pa.Table:
    types = {"step": pa.int64(), "rank": pa.int32(), "sample_id": pa.int64(), "group_id": pa.int64(),
             "completion_len": pa.int32(), "truncated": pa.bool_(), "reward": pa.float64(), "advantage": pa.float32(),
             "prompt": pa.string(), "completion": pa.string(), "q_mass": pa.float64(),
             "reward/acc": pa.float64(), "reward/fmt": pa.float64()}
    return pa.table({k: pa.array([r[k] for r in rows], t) for k, t in types.items()})


def _row(rank, sid, gid, reward, adv, q, acc, fmt_, prompt, completion):
    return {"step": 3, "rank": rank, "sample_id": sid, "group_id": gid, "completion_len": 2, "truncated": False,
            "reward": reward, "advantage": adv, "prompt": prompt, "completion": completion, "q_mass": q,
            "reward/acc": acc, "reward/fmt": fmt_}


@pytest.fixture
def hand_run(tmp_path):
    """Step 3 on two ranks. Group 7 (rank 0) has a MaxEnt q; group 9 straddles the ranks, has a
    reward tie (ids 12 and 2), a NaN and a null reward and a non-finite q; group 4 is one
    completion without text. Rank 1's ids are *smaller*: gather order is rank-major."""
    rank0 = [_row(0, 10, 7, 1.0, 0.5, 0.75, 1.0, 0.5, "P7", "a b"),
             _row(0, 11, 7, 0.0, -0.5, 0.25, 0.0, None, "P7", "<script>x</script>"),
             _row(0, 12, 9, 1.0, 1.0, 0.4, 1.0, 0.0, "P9", "c"),
             _row(0, 13, 9, NAN, -2.0, NAN, None, 0.0, "P9", "d")]
    rank1 = [_row(1, 1, 9, 1.0, 1.0, 0.3, 1.0, 0.0, "P9", "e"),
             _row(1, 2, 9, None, -1.0, 0.3, 0.0, 0.0, "P9", "[bold]f"),
             _row(1, 3, 4, 2.0, 0.0, None, INF, 1.0, None, None)]
    run = tmp_path / "run"
    # tokens for sample 10 only: logp (-1, -2), ref (-1, -1.5), both masked
    call = LossCall(3, 0, 0, np.array([10]), np.array([2]), np.array([[-1.0, -2.0]]), np.array([[True, True]]),
                    np.array([0.5]), ref=np.array([[-1.0, -1.5]]))
    write_run(run, [call])
    widen_world(run, 1)
    for rank, rows in ((0, rank0), (1, rank1)):
        p = run / fmt.shard_relpath(fmt.SAMPLES, 3, rank)
        p.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(_samples(rows), p)
    return run


# Worked by hand from the rules in grpolens/analysis/sidecars/ (gather order 10, 11, 12, 13, 1, 2, 3):
# group 7 -> prompt_index 0: q finite, Σq = 1 -> weight = mass = q.
# group 9 -> 1: rewards 1, NaN, 1, null -> ranks 1, 3, 2 (tie: lower completion_index first), 4;
#   q has a NaN -> weight = advantage (1, -2, 1, -1); mass = max(A,0)/Σ = (.5, 0, .5, 0).
# group 4 -> 2: q null -> weight = A = 0; Σ max(A, 0) = 0 -> mass null.
EXPECTED = [
    [3, 0, 0, 2, 1, "P7", "a b", 1.0, 0.5, 0.75, 0.75, 0.75, 1.0, 0.5],
    [3, 0, 1, 2, 2, "P7", "<script>x</script>", 0.0, -0.5, 0.25, 0.25, 0.25, 0.0, None],
    [3, 1, 0, 4, 1, "P9", "c", 1.0, 1.0, 0.4, 1.0, 0.5, 1.0, 0.0],
    [3, 1, 1, 4, 3, "P9", "d", None, -2.0, None, -2.0, 0.0, None, 0.0],
    [3, 1, 2, 4, 2, "P9", "e", 1.0, 1.0, 0.3, 1.0, 0.5, 1.0, 0.0],
    [3, 1, 3, 4, 4, "P9", "[bold]f", None, -1.0, 0.3, -1.0, 0.0, 0.0, 0.0],
    [3, 2, 0, 1, 1, None, None, 2.0, 0.0, None, 0.0, None, INF, 1.0],
]


def _with(rows, missing):
    """EXPECTED with missing floats as ``missing`` (and +inf as None in strict JSON)."""
    out = []
    for r in rows:
        out.append([missing if (v is None and i >= 7) else (None if missing is None and v == INF else v)
                    for i, v in enumerate(r)])
    return out


def test_hand_worked_sidecar(hand_run):
    grpolens.recompute(hand_run)
    table = pl.read_parquet(hand_run / "grpolens" / "completions.parquet")
    strict = sidecars.sidecar_bytes(table.filter(pl.col("step") == 3))
    payload = json.loads(strict, parse_constant=lambda c: pytest.fail(f"non-strict literal {c}"))
    assert payload == {"columns": COLS, "data": _with(EXPECTED, None)}
    # the reference's json.dump bytes: NaN for missing numbers, Infinity kept, text nulls stay null
    ref = json.dumps({"columns": COLS, "data": _with(EXPECTED, NAN)})
    assert sidecars.sidecar_bytes(table, nan_literals=True) == ref.encode()
    assert b"NaN" in ref.encode() and b"Infinity" in ref.encode()
    # ids and token columns: only sample 10 has tokens; k3 = (0, e^0.5 - 1.5) -> mean by hand
    by_id = {r["sample_id"]: r for r in table.iter_rows(named=True)}
    assert [by_id[i]["rank"] for i in (10, 1)] == [0, 1]
    assert by_id[10]["loss_calls"] == 1 and by_id[10]["tokens"] == 2 and by_id[10]["masked_tokens"] == 2
    assert by_id[10]["kl_mean"] == pytest.approx((math.exp(0.5) - 1.5) / 2, rel=1e-6)
    assert by_id[11]["loss_calls"] == 0 and by_id[11]["tokens"] is None and by_id[11]["kl_mean"] is None


def test_reader_round_trip_and_reference_files(hand_run, tmp_path):
    grpolens.recompute(hand_run)
    table = pl.read_parquet(hand_run / "grpolens" / "completions.parquet")
    paths = {}
    for nan in (False, True):
        (path,) = sidecars.write_sidecars(hand_run, table, key=f"k{int(nan)}", nan_literals=nan)
        paths[nan] = path
        assert path.name == f"k{int(nan)}_step_000003.json"
    want = table.select(COLS)
    assert sidecars.read_sidecar(paths[True]).equals(want)  # NaN literals: every value, ±inf included
    strict = sidecars.read_sidecar(paths[False])
    assert strict.equals(want.with_columns(
        pl.when(pl.col("reward/acc").is_infinite()).then(None).otherwise(pl.col("reward/acc")).alias("reward/acc")))  # strict JSON has no inf
    py = json.loads(paths[False].read_text())
    assert py["columns"] == COLS and len(py["data"]) == table.height

    # the reference's files: custom loop (reward/* columns) and TRL path (none), bare NaN literals
    ref_dir = tmp_path / "out" / "rich_completions"
    ref_dir.mkdir(parents=True)
    base = COLS[:12]
    (ref_dir / "rich_completions_step_000012.json").write_text(
        '{"columns": %s, "data": [[12, 0, 0, 2, 2, "p", "x", 0.0, -0.7071, NaN, -0.7071, 0.0, 0.0], '
        '[12, 0, 1, 2, 1, "p", "y", 1.0, 0.7071, NaN, 0.7071, 1.0, 1.0]]}' % json.dumps(base + ["reward/reward_0"]))
    (ref_dir / "rich_completions_step_000013.json").write_text(
        '{"columns": %s, "data": [[0, 0, 1, 1, "p", "z", NaN, Infinity, 0.5, 0.5, NaN]]}' % json.dumps(base[1:]))
    custom = sidecars.read_sidecar(ref_dir / "rich_completions_step_000012.json")
    assert custom.columns == base + ["reward/reward_0"]
    assert custom["q_mass"].to_list() == [None, None] and custom["reward_rank_desc"].dtype == pl.Int64
    trl = sidecars.read_sidecar(ref_dir / "rich_completions_step_000013.json")
    assert trl["step"].to_list() == [13]  # no step column: taken from the file name
    assert trl["reward_total"].to_list() == [None] and trl["advantage"].to_list() == [INF]
    both = sidecars.read_sidecars(tmp_path / "out")
    assert both["step"].to_list() == [12, 12, 13] and both["reward/reward_0"].to_list() == [0.0, 1.0, None]


@pytest.mark.parametrize("text, needle", [
    ("{", "not valid JSON"),
    ('{"data": []}', '"columns"'),
    ('{"columns": ["step", "prompt"], "data": [[1]]}', "data row 0 has 1 values for 2 columns"),
    ('{"columns": ["step"], "data": [["x"]]}', "expected an integer"),
    ('{"columns": ["reward_total"], "data": [[[1]]]}', "expected a number"),
])
def test_reader_errors_name_the_file(tmp_path, text, needle):
    p = tmp_path / "bad_step_000001.json"
    p.write_text(text)
    with pytest.raises(fmt.RunFormatError) as e:
        sidecars.read_sidecar(p)
    assert needle in str(e.value) and str(p) in str(e.value)


# -- per-sequence token columns against numpy on padded arrays ---------------------------------

RIS = {"level": "token", "mode": "mask", "lower": 0.8, "upper": 1.25, "veto_lower": 0.5, "veto_upper": 2.0}


def _reference(c: LossCall, b: int, eps=0.2) -> dict:
    """The published per-token definitions on row ``b`` of a padded loss call."""
    m, lp = c.mask[b], c.logp[b]
    old = c.old[b] if c.old is not None else lp

    def mean(x, v):
        return float(np.where(v, x, 0).sum() / v.sum()) if v.sum() else None

    def mx(x, v):
        return float(np.where(v, x, -np.inf).max()) if v.sum() else None

    with np.errstate(all="ignore"):
        out = {"tokens": int(c.lengths[b]), "masked_tokens": int(m.sum())}
        v = m & np.isfinite(lp) & np.isfinite(c.ref[b])
        x = c.ref[b] - lp
        out["kl_mean"], out["kl_max"] = mean(np.exp(x) - x - 1, v), mx(np.exp(x) - x - 1, v)
        f = m & np.isfinite(old) & np.isfinite(c.rollout[b])
        out["mismatch_mean"], out["mismatch_max"] = mean(np.abs(old - c.rollout[b]), f), mx(np.abs(old - c.rollout[b]), f)
        d = old - c.rollout[b]
        vi = m & ~np.isnan(d)
        if (vi & (d == np.inf)).any() and (vi & (d == -np.inf)).any():
            vi = np.zeros_like(vi)  # no defined Σδ: the sequence is left out of rollout IS
        w = np.exp(np.clip(d, -20, 20))
        out["is_weight_max"] = mx(w, vi)
        vetoed = bool((vi & ((d < np.log(RIS["veto_lower"])) | (d > np.log(RIS["veto_upper"])))).any())
        out["is_vetoed"] = vetoed
        out["is_masked_tokens"] = int(vi.sum()) if vetoed else int((vi & ((w < RIS["lower"]) | (w > RIS["upper"]))).sum())
        out["entropy_mean"] = mean(c.entropy[b], m & np.isfinite(c.entropy[b]))
        a = c.advantages[b]
        vc = m & np.isfinite(lp) & np.isfinite(old) & np.isfinite(a)
        r = np.exp(lp - old)
        region = ((r < 1 - eps) & (a < 0)) | ((r > 1 + eps) & (a > 0))
        out["clip_frac"] = mean(region.astype(float), vc)
    return out


@pytest.mark.parametrize("nonfinite", [0.0, 0.05])
def test_token_columns_match_numpy(tmp_path, nonfinite):
    rng = np.random.default_rng(5)
    calls = random_calls(rng, steps=(0, 1), ranks=2, micro_batches=2, batch=4, max_len=10, spread=0.9, nonfinite=nonfinite)
    # rank 0's first call of step 1 is trained again in a later loss call on rank 1: the first one counts
    first = next(c for c in calls if c.step == 1 and c.rank == 0 and c.micro_batch == 0)
    again = LossCall(1, 1, 5, first.sample_ids, first.lengths, first.logp - 0.5, first.mask, first.advantages,
                     first.old, first.ref, first.rollout, first.entropy, first.token_ids)
    calls.append(again)
    samples = {}
    for step in (0, 1):
        own = [(c.rank, int(s)) for c in calls if c.step == step and c is not again for s in c.sample_ids]
        ids = [s for _, s in own] + [900 + step]  # one completion without token data
        ranks = [r for r, _ in own] + [1]
        samples[step] = pa.table({"step": pa.array([step] * len(ids), pa.int64()), "rank": pa.array(ranks, pa.int32()),
                                  "sample_id": pa.array(ids, pa.int64()), "group_id": pa.array([i // 3 for i in ids], pa.int64()),
                                  "completion_len": pa.array([5] * len(ids), pa.int32()),
                                  "truncated": pa.array([i % 4 == 0 for i in ids], pa.bool_()),
                                  "reward": pa.array(rng.normal(size=len(ids)), pa.float64())})
    run = write_run(tmp_path / "run", calls, config={"rollout_is": RIS}, samples=samples)
    grpolens.recompute(run)
    table = pl.read_parquet(run / "grpolens" / "completions.parquet")
    assert table.height == sum(t.num_rows for t in samples.values())
    by_id = {r["sample_id"]: r for r in table.iter_rows(named=True)}
    checked = 0
    for c in calls:
        if c is again:
            continue
        for b, sid in enumerate(c.sample_ids):
            got, want = by_id[int(sid)], _reference(c, b)
            assert got["loss_calls"] == (2 if c is first else 1)
            for k, v in want.items():
                assert (got[k] == v) if isinstance(v, (bool, int)) else approx(got[k], v, rel=1e-9), (sid, k, got[k], v)
            checked += 1
    assert checked == sum(len(c.sample_ids) for c in calls) - len(first.sample_ids)
    for step in (0, 1):
        row = by_id[900 + step]
        assert row["loss_calls"] == 0 and all(row[k] is None for k in sidecars.TOKEN_COLUMNS if k != "loss_calls")
    # the on-demand build of one step equals the recompute's rows
    assert sidecars.build_steps(run, [1]).equals(table.filter(pl.col("step") == 1))


def test_token_columns_of_a_rank_without_rollout_logprobs_are_null(tmp_path):
    # rank 1 recorded no rollout_logp (validate accepts a file without the optional column): its
    # completions have no mismatch or IS columns (null, not 0 or False); rank 0's are those of numpy
    rng = np.random.default_rng(8)
    calls = random_calls(rng, steps=(0,), ranks=2, micro_batches=2, batch=4, max_len=10, spread=0.9)
    for c in calls:
        if c.rank == 1:
            c.rollout = None
    ids = [(c.rank, int(s)) for c in calls for s in c.sample_ids]
    samples = pa.table({"step": pa.array([0] * len(ids), pa.int64()), "rank": pa.array([r for r, _ in ids], pa.int32()),
                        "sample_id": pa.array([s for _, s in ids], pa.int64()),
                        "group_id": pa.array([s // 4 for _, s in ids], pa.int64()),
                        "completion_len": pa.array([5] * len(ids), pa.int32()),
                        "truncated": pa.array([False] * len(ids), pa.bool_())})
    run = write_run(tmp_path / "run", calls, config={"rollout_is": RIS}, samples={0: samples})
    grpolens.recompute(run)
    by_id = {r["sample_id"]: r for r in pl.read_parquet(run / "grpolens" / "completions.parquet").iter_rows(named=True)}
    rollout_cols = ("mismatch_mean", "mismatch_max", "is_weight_max", "is_vetoed", "is_masked_tokens")
    vetoed = 0
    for c in calls:
        for b, sid in enumerate(c.sample_ids):
            got, want = by_id[int(sid)], _reference(c, b) if c.rollout is not None else None
            if want is None:
                assert all(got[k] is None for k in rollout_cols), (sid, got)
                assert got["masked_tokens"] == int(c.mask[b].sum())
                continue
            for k, v in want.items():
                assert (got[k] == v) if isinstance(v, (bool, int)) else approx(got[k], v, rel=1e-9), (sid, k, got[k], v)
            vetoed += got["is_vetoed"]
    assert 0 < vetoed < sum(len(c.sample_ids) for c in calls if c.rank == 0)


def test_incremental_keeps_rows_and_sample_only_steps(tmp_path):
    rng = np.random.default_rng(6)
    calls = random_calls(rng, steps=(0,), ranks=1, micro_batches=1, batch=3)

    def samples(step, ids):
        return pa.table({"step": pa.array([step] * len(ids), pa.int64()), "rank": pa.array([0] * len(ids), pa.int32()),
                         "sample_id": pa.array(ids, pa.int64()), "group_id": pa.array([0] * len(ids), pa.int64()),
                         "completion_len": pa.array([1] * len(ids), pa.int32()),
                         "truncated": pa.array([False] * len(ids), pa.bool_())})

    run = write_run(tmp_path / "run", calls, samples={0: samples(0, [0, 1, 2]), 4: samples(4, [50, 51])})
    grpolens.recompute(run)
    path = run / "grpolens" / "completions.parquet"
    t1 = pl.read_parquet(path)
    assert sorted(t1["step"].unique().to_list()) == [0, 4]  # step 4 has samples but no tokens
    assert t1.filter(pl.col("step") == 4)["loss_calls"].to_list() == [0, 0]
    write_run(run, random_calls(rng, steps=(7,), ranks=1, micro_batches=1, batch=2), samples={7: samples(7, [70, 71])})
    res = grpolens.recompute(run, result=True)
    assert 0 in res.reused_steps
    t2 = pl.read_parquet(path)
    assert sorted(t2["step"].unique().to_list()) == [0, 4, 7]
    assert t2.filter(pl.col("step") == 0).equals(t1.filter(pl.col("step") == 0))


@pytest.mark.parametrize("key, why", [
    ("a/b", "contains '/' (a name is one path component)"),
    ("a\\b", "contains '\\' (a name is one path component)"),
    (" ", "is empty"),
    ("..", "is a special directory name"),
    (".hidden", "starts with '.' (a hidden name)"),
    ("tab\there", "contains a control character"),
    ("del\x7f", "contains a control character"),
    ("k" * 256, "is 256 bytes long, more than the 255 a file name may have"),
])
def test_a_key_that_cannot_name_a_file_is_refused_as_run_names_are(key, why):
    """--key is checked by grpolens.run.names, the one place a name becomes a path component."""
    with pytest.raises(grpolens.errors.UserError) as e:
        sidecars.check_key(key)
    assert e.value.message == f"--key: {key!r} cannot name a file or directory: it {why}"


def test_a_key_is_refused_when_its_file_names_would_be_too_long(tmp_path):
    """The key fits, its file names not: refused before the command computes (the shortest name)
    or before the first file is written (a step of more digits), naming the file name."""
    assert sidecars.check_key(" " + "k" * 238 + " ") == "k" * 238  # + "_step_000000.json": 255 bytes
    with pytest.raises(grpolens.errors.UserError) as e:
        sidecars.check_key("k" * 239)
    assert e.value.message == (f"--key: {'k' * 239 + '_step_000000.json'!r} cannot name a file or directory: "
                               "it is 256 bytes long, more than the 255 a file name may have")
    table = pl.DataFrame({"step": [1, 1_000_000], "prompt_index": [0, 0], "completion_index": [0, 0]})
    with pytest.raises(grpolens.errors.UserError, match="_step_1000000.json' cannot name a file or directory: it is 256"):
        sidecars.write_sidecars(tmp_path, table, key="k" * 238, out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()  # not the first step's file either


@pytest.mark.parametrize("split", [False, True])
def test_the_steps_pieces_give_the_table_that_merging_them_as_frames_gives(split):
    # Completions.combine concatenates the shards' arrays (a column a shard lacks: NaN) instead of
    # merge_partials' polars concat and sort (lacking: null); the completions' columns must be the
    # same, nulls included (a rank without rollout_logp has no IS columns, not 0), and a sequence
    # split over two pieces (which the writer never makes) still merges by the columns' rules
    from grpolens.analysis.sidecars.steps import concat_pieces
    from grpolens.metrics.partials import merge_partials

    rng = np.random.default_rng(11)
    pieces = []
    for rank in range(3):
        n = 6
        p = {"step": np.full(n, 4, np.int64), "rank": np.full(n, rank, np.int64),
             "micro_batch": rng.integers(0, 2, n).astype(np.int64), "sample_id": (100 * rank + rng.permutation(40)[:n]).astype(np.int64),
             "seq_tokens": rng.integers(1, 9, n).astype(np.float64), "health.masked": rng.integers(0, 5, n).astype(np.float64),
             "kl.k3.sum": rng.random(n), "kl.n": rng.integers(0, 3, n).astype(np.float64), "kl.k3.max": rng.random(n),
             "entropy.sum": rng.random(n), "entropy.n": rng.integers(0, 3, n).astype(np.float64),
             "clip.g.region": rng.integers(0, 2, n).astype(np.float64), "clip.g.n": rng.integers(0, 4, n).astype(np.float64)}
        if rank != 1:  # rank 1 recorded no rollout_logp: no mismatch or IS partials
            p.update({"mm.absd": rng.random(n), "mm.n": rng.integers(0, 3, n).astype(np.float64), "mm.absdmax": rng.random(n)})
            p.update(_ris_partials(rng, n))
        pieces.append(p)
    if split:  # the same sequence in two pieces
        pieces.append({k: v[:2].copy() for k, v in pieces[0].items()})
    cfg = {"rollout_is": RIS}
    want = sidecars.sequence_columns(merge_partials([pl.DataFrame(p) for p in pieces]), cfg)
    got = sidecars.sequence_columns(concat_pieces(pieces), cfg)
    assert got.equals(want, null_equal=True)
    if not split:  # (merged by the rules, a lacking column sums to 0: the merge's own behaviour, unchanged)
        assert got["is_vetoed"].null_count() == 6 and got["is_vetoed"].null_count() < got.height
    assert sidecars.sequence_columns(concat_pieces([]), cfg).equals(sidecars.sequence_columns(pl.DataFrame(), cfg))


def _ris_partials(rng, n):
    """A rollout-IS producer's per-sequence partials of ``n`` random sequences."""
    from grpolens.metrics.partials import PRODUCERS
    from grpolens.metrics.batch import TokenBatch

    lengths = rng.integers(1, 6, n)
    rows = int(lengths.sum())
    seq = np.repeat(np.arange(n), lengths)
    batch = TokenBatch.from_arrow(pa.table({
        "step": np.zeros(rows, np.int64), "rank": np.zeros(rows, np.int32), "micro_batch": np.zeros(rows, np.int32),
        "sample_id": seq.astype(np.int64), "pos": np.concatenate([np.arange(k) for k in lengths]).astype(np.int32),
        "logp": -rng.random(rows), "old_logp": -rng.random(rows), "rollout_logp": -rng.random(rows) * 3,
        "advantage": rng.normal(size=rows).astype(np.float32), "mask": rng.random(rows) < 0.8}))
    return PRODUCERS["rollout_is"].fn(batch, {"rollout_is": RIS})
