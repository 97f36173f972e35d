"""The compiled diversity pass against the one-group numpy functions (bit for bit) and the
independent reference of test_diversity.py; the flat step assembly (token-id pieces, samples table,
text fallback) against the list path."""

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

import grpolens
from grpolens.metrics import diversity
from grpolens.metrics.diversity import (
    CompletionIds, SampleTokens, distinct_n, groups_diversity, jaccard_distance, numpy_sum,
)
from tests.metrics.test_diversity import _samples, ref_group
from tests.refdata import random_calls, write_run


def test_numpy_sum_adds_in_numpys_order():
    """Every length through the in-order, 8-way and halving cases, at offsets, on values of mixed
    magnitude where the order shows in the last bits."""
    rng = np.random.default_rng(0)
    order_shows = 0
    for n in [*range(0, 300), 1000, 2016, 8385, 100_003]:
        a = rng.random(n + 3) * 10.0 ** rng.integers(-8, 8, n + 3)
        lo = int(rng.integers(0, 4))
        want = a[lo:lo + n].sum()
        assert numpy_sum(a, lo, n) == want, n
        order_shows += sum(a[lo:lo + n].tolist()) != want  # an in-order sum would fail this test
    assert order_shows > 100


def _bits_reference(group):
    """The one-group numpy functions: distinct-n by a sort, Jaccard by M.T @ M and numpy's mean."""
    joined = np.concatenate([np.asarray(c, dtype=np.int64) for c in group]) if group else np.zeros(0, np.int64)
    return [distinct_n(joined, 1), distinct_n(joined, 2), jaccard_distance(group) if group else 0.0]


def _ragged_groups(rng, sizes, vocab, base=0):
    return [[rng.integers(0, vocab, size=rng.integers(0, 12)) + base for _ in range(k)] for k in sizes]


@pytest.mark.parametrize("base", [0, -1, 2**24 - 3, 2**40, -2**62])
def test_groups_equal_the_one_group_functions_bit_for_bit(base):
    """Ragged groups of 0 to 9 completions (empty completions, one-completion groups) and groups
    over 64 completions (the pair distances of 65, 70 and 130 completions are summed by numpy's
    halving), token ids around 2**24, negative (a null id is -1) and huge: every value equals the
    one-group numpy functions' exactly and the independent reference to rounding."""
    rng = np.random.default_rng(abs(base) % 1000)
    sizes = [*rng.integers(0, 10, size=30), 1, 65, 70, 130]
    groups = _ragged_groups(rng, sizes, vocab=int(rng.integers(2, 40)), base=base)
    groups.append([np.array([], dtype=np.int64)] * 3)  # three empty completions
    got = groups_diversity(groups)
    for g, row in zip(groups, got):
        assert row.tolist() == _bits_reference(g)
        ref = ref_group([c.tolist() for c in g])
        assert row == pytest.approx([ref["distinct_1"], ref["distinct_2"], ref["jaccard"]])


def test_large_groups_with_wide_vocabularies_against_the_reference():
    """Completions with thousands of distinct tokens (each completion's set spans many 64-bit
    words) and one token shared by all: exact against the reference's set arithmetic."""
    rng = np.random.default_rng(3)
    groups = [[np.append(rng.integers(0, 5000, size=rng.integers(100, 900)), 7) for _ in range(k)] for k in (2, 8, 67)]
    got = groups_diversity(groups)
    for g, row in zip(groups, got):
        assert row.tolist() == _bits_reference(g)
        ref = ref_group([c.tolist() for c in g])
        assert row == pytest.approx([ref["distinct_1"], ref["distinct_2"], ref["jaccard"]])


def test_text_groups_and_hand_worked_values():
    """Whitespace tokens go the same way (numbered first); the module docstring's example."""
    got = groups_diversity([[["a", "b", "c"], ["a", "b", "d"]], [["x"]], []])
    assert got.tolist() == [[4 / 6, 4 / 5, 0.5], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


def _piece(sids, seqs):
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    return CompletionIds(np.array(sids, dtype=np.int64), np.cumsum(lengths) - lengths, lengths,
                         np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs]))


def _tokens_of(piece, sid):
    i = int(np.searchsorted(piece.sample_id, sid))
    assert piece.sample_id[i] == sid
    return piece.ids[piece.start[i]:piece.start[i] + piece.length[i]].tolist()


def test_sample_tokens_keep_each_completions_first_occurrence_and_merge_in_any_split():
    a = _piece([5, 2], [[1, 2, 3], [4]])
    b = _piece([2, 9], [[40, 41], []])  # sample 2 again (a later loss call): the first stays
    c = _piece([7, 5], [[8], [50]])
    v = SampleTokens()
    one = v.combine(0, [a, None, b, c])
    assert one.sample_id.tolist() == [2, 5, 7, 9]
    assert [_tokens_of(one, s) for s in (2, 5, 7, 9)] == [[4], [1, 2, 3], [8], []]
    two = v.combine(0, [v.combine(0, [a, b]), c])
    assert [_tokens_of(two, s) for s in (2, 5, 7, 9)] == [[4], [1, 2, 3], [8], []]
    assert v.combine(0, [None, None]) is None


def test_step_groups_follow_the_samples_table_with_the_text_fallback():
    """Groups in the order of their first row, completions in table order; a sample without token
    rows counts its text's words (never equal to a token id, even '3' and 3), one with neither is
    left out. The values equal groups_diversity on the same lists, bit for bit."""
    ids = _piece([10, 11, 12, 13], [[3, 1, 3], [1, 2], [], [3, 3, 3]])
    s = pl.DataFrame({
        "sample_id": [12, 10, 20, 11, 21, 13, 22],
        "group_id": [7, 4, 7, 7, 4, 9, 9],
        "completion": [None, "x", "3 1 y", None, None, "ignored: tokens win", "a  b\ta"],
    })
    g = diversity._step_groups(s, ids)
    assert g.sizes.tolist() == [3, 1, 2]  # groups 7, 4, 9; sample 21 has neither tokens nor text
    lists = [[[], ["3", "1", "y"], [1, 2]], [[3, 1, 3]], [[3, 3, 3], ["a", "b", "a"]]]
    got = diversity.flat_diversity(g.tok, g.start, g.length, g.sizes, g.u)
    assert got.tolist() == groups_diversity(lists).tolist()
    for group, row in zip(lists, got):
        ref = ref_group(group)
        assert row == pytest.approx([ref["distinct_1"], ref["distinct_2"], ref["jaccard"]])
    assert diversity._step_groups(s.with_columns(pl.lit(None, pl.String).alias("completion")), None) is None
    assert diversity._step_groups(s.drop("completion"), None) is None
    assert diversity._step_groups(s.head(0), ids) is None


def test_a_step_with_text_only_some_samples_and_one_with_neither(tmp_path):
    """Step 0: token ids for the trained samples plus a sample generated but not trained on, with
    text; step 1: no token ids and no text, so no diversity values."""
    rng = np.random.default_rng(8)
    calls = random_calls(rng, steps=(0, 1), ranks=2, micro_batches=1, batch=3)
    for c in calls:
        if c.step == 1:
            c.token_ids = None
    s0 = [c for c in calls if c.step == 0]
    table = _samples(s0, lambda s: int(s) % 2, texts=lambda s: None)
    extra = pa.table({"step": pa.array([0], pa.int64()), "rank": pa.array([0], pa.int32()),
                      "sample_id": pa.array([999], pa.int64()), "group_id": pa.array([1], pa.int64()),
                      "completion_len": pa.array([3], pa.int32()), "truncated": pa.array([False]),
                      "completion": pa.array(["7 7 x"], pa.string())})
    s1 = _samples([c for c in calls if c.step == 1], lambda s: 0)
    s1 = s1.set_column(0, "step", pa.array(np.ones(s1.num_rows), pa.int64()))
    run = write_run(tmp_path / "run", calls, samples={0: pa.concat_tables([table, extra]), 1: s1})
    df = grpolens.recompute(run, write=False)
    groups = {}
    for c in s0:
        for i, sid in enumerate(c.sample_ids):
            groups.setdefault(int(sid) % 2, []).append([int(t) for t in c.token_ids[i, : c.lengths[i]]])
    groups[1].append(["7", "7", "x"])
    vals = [ref_group(groups[k]) for k in sorted(groups)]
    for key in ("distinct_1", "distinct_2", "jaccard"):
        assert df[f"diversity/{key}"][0] == pytest.approx(np.mean([v[key] for v in vals]))
        assert df[f"diversity/{key}"][1] is None


# the diversity and top-token kernels on random groups and a random batch, printed exactly
_RELOAD = """
import numpy as np
from grpolens.analysis import drilldown
from grpolens.metrics.diversity import groups_diversity, numpy_sum
from tests.analysis.test_drilldown_kernels import _batch
rng = np.random.default_rng(0)
groups = [[rng.integers(-1, 30, size=rng.integers(0, 40)) for _ in range(k)] for k in (1, 2, 8, 70)]
out = [groups_diversity(groups).tobytes().hex(), numpy_sum(rng.random(1000), 3, 900).hex()]
b = _batch(1, 0.1)
for by in drilldown.SCORES:
    pos, score = drilldown._top_positions(b, by, 7)
    out += [pos.tobytes().hex(), score.tobytes().hex(), drilldown.token_scores(b, by, False).tobytes().hex()]
print("\\n".join(out))
"""


@pytest.mark.timeout(300)
def test_kernels_reload_from_the_cache_with_the_same_values(tmp_path):
    """Compiled in one process, loaded from numba's cache in two more (every recompute after the
    first): the same values. A recursive numpy_sum compiled fine and crashed only on loading."""
    from tests.kernel_cache import outputs_over_one_cache

    out = outputs_over_one_cache(_RELOAD, tmp_path / "cache")
    assert out[0] and out[0] == out[1] == out[2]
