"""verl's rejection-filter metrics (``rollout_rs/*``) against verl's formulas on padded arrays, and
how the per-shard partials of :class:`~grpolens.metrics.rollout_is_visitors.RSPartials` merge: a
sequence cut across pieces, a completion trained on in two loss calls.

The reference is ``compute_rollout_rejection_mask`` / ``compute_rs_metrics`` of verl 0.9.1
(``verl/trainer/ppo/rollout_corr_helper.py``) written out with numpy over the step's rows padded
to one (B, T) batch, the global batch verl filters on the driver; the masked means divide exactly
(verl adds 1e-8 to the count).
"""

import numpy as np
import polars as pl
import pytest

import grpolens
from grpolens.run.config import check_config
from grpolens.run.format import CONFIG_DEFAULTS
from tests.refdata import LossCall, f32, random_calls, write_run

S = 20.0


def padded(calls: list[LossCall], step: int) -> tuple[np.ndarray, np.ndarray]:
    """δ = old − rollout and the response mask of a step's rows, one (B, T) batch."""
    cs = [c for c in calls if c.step == step]
    T = max(c.logp.shape[1] for c in cs)
    pad = lambda x, fill: np.pad(x, ((0, 0), (0, T - x.shape[1])), constant_values=fill)  # noqa: E731
    d = np.concatenate([pad(np.where(c.mask & c.valid, c.old - c.rollout, 0.0), 0.0) for c in cs])
    m = np.concatenate([pad(c.mask & c.valid, False) for c in cs])
    return d, m


def verl_rs_ref(d: np.ndarray, m: np.ndarray, filters: list[dict]) -> dict[str, float]:
    """verl's per-option metrics and the combined masked fractions, on padded arrays."""
    ds = np.clip(d, -S, S)
    stats = {1: -ds, 2: 0.5 * ds ** 2, 3: np.exp(ds) - 1.0 - ds}
    mf = m.astype(float)
    M, nrow = mf.sum(), mf.sum(1)
    valid_row = nrow > 0
    mm = lambda x: (np.where(m, x, 0.0)).sum() / M  # noqa: E731  (masked mean over the batch)
    keep_all = np.ones(m.shape, bool)
    out = {}
    for f in filters:
        opt = f["option"]
        k1 = opt.endswith("k1")
        stat = stats[int(opt[-1])]
        up = np.log(f["upper"]) if k1 else f["upper"]
        lo = np.log(f["lower"]) if k1 else 0.0
        if opt.startswith("token"):
            seq = np.where(m, stat, 0.0).sum(1) / np.maximum(nrow, 1)
            tok, level = stat, "token"
        else:
            if opt.startswith("seq_sum"):
                seq = np.where(m, stat, 0.0).sum(1)
            elif opt.startswith("seq_mean"):
                seq = np.where(m, stat, 0.0).sum(1) / np.maximum(nrow, 1)
            else:  # seq_max: -inf on an empty row, read as 0
                seq = np.where(valid_row, np.where(m, stat, -np.inf).max(1), 0.0)
            tok, level = np.repeat(seq[:, None], m.shape[1], 1), "sequence"
        keep = ((tok >= lo) & (tok <= up)) if k1 else tok <= up
        v = seq[valid_row]
        p = f"{opt}/"
        out[p + "mean"] = mm(tok)
        if level == "sequence":
            out[p + "max"], out[p + "min"] = v.max(), v.min()
            out[p + "fraction_high"] = np.mean(v > up)
            out[p + "fraction_low"] = np.mean(v < lo) if k1 else 0.0
        else:
            out[p + "max"], out[p + "min"] = tok[m].max(), tok[m].min()
            out[p + "fraction_high"] = mm(tok > up)
            out[p + "fraction_low"] = mm(tok < lo) if k1 else 0.0
        cl = np.clip(tok, lo, up)
        out[p + "std"] = np.sqrt(max(0.0, mm(cl * cl) - mm(cl) ** 2)) if M > 1 else 0.0
        out[p + "seq_mean"] = v.mean()
        out[p + "seq_std"] = v.std(ddof=1) if len(v) > 1 else 0.0
        out[p + "seq_max"], out[p + "seq_min"] = v.max(), v.min()
        out[p + "seq_max_deviation"] = np.abs(v).max()
        out[p + "seq_fraction_high"] = np.mean(v > up)
        if k1:
            out[p + "seq_fraction_low"] = np.mean(v < lo)
        out[p + "masked_fraction"] = mm(~keep)
        out[p + "seq_masked_fraction"] = (~keep & m).any(1)[valid_row].mean()
        keep_all &= keep
    out["masked_fraction"] = mm(~keep_all)
    out["seq_masked_fraction"] = (~keep_all & m).any(1).mean()  # over every row, empty ones too
    return out


def close(got, want, rel=1e-9, abs_=1e-12):
    return got is not None and abs(got - want) <= abs_ + rel * abs(want)


def rs_config(rs: str, thresholds: str) -> dict:
    return check_config({**CONFIG_DEFAULTS, "rollout_is": {"rs": rs, "rs_threshold": thresholds}})


#: every kind of filter: token options, and sequence options reducing by sum, mean and max
OPTIONS = [
    ("token_k1,seq_sum_k2,seq_mean_k3,seq_max_k2", "0.95_1.05,0.03,0.007,0.015"),
    ("token_k2,token_k3,seq_sum_k1,seq_mean_k1,seq_max_k3", "0.008,0.008,0.82_1.05,0.95_1.03,0.015"),
    ("seq_sum_k3,seq_mean_k2", "0.03,0.006"),
]


@pytest.mark.parametrize("rs,thresholds", OPTIONS)
def test_rejection_metrics_are_verls_formulas_over_the_step(tmp_path, rs, thresholds):
    """Every ``rollout_rs/*`` metric of every filter kind, on ragged rows with an empty (all-masked)
    row and a one-token row in each loss call, against verl's formulas over the step's rows."""
    rng = np.random.default_rng(41)
    calls = random_calls(rng, spread=0.4)
    cfg = rs_config(rs, thresholds)
    run = write_run(tmp_path / "run", calls, config={"rollout_is": {"rs": rs, "rs_threshold": thresholds}})
    got = grpolens.recompute(run, write=False)
    filters = cfg["rollout_is"]["rs"]
    for step in (0, 1):
        ref = verl_rs_ref(*padded(calls, step), filters)
        row = got.filter(pl.col("step") == step).row(0, named=True)
        bad = {k: (row.get("rollout_rs/" + k), v) for k, v in ref.items() if not close(row.get("rollout_rs/" + k), v)}
        assert not bad, bad
        assert set("rollout_rs/" + k for k in ref) == {c for c in got.columns if c.startswith("rollout_rs/")}
        # the data reach the bounds: the fractions compared are neither all 0 nor all 1
        fracs = {k: v for k, v in ref.items() if "fraction" in k and not (k.endswith("fraction_low") and "k1" not in k)}
        assert all(0 < v < 1 for v in fracs.values()), fracs


def _rs_pieces(tables, cfg):
    from grpolens.functional.is_weights import ISConfig
    from grpolens.metrics.batch import TokenBatch
    from grpolens.metrics.rollout_is_visitors import RSPartials

    v = RSPartials(ISConfig.from_cfg(cfg))
    return v, [v.shard(TokenBatch.from_arrow(t), None) for t in tables]


@pytest.mark.parametrize("rs,thresholds", OPTIONS[:2])
def test_rejection_partials_of_a_sequence_cut_across_pieces_merge_by_their_rules(rs, thresholds):
    """Pieces that cut sequences in two (each multi-token sequence split at its middle token):
    a sequence's maxima merge by max, minima by min, counts and sums add up, and the step's
    metrics are verl's over the whole rows."""
    import pyarrow as pa

    from tests.refdata import call_table

    calls = random_calls(np.random.default_rng(43), spread=0.4, steps=(0,))
    table = pa.concat_tables([call_table(c) for c in calls])
    sid = table.column("sample_id").to_numpy()
    starts = np.flatnonzero(np.r_[True, sid[1:] != sid[:-1]])
    lengths = np.diff(np.r_[starts, len(sid)])
    cuts = (starts + lengths // 2)[lengths > 1]
    bounds = [0, *cuts.tolist(), len(sid)]
    cfg = rs_config(rs, thresholds)
    v, pieces = _rs_pieces([table.slice(a, b - a) for a, b in zip(bounds, bounds[1:])], cfg)
    assert len(pieces) > 8
    got = v.combine(0, pieces + [None])  # a shard without rollout log-probs gives None: nothing to merge
    ref = verl_rs_ref(*padded(calls, 0), cfg["rollout_is"]["rs"])
    bad = {k: (got.get("rollout_rs/" + k), w) for k, w in ref.items() if not close(got.get("rollout_rs/" + k), w)}
    assert not bad, bad
    assert set(got) == {"rollout_rs/" + k for k in ref}
    assert v.combine(0, [None, None]) is None


def test_a_completion_trained_on_in_two_loss_calls_is_filtered_once(tmp_path):
    """verl filters each completion once, on the driver, before the mini-batches and PPO epochs:
    rank 0's first loss call trained on again as micro-batch 2 (the same completions, the same
    log-probs) leaves every ``rollout_rs/*`` metric as without it."""
    import copy

    calls = random_calls(np.random.default_rng(47), spread=0.4, steps=(0,))
    again = copy.deepcopy(calls[0])
    again.micro_batch = 2
    rs, thresholds = OPTIONS[0]
    cfg = rs_config(rs, thresholds)
    ref = verl_rs_ref(*padded(calls, 0), cfg["rollout_is"]["rs"])
    twice = verl_rs_ref(*padded(calls + [again], 0), cfg["rollout_is"]["rs"])
    assert twice["masked_fraction"] != ref["masked_fraction"]  # counted twice, the repeated rows would weigh
    run = write_run(tmp_path / "run", calls + [again], config={"rollout_is": {"rs": rs, "rs_threshold": thresholds}})
    row = grpolens.recompute(run, write=False).row(0, named=True)
    bad = {k: (row.get("rollout_rs/" + k), v) for k, v in ref.items() if not close(row.get("rollout_rs/" + k), v)}
    assert not bad, bad
