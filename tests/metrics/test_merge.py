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
