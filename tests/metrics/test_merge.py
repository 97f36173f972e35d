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
    samples = [random_samples(rng, step, groups=4, first_id=1000 * step) for step in (0, 1, 2)]
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
    from grpolens.plugins import load_builtins
    from grpolens.run import format as fmt

    load_builtins()
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

    from grpolens.functional import is_weights as ris
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
