"""verl's rejection-filter metrics (``rollout_rs/*``) against verl's formulas on padded arrays, and
how the per-shard partials of :class:`~grpolens.metrics.rollout_is.visitors.RSPartials` merge: a
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
    # two token filters, the second's rejections a subset of the first's: together, their union
    ("token_k1,token_k2", "0.95_1.05,0.008"),
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
    from grpolens.functional.rollout_is import ISConfig
    from grpolens.metrics.batch import TokenBatch
    from grpolens.metrics.rollout_is import RSPartials

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


# ---------------------------------------------------------------------------------------------
# recompute --is-weights: the files (docs/rollout-is.md, "Outputs")
# ---------------------------------------------------------------------------------------------

#: docs/rollout-is.md: keyed like tokens, then mask, valid, is_weight_raw, is_weight, is_mask
WEIGHT_COLUMNS = ["step", "rank", "micro_batch", "sample_id", "pos", "mask", "valid", "is_weight_raw", "is_weight",
                  "is_mask"]


def _files(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.parquet"))


def test_is_weights_files_mirror_the_token_shards_part_by_part(tmp_path):
    """One weights file per token shard, named like it (part files too), holding the shard's keys
    with the tokens' own types, its mask, and weights that are null exactly where not valid."""
    import pyarrow.parquet as pq

    from grpolens.cli import main
    from grpolens.run import format as fmt

    calls = random_calls(np.random.default_rng(53), spread=0.3, micro_batches=3, nonfinite=0.1)
    run = write_run(tmp_path / "run", calls, parts=2, config={"rollout_is": {"level": "token", "mode": "truncate",
                                                                            "threshold": [0.5, 2.0]}})
    main(["recompute", str(run), "--is-weights", "-q"])
    root, tokens = run / "grpolens" / "is_weights", run / "tokens"
    names = _files(tokens)
    assert any("-0001.parquet" in n for n in names) and any("-0000.parquet" in n for n in names)
    assert _files(root) == names
    key_types = {c.name: c.type for c in fmt.TOKEN_COLUMNS}
    for n in names:
        w, t = pq.read_table(root / n), pq.read_table(tokens / n)
        assert w.column_names == WEIGHT_COLUMNS
        assert [w.schema.field(k).type for k in WEIGHT_COLUMNS[:5]] == [key_types[k] for k in WEIGHT_COLUMNS[:5]]
        assert [str(w.schema.field(k).type) for k in WEIGHT_COLUMNS[5:]] == ["bool", "bool", "double", "double", "bool"]
        w, t = pl.from_arrow(w), pl.from_arrow(t).sort(WEIGHT_COLUMNS[1:5])
        w = w.sort(WEIGHT_COLUMNS[1:5])
        assert w.select(WEIGHT_COLUMNS[:6]).equals(t.select(WEIGHT_COLUMNS[:6]))
        valid = w["valid"].to_numpy()
        assert not valid.all() and valid.any()
        for col in ("is_weight_raw", "is_weight"):
            assert (w[col].is_null().to_numpy() == ~valid).all(), (n, col)
    # a later run of the same tokens written one file per (step, rank): the part files of the
    # earlier layout are removed (a reader would take them for current ones), other files are not
    (root / "step=00000000" / "notes.txt").write_text("mine")
    import shutil

    shutil.rmtree(tokens)
    write_run(run, calls)
    main(["recompute", str(run), "--is-weights", "-q"])
    assert _files(root) == _files(tokens) == [f"step={s:08d}/rank={r:05d}.parquet" for s in (0, 1) for r in (0, 1)]
    assert (root / "step=00000000" / "notes.txt").read_text() == "mine"


def test_is_weights_remove_a_stale_part_that_is_a_dangling_link(tmp_path):
    """``--out OUT`` on disk: a part of an earlier layout that is a symbolic link whose target is gone
    is removed like any stale part (a reader of ``step=S/rank=*.parquet``, polars' glob, fails on
    it); the listing of a storage location reports no such entry, so only the directory's own
    glob finds it."""
    import os

    from grpolens.cli import main

    calls = random_calls(np.random.default_rng(53), spread=0.3, steps=(0,), ranks=1)
    run = write_run(tmp_path / "run", calls, config={"rollout_is": {"level": "token", "mode": "truncate",
                                                                    "threshold": [0.5, 2.0]}})
    step = tmp_path / "out" / "is_weights" / "step=00000000"
    step.mkdir(parents=True)
    (step / "rank=00003.parquet").symlink_to(tmp_path / "gone.parquet")
    main(["recompute", str(run), "--is-weights", "-q", "--out", str(tmp_path / "out")])
    assert sorted(os.listdir(step)) == ["rank=00000.parquet"]
    assert pl.read_parquet(step / "rank=*.parquet").height == sum(int(c.valid.sum()) for c in calls)


def test_is_weights_config_json_records_the_config_used(tmp_path):
    """``is_weights/config.json``: every setting of the IS config the weights were computed with,
    the rejection filters, whether the run configured IS at all, and what each column holds."""
    import json

    from grpolens.analysis.is_weights import is_weight_writer

    columns = {"valid": "mask and the log-ratio is defined (weights are null elsewhere)",
               "is_weight_raw": "safety-bounded weight at the level, before truncation/zeroing",
               "is_weight": "applied weight (after truncation/zeroing)",
               "is_mask": "the loss mask after the mask band, veto and rejection filters"}
    ris = {"level": "sequence", "mode": "both", "threshold": [0.5, 2.0], "mask_threshold": [0.25, 4.0],
           "veto_threshold": [1e-3, 1e3], "rs": "token_k1,seq_max_k2", "rs_threshold": "0.8_1.25,0.5"}
    want = {"level": "sequence", "mode": "both", "lower": 0.5, "upper": 2.0, "mask_lower": 0.25, "mask_upper": 4.0,
            "veto_lower": 1e-3, "veto_upper": 1e3,
            "rs": [{"option": "token_k1", "lower": 0.8, "upper": 1.25}, {"option": "seq_max_k2", "lower": None, "upper": 0.5}],
            "configured": True, "columns": columns}
    unset = {"level": "token", "mode": "none", "lower": None, "upper": None, "mask_lower": None, "mask_upper": None,
             "veto_lower": None, "veto_upper": None, "rs": [], "configured": False, "columns": columns}
    calls = random_calls(np.random.default_rng(59), steps=(0,), ranks=1)
    for name, config, expected in (("set", {"rollout_is": ris}, want), ("unset", None, unset)):
        run = write_run(tmp_path / name, calls, config=config)
        is_weight_writer(run)
        text = (run / "grpolens" / "is_weights" / "config.json").read_text()
        assert json.loads(text) == expected, name
        assert text == json.dumps(expected, indent=2) + "\n"  # indented, one key a line, a final newline


def test_is_weights_of_a_run_without_rollout_logprobs_name_its_first_token_shard(tmp_path):
    from grpolens.errors import UserError
    from grpolens.analysis.is_weights import is_weight_writer

    run = write_run(tmp_path / "run", random_calls(np.random.default_rng(0), rollout=False))
    with pytest.raises(UserError) as e:
        is_weight_writer(run)
    assert str(e.value) == (f"--is-weights: {run / 'tokens' / 'step=00000000' / 'rank=00000.parquet'} has no "
                            "rollout_logp column, so there are no IS weights")
    assert not (run / "grpolens" / "is_weights").exists()


def test_rejection_metrics_of_a_step_are_the_same_to_the_last_bit_on_every_merge():
    """The pieces merge in row order, never in a hash order (polars' varies from call to call),
    so the float sums behind each metric add in one order: every merge of the same pieces gives
    the same bits."""
    import pyarrow as pa

    from tests.refdata import call_table

    calls = random_calls(np.random.default_rng(61), spread=0.4, steps=(0,), batch=8)
    again = [LossCall(c.step, c.rank, c.micro_batch + 2, c.sample_ids, c.lengths, c.logp, c.mask, c.advantages,
                      old=c.old, rollout=c.rollout) for c in calls[:2]]  # a second loss call of the same completions
    rs, thresholds = OPTIONS[1]
    v, pieces = _rs_pieces([pa.concat_tables([call_table(c)]) for c in calls + again], rs_config(rs, thresholds))
    first = v.combine(0, pieces)
    for _ in range(8):
        assert v.combine(0, pieces) == first


def test_is_hist_has_its_documented_columns_and_counts_zeroed_weights_apart(tmp_path):
    """``is_hist.parquet``: step, kind, lo, hi (floats), count (an integer); the applied weights
    IcePop set to 0 are the applied row with lo = hi = 0 (docs/rollout-is.md). Band [0.5, 1.2]:
    of the raw weights [0.4, 1, 2] and [1.1], two are zeroed."""
    old, roll = [[-1.0, -1.0, -1.0], [-1.0, -9.0, -9.0]], [[-1.0 - np.log(0.4), -1.0, -1.0 - np.log(2.0)],
                                                         [-1.0 - np.log(1.1), -9.0, -9.0]]
    mask = np.array([[True, True, True], [True, False, False]])
    from tests.metrics.rollout_is_reference import one_call

    run, _ = one_call(tmp_path, old, roll, mask=mask, config={"rollout_is": "token", "rollout_is_threshold": "0.5_1.2"})
    grpolens.recompute(run)
    h = pl.read_parquet(run / "grpolens" / "is_hist.parquet")
    assert h.schema == pl.Schema({"step": pl.Int64, "kind": pl.String, "lo": pl.Float64, "hi": pl.Float64,
                                  "count": pl.Int64})
    zero = h.filter((pl.col("lo") == 0.0) & (pl.col("hi") == 0.0))
    assert zero.select("kind", "count").rows() == [("applied", 2)]
    applied = h.filter((pl.col("kind") == "applied") & (pl.col("hi") > 0))
    assert applied["count"].sum() == 2 and h.filter(pl.col("kind") == "raw")["count"].sum() == 4
    assert (applied["lo"] > 0).all() and (h.filter(pl.col("kind") == "raw")["lo"] > 0).all()


@pytest.mark.parametrize("band", ["0.5_1.0", "1.0_2.0"])
def test_rejection_statistic_exactly_on_a_bound_is_counted_on_neither_side(tmp_path, band):
    """verl counts stat > upper and (k1) stat < lower as beyond the band, strictly, in every
    fraction. Rows δ = [0, 0], [0.5, 0.25], [-0.25] (exact in float32): k1 = −δ is exactly 0 = log 1
    on row 0, a bound of both bands; k2 = δ²/2 is exactly 0.125, the k2 bound, on row 1's first
    token, and row 1's max."""
    from tests.metrics.rollout_is_reference import one_call

    delta = [[0.0, 0.0], [0.5, 0.25], [-0.25, 0.0]]
    mask = np.array([[True, True], [True, True], [True, False]])
    rs = "token_k1,seq_mean_k1,token_k2,seq_max_k2"
    thresholds = f"{band},{band},0.125,0.125"
    run, c = one_call(tmp_path, np.full((3, 2), -1.0), -1.0 - np.array(delta), mask=mask,
                      config={"rs": rs, "rs_threshold": thresholds})
    row = grpolens.recompute(run, write=False).row(0, named=True)
    d = np.where(mask, c.old - c.rollout, 0.0)
    assert (d == np.array(delta)).all()
    ref = verl_rs_ref(d, mask, rs_config(rs, thresholds)["rollout_is"]["rs"])
    bad = {k: (row.get("rollout_rs/" + k), v) for k, v in ref.items() if not close(row.get("rollout_rs/" + k), v)}
    assert not bad, bad
    # by hand: k1 per token [0, 0, -0.5, -0.25, 0.25], row means [0, -0.375, 0.25]; the k2 bound is
    # reached, not passed
    want = {"0.5_1.0": {"token_k1/fraction_high": 1 / 5, "token_k1/fraction_low": 0.0, "token_k1/masked_fraction": 1 / 5,
                        "seq_mean_k1/fraction_high": 1 / 3, "seq_mean_k1/fraction_low": 0.0,
                        "seq_mean_k1/masked_fraction": 1 / 5},
            "1.0_2.0": {"token_k1/fraction_high": 0.0, "token_k1/fraction_low": 2 / 5, "token_k1/masked_fraction": 2 / 5,
                        "seq_mean_k1/fraction_high": 0.0, "seq_mean_k1/fraction_low": 1 / 3,
                        "seq_mean_k1/masked_fraction": 2 / 5}}[band]
    want.update({"token_k2/fraction_high": 0.0, "seq_max_k2/fraction_high": 0.0, "token_k2/masked_fraction": 0.0,
                 "seq_max_k2/masked_fraction": 0.0})
    assert {k: row["rollout_rs/" + k] for k in want} == pytest.approx(want, abs=1e-15)


def _call(step, rank, deltas, mask, first_id):
    """One loss call of rows δ (old = −1, rollout = −1 − δ: exact in float32 for these values)."""
    d = np.array(deltas, float)
    B, T = d.shape
    return LossCall(step, rank, 0, np.arange(first_id, first_id + B), np.full(B, T), f32(np.full((B, T), -1.0)),
                    np.array(mask, bool), f32(np.ones(B)), old=f32(np.full((B, T), -1.0)), rollout=f32(-1.0 - d))


def test_rejection_metrics_of_one_and_two_tokens_and_rows_and_of_none(tmp_path):
    """verl's guards: the token-weighted std is 0.0 unless more than one token, the std over rows
    0.0 unless more than one row; a step without a valid token has no ``rollout_rs/*``. Step 0: one
    token; step 1: one row of two tokens; step 2: two rows of one token; step 3: every token masked."""
    rs, thresholds = "token_k1,seq_mean_k2", "0.95_1.05,0.01"
    calls = [_call(0, 0, [[0.25, 0.0]], [[True, False]], 0), _call(1, 0, [[0.25, -0.5]], [[True, True]], 10),
             _call(2, 0, [[0.25, 0.0], [-0.5, 0.0]], [[True, False], [True, False]], 20),
             _call(3, 0, [[0.25, -0.5]], [[False, False]], 30)]
    run = write_run(tmp_path / "run", calls, config={"rollout_is": {"rs": rs, "rs_threshold": thresholds}})
    got = grpolens.recompute(run, write=False)
    filters = rs_config(rs, thresholds)["rollout_is"]["rs"]
    for step in (0, 1, 2):
        ref = verl_rs_ref(*padded(calls, step), filters)
        row = got.filter(pl.col("step") == step).row(0, named=True)
        bad = {k: (row.get("rollout_rs/" + k), v) for k, v in ref.items() if not close(row.get("rollout_rs/" + k), v)}
        assert not bad, (step, bad)
        std, seq_std = row["rollout_rs/token_k1/std"], row["rollout_rs/seq_mean_k2/seq_std"]
        assert (std == 0.0, seq_std == 0.0) == ((True, True), (False, True), (False, False))[step], step
    last = got.filter(pl.col("step") == 3).row(0, named=True)
    assert all(v is None for k, v in last.items() if k.startswith("rollout_rs/"))


def test_rejection_metrics_of_a_step_whose_other_rank_has_no_rollout_logprobs(tmp_path):
    """Rank 1 recorded no rollout_logp (validate accepts it): its shards give no rejection
    partials, and each step's ``rollout_rs/*`` are verl's over rank 0's rows."""
    calls = random_calls(np.random.default_rng(73), spread=0.4)
    for c in calls:
        if c.rank == 1:
            c.rollout = None
    rs, thresholds = OPTIONS[0]
    run = write_run(tmp_path / "run", calls, config={"rollout_is": {"rs": rs, "rs_threshold": thresholds}})
    got = grpolens.recompute(run, write=False)
    own = [c for c in calls if c.rank == 0]
    for step in (0, 1):
        ref = verl_rs_ref(*padded(own, step), rs_config(rs, thresholds)["rollout_is"]["rs"])
        row = got.filter(pl.col("step") == step).row(0, named=True)
        bad = {k: (row.get("rollout_rs/" + k), v) for k, v in ref.items() if not close(row.get("rollout_rs/" + k), v)}
        assert not bad, bad


@pytest.mark.parametrize("how", ["set", "config"])
def test_is_weights_of_a_what_if_use_its_settings(tmp_path, how):
    """``--is-weights`` with ``--set`` or ``--config``: the weights (and config.json) are those of the
    what-if's IS settings, an upper bound of 1.05 in place of the run's 2.0."""
    import json

    from grpolens.cli import main

    calls = random_calls(np.random.default_rng(79), spread=0.3, steps=(0,), ranks=1)
    run = write_run(tmp_path / "run", calls, config={"rollout_is": {"level": "token", "mode": "truncate",
                                                                    "lower": 0.5, "upper": 2.0}})
    if how == "set":
        args = ["--set", "rollout_is.upper=1.05"]
    else:
        (tmp_path / "what-if.json").write_text(json.dumps({"rollout_is": {"level": "token", "mode": "truncate",
                                                                         "lower": 0.5, "upper": 1.05}}))
        args = ["--config", str(tmp_path / "what-if.json")]
    main(["recompute", str(run), *args, "--is-weights", "-q"])
    [cfg] = list((run / "grpolens" / "variants").rglob("is_weights/config.json"))
    assert json.loads(cfg.read_text())["upper"] == 1.05
    w = pl.concat([pl.read_parquet(f) for f in cfg.parent.rglob("*.parquet")])["is_weight"].drop_nulls()
    assert w.max() == 1.05
