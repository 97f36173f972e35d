"""verl 0.9.1's KL-Cov and Clip-Cov losses: which tokens of a loss call they treat apart.

Both rank a call's tokens (its response-mask tokens, every row of the micro-batch flattened row by
row) by the covariance of advantage and log-prob, ``c = (A − Ā)·(logp − l̄)`` with the means over
those tokens, computed in float32 (``compute_policy_loss_kl_cov`` / ``_clip_cov`` in
``verl/trainer/ppo/core_algos.py``):

    kl_cov    the k = max(1, int(n · kl_cov_ratio)) tokens of largest c (``torch.topk`` on the CPU)
              get L = −A·r + ppo_kl_coef·|d| instead of L = −A·r (r = e^d unclamped); ppo_kl = mm|d|
    clip_cov  candidates: clip_cov_lb < c < clip_cov_ub among the tokens PPO's clip leaves alone;
              min(clip_num, #candidates) of them, clip_num = max(1, int(clip_cov_ratio · n)), drawn
              with ``torch.randperm``, get L = 0; pg_clipfrac = that count / n; ppo_kl = mm(−d)

What a run determines and what it does not:

* ties: when the k-th and (k+1)-th covariances are equal, ``torch.topk`` keeps the tokens its
  CPU kernel's partition leaves in front (:mod:`grpolens.functional.torch_topk` replays it); that
  needs the call's rows in verl's order: the order they were written in (ascending row of the
  rank's batch) unless verl shuffles (``actor.shuffle``) or re-batches by length
  (``use_dynamic_bsz``), which a run does not record;
* float32: verl's means are float32 sums whose last bits depend on its kernel (vector width,
  threads); a covariance within that rounding of the one it is ranked against (or of a Clip-Cov
  bound) could fall either way;
* Clip-Cov's random draw: with more candidates than clip_num, which ones verl zeroes is its
  random choice, so its pg_loss is not a function of the run (pg_clipfrac still is).

A call in any of these cases has no pg_loss (``Call.sure`` false, with the reason); the step's
``actor/pg_loss`` and ``actor/loss`` are then left empty rather than guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from grpolens.functional.torch_topk import topk_indices
from grpolens.metrics.batch import KEY_COLUMNS, TokenBatch
from grpolens.metrics.engine import Visitor, visitor
from grpolens.metrics.verl_policy_loss import (COV_MODES, actor_cfg, bypass_corr, clip_bounds, is_weight, loss_mode,
                                               policy_terms)

VISITOR = "verl_actor.cov"
#: float32's unit roundoff
_U = 2.0 ** -24
#: a bound on the relative error of verl's float32 sums (torch's cascade sum: a few ulps per level)
_SUM_ERR = 2.0 ** -16
#: why a call's pg_loss is not determined by the run
RANDOM, ORDER, ROUNDING = "random", "order", "rounding"
REASONS = {
    RANDOM: "the Clip-Cov loss zeroes a random choice of its candidate tokens (drawn with torch.randperm)",
    ORDER: "covariances tie at the top-k boundary and verl's row order within the micro-batch is not recorded "
           "(actor.shuffle or use_dynamic_bsz)",
    ROUNDING: "covariances lie within verl's float32 rounding of each other at the boundary",
}


def notes(raw) -> list[str]:
    """What a recompute says about steps whose ``pg_loss`` (and ``loss``) it left empty (``raw``:
    its table by grpolens' names, ``verl_actor/pg_loss_*_calls`` counting the calls per reason)."""
    out = []
    for col, why in (("verl_actor/pg_loss_random_calls", f"depends on verl's random choice ({REASONS[RANDOM]})"),
                     ("verl_actor/pg_loss_unsure_calls", f"depends on what the run does not record ({REASONS[ORDER]}, "
                                                         f"or {REASONS[ROUNDING]})")):
        if col not in raw.columns:
            continue
        steps = raw.filter(raw[col] > 0)["step"].to_list()
        if steps:
            at = ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")
            out.append(f"verl_actor/pg_loss and verl_actor/loss (verl's actor/pg_loss and actor/loss) left empty at "
                       f"{len(steps)} step(s) ({at}): the value {why}; the steps' other values are exact")
    return out


def settings(a: dict) -> dict:
    """PolicyLossConfig's values for the two losses (its defaults where the run's config is silent)."""
    p = dict(a.get("policy_loss") or {})
    get = lambda k, d: float(p[k]) if p.get(k) is not None else d  # noqa: E731
    return {"kl_cov_ratio": get("kl_cov_ratio", 0.0002), "ppo_kl_coef": get("ppo_kl_coef", 0.1),
            "clip_cov_ratio": get("clip_cov_ratio", 0.0002), "clip_cov_lb": get("clip_cov_lb", 1.0),
            "clip_cov_ub": get("clip_cov_ub", 5.0)}


def order_known(a: dict) -> bool:
    """Whether a loss call's rows reached verl's loss in ascending row order (the run's order)."""
    return not a.get("shuffle") and not a.get("use_dynamic_bsz")


def covariance(adv: np.ndarray, logp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """verl's float32 ``(A − Ā)·(logp − l̄)`` per token, and a bound on how far verl's own value of
    each may be from it: 0 where verl's means are sure (:func:`_mean`), else what its means'
    differently rounded float32 sums can move it by."""
    a, lp = adv.astype(np.float32), logp.astype(np.float32)
    (ma, ea), (ml, el) = _mean(a), _mean(lp)
    da, dl = a - ma, lp - ml
    c = (da * dl).astype(np.float64)
    da, dl = np.abs(da.astype(np.float64)), np.abs(dl.astype(np.float64))
    if ea == 0.0 and el == 0.0:  # the same float32 operations on the same values
        return c, np.zeros(len(c))
    # a differently rounded mean moves the difference (and its rounding, by an ulp), then the product
    sa = ea + _U * da if ea else 0.0
    sl = el + _U * dl if el else 0.0
    return c, 2 * (sa * dl + sl * da + sa * sl + _U * np.abs(c))


def _mean(x: np.ndarray) -> tuple[np.float32, float]:
    """torch's float32 mean of ``x`` (its float32 sum, divided by the count) and how far verl's may
    be from it: 0 when every partial sum is exact in float32 whatever the order (the values are
    multiples of 2^e and Σ|x| < 2^(e + 24)), so torch's sum is the exact one; else a bound on a
    float32 cascade sum's error. Two values or fewer (zeros add exactly) are summed by one rounding."""
    n = len(x)
    s64 = float(x.astype(np.float64).sum())
    m = np.float32(np.float32(s64) / np.float32(n))
    nz = x[x != 0]
    if len(nz) <= 2:  # at most one addition: rounded once, in any order
        return m, 0.0
    mant, exp = np.frexp(nz.astype(np.float64))  # x = mant·2^exp, |mant| in [0.5, 1): 24 bits below 2^exp
    lowest = int((exp - 24 + _trailing_zeros((np.abs(mant) * 2.0 ** 24).astype(np.int64))).min())
    total = float(np.abs(nz.astype(np.float64)).sum())
    if total < 2.0 ** (lowest + 24):
        return m, 0.0
    return m, _SUM_ERR * total / n + 2 * _U * abs(float(m))


def _trailing_zeros(v: np.ndarray) -> np.ndarray:
    """Trailing zero bits of positive integers."""
    low = v & -v
    return np.log2(low).astype(np.int64)


@dataclass
class Call:
    """One loss call's choice: ``chosen`` indices into its tokens (None when not determined),
    ``count`` the number chosen (None when not determined either), ``reason`` one of :data:`REASONS`,
    ``drawn_from`` the candidates of a Clip-Cov draw (each chosen with probability count / their number)."""
    chosen: np.ndarray | None
    count: int | None
    reason: str | None = None
    drawn_from: np.ndarray | None = None

    @property
    def sure(self) -> bool:
        return self.chosen is not None


def kl_cov_choice(adv: np.ndarray, logp: np.ndarray, ratio: float, ordered: bool,
                  gain: np.ndarray | None = None) -> Call:
    """The tokens verl's KL-Cov penalises in one call (its tokens in verl's flattened order, row by
    row; ``ordered``: whether that is the order verl had, which only a tie at the boundary needs;
    ``gain``: what choosing each token adds to the call's loss, which settles a tie whose tokens
    all add the same, whatever the order)."""
    n = len(adv)
    if n == 0:
        return Call(np.zeros(0, dtype=np.int64), 0)
    k = max(1, int(n * ratio))
    c, err = covariance(adv, logp)
    chosen, sure = topk_indices(c, k, err=err, same=_same(adv, logp))
    if not sure:
        return Call(None, k, ROUNDING)
    tie = c == c[chosen].min()  # the k-th value's class: any topk takes every larger one and some of these
    if not ordered and k < n and tie.sum() > int(tie[chosen].sum()) and not _all_equal(gain, tie):
        return Call(None, k, ORDER)
    return Call(chosen, k)


def clip_cov_choice(adv: np.ndarray, logp: np.ndarray, clipped: np.ndarray, s: dict,
                    gain: np.ndarray | None = None) -> Call:
    """The tokens verl's Clip-Cov zeroes in one call when the run determines them (every candidate,
    when there are no more than clip_num, or any clip_num of them when each adds the same ``gain``),
    else their count only (or nothing, near a bound)."""
    n = len(adv)
    if n == 0:
        return Call(np.zeros(0, dtype=np.int64), 0)
    c, err = covariance(adv, logp)
    lb, ub = s["clip_cov_lb"], s["clip_cov_ub"]
    free = ~clipped
    cand = free & (c > lb) & (c < ub)
    near = free & ((np.abs(c - lb) <= err) | (np.abs(c - ub) <= err))
    if near.any():  # a covariance verl may put on the other side of a bound: even the count is unsure
        return Call(None, None, ROUNDING)
    clip_num = max(int(s["clip_cov_ratio"] * n), 1)
    idx = np.flatnonzero(cand)
    if len(idx) > clip_num:
        if _all_equal(gain, cand):  # whichever verl draws, the loss loses the same
            return Call(idx[:clip_num], clip_num)
        return Call(None, clip_num, RANDOM, drawn_from=idx)
    return Call(idx, len(idx))


def _all_equal(gain: np.ndarray | None, where: np.ndarray) -> bool:
    g = None if gain is None else gain[where]
    return g is not None and len(g) > 0 and bool((g == g[0]).all())


def _same(adv: np.ndarray, logp: np.ndarray) -> np.ndarray:
    """A label per token, equal for tokens with the same (advantage, log-prob) in float32: their
    covariances are equal in verl's arithmetic whatever its means' rounding."""
    pairs = np.stack([adv.astype(np.float32).view(np.int32), logp.astype(np.float32).view(np.int32)], axis=1)
    return np.unique(pairs, axis=0, return_inverse=True)[1].ravel()


class CovTokens(Visitor):
    """Per token of each loss call (KL-Cov and Clip-Cov only): its keys, advantage, log-prob, whether
    PPO's clip already binds (Clip-Cov) and how the loss term changes when the token is chosen
    (KL-Cov: + ppo_kl_coef·|d|·w; Clip-Cov: −L·w). Combined: the step's tokens in key order."""

    name = VISITOR

    def __init__(self, cfg: dict):
        self.cfg = cfg
        a = actor_cfg(cfg)
        self.a = a
        self.mode = loss_mode(a) if a is not None and bypass_corr(cfg) is None else None

    def shard(self, b: TokenBatch, shard) -> dict | None:
        if self.mode not in COV_MODES or b.n_seq == 0:
            return None
        m = b.valid_policy
        A = np.where(m, b.adv, 0.0)
        with np.errstate(invalid="ignore", over="ignore"):
            d = np.where(m, b.logp - b.old, 0.0)
            L, clip, _, _ = policy_terms(b, self.a, self.mode, m, A, d, d, np.exp(d), *clip_bounds(self.a))
            w = is_weight(b, self.cfg)
            w = np.ones(b.n) if w is None else w
            delta = settings(self.a)["ppo_kl_coef"] * np.abs(d) * w if self.mode == "kl_cov" else -L * w
        out = {k: b.cols[k][m] for k in KEY_COLUMNS}
        out.update(pos=b.cols["pos"][m], adv=b.adv[m], logp=b.logp[m], clipped=clip[m] > 0, delta=delta[m])
        return out

    def combine(self, step: int, pieces: list) -> dict | None:
        return concat_in_order(pieces, (*KEY_COLUMNS, "pos"))


def concat_in_order(pieces: list, keys: tuple[str, ...]) -> dict | None:
    """The pieces' arrays (dicts of equal-length columns; None for nothing) joined, sorted by ``keys``."""
    parts = [p for p in pieces if p is not None]
    if not parts:
        return None
    out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    order = np.lexsort([out[k] for k in keys][::-1])
    return {k: v[order] for k, v in out.items()}


@visitor(VISITOR, families=("verl_actor",))
def _cov_visitor(cfg: dict) -> CovTokens:
    return CovTokens(cfg)


def call_changes(sd, calls: list) -> dict[tuple[int, int], tuple[Call, np.ndarray, np.ndarray | None]]:
    """Per loss call ``(rank, micro_batch)``: verl's choice, the change to each of its rows' loss
    sum (aligned with the call's row indices ``idx``; zeros where the choice is not determined) and
    its expectation over Clip-Cov's draw (the change itself without a draw; None where not determined)."""
    a = actor_cfg(sd.cfg)
    mode, s = loss_mode(a), settings(a)
    p = (sd.extra.get("pieces") or {}).get(VISITOR) or _NO_TOKENS
    sid_all = np.asarray(sd.col("sample_id"), dtype=np.int64)
    per_row_mean = a.get("loss_agg_mode") == "seq-mean-token-mean"
    # the tokens are in key order: each call's are one run of (rank, micro_batch)
    keys = np.stack([p["rank"], p["micro_batch"]], axis=1)
    starts = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]).any(axis=1)]) if len(keys) else np.zeros(0, int)
    spans = {(int(keys[i, 0]), int(keys[i, 1])): (i, j) for i, j in zip(starts, np.r_[starts[1:], len(keys)])}
    out = {}
    for r, u, _, idx in calls:
        sel = np.arange(*spans.get((r, u), (0, 0)))
        adv, logp, delta = p["adv"][sel], p["logp"][sel], p["delta"][sel]
        rows = np.searchsorted(sid_all[idx], p["sample_id"][sel])  # a call's rows are in key order
        # what a chosen token adds to the aggregated loss, up to a factor common to the call
        gain = delta / (np.asarray(sd.col("va.n_pg"))[idx][rows] + 1e-8) if per_row_mean else delta
        if mode == "kl_cov":
            call = kl_cov_choice(adv, logp, s["kl_cov_ratio"], order_known(a), gain)
        else:
            call = clip_cov_choice(adv, logp, p["clipped"][sel], s, gain)
        change = np.zeros(len(idx))
        if call.sure and len(call.chosen):
            np.add.at(change, rows[call.chosen], delta[call.chosen])
        expect = change if call.sure else None
        if call.drawn_from is not None:
            expect = np.zeros(len(idx))
            np.add.at(expect, rows[call.drawn_from], delta[call.drawn_from] * (call.count / len(call.drawn_from)))
        out[(r, u)] = (call, change, expect)
    return out


_NO_TOKENS = {k: np.zeros(0, dtype=np.int64) for k in (*KEY_COLUMNS, "pos")} | {
    "adv": np.zeros(0), "logp": np.zeros(0), "clipped": np.zeros(0, dtype=bool), "delta": np.zeros(0)}
