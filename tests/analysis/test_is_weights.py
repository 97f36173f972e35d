"""``recompute --is-weights``: the per-token weights file equals the reference weights
(:mod:`tests.metrics.rollout_is_reference`), where it goes, and the IS histograms' end bins.
"""

import json

import numpy as np
import polars as pl
import pytest

import grpolens
from grpolens.errors import UserError
from grpolens.run import format as fmt

from tests.metrics.rollout_is_reference import BANDS, norm, one_call, ref_call
from tests.refdata import random_calls, write_run


@pytest.mark.parametrize("level,mode", [("token", "both"), ("sequence", "icepop"), ("geometric", "truncate")])
def test_is_weights_output(tmp_path, level, mode):
    rng = np.random.default_rng(23)
    calls = random_calls(rng, spread=0.3, nonfinite=0.05)
    lo, hi = BANDS[level]
    ris = {"level": level, "mode": mode, "threshold": [lo, hi], "veto_threshold": [0.7, 1.4],
           "rs": "seq_max_k2", "rs_threshold": 0.05}
    run = write_run(tmp_path / "run", calls, config={"rollout_is": ris})
    from grpolens.cli import main

    main(["recompute", str(run), "--is-weights", "-q"])
    cfg = norm(ris)
    root = run / "grpolens" / "is_weights"
    assert json.loads((root / "config.json").read_text())["mode"] == mode
    for c in calls:
        r = ref_call(c, cfg)
        t = pl.read_parquet(root / f"step={c.step:08d}" / f"rank={c.rank:05d}.parquet")
        t = t.filter(pl.col("micro_batch") == c.micro_batch).sort(["sample_id", "pos"])
        rows = np.nonzero(c.valid)
        assert t["valid"].to_list() == r["V"][rows].tolist()
        v = r["V"][rows]
        np.testing.assert_allclose(t["is_weight_raw"].to_numpy()[v], r["w"][rows][v], rtol=1e-12)
        np.testing.assert_allclose(t["is_weight"].to_numpy()[v], r["a"][rows][v], rtol=1e-12)
        assert t["is_weight"].null_count() == (~v).sum()
        assert t["is_mask"].to_list() == r["keep"][rows].tolist()
    # the IS-weight histogram of every step sits next to metrics.parquet
    h = pl.read_parquet(run / "grpolens" / "is_hist.parquet")
    n_valid = sum(ref_call(c, cfg)["V"].sum() for c in calls if c.step == 0)
    assert h.filter((pl.col("step") == 0) & (pl.col("kind") == "raw"))["count"].sum() == n_valid
    assert h.filter((pl.col("step") == 0) & (pl.col("kind") == "applied"))["count"].sum() == n_valid


def test_is_weights_of_a_run_whose_later_rank_has_no_rollout_logprobs_say_so(tmp_path, capsys):
    """Rank 1 recorded no rollout_logp: rank 0's weights are written, and one line says which shards
    have none (the first shard has the column, so the command's early check passes)."""
    calls = random_calls(np.random.default_rng(5), spread=0.3)
    for c in calls:
        if c.rank == 1:
            c.rollout = None
    run = write_run(tmp_path / "run", calls, config={"rollout_is": {"level": "token", "mode": "truncate",
                                                                    "threshold": [0.5, 2.0]}})
    from grpolens.cli import main

    main(["recompute", str(run), "--is-weights", "-q"])
    root = run / "grpolens" / "is_weights"
    written = sorted(str(f.relative_to(root)) for f in root.rglob("*.parquet"))
    assert written == [f"step={s:08d}/rank=00000.parquet" for s in sorted({c.step for c in calls})]
    rank1 = sorted(str(s.path) for s in fmt.list_shards(run, fmt.TOKENS) if s.rank == 1)
    err = capsys.readouterr().err
    assert err.strip() == (f"warning: --is-weights: {len(rank1)} token shard(s) have no rollout_logp values, so "
                           f"their tokens have no IS weights (first: {rank1[0]})")


def test_is_hist_counts_weights_beyond_the_safety_bound_in_its_end_bins(tmp_path):
    # raw weights e^-30, e^0.5, e^30: bounded to e^∓20, the two extremes land in the lowest and the
    # highest bin (both are [e^-20, ...) and [..., e^20]), not outside the histogram; mode none: the
    # applied histogram is the same
    run, _ = one_call(tmp_path, [[-1.0, -1.0, -1.0]], [[29.0, -1.5, -31.0]], config={"level": "token", "mode": "none"})
    grpolens.recompute(run)
    h = pl.read_parquet(run / "grpolens" / "is_hist.parquet")
    for kind in ("raw", "applied"):
        k = h.filter((pl.col("kind") == kind) & (pl.col("hi") > 0)).sort("lo")
        assert k["lo"][0] == pytest.approx(np.exp(-20.0)) and k["hi"][-1] == pytest.approx(np.exp(20.0))
        inside = (k["lo"] <= np.exp(0.5)) & (k["hi"] > np.exp(0.5))
        assert (k["count"][0], k["count"][-1], k.filter(inside)["count"].to_list(), k["count"].sum()) == (1, 1, [1], 3)


def test_is_weights_follow_out(tmp_path):
    """With --out the weights go below it (OUT/is_weights/), the same files as without, none under RUN."""
    calls = random_calls(np.random.default_rng(5), spread=0.3)
    run = write_run(tmp_path / "run", calls, config={"rollout_is": {"level": "token", "mode": "truncate", "threshold": [0.5, 2.0]}})
    from grpolens.cli import main

    main(["recompute", str(run), "--is-weights", "-q", "--out", str(tmp_path / "out")])
    got = tmp_path / "out" / "is_weights"
    assert not (run / "grpolens" / "is_weights").exists()
    main(["recompute", str(run), "--is-weights", "-q", "--full"])
    want = run / "grpolens" / "is_weights"
    names = sorted(p.relative_to(want).as_posix() for p in want.rglob("*") if p.is_file())
    assert "config.json" in names and len(names) > 1
    assert names == sorted(p.relative_to(got).as_posix() for p in got.rglob("*") if p.is_file())
    for n in names:
        if n.endswith(".parquet"):
            assert pl.read_parquet(got / n).equals(pl.read_parquet(want / n)), n


def test_is_weights_needs_rollout(tmp_path):
    from grpolens.analysis.is_weights import is_weight_writer

    run = write_run(tmp_path / "run", random_calls(np.random.default_rng(0), rollout=False))
    with pytest.raises(UserError, match="rollout_logp"):
        is_weight_writer(run)
