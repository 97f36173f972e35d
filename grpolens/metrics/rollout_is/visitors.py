"""Per-step visitors of the rollout-IS family: what one pass over the tokens gives besides the
per-sequence partials.

The exact δ quantiles (:class:`DeltaQuantiles`) and verl's rejection-filter partials
(:class:`RSPartials`), both read by the family's metrics. The visitors that write outputs (the
IS-weight histograms, the ``--is-weights`` files) are in :mod:`grpolens.analysis.is_weights`.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from grpolens.functional import rollout_is as ris
from grpolens.functional.histogram import LogHistogram
from grpolens.functional.rollout_is import ISConfig
from grpolens.metrics.batch import KEY_COLUMNS, TokenBatch
from grpolens.metrics.engine import Visitor, visitor
from grpolens.metrics.rollout_is.inputs import DELTA_VISITOR, FAMILY, RS_VISITOR, batch_inputs, mismatch_inputs
from grpolens.metrics.rollout_is.offset import OFFSET_MIN_AGREEMENT, OFFSET_MIN_NATS


class DeltaQuantiles(Visitor):
    """Per-step quantiles of δ over masked finite tokens from a mergeable log-binned histogram
    (:mod:`grpolens.functional.histogram`: within 0.5 % of the exact order statistic), and exact
    counts of each sign: shards and engines merge it exactly."""

    name = DELTA_VISITOR

    def shard(self, b: TokenBatch, shard) -> tuple[LogHistogram, int, int] | None:
        if not b.has("rollout_logp"):
            return None
        d = mismatch_inputs(b)[3]  # the mismatch partials' δ: masked tokens, both log-probs finite
        return LogHistogram.with_signs(d)

    def combine(self, step: int, pieces: list) -> dict[str, float] | None:
        parts = [p for p in pieces if p is not None]
        if not parts:
            return None
        h = LogHistogram.merge_all([p[0] for p in parts])
        n = h.n
        if n == 0:
            return {"n": 0.0}
        neg, pos = sum(p[1] for p in parts), sum(p[2] for p in parts)
        q25, med, q75 = h.quantile(0.25), h.quantile(0.5), h.quantile(0.75)
        agree = neg / n if med < 0 else pos / n if med > 0 else 0.0
        flag = abs(med) >= OFFSET_MIN_NATS and agree >= OFFSET_MIN_AGREEMENT
        return {"n": float(n), "median": float(med), "iqr": float(q75 - q25),
                "agreement": float(agree), "flag": 1.0 if flag else 0.0}


@visitor(DELTA_VISITOR, families=(FAMILY,))
def _delta_visitor(cfg: dict) -> DeltaQuantiles:
    return DeltaQuantiles()


class RSPartials(Visitor):
    """Per-sequence partials of verl's rejection filters (only when ``rollout_is.rs`` is set)."""

    name = RS_VISITOR

    def __init__(self, c: ISConfig):
        self.c = c
        self.ks = sorted({f.k for f in c.rs})

    def shard(self, b: TokenBatch, shard) -> dict | None:
        if not self.c.rs or not b.has("rollout_logp"):
            return None
        x = batch_inputs(b)
        sg, d = x.seg, x.dv
        out = dict(b.seq_keys)
        out["n"] = sg.n
        stats = {k: ris.rs_stat(k, d) for k in self.ks}
        for k, s in stats.items():
            out[f"k{k}.sum"] = sg.sum(s)
            out[f"k{k}.max"] = sg.max(s)
        tokrej = np.zeros(len(d), dtype=bool)
        for f in self.c.token_filters:
            s = stats[f.k]
            lo, hi = f.log_band
            cl = np.clip(s, lo, hi)
            rej = ~f.keep(s)
            tokrej |= rej
            o = f.option
            out.update({f"{o}.min": sg.min(s), f"{o}.hi": sg.sum(s > hi),
                        f"{o}.lo": sg.sum(s < lo) if f.k == 1 else np.zeros(b.n_seq),
                        f"{o}.c": sg.sum(cl), f"{o}.c2": sg.sum(cl * cl), f"{o}.rej": sg.sum(rej)})
        out["tokrej"] = sg.sum(tokrej)
        return out

    def combine(self, step: int, pieces: list) -> dict[str, float | None] | None:
        parts = [pl.DataFrame(p) for p in pieces if p is not None]
        if not parts:
            return None
        df = pl.concat(parts, how="vertical_relaxed")
        rule = lambda c: pl.col(c).max() if c.endswith(".max") else pl.col(c).min() if c.endswith(".min") else pl.col(c).sum()  # noqa: E731
        # in row order: sums over sequences must not depend on a hash order (bit-identical reruns)
        df = df.group_by(list(KEY_COLUMNS), maintain_order=True).agg([rule(c).alias(c) for c in df.columns if c not in KEY_COLUMNS])
        # a filter decides once per completion (verl: on the driver, before the mini-batches and
        # PPO epochs): a completion trained on in several loss calls counts once
        df = df.unique(subset=["step", "sample_id"], keep="first", maintain_order=True)
        return rs_summary({c: df[c].to_numpy() for c in df.columns}, self.c)


@visitor(RS_VISITOR, families=(FAMILY,))
def _rs_visitor(cfg: dict) -> RSPartials:
    return RSPartials(ISConfig.from_cfg(cfg))


def rs_summary(p: dict[str, np.ndarray], c: ISConfig) -> dict[str, float | None]:
    """verl's per-filter metrics (``rollout_rs/<option>/<stat>``) and the combined masked fractions,
    over the whole step. Token filters: statistics over valid tokens; sequence filters: over
    sequences with a valid token (``mean`` and ``std`` weight a sequence by its tokens)."""
    n = p["n"].astype(np.float64)
    N = n.sum()
    ok = n > 0
    out: dict[str, float | None] = {}
    if N == 0:
        return out
    seq_rej = np.zeros(len(n), dtype=bool)
    for f in c.rs:
        lo, hi = f.log_band
        pre = f"rollout_rs/{f.option}/"
        ksum, kmax = p[f"k{f.k}.sum"], p[f"k{f.k}.max"]
        if f.scope == "token":
            o = f.option
            v = ksum[ok] / n[ok]
            out[pre + "mean"] = ris._f(ksum.sum() / N)
            out[pre + "max"], out[pre + "min"] = ris._f(kmax[ok].max()), ris._f(p[f"{o}.min"][ok].min())
            out[pre + "fraction_high"] = ris._f(p[f"{o}.hi"].sum() / N)
            out[pre + "fraction_low"] = ris._f(p[f"{o}.lo"].sum() / N)
            c1, c2 = p[f"{o}.c"].sum(), p[f"{o}.c2"].sum()
            rej_tokens = p[f"{o}.rej"]
            rej_rows = rej_tokens > 0
        else:
            val = ksum if f.scope == "sum" else np.nan_to_num(ksum / np.where(ok, n, 1.0)) if f.scope == "mean" else np.where(ok, kmax, 0.0)
            v = val[ok]
            out[pre + "mean"] = ris._f((n * val).sum() / N)
            out[pre + "max"], out[pre + "min"] = ris._f(v.max()), ris._f(v.min())
            out[pre + "fraction_high"] = ris._f(np.mean(v > hi))
            out[pre + "fraction_low"] = ris._f(np.mean(v < lo)) if f.k == 1 else 0.0
            cl = np.clip(val, lo, hi)
            c1, c2 = (n * cl).sum(), (n * cl * cl).sum()
            rej_rows = ~f.keep(val)
            rej_tokens = np.where(rej_rows, n, 0.0)
            seq_rej |= rej_rows & ok
        m = c1 / N
        out[pre + "std"] = float(np.sqrt(max(0.0, c2 / N - m * m))) if N > 1 else 0.0
        out[pre + "seq_mean"] = ris._f(v.mean())
        out[pre + "seq_std"] = ris._f(v.std(ddof=1)) if len(v) > 1 else 0.0
        out[pre + "seq_max"], out[pre + "seq_min"] = ris._f(v.max()), ris._f(v.min())
        out[pre + "seq_max_deviation"] = ris._f(np.abs(v).max())
        out[pre + "seq_fraction_high"] = ris._f(np.mean(v > hi))
        if f.k == 1:
            out[pre + "seq_fraction_low"] = ris._f(np.mean(v < lo))
        out[pre + "masked_fraction"] = ris._f(rej_tokens.sum() / N)
        out[pre + "seq_masked_fraction"] = ris._f(np.mean(rej_rows[ok]))
    rejected = np.where(seq_rej, n, p["tokrej"])
    out["rollout_rs/masked_fraction"] = ris._f(rejected.sum() / N)
    out["rollout_rs/seq_masked_fraction"] = ris._f(np.mean(rejected > 0))  # over all rows, as verl
    return out
