"""``TokenBatch``: how a shard's rows become the arrays every family reads. Hand-built Arrow tables,
hand-worked expectations: the null conventions of the run format, columns in several chunks, rows
out of order, sequence boundaries and the segment reductions on ragged sequences."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from grpolens.metrics.batch import TokenBatch

NAN = float("nan")


def _table(rows: list[dict], **types) -> pa.Table:
    """Rows as dicts; missing keys are nulls. Key columns default to 0."""
    cols = {k: [r.get(k, 0) for r in rows] for k in ("step", "rank", "micro_batch", "sample_id", "pos")}
    extra = dict.fromkeys(k for r in rows for k in r if k not in cols)
    cols.update({k: [r.get(k) for r in rows] for k in extra})
    cols.setdefault("mask", [True] * len(rows))
    return pa.table({k: pa.array(v, type=types.get(k)) for k, v in cols.items()})


def _seq(sample_id: int, logps: list[float], **per_token) -> list[dict]:
    return [{"sample_id": sample_id, "pos": i, "logp": lp, "advantage": 1.0,
             **{k: v[i] for k, v in per_token.items()}} for i, lp in enumerate(logps)]


def test_columns_split_in_several_chunks_are_read_whole():
    rows = _seq(0, [-1.0, -2.0]) + _seq(1, [-3.0]) + _seq(2, [-4.0, -5.0, -6.0])
    whole = _table(rows, rank=pa.int32(), micro_batch=pa.int32(), pos=pa.int32())  # the format's types
    for cuts in ([2], [2, 3], [1, 2, 4]):  # 2, 3 and 4 record batches
        edges = [0, *cuts, len(rows)]
        batches = [whole.slice(a, b - a).to_batches()[0] for a, b in zip(edges, edges[1:])]
        table = pa.Table.from_batches(batches)
        assert table.column("logp").num_chunks == len(cuts) + 1
        b = TokenBatch.from_arrow(table)
        np.testing.assert_array_equal(b.logp, [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0])
        np.testing.assert_array_equal(b.starts, [0, 2, 3])
        np.testing.assert_array_equal(b.lengths, [2, 1, 3])
        # keys widened to int64 whatever the stored width, so every shard's keys have one type
        assert {k: b.cols[k].dtype for k in ("step", "rank", "micro_batch", "sample_id", "pos")} == dict.fromkeys(
            ("step", "rank", "micro_batch", "sample_id", "pos"), np.dtype(np.int64))


def test_nulls_in_an_optional_column_are_nan_and_a_null_old_logp_means_ratio_one():
    rows = _seq(0, [-1.0, -2.0, -3.0], ref_logp=[-1.5, None, -2.5], old_logp=[None, -2.5, None],
                entropy=[0.5, 0.25, None])
    for float_type in (pa.float64(), pa.float32()):
        b = TokenBatch.from_arrow(_table(rows, ref_logp=float_type, old_logp=float_type, entropy=float_type))
        assert b.present >= {"ref_logp", "old_logp", "entropy"}
        assert b.cols["ref_logp"].dtype == np.float64
        np.testing.assert_array_equal(b.cols["ref_logp"], [-1.5, NAN, -2.5])
        np.testing.assert_array_equal(b.cols["entropy"], [0.5, 0.25, NAN])
        # no behaviour policy where old_logp is null: old = logp there, the ratio is exactly 1
        np.testing.assert_array_equal(b.old, [-1.0, -2.5, -3.0])
        np.testing.assert_array_equal(b.ratio, [1.0, np.exp(0.5), 1.0])


def test_a_stored_nan_old_logp_stays_nan():
    b = TokenBatch.from_arrow(_table(_seq(0, [-1.0, -2.0], old_logp=[NAN, None])))
    np.testing.assert_array_equal(b.old, [NAN, -2.0])
    np.testing.assert_array_equal(b.valid_policy, [False, True])


def test_an_entirely_null_optional_column_is_absent():
    b = TokenBatch.from_arrow(_table(_seq(0, [-1.0, -2.0], ref_logp=[None, None], rollout_rejected=[None, None],
                                          token_id=[None, None]), ref_logp=pa.float64(),
                                     rollout_rejected=pa.bool_(), token_id=pa.int64()))
    assert not b.has("ref_logp") and "rollout_rejected" not in b.present and "token_id" not in b.present
    assert b.has("logp", "advantage")
    # a run without a behaviour policy: every old_logp null, the ratio is 1 everywhere
    no_old = TokenBatch.from_arrow(_table(_seq(0, [-1.0, -2.0], old_logp=[None, None]), old_logp=pa.float64()))
    assert not no_old.has("old_logp")
    np.testing.assert_array_equal(no_old.old, [-1.0, -2.0])


def test_missing_logp_or_advantage_columns_are_nan():
    t = _table(_seq(0, [-1.0, -2.0])).drop_columns(["advantage"])
    b = TokenBatch.from_arrow(t)
    np.testing.assert_array_equal(b.adv, [NAN, NAN])
    assert not b.valid_policy.any()


def test_null_flags_and_token_ids_take_their_documented_defaults():
    rows = _seq(0, [-1.0, -2.0, -3.0], rollout_rejected=[True, None, False], token_id=[7, None, 9])
    t = _table(rows, token_id=pa.int32())
    t = t.set_column(t.column_names.index("mask"), "mask", pa.array([True, None, False]))
    b = TokenBatch.from_arrow(t)
    np.testing.assert_array_equal(b.mask, [True, False, False])  # a null mask is "not in the loss"
    np.testing.assert_array_equal(b.cols["rollout_rejected"], [True, False, False])
    np.testing.assert_array_equal(b.cols["token_id"], [7, -1, 9])
    assert b.has("token_id", "rollout_rejected")
    assert b.cols["token_id"].dtype == np.int64
    # the trainer's rollout correction saw the loss mask plus the tokens it rejected
    np.testing.assert_array_equal(b.pre_rejection_mask, [True, False, False])
    b2 = TokenBatch.from_arrow(_table(_seq(0, [-1.0, -2.0, -3.0], rollout_rejected=[False, True, False],
                                           mask=[True, False, False])))
    np.testing.assert_array_equal(b2.pre_rejection_mask, [True, True, False])
    no_flags = TokenBatch.from_arrow(_table(_seq(0, [-1.0, -2.0], mask=[True, False])))
    np.testing.assert_array_equal(no_flags.pre_rejection_mask, [True, False])


def test_rows_out_of_order_are_sorted_with_every_column():
    rows = [
        {"step": 1, "rank": 0, "micro_batch": 0, "sample_id": 3, "pos": 1, "logp": -0.4, "advantage": 4.0},
        {"step": 0, "rank": 1, "micro_batch": 0, "sample_id": 5, "pos": 0, "logp": -0.3, "advantage": 3.0},
        {"step": 0, "rank": 0, "micro_batch": 1, "sample_id": 2, "pos": 0, "logp": -0.2, "advantage": 2.0},
        {"step": 1, "rank": 0, "micro_batch": 0, "sample_id": 3, "pos": 0, "logp": -0.5, "advantage": 5.0},
        {"step": 0, "rank": 0, "micro_batch": 0, "sample_id": 9, "pos": 0, "logp": -0.1, "advantage": 1.0},
    ]
    t = pa.table({k: [r[k] for r in rows] for k in rows[0]} | {"mask": [True] * 5})
    b = TokenBatch.from_arrow(t)
    np.testing.assert_array_equal(b.logp, [-0.1, -0.2, -0.3, -0.5, -0.4])
    np.testing.assert_array_equal(b.adv, [1.0, 2.0, 3.0, 5.0, 4.0])
    np.testing.assert_array_equal(b.cols["pos"], [0, 0, 0, 0, 1])
    np.testing.assert_array_equal(b.lengths, [1, 1, 1, 2])
    assert {k: v.tolist() for k, v in b.seq_keys.items()} == {
        "step": [0, 0, 0, 1], "rank": [0, 0, 1, 0], "micro_batch": [0, 1, 0, 0], "sample_id": [9, 2, 5, 3]}


@pytest.mark.parametrize("key", ["step", "rank", "micro_batch", "sample_id", "pos"])
def test_two_rows_out_of_order_in_any_key_are_sorted(key):
    # the smallest table that can be out of order: the row with the larger key first; the keys before
    # it equal (a pair decided by an earlier key says nothing about the later ones)
    first = {"step": 0, "rank": 0, "micro_batch": 0, "sample_id": 0, "pos": 0, key: 1, "logp": -0.2, "advantage": 2.0}
    second = {"step": 0, "rank": 0, "micro_batch": 0, "sample_id": 0, "pos": 0, "logp": -0.1, "advantage": 1.0}
    b = TokenBatch.from_arrow(pa.table({k: [first[k], second[k]] for k in first} | {"mask": [True, True]}))
    np.testing.assert_array_equal(b.logp, [-0.1, -0.2])
    np.testing.assert_array_equal(b.cols[key], [0, 1])


def test_rows_out_of_order_after_the_first_row_are_sorted():
    # every row's key is above the first row's: only comparing each row with the one before finds
    # that pos 2 comes before pos 1
    b = TokenBatch.from_arrow(_table([{"pos": 0, "logp": -0.1}, {"pos": 2, "logp": -0.3}, {"pos": 1, "logp": -0.2}]))
    np.testing.assert_array_equal(b.logp, [-0.1, -0.2, -0.3])
    np.testing.assert_array_equal(b.cols["pos"], [0, 1, 2])


@pytest.mark.parametrize("key", ["step", "rank", "micro_batch", "sample_id"])
def test_a_change_in_any_key_starts_a_new_sequence(key):
    rows = [{"pos": 0, "logp": -1.0, "advantage": 1.0}, {"pos": 1, "logp": -1.0, "advantage": 1.0},
            {key: 1, "pos": 2, "logp": -1.0, "advantage": 1.0}]
    b = TokenBatch.from_arrow(_table(rows))
    np.testing.assert_array_equal(b.starts, [0, 2])
    assert b.n_seq == 2 and b.n == 3


@pytest.mark.parametrize("key", ["rank", "micro_batch"])
def test_a_sequence_after_a_key_change_keeps_its_tokens_together(key):
    # a sequence of two tokens after the change: each row is compared with the row before it, not with
    # the first row (the same sample id in two micro-batches: a completion reused by num_iterations)
    rows = [{"pos": 0, "logp": -1.0, "advantage": 1.0}, {key: 1, "pos": 0, "logp": -1.0, "advantage": 1.0},
            {key: 1, "pos": 1, "logp": -1.0, "advantage": 1.0}]
    b = TokenBatch.from_arrow(_table(rows))
    np.testing.assert_array_equal(b.starts, [0, 1])
    np.testing.assert_array_equal(b.lengths, [1, 2])


def test_seq_any_of_a_single_sequence():
    b = TokenBatch.from_arrow(_table(_seq(0, [-1.0, -2.0])))
    np.testing.assert_array_equal(b.seq_any(np.array([False, True])), [True])
    np.testing.assert_array_equal(b.seq_any(np.array([False, False])), [False])


def test_segment_reductions_on_ragged_sequences():
    b = TokenBatch.from_arrow(_table(_seq(0, [-1.0, -2.0, -3.0]) + _seq(1, [-4.0]) + _seq(2, [-5.0, -6.0])))
    x = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    valid = np.array([True, False, True, False, True, True])
    np.testing.assert_array_equal(b.seq_sum(x), [6.0, 4.0, 11.0])
    np.testing.assert_array_equal(b.masked_sum(np.where(valid, x, NAN), valid), [4.0, 0.0, 11.0])
    np.testing.assert_array_equal(b.count(valid), [2.0, 0.0, 2.0])
    np.testing.assert_array_equal(b.seq_max(x, valid), [3.0, -np.inf, 6.0])
    np.testing.assert_array_equal(b.seq_max(x, valid, empty=0.0), [3.0, 0.0, 6.0])
    np.testing.assert_array_equal(b.seq_min(-x, valid), [-3.0, np.inf, -6.0])
    np.testing.assert_array_equal(b.seq_min(x, valid), [1.0, np.inf, 5.0])
    np.testing.assert_array_equal(b.seq_any(np.array([False, False, True, False, False, False])), [True, False, False])
    np.testing.assert_array_equal(b.seq_first(x), [1.0, 4.0, 5.0])
    np.testing.assert_array_equal(b.broadcast(np.array([10.0, 20.0, 30.0])), [10, 10, 10, 20, 30, 30])


def test_an_empty_batch_has_no_sequences():
    t = _table(_seq(0, [-1.0])).slice(0, 0)
    b = TokenBatch.from_arrow(t)
    assert b.n == 0 and b.n_seq == 0 and b.lengths.tolist() == []
    x = np.zeros(0)
    for got in (b.seq_sum(x), b.seq_max(x, x.astype(bool)), b.seq_min(x, x.astype(bool)), b.seq_any(x)):
        assert got.shape == (0,)
    assert b.seq_any(x).dtype == bool
    # indexing and repeating by the (empty) sequence starts and lengths: integers, even with no sequence
    assert b.seq_first(x).shape == (0,) and b.broadcast(x).shape == (0,)
    assert all(v.shape == (0,) for v in b.seq_keys.values())


def test_the_policy_quantities():
    b = TokenBatch.from_arrow(_table(_seq(0, [-1.0, -2.0, -np.inf, -1.0], old_logp=[-1.5, -2.0, -1.0, -1.0],
                                          ) + [{"sample_id": 1, "pos": 0, "logp": -1.0, "old_logp": -1.0,
                                                "advantage": NAN}]))
    np.testing.assert_array_equal(b.log_ratio, [0.5, 0.0, -np.inf, 0.0, 0.0])
    np.testing.assert_allclose(b.ratio, [np.exp(0.5), 1.0, 0.0, 1.0, 1.0])
    np.testing.assert_array_equal(b.valid_policy, [True, True, False, True, False])
    no_old = TokenBatch.from_arrow(_table(_seq(0, [-1.0, -2.0])))
    assert no_old.old is no_old.logp and not no_old.log_ratio.any()


def test_sequence_starts_and_order_in_one_pass_equal_the_vectorised_reference():
    """The compiled pass over the keys: sequence starts where any of step, rank, micro_batch,
    sample_id changes, and "ordered" exactly when every row's full key is above the previous row's
    (a repeated key is not ordered: from_arrow sorts then). Random keys in few values, so that ties
    at every level happen, in both stored widths."""
    from grpolens.metrics.batch import _sequence_starts

    rng = np.random.default_rng(5)
    names = ("step", "rank", "micro_batch", "sample_id", "pos")
    outcomes = set()
    for trial in range(300):
        n = int(rng.integers(0, 30))
        keys = [rng.integers(0, 2 if trial % 3 else 3, n) for _ in names]
        if trial % 2:  # mostly sorted: one lexsort, maybe a swap
            order = np.lexsort(keys[::-1])
            keys = [k[order] for k in keys]
            if n > 1 and trial % 4 == 1:
                i = int(rng.integers(0, n - 1))
                keys = [np.concatenate([k[:i], k[i + 1:i + 2], k[i:i + 1], k[i + 2:]]) for k in keys]
        typed = [k.astype(np.int32 if i in (1, 2, 4) and trial % 5 else np.int64) for i, k in enumerate(keys)]
        starts, ordered = _sequence_starts(*typed)
        change = np.ones(n, bool)
        if n > 1:
            change[1:] = np.any([k[1:] != k[:-1] for k in keys[:4]], axis=0)
        np.testing.assert_array_equal(starts, np.flatnonzero(change))
        rows = list(zip(*(k.tolist() for k in keys)))
        assert ordered == all(a < b for a, b in zip(rows, rows[1:])), rows
        outcomes.add(ordered)
    assert outcomes == {True, False}


def test_counts_and_any_per_sequence_equal_the_float_reduction():
    """count and seq_any of a boolean mask (a compiled pass) give what the float64 reduceat of the
    mask gives, on ragged sequences, single tokens, all-false and all-true masks; a mask that is
    not boolean takes the reduceat itself."""
    rng = np.random.default_rng(7)
    for trial in range(200):
        lengths = rng.integers(1, 12, int(rng.integers(1, 20)))
        rows = [r for sid, k in enumerate(lengths) for r in _seq(sid, [-1.0] * int(k))]
        b = TokenBatch.from_arrow(_table(rows))
        valid = rng.random(b.n) < [0.0, 0.3, 1.0][trial % 3]
        want = np.add.reduceat(valid.astype(np.float64), b.starts)
        got = b.count(valid)
        assert got.dtype == np.float64
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(b.seq_any(valid), want > 0)
        np.testing.assert_array_equal(b.count(valid.astype(np.float64)), want)
        np.testing.assert_array_equal(b.seq_any(valid.astype(np.int64)), want > 0)
    none = TokenBatch.from_arrow(_table(_seq(0, [-1.0])).slice(0, 0))
    assert none.count(np.zeros(0, bool)).shape == (0,) and none.seq_any(np.zeros(0, bool)).shape == (0,)


def test_columns_of_other_types_convert_as_arrow_converts_them():
    # a caller that skipped the footer check's type check: a float16 log-prob, a float pos, an
    # integer mask, a dictionary-encoded key are read as Arrow converts them, never as raw buffers
    rows = _seq(0, [-1.0, -2.0]) + _seq(1, [-3.0])
    t = _table(rows, logp=pa.float16(), pos=pa.float64())
    t = t.set_column(t.schema.get_field_index("mask"), "mask", pa.array([1, 0, 1], pa.int8()))
    t = t.set_column(t.schema.get_field_index("sample_id"), "sample_id", t.column("sample_id").dictionary_encode())
    b = TokenBatch.from_arrow(t)
    np.testing.assert_array_equal(b.logp, [-1.0, -2.0, -3.0])
    assert b.logp.dtype == np.float64 and b.cols["pos"].dtype == np.int64
    np.testing.assert_array_equal(b.cols["pos"], [0, 1, 0])
    np.testing.assert_array_equal(b.starts, [0, 2])
    np.testing.assert_array_equal(b.mask, [True, False, True])  # 0/1 integers: truth values, not bits


def test_the_ratio_is_every_tokens_own_whichever_family_asks_first():
    # the ratio families keep a masked ratio (1 where the ratio is undefined or the token is
    # unmasked) for their kernels; a token table (TokenBatch.ratio) must never show that 1
    from grpolens.metrics import ratios

    rows = _seq(0, [-1.0, -2.0, -3.0], old_logp=[NAN, -2.5, -1.0], mask=[True, True, False])
    want = np.exp(np.array([NAN, 0.5, -2.0]))
    for first in ("family", "table"):
        b = TokenBatch.from_arrow(_table(rows))
        if first == "family":
            np.testing.assert_array_equal(ratios.ratio(b), [1.0, np.exp(0.5), 1.0])
        np.testing.assert_array_equal(b.ratio, want)
        np.testing.assert_array_equal(ratios.ratio(b), [1.0, np.exp(0.5), 1.0])
