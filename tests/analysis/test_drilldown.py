"""Top-K tokens (mergeable, equal to a global top-K) and the ``grpolens tokens`` view."""

import json
import subprocess
import sys

import numpy as np
import polars as pl
import pytest

import grpolens
from grpolens.analysis import drilldown
from grpolens.metrics.batch import TokenBatch
from tests.refdata import call_table, random_calls, write_run


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "grpolens.cli", *map(str, args)], capture_output=True, text=True)


def ref_scores(c, by):
    """Per-token scores on padded arrays, written from the definitions in drilldown's docstring."""
    with np.errstate(all="ignore"):
        if by == "kl":
            x = c.ref - c.logp
            s = np.exp(x) - x - 1
        elif by == "mismatch":
            s = np.abs(c.old - c.rollout)
        elif by == "ratio":
            s = np.abs(c.logp - c.old)
        elif by == "entropy":
            s = c.entropy.copy()
        else:
            s = np.abs(c.adv_tok) * np.abs(np.exp(c.logp - c.old) - 1)
    return np.where(c.mask & np.isfinite(s), s, np.nan)


def test_largest_is_a_stable_sorts_top_k():
    """_largest (blockwise-maximum candidates, then a partition) against a stable sort: the values
    above the k-th largest in position order, then the first positions holding it; on ties,
    sorted and constant input, lengths that are no whole number of blocks, the maximum in the
    last partial block, and k around the candidate threshold."""
    rng = np.random.default_rng(7)
    cases = [rng.normal(size=20_011), np.round(rng.normal(size=30_000), 1), np.zeros(9_000),
             np.sort(rng.normal(size=10_000)), np.sort(rng.normal(size=10_000))[::-1].copy(),
             np.r_[np.zeros(12_800), np.ones(5)], np.r_[rng.normal(size=6_431), 99.0], rng.normal(size=40),
             rng.integers(0, 3, 50_000).astype(np.float64)]
    for x in cases:
        for k in (1, 2, 5, 32, 63, 64, 65, 100, 1_000):
            if k >= len(x):
                continue
            best = np.lexsort((np.arange(len(x)), -x))[:k]
            t = x[best[-1]]
            want = np.r_[np.sort(best[x[best] > t]), np.sort(best[x[best] == t])]
            assert np.array_equal(drilldown._largest(x, k), want), (len(x), k)


@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("nonfinite", [0.0, 0.05])
def test_top_tokens_equal_global_top_k(tmp_path, parts, nonfinite):
    rng = np.random.default_rng(11)
    calls = random_calls(rng, steps=(0, 1), ranks=3, micro_batches=3, batch=5, max_len=12, nonfinite=nonfinite)
    run = write_run(tmp_path / "run", calls, parts=parts, rng=rng)
    res = grpolens.recompute(run, overrides={"top_k_tokens": 7}, result=True)  # a what-if: under variants/
    top = pl.read_parquet(res.out_dir / "top_tokens.parquet")
    for step in (0, 1):
        for by in drilldown.SCORES:
            vals = np.concatenate([ref_scores(c, by)[c.valid] for c in calls if c.step == step])
            vals = np.sort(vals[~np.isnan(vals)])[::-1][:7]
            got = top.filter((pl.col("step") == step) & (pl.col("by") == by)).sort("score", descending=True)
            np.testing.assert_allclose(got["score"].to_numpy(), vals, rtol=1e-12)


def test_top_tokens_ties_go_to_the_first_keys_whatever_the_split():
    """Many tokens share the top score (bf16 values do): every shard keeps, like the step's merge,
    the first rows in key order among equal scores, so the step's top-K is the same rows whether
    its tokens come as one shard or several, and they are the global order's first K."""
    import pyarrow as pa

    rng = np.random.default_rng(14)
    calls = random_calls(rng, steps=(0,), ranks=2, micro_batches=2, batch=6, max_len=30, all_masked_row=False)
    for c in calls:  # a third of the tokens at the top entropy, the rest below it
        c.entropy[rng.random(c.entropy.shape) < 0.33] = 4.0
    k = 7
    table = pa.concat_tables([call_table(c) for c in calls])
    keys = ["step", "rank", "micro_batch", "sample_id", "pos"]
    ent, mask = table["entropy"].to_numpy(), table["mask"].to_numpy()
    order = np.lexsort([table[c].to_numpy() for c in keys[::-1]] + [-np.where(mask, ent, -np.inf)])
    want = [tuple(table[c][int(i)].as_py() for c in keys) for i in order[:k]]
    assert ent[order[k]] == 4.0  # ties beyond the K-th: the test is about them

    top = drilldown.TopTokens(k)
    for parts in ([table], [call_table(c) for c in calls], [call_table(c) for c in calls[::-1]]):
        pieces = [top.shard(TokenBatch.from_arrow(t), None) for t in parts]
        got = top.combine(0, pieces).filter(pl.col("by") == "entropy")
        assert list(got.select(keys).iter_rows()) == want, len(parts)


def test_top_tokens_incremental_keeps_earlier_steps(tmp_path):
    rng = np.random.default_rng(12)
    run = write_run(tmp_path / "run", random_calls(rng, steps=(0, 1)))
    grpolens.recompute(run)
    write_run(run, random_calls(rng, steps=(2,)))
    res = grpolens.recompute(run, result=True)
    assert res.computed_steps == [2]
    top = pl.read_parquet(run / "grpolens" / "top_tokens.parquet")
    assert sorted(top["step"].unique().to_list()) == [0, 1, 2]


def test_tokens_command_views(tmp_path):
    rng = np.random.default_rng(13)
    calls = random_calls(rng, steps=(0,), ranks=2)
    run = write_run(tmp_path / "run", calls)
    r = _cli("tokens", run, "--step", "0", "--by", "mismatch", "--top", "4")
    assert r.returncode == 0, r.stderr
    assert "top 4 tokens by mismatch" in r.stdout
    sid = int(calls[0].sample_ids[0])
    r = _cli("tokens", run, "--step", "0", "--sample", sid, "--by", "entropy")
    assert r.returncode == 0 and f"sample {sid}" in r.stdout
    # bad input: precise messages, exit 2, no traceback
    for args, needle in ((("--step", "5"), "no token shards for step 5"), (("--step", "0", "--by", "foo"), "--by"),
                         (("--step", "0", "--sample", "999999"), "sample 999999")):
        r = _cli("tokens", run, *args)
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr


def test_tokens_command_missing_column_and_all_masked(tmp_path):
    rng = np.random.default_rng(14)
    calls = random_calls(rng, steps=(0,), ref=False)
    for c in calls:
        c.mask[:] = False
    run = write_run(tmp_path / "run", calls)
    r = _cli("tokens", run, "--step", "0", "--by", "kl")
    assert r.returncode == 2 and "ref_logp" in r.stderr
    r = _cli("tokens", run, "--step", "0", "--by", "entropy")
    assert r.returncode == 0 and "no masked token" in r.stdout


def test_untrusted_token_text_is_not_interpreted(tmp_path):
    rng = np.random.default_rng(15)
    calls = random_calls(rng, steps=(0,), ranks=1, micro_batches=1)
    run = write_run(tmp_path / "run", calls)
    vocab = [f"[bold red]t{i}[/]" if i % 2 else f"\x1b[31mx{i}\x1b]0;pwned\x07" for i in range(50)]
    (run / "vocab.json").write_text(json.dumps(vocab))
    m = json.loads((run / "grpolens.json").read_text())
    m["config"]["vocab_file"] = "vocab.json"
    (run / "grpolens.json").write_text(json.dumps(m))
    sid = int(calls[0].sample_ids[0])
    r = _cli("tokens", run, "--step", "0", "--sample", sid, "--by", "entropy")
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout  # no escape sequence reaches the terminal
    assert "\\x1b" in r.stdout or "[bold red]" in r.stdout  # shown as visible text instead
