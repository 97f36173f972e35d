"""The compiled checks of a tokens shard refuse exactly what validate's reference functions refuse,
with their message, and the column views give what Arrow's own conversion gives.

Random shards with ragged sequences, each corrupted one way (or not at all): a negative key, keys
out of order at any row, a repeated key, a positive log-prob just above or exactly at the
tolerance (float32 and float64), nulls over positive values, a rejected token in the loss; read
whole, as a slice (Arrow offsets) and in several chunks. The reference is
:func:`refuse_bad_values` then :func:`key_order_problems`, as ``read_tokens`` called them."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from grpolens.errors import RunFormatError
from grpolens.run import format as fmt
from grpolens.run.token_columns import bools, refuse_bad_tokens, values
from grpolens.run.validate import POSITIVE_LOGP_TOLERANCE, key_order_problems
from grpolens.run.validate import refuse_bad_values as _refuse_bad_values

LOGPS = ("logp", "old_logp", "ref_logp", "rollout_logp")


def _shard(rng, n_seq: int = 12, float_type=pa.float32()) -> dict[str, np.ndarray]:
    lengths = rng.integers(1, 9, n_seq)
    n = int(lengths.sum())
    mb = np.repeat(np.sort(rng.integers(0, 3, n_seq)), lengths).astype(np.int32)
    sid = np.repeat(np.arange(n_seq) * 3 + rng.integers(0, 3, n_seq), lengths).astype(np.int64)
    pos = np.concatenate([np.arange(k) for k in lengths]).astype(np.int32)
    cols = {"step": np.full(n, 4, np.int64), "rank": np.full(n, 1, np.int32), "micro_batch": mb,
            "sample_id": sid, "pos": pos, "advantage": rng.normal(size=n).astype(np.float32),
            "mask": rng.random(n) < 0.8}
    for c in LOGPS:
        cols[c] = -rng.exponential(size=n).astype(float_type.to_pandas_dtype())
    cols["rollout_rejected"] = ~cols["mask"] & (rng.random(n) < 0.5)
    return cols


def _corrupt(rng, cols: dict, how: str, types: dict) -> dict:
    n = len(cols["pos"])
    i = int(rng.integers(0, n))
    c = {k: v.copy() for k, v in cols.items()}
    nulls: dict[str, np.ndarray] = {}
    if how == "negative":
        c[str(rng.choice(["micro_batch", "sample_id", "pos"]))][i] = -1
    elif how == "swap" and n > 1:
        j = min(i, n - 2)
        for k in ("micro_batch", "sample_id", "pos"):
            c[k][[j, j + 1]] = c[k][[j + 1, j]]
    elif how == "repeat":
        for k in c:
            c[k] = np.insert(c[k], i, c[k][i])
    elif how in ("positive", "at_tolerance", "positive_null", "inf"):
        col = str(rng.choice(LOGPS[1:] if how == "positive_null" else LOGPS))  # logp itself has no nulls
        dtype = c[col].dtype
        c[col][i] = {"positive": dtype.type(2e-3), "inf": np.inf,
                     "at_tolerance": dtype.type(POSITIVE_LOGP_TOLERANCE), "positive_null": dtype.type(5.0)}[how]
        if how == "positive_null":  # a positive value under a null: not a value, not refused
            nulls[col] = np.zeros(n, bool)
            nulls[col][i] = True
    elif how == "rejected_in_loss":
        c["rollout_rejected"][i] = True
        c["mask"][i] = True
    elif how == "null_key":
        nulls["pos"] = np.zeros(len(c["pos"]), bool)
        nulls["pos"][i] = True
    elif how == "nulls":  # nulls in the nullable columns only: fine
        for k in ("old_logp", "ref_logp", "rollout_rejected"):
            nulls[k] = rng.random(len(c[k])) < 0.3
    return {k: pa.array(v, type=types.get(k), mask=nulls.get(k)) for k, v in c.items()}


def _reference(table: pa.Table) -> str | None:
    try:
        _refuse_bad_values("shard", fmt.TOKENS, table)
    except RunFormatError as e:
        return f"{e.column}: {e.message}"
    problems = key_order_problems(*(table.column(c).to_numpy() for c in ("micro_batch", "sample_id", "pos")))
    return problems[0] if problems else None


def _ours(table: pa.Table) -> str | None:
    try:
        refuse_bad_tokens("shard", table)
    except RunFormatError as e:
        return e.message if e.column is None else f"{e.column}: {e.message}"
    return None


HOW = ("none", "negative", "swap", "repeat", "positive", "at_tolerance", "positive_null", "inf",
       "rejected_in_loss", "null_key", "nulls")


@pytest.mark.parametrize("float_type", [pa.float32(), pa.float64()], ids=str)
def test_the_compiled_checks_refuse_what_the_reference_refuses(float_type, monkeypatch):
    import grpolens.run.validate as validate

    asked = []  # the reference is asked only when a compiled pass found something
    real = validate.refuse_bad_values
    monkeypatch.setattr(validate, "refuse_bad_values", lambda *a: asked.append(1) or real(*a))
    rng = np.random.default_rng(11)
    types = {"rank": pa.int32(), "micro_batch": pa.int32(), "pos": pa.int32(), "advantage": pa.float32(),
             **{c: float_type for c in LOGPS}}
    seen = set()
    for trial in range(400):
        how = HOW[trial % len(HOW)]
        table = pa.table(_corrupt(rng, _shard(rng, float_type=float_type), how, types))
        a, b = int(rng.integers(0, 3)), int(rng.integers(0, 3))
        for t in (table, table.slice(a, table.num_rows - a - b),
                  pa.Table.from_batches(table.to_batches(max_chunksize=int(rng.integers(1, 7))))):
            want = _reference(t)
            asked.clear()
            assert _ours(t) == want, (how, want)
            assert bool(asked) == (want is not None), how
            seen.add((how, want is None))
    # every corruption was refused at least once, and the harmless ones never
    refused = {how for how, ok in seen if not ok}
    assert refused == {"negative", "swap", "repeat", "positive", "rejected_in_loss", "null_key"}
    assert {how for how, ok in seen if ok} >= {"none", "at_tolerance", "positive_null", "inf", "nulls"}


def test_a_shard_without_rows_or_with_one_row_is_fine():
    rng = np.random.default_rng(1)
    one = pa.table(_corrupt(rng, _shard(rng, n_seq=1), "none", {})).slice(0, 1)
    for t in (one, one.slice(0, 0)):
        assert _ours(t) is None and _reference(t) is None


@pytest.mark.parametrize("type_", [pa.int32(), pa.int64(), pa.float32(), pa.float64()], ids=str)
def test_values_are_what_arrow_converts_nulls_replaced(type_):
    rng = np.random.default_rng(2)
    data = rng.integers(-50, 50, 40)
    nulls = rng.random(40) < 0.2
    for mask in (None, nulls):
        arr = pa.array(data, type=type_, mask=mask)
        chunked = pa.chunked_array([arr.slice(0, 7), arr.slice(7, 20), arr.slice(27)])
        for col in (arr, arr.slice(3, 30), chunked, chunked.slice(5, 25)):
            want = col.fill_null(-9).to_numpy() if col.null_count else col.to_numpy()
            got = values(col, null=-9)
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError):
        values(pa.array(data, type=type_, mask=nulls))


def test_bools_are_what_arrow_converts_at_every_bit_offset():
    rng = np.random.default_rng(3)
    data = rng.random(77) < 0.5
    nulls = rng.random(77) < 0.2
    for mask in (None, nulls):
        arr = pa.array(data, mask=mask)
        for start in range(9):
            for col in (arr.slice(start), arr.slice(start, 13), pa.chunked_array([arr.slice(start, 5), arr.slice(40)])):
                for null in (False, True):
                    want = col.fill_null(null).to_numpy(zero_copy_only=False)
                    np.testing.assert_array_equal(bools(col, null), want)
    assert bools(pa.array([], pa.bool_())).dtype == bool
