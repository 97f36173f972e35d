import itertools

import numpy as np
import pyarrow as pa
import pytest

import grpolens
from grpolens.metrics import diversity
from grpolens.metrics.diversity import distinct_n, group_diversity, groups_diversity, jaccard_distance
from tests.refdata import random_calls, write_run


def ref_group(completions):
    """Reference written from MaxEnt-GRPO's definitions, independently of the module."""
    joined = sum((list(c) for c in completions), [])
    out = {}
    for n in (1, 2):
        grams = [tuple(joined[i:i + n]) for i in range(len(joined) - n + 1)]
        out[f"distinct_{n}"] = len(set(grams)) / len(grams) if grams else 0.0
    pairs = list(itertools.combinations(completions, 2))
    d = []
    for a, b in pairs:
        a, b = set(a), set(b)
        d.append(0.0 if not (a | b) else 1 - len(a & b) / len(a | b))
    out["jaccard"] = float(np.mean(d)) if d else 0.0
    return out


def test_worked_example():
    g = group_diversity([["a", "b", "c"], ["a", "b", "d"]])
    assert g == pytest.approx({"distinct_1": 4 / 6, "distinct_2": 4 / 5, "jaccard": 0.5})


def test_edge_cases():
    assert distinct_n([], 1) == 0.0 and distinct_n(["a"], 2) == 0.0
    assert jaccard_distance([["a"]]) == 0.0
    assert jaccard_distance([[], []]) == 0.0
    assert jaccard_distance([["a"], ["b"]]) == 1.0


def test_distinct_n_against_reference():
    rng = np.random.default_rng(9)
    for _ in range(40):
        toks = list(rng.integers(0, 5, size=rng.integers(0, 9)))
        ref = ref_group([toks])
        assert (distinct_n(toks, 1), distinct_n(toks, 2)) == pytest.approx((ref["distinct_1"], ref["distinct_2"]))
    assert (distinct_n(["a", "b", "a", "b"], 1), distinct_n(["a", "b", "a", "b"], 2)) == (2 / 4, 2 / 3)  # ab ba ab
    assert distinct_n(["a"], 1) == 1.0 and distinct_n(["a", "a"], 2) == 1.0
    # bigrams (2, -1), (-1, 1), (1, 5) are distinct; a null token id is -1, and ids may be huge
    assert distinct_n(np.array([2, -1, 1, 5]), 2) == 1.0
    assert distinct_n(np.array([2**62, 1, 2**62, 2]), 2) == 1.0
    with pytest.raises(ValueError, match=r"^distinct_n supports n = 1 or 2$"):  # the whole message
        distinct_n([1, 2, 3], 3)


def test_unique_helpers():
    x = np.array([5, -3, 5, 2**40, -3, 0])
    assert diversity._unique(x).tolist() == [-3, 0, 5, 2**40] and diversity._unique(np.zeros(0)).size == 0
    n, rank = diversity._dense_ranks(x)
    assert n == 4 and rank.tolist() == [2, 0, 2, 3, 0, 1]
    assert diversity._n_unique(x) == 4 and diversity._n_unique(np.zeros(0)) == 0
    assert diversity._n_unique(np.array([7])) == 1


def _groups(rng, n_groups, max_size, base, vocab=5):
    return [[rng.integers(0, vocab, size=rng.integers(0, 6)) + base for _ in range(rng.integers(1, max_size + 1))]
            for _ in range(n_groups)]


@pytest.mark.parametrize("dense_span", [2**24, 64, 0])
def test_token_ids_of_any_size_on_every_key_path(monkeypatch, dense_span):
    """groups_diversity numbers the token values densely before its kernel: shifted by the
    smallest when they span at most DENSE_SPAN values, ranked (one sort) otherwise. Lowering
    DENSE_SPAN reaches the ranked path on small data. The cases keep the bounds of the packed sort
    keys this replaced: 130 groups of ids near 2**23, ids at 2**24, negative and huge ids."""
    monkeypatch.setattr(diversity, "DENSE_SPAN", dense_span)
    rng = np.random.default_rng(11)
    cases = [_groups(rng, 12, 4, base) for base in (0, 2**23, 2**40, -2**40, -2)]
    cases.append(_groups(rng, 130, 2, 2**23 - 3))
    cases.append([[np.array([1, 2**24]), np.array([2**24])], [np.array([0, 2**24, 1])]])
    cases.append([[np.array([3, 1, 3])], [np.array([2, 2])], [np.array([], dtype=np.int64)] * 2])  # last group: no token
    cases.append([[np.array([4, 5])], [], [np.array([5, 6]), np.array([6])]])  # a group without a completion
    for groups in cases:
        got = groups_diversity(groups)
        assert got.shape == (len(groups), 3)
        for g, row in zip(groups, got):
            ref = ref_group([list(c) for c in g])
            assert row == pytest.approx([ref["distinct_1"], ref["distinct_2"], ref["jaccard"]])


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_groups_against_reference(seed):
    rng = np.random.default_rng(seed)
    for _ in range(20):
        g = [list(rng.integers(0, 6, size=rng.integers(0, 7))) for _ in range(rng.integers(1, 5))]
        assert group_diversity(g) == pytest.approx(ref_group(g))


def _samples(calls, groups_of, texts=None):
    sids = np.concatenate([c.sample_ids for c in calls])
    cols = {
        "step": pa.array(np.zeros(len(sids)), pa.int64()),
        "rank": pa.array(np.zeros(len(sids)), pa.int32()),
        "sample_id": pa.array(sids, pa.int64()),
        "group_id": pa.array([groups_of(s) for s in sids], pa.int64()),
        "completion_len": pa.array(np.ones(len(sids)), pa.int32()),
        "truncated": pa.array(np.zeros(len(sids), bool)),
    }
    if texts is not None:
        cols["completion"] = pa.array([texts(s) for s in sids], pa.string())
    return pa.table(cols)


def test_step_values_use_token_ids_across_ranks(tmp_path):
    rng = np.random.default_rng(5)
    calls = random_calls(rng, steps=(0,), ranks=2, micro_batches=1, batch=3)
    groups_of = lambda s: int(s) % 2  # groups straddle both ranks
    run = write_run(tmp_path / "run", calls, samples={0: _samples(calls, groups_of)})
    df = grpolens.recompute(run, write=False)
    seqs = {}
    for c in calls:
        for i, sid in enumerate(c.sample_ids):
            seqs[int(sid)] = list(c.token_ids[i, : c.lengths[i]])
    groups = {}
    for sid, toks in seqs.items():
        groups.setdefault(groups_of(sid), []).append(toks)
    vals = [ref_group(g) for g in groups.values()]
    sizes = np.array([len(g) for g in groups.values()], float)
    for key in ("distinct_1", "distinct_2", "jaccard"):
        assert df[f"diversity/{key}"][0] == pytest.approx(np.mean([v[key] for v in vals]))
        micro = sum(v[key] * s for v, s in zip(vals, sizes)) / sizes.sum()
        assert df[f"diversity/{key}_micro"][0] == pytest.approx(micro)
    maxent = grpolens.recompute(run, profile="maxent", write=False)
    assert maxent["train/completions/diversity/jaccard"][0] == pytest.approx(df["diversity/jaccard"][0])


def test_text_fallback_and_no_samples(tmp_path):
    rng = np.random.default_rng(6)
    calls = random_calls(rng, steps=(0, 1), ranks=1, micro_batches=1, batch=2)
    for c in calls:
        c.token_ids = None
    texts = {0: "a b c", 1: "a b d"}
    run = write_run(tmp_path / "run", calls,
                    samples={0: _samples(calls[:1], lambda s: 0, texts=lambda s: texts[int(s)])})
    df = grpolens.recompute(run, write=False)
    sids = calls[0].sample_ids
    ref = ref_group([texts[int(s)].split() for s in sids])
    for key in ("distinct_1", "distinct_2", "jaccard"):
        assert df.filter(df["step"] == 0)[f"diversity/{key}"][0] == pytest.approx(ref[key])
    assert df.filter(df["step"] == 1)["diversity/jaccard"][0] is None  # no samples at step 1


@pytest.mark.parametrize("seed", [4, 5])
def test_many_groups_at_once_equal_each_group_alone(seed):
    """The step-level computation packs all groups into one sort: no n-gram may cross groups."""
    from grpolens.metrics.diversity import groups_diversity

    rng = np.random.default_rng(seed)
    groups = [[rng.integers(0, 8, size=rng.integers(0, 6)) for _ in range(rng.integers(1, 5))] for _ in range(12)]
    got = groups_diversity(groups)
    for g, row in zip(groups, got):
        ref = ref_group([list(c) for c in g])
        assert row == pytest.approx([ref["distinct_1"], ref["distinct_2"], ref["jaccard"]])


def test_one_sequence_shards_and_a_sample_without_tokens_or_text(tmp_path):
    """Each rank's shard holds one sequence; the samples table lists first a completion with no
    token rows and no text (generated, never trained on): it is left out, the others still count."""
    rng = np.random.default_rng(7)
    calls = random_calls(rng, steps=(0,), ranks=2, micro_batches=1, batch=1)
    table = _samples(calls, lambda s: 0)
    ghost = pa.table({c: pa.array([999 if c == "sample_id" else False if c == "truncated" else 0], table.schema.field(c).type)
                      for c in table.column_names})
    run = write_run(tmp_path / "run", calls, samples={0: pa.concat_tables([ghost, table])})
    df = grpolens.recompute(run, write=False)
    ref = ref_group([list(c.token_ids[0, : c.lengths[0]]) for c in calls])
    for key in ("distinct_1", "distinct_2", "jaccard"):
        assert df[f"diversity/{key}"][0] == pytest.approx(ref[key])
