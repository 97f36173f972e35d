"""Merging partials equals one pass: the same loss calls split into random part files (and samples
in per-rank shards) give identical metrics, for every registered metric under every profile."""

import numpy as np
import polars as pl
import pytest

import grpolens
from grpolens.metrics.registry import PROFILES
from tests.refdata import random_calls, random_samples, write_run, write_samples

CONFIGS = [
    {"loss_type": "grpo", "beta": 0.04, "use_bias_correction_kl": True, "delta": 1.4, "max_completion_length": 9},
    {"loss_type": "gspo", "epsilon": 0.05, "beta": 0.02},
]


def _equal(a: pl.DataFrame, b: pl.DataFrame) -> None:
    assert a.columns == b.columns
    for col in a.columns:
        x, y = a[col].to_list(), b[col].to_list()
        assert x == y, (col, x, y)  # bit-identical: a sequence is never split, sums run in one order


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c["loss_type"])
def test_parts_give_single_pass_metrics(tmp_path, cfg):
    rng = np.random.default_rng(31)
    calls = random_calls(rng, steps=(0, 1, 2), micro_batches=4, nonfinite=0.05, spread=0.5)
    # completions no longer than the grpo config's max_completion_length, which reading a run enforces
    samples = [random_samples(rng, step, groups=4, max_len=9, first_id=1000 * step) for step in (0, 1, 2)]
    one = write_run(tmp_path / "one", calls, config=cfg)
    many = write_run(tmp_path / "many", calls, config=cfg, parts=3, rng=np.random.default_rng(7))
    for run in (one, many):
        write_samples(run, samples)
    assert len(list((many / "tokens").rglob("*.parquet"))) > len(list((one / "tokens").rglob("*.parquet")))
    for profile in PROFILES:
        a = grpolens.recompute(one, profile=profile, write=False)
        b = grpolens.recompute(many, profile=profile, write=False)
        assert a.height == 3 and a.width > 1, profile
        _equal(a, b)


def test_halves_of_sequences_merge(tmp_path):
    """Token-level partials (sums, counts, extrema) merge by their rules even when one sequence is
    cut into pieces. Sequence-level quantities (GSPO ratio) need whole sequences, which the run
    format guarantees (a loss call is never split), so the config here is token-level."""
    import pyarrow.parquet as pq

    from grpolens.metrics.batch import TokenBatch
    from grpolens.run.config import check_config
    from grpolens.metrics.partials import PRODUCERS, merge_partials, sequence_partials
    from grpolens.plugins import load_plugins
    from grpolens.run import format as fmt

    load_plugins()
    rng = np.random.default_rng(32)
    calls = random_calls(rng, steps=(0,), ranks=1, micro_batches=3, nonfinite=0.1, spread=0.5, max_len=20)
    cfg = check_config({**fmt.CONFIG_DEFAULTS, "loss_type": "dapo", "beta": 0.04, "use_bias_correction_kl": True,
                        "delta": 1.3})
    run = write_run(tmp_path / "run", calls)
    table = pq.read_table(next((run / "tokens").rglob("*.parquet")))
    whole = pl.DataFrame(sequence_partials(TokenBatch.from_arrow(table), cfg))
    cuts = np.sort(rng.choice(np.arange(1, table.num_rows), size=12, replace=False))
    bounds = [0, *cuts.tolist(), table.num_rows]
    pieces = [pl.DataFrame(sequence_partials(TokenBatch.from_arrow(table.slice(a, b - a)), cfg))
              for a, b in zip(bounds, bounds[1:])]
    merged = merge_partials(pieces)
    mine = [c for p in ("policy", "kl", "clip", "loss") for c in PRODUCERS[p].merge]
    assert merged.height == whole.height < sum(p.height for p in pieces)  # some sequence was cut
    for c in mine:
        a, b = whole[c].to_numpy(), merged[c].to_numpy()
        assert np.allclose(a, b, rtol=1e-12, atol=1e-12, equal_nan=True), c


def test_merge_arrays_fills_missing_columns_neutrally_and_falls_back_on_shared_sequences():
    import numpy as np

    from grpolens.metrics.partials import merge_arrays

    key = lambda sids: {"step": np.zeros(len(sids), np.int64), "rank": np.zeros(len(sids), np.int64),
                        "micro_batch": np.zeros(len(sids), np.int64), "sample_id": np.array(sids, np.int64)}
    a = {**key([2, 0]), "entropy.sum": np.array([1.0, 2.0]), "entropy.n": np.array([1.0, 1.0])}
    b = {**key([1]), "health.masked": np.array([3.0])}  # a rank whose shard had no entropy column
    out = merge_arrays([a, b])
    assert out["sample_id"].tolist() == [0, 1, 2]
    assert out["entropy.sum"].tolist() == [2.0, 0.0, 1.0] and out["entropy.n"].tolist() == [1.0, 0.0, 1.0]
    assert out["health.masked"].tolist() == [0.0, 3.0, 0.0]
    # a sequence in two pieces (never from whole shards, but possible): merged by its rule
    c = {**key([0]), "entropy.sum": np.array([5.0]), "entropy.n": np.array([2.0])}
    out = merge_arrays([a, c])
    assert out["sample_id"].tolist() == [0, 2] and out["entropy.sum"].tolist() == [7.0, 1.0]


def test_is_partials_of_cut_sequences_merge(tmp_path):
    """The rollout-IS partials (sums, counts, extrema over a sequence's valid tokens) merge by their
    rules when a sequence is cut, including a piece that holds none of its valid tokens: such a
    piece must contribute its rule's neutral value (an empty max is -inf). Finite log-probs only,
    as the IS inputs leave out a sequence holding both +inf and -inf log-ratios, a decision on the
    whole sequence."""
    import pyarrow.parquet as pq

    from grpolens.functional import rollout_is as ris
    from grpolens.metrics.batch import TokenBatch
    from grpolens.metrics.partials import merge_partials
    from grpolens.run.config import check_config
    from grpolens.run import format as fmt

    rng = np.random.default_rng(33)
    calls = random_calls(rng, steps=(0,), ranks=1, micro_batches=3, spread=0.5, max_len=20)
    c0 = calls[0]
    k = int(np.argmax(c0.lengths))  # its longest sequence: the first two tokens leave the mask
    c0.mask[k, :2] = False
    assert c0.mask[k].any()
    ris_cfg = {"level": "token", "mode": "truncate", "threshold": [0.8, 1.25], "veto_threshold": [0.2, 5.0],
               "rs": "seq_max_k2,seq_sum_k3", "rs_threshold": "0.2,0.5"}
    c = ris.ISConfig.from_cfg(check_config({**fmt.CONFIG_DEFAULTS, "rollout_is": ris_cfg}))
    run = write_run(tmp_path / "run", calls)
    table = pq.read_table(next((run / "tokens").rglob("*.parquet")))

    def partials(t) -> pl.DataFrame:
        b = TokenBatch.from_arrow(t)
        return pl.DataFrame({**b.seq_keys, **ris.sequence_partials(b, ris.inputs(b), c)})

    whole = partials(table)
    sid = table.column("sample_id").to_numpy()
    first = int(np.flatnonzero(sid == c0.sample_ids[k])[0])  # a cut right after the two masked tokens
    cuts = np.unique([*rng.choice(np.arange(1, table.num_rows), size=16, replace=False), first + 2])
    bounds = [0, *cuts.tolist(), table.num_rows]
    pieces = [partials(table.slice(a, b - a)) for a, b in zip(bounds, bounds[1:])]
    merged = merge_partials(pieces)
    assert merged.height == whole.height < sum(p.height for p in pieces)  # some sequence was cut
    # and some piece holds a cut sequence without any of its valid tokens
    empty = pl.concat(pieces).filter(pl.col("ris.n") == 0).select("sample_id").to_series()
    assert whole.filter(pl.col("sample_id").is_in(empty.unique().to_list()) & (pl.col("ris.n") > 0)).height > 0
    for col in ris.IS_MERGE:
        a, b = whole[col].to_numpy(), merged[col].to_numpy()
        assert np.allclose(a, b, rtol=1e-12, atol=1e-12, equal_nan=True), col


def _keys(step, rank, micro_batch, sample_ids):
    n = len(sample_ids)
    return {"step": np.full(n, step, np.int64), "rank": np.full(n, rank, np.int64),
            "micro_batch": np.full(n, micro_batch, np.int64), "sample_id": np.asarray(sample_ids, np.int64)}


def test_merge_arrays_orders_by_step_rank_micro_batch_then_sample():
    """Whole-shard pieces come back in key order (step, rank, micro_batch, sample_id): the order
    of the sample ids alone disagrees here at every level of the key."""
    from grpolens.metrics.partials import merge_arrays

    pieces = [{**_keys(1, 0, 0, [1]), "entropy.sum": np.array([4.0])},
              {**_keys(0, 1, 0, [2]), "entropy.sum": np.array([3.0])},
              {**_keys(0, 0, 1, [0]), "entropy.sum": np.array([2.0])},
              {**_keys(0, 0, 0, [5]), "entropy.sum": np.array([1.0])}]
    out = merge_arrays(pieces)
    rows = list(zip(out["step"].tolist(), out["rank"].tolist(), out["micro_batch"].tolist(), out["sample_id"].tolist()))
    assert rows == [(0, 0, 0, 5), (0, 0, 1, 0), (0, 1, 0, 2), (1, 0, 0, 1)]
    assert out["entropy.sum"].tolist() == [1.0, 2.0, 3.0, 4.0]


def test_merge_arrays_merges_a_shared_sequence_that_is_not_the_first_in_key_order():
    """Sample 5 lies in both pieces, behind sample 0, which is in one piece only: the shared-sequence
    test must compare every pair of neighbours in key order, not only the first row, so sample 5
    comes back once with its two entropy sums added (1.5 + 2.0) and sample 0 untouched."""
    from grpolens.metrics.partials import merge_arrays
    from grpolens.metrics.registry import load_families

    load_families()
    a = {**_keys(0, 0, 0, [0, 5]), "entropy.sum": np.array([4.0, 1.5]), "entropy.n": np.array([2.0, 1.0])}
    b = {**_keys(0, 0, 0, [5]), "entropy.sum": np.array([2.0]), "entropy.n": np.array([3.0])}
    out = merge_arrays([a, b])
    assert list(out["sample_id"]) == [0, 5]
    assert list(out["entropy.sum"]) == [4.0, 3.5] and list(out["entropy.n"]) == [2.0, 4.0]


def test_merge_arrays_keeps_apart_sequences_that_share_only_a_sample_id():
    """Two ranks may number their samples alike: (rank 0, sample 1) and (rank 1, sample 1) are two
    sequences, so nothing merges, and the rank without the max column gets the max rule's -inf."""
    from grpolens.metrics.partials import merge_arrays
    from grpolens.metrics.registry import load_families

    load_families()
    out = merge_arrays([{**_keys(0, 0, 0, [1]), "policy.d.max": np.array([-0.5])}, _keys(0, 1, 0, [1])])
    assert out["rank"].tolist() == [0, 1] and out["sample_id"].tolist() == [1, 1]
    assert out["policy.d.max"].tolist() == [-0.5, -np.inf]


def test_merge_partials_applies_each_rule_to_a_cut_sequence_and_ignores_absent_columns():
    """Sample 3 is cut into two pieces with different columns: the sum adds, the max and the min
    take the extreme, `first` takes the value of the piece that has one (the other lacks the
    column: null, ignored). Sample 1 lies whole in the piece without the advantage: null there."""
    from grpolens.metrics.partials import merge_partials
    from grpolens.metrics.registry import load_families

    load_families()
    a = pl.DataFrame({**_keys(0, 0, 0, [3, 1]), "entropy.sum": [1.0, 2.0], "policy.d.max": [-0.5, 0.25],
                      "policy.d.min": [-1.0, 0.0]})
    b = pl.DataFrame({**_keys(0, 0, 0, [3]), "entropy.sum": [4.0], "policy.d.max": [-0.75],
                      "policy.d.min": [-2.0], "advantage.seq": [0.5]})
    out = merge_partials([a, b])
    assert out["sample_id"].to_list() == [1, 3]
    assert out["entropy.sum"].to_list() == [2.0, 5.0]
    assert out["policy.d.max"].to_list() == [0.25, -0.5]
    assert out["policy.d.min"].to_list() == [0.0, -2.0]
    assert out["advantage.seq"].to_list() == [None, 0.5]


def test_merge_partials_of_whole_pieces_leaves_an_absent_column_null():
    """No sequence is cut: the pieces are put side by side in key order, and a sequence from the
    piece without a column has null there (no value, not a sum of nothing)."""
    from grpolens.metrics.partials import merge_partials

    a = pl.DataFrame({**_keys(0, 1, 0, [0]), "entropy.sum": [1.5]})
    b = pl.DataFrame({**_keys(0, 0, 0, [4]), "health.masked": [2.0]})
    out = merge_partials([a, pl.DataFrame(), b])
    assert out["rank"].to_list() == [0, 1]
    assert out["entropy.sum"].to_list() == [None, 1.5] and out["health.masked"].to_list() == [2.0, None]


def _config():
    from grpolens.plugins import load_plugins
    from grpolens.run import format as fmt
    from grpolens.run.config import check_config

    load_plugins()
    return check_config(dict(fmt.CONFIG_DEFAULTS))


def _batch():
    from grpolens.metrics.batch import TokenBatch
    from tests.refdata import call_table

    (c,) = random_calls(np.random.default_rng(40), steps=(0,), ranks=1, micro_batches=1)
    return TokenBatch.from_arrow(call_table(c))


def test_a_producer_declares_valid_merge_rules_and_a_name_of_its_own():
    """What a plugin author sees when registering a producer wrongly: one line naming it."""
    from grpolens.metrics.partials import PRODUCERS, producer

    _config()  # the built-in producers registered
    with pytest.raises(ValueError, match=r"producer plugin_x: unknown merge rules \{'x.sum': 'mean'\}"):
        producer("plugin_x", merge={"x.sum": "mean"})
    assert "plugin_x" not in PRODUCERS
    entropy = PRODUCERS["entropy"]
    try:
        with pytest.raises(ValueError, match="producer entropy registered twice"):
            producer("entropy", merge={"x.sum": "sum"})(lambda b, cfg: {})
    finally:
        PRODUCERS["entropy"] = entropy  # the registry as it was, whatever the registration did


def test_a_producer_must_return_exactly_the_columns_it_declares():
    from grpolens.metrics.partials import PRODUCERS, producer, sequence_partials

    batch = _batch()
    cases = (("plugin_missing", {}, r"\['x.sum'\] missing, \[\] undeclared"),
             ("plugin_extra", {"x.sum": np.zeros(batch.n_seq), "x.other": np.zeros(batch.n_seq)},
              r"\[\] missing, \['x.other'\] undeclared"))
    for name, returned, columns in cases:
        producer(name, merge={"x.sum": "sum"}, families=("plugin",))(lambda b, cfg, r=returned: r)
        try:
            with pytest.raises(RuntimeError, match=rf"producer {name}: columns {columns}"):
                sequence_partials(batch, _config(), frozenset({"plugin"}))
        finally:
            del PRODUCERS[name]


def test_sequence_partials_runs_only_the_producers_of_the_families_asked_for():
    """``recompute --only``: the producers of other families are not run (and one whose optional
    column is absent is skipped without stopping the others)."""
    from grpolens.metrics.batch import KEY_COLUMNS
    from grpolens.metrics.partials import sequence_partials

    batch = _batch()
    only = sequence_partials(batch, _config(), frozenset({"entropy"}))
    assert set(only) == {*KEY_COLUMNS, "seq_tokens", "entropy.sum", "entropy.n"}
    # every producer of every family; the kl producer needs ref_logp, which this batch lacks
    del batch.cols["ref_logp"]
    batch.present.discard("ref_logp")
    full = sequence_partials(batch, _config())
    assert "entropy.sum" in full and "health.masked" in full and "loss.sum" in full
    assert not any(c.startswith("kl.") for c in full)
