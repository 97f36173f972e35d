"""The dashboard's data layer against independent numpy references on the shards themselves."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpolens.errors import UserError
from grpolens.serve import data
from grpolens.serve.runs import RunSet, UnknownRun, find_runs, resolve_runs


def raw_step(run: Path, table: str, step: int) -> dict[str, np.ndarray]:
    """All rows of one step read straight from the files (no grpolens reader)."""
    files = sorted((run / table / f"step={step:08d}").glob("rank=*.parquet"))
    t = pa.concat_tables([pq.read_table(f) for f in files], promote_options="default")
    return {c: t[c].to_numpy(zero_copy_only=False) for c in t.column_names}


# ---------------------------------------------------------------------------------------------
# The allow-list
# ---------------------------------------------------------------------------------------------

def test_runs_discovered_and_named(serve_runs, runset):
    root, alpha, beta = serve_runs
    assert runset.names == ["alpha", "beta"]
    assert runset.path("alpha") == alpha.resolve()
    # A directory, a run itself, and the same run twice give each run once.
    again = resolve_runs([alpha, root])
    assert again.names == ["alpha", "beta"]
    with_base = resolve_runs([alpha], baseline=beta)
    assert with_base.names == ["alpha", "beta"] and with_base.baseline == "beta"
    assert find_runs(root / "alpha" / "tokens") == []


@pytest.mark.parametrize("bad", ["../alpha", "/etc", "alpha/../beta", "", None, 3, ["alpha"], "ALPHA"])
def test_unknown_runs_are_refused(runset, bad):
    with pytest.raises(UnknownRun):
        runset.path(bad)


def test_check_refuses_a_list_with_one_bad_name(runset, serve_runs):
    assert runset.check(["alpha", "beta"]) == ["alpha", "beta"]
    with pytest.raises(UnknownRun):
        runset.check(["alpha", str(serve_runs[2])])


def test_resolve_errors(tmp_path, serve_runs):
    with pytest.raises(UserError, match="no such run"):
        resolve_runs([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no grpolens run"):
        resolve_runs([tmp_path / "empty"])
    with pytest.raises(UserError, match="--baseline"):
        resolve_runs([serve_runs[1]], baseline=tmp_path / "empty")


def test_duplicate_run_names_get_suffixes(tmp_path):
    import shutil

    from grpolens.adapters.synth import synth_run

    a = synth_run(tmp_path / "x" / "run", steps=2, max_len=8)
    shutil.copytree(a, tmp_path / "y" / "run")
    rs = resolve_runs([tmp_path])
    assert rs.names == ["run", "run-2"]


# ---------------------------------------------------------------------------------------------
# Curves
# ---------------------------------------------------------------------------------------------

def ema_reference(x, y, w):
    """Time-weighted EMA as a plain recurrence over the finite points: across a gap of ``d`` steps
    the previous average keeps the share ``w ** d``; the first finite point starts the average."""
    out = np.full(len(y), np.nan)
    avg, last = None, None
    for i, (s, v) in enumerate(zip(x, y)):
        if not math.isfinite(v):
            continue
        if avg is None:
            avg = v
        else:
            keep = w ** (s - last)
            avg = keep * avg + (1 - keep) * v
        last = s
        out[i] = avg
    return out


@pytest.mark.parametrize("w", [0.0, 0.3, 0.9, 0.99])
def test_ema_time_weighted_over_gaps(w):
    rng = np.random.default_rng(1)
    x = np.sort(rng.choice(np.arange(200), size=40, replace=False))  # ragged step gaps
    y = rng.normal(size=40)
    y[[3, 17, 18]] = np.nan
    y[25] = np.inf
    got = data.ema(x, y.copy(), w)
    want = y if w == 0 else ema_reference(x, y, w)  # weight 0: no smoothing at all
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9, equal_nan=True)


def test_ema_every_other_step_equals_every_step_at_squared_weight():
    # hand-worked: logged at steps 0, 2 with weight 0.5 keeps 0.25 of the old average
    got = data.ema(np.array([0, 2]), np.array([1.0, 5.0]), 0.5)
    np.testing.assert_allclose(got, [1.0, 0.25 * 1 + 0.75 * 5], rtol=1e-6)


def test_curve_drops_unlogged_steps_so_lines_connect():
    # a metric logged every other step: the null steps are not points (no isolated dots)
    df = pl.DataFrame({"step": np.arange(6), "m": [1.0, None, 3.0, None, 5.0, float("nan")]})
    c = data.curve(df, "m", smoothing=0.5)
    np.testing.assert_array_equal(c["x"], [0, 2, 4, 5])
    assert np.isnan(c["y"][-1])  # a logged NaN stays a visible gap
    np.testing.assert_allclose(c["smooth"][:3], ema_reference([0, 2, 4], [1.0, 3.0, 5.0], 0.5), rtol=1e-6)


def test_downsample_keeps_spikes_and_bounds():
    rng = np.random.default_rng(2)
    n = 100_000
    y = rng.normal(size=n)
    y[54_321] = 1e6
    y[777] = -1e6
    y[1000:1100] = np.nan
    idx = data.downsample_minmax(n, y, 2000)
    assert len(idx) <= 2002 and idx[0] == 0 and idx[-1] == n - 1
    assert np.all(np.diff(idx) > 0)
    assert 54_321 in idx and 777 in idx
    assert 1000 in idx  # the NaN stretch fills a whole bucket: one of its points keeps the gap in the line
    assert np.isfinite(y[idx]).sum() >= len(idx) - 1
    np.testing.assert_array_equal(data.downsample_minmax(50, y[:50], 2000), np.arange(50))
    # all finite (the library's fast path), an odd budget: still bounded, ends and extremes kept
    z = np.cumsum(rng.normal(size=n))
    idx = data.downsample_minmax(n, z, 1001)
    assert len(idx) <= 1003 and idx[0] == 0 and idx[-1] == n - 1 and np.all(np.diff(idx) > 0)
    assert {int(np.argmin(z)), int(np.argmax(z))} <= set(idx.tolist())


def test_curve_range_and_nulls():
    df = pl.DataFrame({"step": np.arange(10), "m": [1.0, None, 3.0, float("nan"), 5, 6, 7, 8, 9, float("inf")]})
    c = data.curve(df, "m", lo=2, hi=8)
    np.testing.assert_array_equal(c["x"], np.arange(2, 9))
    assert np.isnan(c["y"][1]) and c["y"][0] == 3.0
    assert data.curve(df, "absent")["x"].size == 0


def test_series_joins_metrics_and_samples(serve_runs):
    _, alpha, _ = serve_runs
    s = data.series(alpha)
    m = pl.read_parquet(alpha / "grpolens" / "metrics.parquet")
    assert s.height == m.height == 14
    assert set(m.columns) == set(s.columns)  # recompute gave rewards and lengths: no samples scan needed
    both = data.series(alpha, with_samples=True)
    assert set(m.columns) < set(both.columns) and "samples/length/p50" in both.columns
    assert both.height == 14


def test_samples_summary_against_numpy(serve_runs):
    _, alpha, _ = serve_runs
    summ = data.samples_summary(alpha)
    for step in (0, 9, 13):
        raw = raw_step(alpha, "samples", step)
        row = summ.filter(pl.col("step") == step).row(0, named=True)
        r = raw["reward"].astype(float)
        assert row["samples/reward/p50"] == pytest.approx(np.quantile(r, 0.5))
        assert row["samples/reward/p05"] == pytest.approx(np.quantile(r, 0.05))
        assert row["samples/reward/accuracy/mean"] == pytest.approx(raw["reward/accuracy"].mean())
        assert row["samples/length/mean"] == pytest.approx(raw["completion_len"].mean())
        assert row["samples/truncated_frac"] == pytest.approx(raw["truncated"].mean())
        groups = {}
        for g, v in zip(raw["group_id"], r):
            groups.setdefault(g, []).append(v)
        zero = np.mean([len(set(v)) == 1 for v in groups.values()])
        assert row["samples/zero_std_group_frac"] == pytest.approx(zero)


def test_overview_picks_available_metrics(serve_runs):
    _, alpha, _ = serve_runs
    slots = dict(data.overview_metrics([data.series(alpha)]))
    assert slots["entropy"] == "entropy"
    assert slots["reward"] in data.series(alpha).columns
    frame = pl.DataFrame({"step": [0, 1], "kl/k3": [0.1, 0.2], "kl/k1": [0.3, None], "clip/low": [None, None]})
    got = data.overview_metrics([frame])
    assert ("KL to reference", "kl/k3") in got
    assert all(c != "clip/low" for _, c in got)  # all-null columns are skipped


def test_compare_against_numpy(serve_runs):
    _, alpha, beta = serve_runs
    a, b = data.series(alpha), data.series(beta)
    same = data.compare(a, a)
    assert same.height > 0 and (same["max_abs_delta"] == 0).all()
    cmp = data.compare(a, b, lo=2, hi=11).filter(pl.col("metric") == "entropy").row(0, named=True)
    ya = a.filter(pl.col("step").is_between(2, 11))["entropy"].to_numpy()
    yb = b.filter(pl.col("step").is_between(2, 11))["entropy"].to_numpy()
    d = yb - ya
    assert cmp["steps"] == 10
    assert cmp["mean_delta"] == pytest.approx(d.mean())
    assert cmp["max_abs_delta"] == pytest.approx(np.abs(d).max())
    assert cmp["at_step"] == 2 + int(np.argmax(np.abs(d)))
    assert cmp["rel_delta"] == pytest.approx(d.mean() / max(abs(ya.mean()), abs(yb.mean())))
    rel = data.compare(a, b)["rel_delta"].abs().to_numpy()
    assert np.all(np.diff(rel) <= 0)
    dc = data.delta_curve(a, b, "entropy")
    np.testing.assert_allclose(dc["y"], b["entropy"].to_numpy() - a["entropy"].to_numpy())


# ---------------------------------------------------------------------------------------------
# One step
# ---------------------------------------------------------------------------------------------

def token_reference(run: Path, step: int) -> dict[str, np.ndarray]:
    t = raw_step(run, "tokens", step)
    logp = t["logp"].astype(np.float64)
    old = t["old_logp"].astype(np.float64)
    ref = t["ref_logp"].astype(np.float64)
    roll = t["rollout_logp"].astype(np.float64)
    d = ref - logp
    t["kl_ref"] = np.exp(d) - d - 1
    t["ratio_ref"] = np.exp(logp - old)
    t["mismatch_ref"] = np.abs(old - roll)
    t["w_ref"] = np.exp(old - roll)
    return t


@pytest.mark.parametrize("by", ["kl", "mismatch", "ratio", "entropy", "adv_ratio"])
def test_top_tokens_is_global_top_k_over_all_ranks(serve_runs, by):
    _, alpha, _ = serve_runs
    step, k = 9, 25
    t = token_reference(alpha, step)
    score = {"kl": t["kl_ref"], "mismatch": t["mismatch_ref"], "ratio": np.abs(np.log(t["ratio_ref"])),
             "entropy": t["entropy"].astype(np.float64),
             "adv_ratio": np.abs(t["advantage"].astype(np.float64) * (t["ratio_ref"] - 1))}[by]
    ok = t["mask"] & np.isfinite(score)
    want = np.sort(score[ok])[::-1][:k]
    got = data.top_tokens(alpha, step, by, k)
    np.testing.assert_allclose(got["score"].to_numpy(), want, rtol=1e-9, atol=1e-12)
    assert got["rank"].n_unique() >= 1 and got.height == k
    # The top token is really that (sample, pos) in the files.
    i = int(np.flatnonzero(ok)[np.argmax(score[ok])])
    assert (int(got["sample_id"][0]), int(got["pos"][0])) == (int(t["sample_id"][i]), int(t["pos"][i]))


def test_top_tokens_rejects_unknown_score(serve_runs):
    with pytest.raises(UserError, match="unknown score"):
        data.top_tokens(serve_runs[1], 0, "nonsense")


def test_step_tokens_nonfinite_scores_are_null(tmp_path):
    from tests.refdata import random_calls, write_run

    rng = np.random.default_rng(5)
    calls = random_calls(rng, steps=(0,), nonfinite=0.2)
    run = tmp_path / "run"
    write_run(run, calls)
    t = data.step_tokens(run, 0)
    for c in ("kl", "ratio", "mismatch", "is_weight", "adv_ratio", "entropy"):
        v = t[c].drop_nulls().to_numpy()
        assert np.all(np.isfinite(v)), c
    top = data.top_tokens(run, 0, "kl", 1000)
    assert np.all(np.isfinite(top["score"].to_numpy()))
    assert np.all(np.diff(top["score"].to_numpy()) <= 0)


def copy_run(src: Path, dst: Path, drop: tuple[str, ...] = ()) -> Path:
    import shutil

    shutil.copytree(src, dst)
    for name in drop:
        (dst / "grpolens" / name).unlink()
    return dst


@pytest.mark.parametrize("source", ["sidecar", "computed"])
def test_sequence_table_against_numpy(serve_runs, tmp_path, source):
    _, alpha, _ = serve_runs
    run = alpha if source == "sidecar" else copy_run(alpha, tmp_path / "run", ("completions.parquet",))
    step = 9
    t = token_reference(run, step)
    s = raw_step(run, "samples", step)
    tab = data.sequence_table(run, step)
    assert tab.height == len(s["sample_id"])
    # text first: prompt and completion before the numeric columns; reward/<name> after reward_total
    assert list(tab.columns[:7]) == ["sample_id", "prompt", "completion", "rank", "group_id", "reward_rank_desc",
                                     "reward_total"]
    rewards = [c for c in tab.columns if c.startswith("reward/")]
    assert list(tab.columns[7:7 + len(rewards)]) == rewards
    cfg = {"epsilon": 0.2, "epsilon_high": 0.28}  # the synthetic runs' config
    for row in tab.iter_rows(named=True):
        sel = t["sample_id"] == row["sample_id"]
        m = sel & t["mask"]
        assert row["tokens"] == sel.sum()
        assert row["masked_tokens"] == m.sum()
        assert row["kl_mean"] == pytest.approx(t["kl_ref"][m].mean())
        assert row["kl_max"] == pytest.approx(t["kl_ref"][m].max())
        assert row["mismatch_mean"] == pytest.approx(t["mismatch_ref"][m].mean())
        assert row["is_weight_max"] == pytest.approx(t["w_ref"][m].max(), rel=1e-6)
        assert row["entropy_mean"] == pytest.approx(t["entropy"][m].astype(float).mean())
        r, a = t["ratio_ref"][m], t["advantage"][m]
        clipped = ((a > 0) & (r > 1 + cfg["epsilon_high"])) | ((a < 0) & (r < 1 - cfg["epsilon"]))
        assert row["clip_frac"] == pytest.approx(clipped.mean())
        assert row["is_vetoed"] is False  # no weight leaves [1e-4, 1e4] in this run
        assert row["completion"] is None or len(row["completion"]) <= data.PREVIEW_CHARS
    # reward rank: within a group, 1..n in order of non-increasing reward
    for _, g in tab.group_by("group_id"):
        g = g.sort("reward_rank_desc")
        assert g["reward_rank_desc"].to_list() == list(range(1, g.height + 1))
        assert g["reward_total"].to_list() == sorted(g["reward_total"].to_list(), reverse=True)


def test_sidecar_and_computed_tables_agree(serve_runs, tmp_path):
    _, _, beta = serve_runs
    other = copy_run(beta, tmp_path / "run", ("completions.parquet",))
    for step in (0, 8):
        a = data.sequence_table(beta, step)
        b = data.sequence_table(other, step)
        assert a.columns == b.columns
        for c in a.columns:
            if a[c].dtype.is_float():
                np.testing.assert_allclose(a[c].fill_null(np.nan).to_numpy(), b[c].fill_null(np.nan).to_numpy(),
                                           rtol=1e-6, err_msg=c)
            else:
                assert a[c].to_list() == b[c].to_list(), c


def test_completions_paging_sorting_filtering(serve_runs):
    _, alpha, _ = serve_runs
    step = 9
    full = data.sequence_table(alpha, step)
    seen = []
    for page in range(5):
        rows, total = data.completions_page(alpha, step, page, 7)
        assert total == full.height
        seen += rows["sample_id"].to_list()
    assert sorted(seen) == sorted(full["sample_id"].to_list())  # every row once, none twice

    rows, total = data.completions_page(alpha, step, 0, 100, [{"column_id": "kl_max", "direction": "desc"}])
    assert rows["kl_max"].to_list() == sorted(full["kl_max"].to_list(), reverse=True)

    rows, total = data.completions_page(alpha, step, 0, 100, None, "{reward_total} > 0.5 && {truncated} = false")
    want = full.filter((pl.col("reward_total") > 0.5) & ~pl.col("truncated"))
    assert total == want.height and set(rows["sample_id"]) == set(want["sample_id"])

    g = int(full["group_id"][0])
    rows, total = data.completions_page(alpha, step, 0, 100, group=g, max_rank=1)
    want = full.filter((pl.col("group_id") == g) & (pl.col("reward_rank_desc") <= 1))
    assert total == want.height >= 1

    rows, total = data.completions_page(alpha, step, 0, 100, None, '{completion} contains "<script>"')
    assert all("<script>" in c for c in rows["completion"])
    # what the DataTable's own filter row sends
    rows, total = data.completions_page(alpha, step, 0, 100, None, "{tokens} s> 20 && {completion} icontains THE")
    want = full.filter((pl.col("tokens") > 20) & pl.col("completion").str.to_lowercase().str.contains("the"))
    assert total == want.height > 0


@pytest.mark.parametrize("query", ["{nope} > 1", "{reward} ~ 1", "reward > 1", "{reward} > abc",
                                   "{reward} > 1; import os"])
def test_bad_filter_queries_are_user_errors(serve_runs, query):
    with pytest.raises(UserError):
        data.completions_page(serve_runs[1], 9, 0, 10, None, query)


def test_completion_returns_full_texts_and_tokens_in_order(serve_runs):
    _, alpha, _ = serve_runs
    s = raw_step(alpha, "samples", 3)
    sid = int(s["sample_id"][5])
    c = data.completion(alpha, 3, sid)
    assert c["sample"]["completion"] == s["completion"][5]
    assert c["tokens"]["pos"].to_list() == list(range(int(s["completion_len"][5])))
    assert data.completion(alpha, 3, 10**9) is None


def test_is_step_detail_computed_against_numpy(serve_runs, tmp_path):
    _, _, beta = serve_runs
    run = copy_run(beta, tmp_path / "run", ("is_hist.parquet",))
    step = 10  # rollout drift from step 7 on
    t = token_reference(run, step)
    w = t["w_ref"][t["mask"]]
    d = data.is_step_detail(run, step)
    assert d["tokens"] == len(w) and d["source"] == "tokens"
    edges = data.IS_LOG10_EDGES
    clipped = np.clip(np.log10(w), edges[0], edges[-1] - 1e-12)
    np.testing.assert_array_equal(d["raw"], np.histogram(clipped, edges)[0])
    applied = np.clip(np.log10(np.minimum(w, 2.0)), edges[0], edges[-1] - 1e-12)  # truncate at upper=2
    np.testing.assert_array_equal(d["applied"], np.histogram(applied, edges)[0])
    assert d["offset_mean"] == pytest.approx(np.log(w).mean())
    assert d["offset_sd"] == pytest.approx(np.log(w).std(ddof=1))
    assert d["offset_mean"] > 0.05  # the injected drift: rollout log-probs ~0.1 lower


def test_is_step_detail_from_recomputed_histograms(serve_runs):
    _, _, beta = serve_runs
    step = 10
    t = token_reference(beta, step)
    w = t["w_ref"][t["mask"]]
    d = data.is_step_detail(beta, step)
    assert d["source"] == "is_hist.parquet"
    weight_edges = 10 ** d["edges"]
    np.testing.assert_array_equal(d["raw"], np.histogram(w, weight_edges)[0])
    assert d["applied"].sum() + d["zeroed"] == len(w)
    assert d["metrics"]["mismatch/constant_offset"] == 1.0  # the family flags the injected drift


def test_is_heatmap_from_recomputed_histograms(serve_runs):
    _, alpha, _ = serve_runs
    hm = data.is_heatmap(alpha)
    assert hm["source"] == "is_hist.parquet" and list(hm["steps"]) == list(range(14))
    t = token_reference(alpha, 4)
    np.testing.assert_array_equal(hm["counts"][4], np.histogram(t["w_ref"][t["mask"]], 10 ** hm["log10_edges"])[0])


def test_is_heatmap_from_tokens(serve_runs, tmp_path):
    _, alpha, _ = serve_runs
    run = copy_run(alpha, tmp_path / "run", ("is_hist.parquet",))
    hm = data.is_heatmap(run)
    assert hm["counts"].shape == (14, len(data.IS_LOG10_EDGES) - 1) and hm["source"] == "tokens"
    t = token_reference(run, 4)
    assert hm["counts"][4].sum() == t["mask"].sum()
    few = data.is_heatmap(run, max_steps=5)
    assert list(few["steps"]) == [0, 3, 6, 10, 13] and "sampled" in few["source"]


def test_caches_follow_file_changes(tmp_path, serve_runs):
    import shutil

    import grpolens

    run = tmp_path / "run"
    shutil.copytree(serve_runs[1], run)
    before = data.series(run).height
    shutil.rmtree(run / "tokens" / "step=00000013")
    shutil.rmtree(run / "samples" / "step=00000013")
    for marker in (run / "complete").glob("step=00000013.rank=*.json"):  # the step is gone whole
        marker.unlink()
    shutil.rmtree(run / "grpolens")
    grpolens.recompute(run, write=True)
    assert data.series(run).height == before - 1
