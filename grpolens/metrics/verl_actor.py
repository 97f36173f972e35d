"""verl's actor metrics (``actor/pg_loss``, ``actor/pg_clipfrac`` ...), as verl 0.9.1 computes and reduces them.

Only for runs recorded from verl (their config has ``verl_actor``, written by
:func:`grpolens.integrations.verl.verl_config`). Per loss call (one micro-batch on one rank), with
``m`` the response mask after rollout rejection, ``d = logp − old_logp``, ``r = exp(clip(d, ±20))``,
``A`` the advantage and ``w`` the rollout IS weight (when ``rollout_is`` is set), the policy loss
of ``policy_loss.loss_mode`` (``verl/trainer/ppo/core_algos.py``):

    vanilla  L1 = −A·r, L2 = −A·clip(r, 1 − ε_l, 1 + ε_h), Lc = max(L1, L2), L3 = −A·clip_ratio_c
             L = min(L3, Lc) if A < 0 else Lc;  pg_clipfrac = mm[L2 > L1], pg_clipfrac_lower = mm[Lc > L3 ∧ A < 0]
    gspo     s = exp(min(Σ_t d·m / max(Σ m, 1), 10)) per sequence, L = max(−A·s, −A·clip(s, ...));
             pg_clipfrac = mm[L2 > L1]; ppo_kl from the unclamped d
    cispo    L = −clip(r, 1 − ε_l, 1 + ε_h)·A·logp;  pg_clipfrac = mm[r ≠ clip(r)]
    sapo     L = −(4/τ)·σ(τ(r − 1))·A, τ = tau_pos if A > 0 else tau_neg; aggregated seq-mean-token-mean
    geo_mean ℓ = −Ā·exp(Σ_t sgn(A)·min(sgn(A)·d, sgn(A)·clip(d, −ε_l, ε_h))·m / (T + 1e-8)) per row, pg_loss the
             mean over the call's rows (fully masked ones too); pg_clipfrac(_lower) = mm[d ≠ clip(d) ∧ A ≷ 0]
    dppo_tv  L = −A·min(r, clip_ratio_c)·logp·v, v: p − q <= ε_h (A > 0), >= −ε_l (else), p = e^logp, q = e^old;
    dppo_kl  v: binary KL(q ‖ p) <= ε_h or p <= q (A > 0), <= ε_l or p >= q (else);
             pg_clipfrac = mm[¬v], pg_clipfrac_lower = mm[r > clip_ratio_c ∧ v]
    gpg      L = −A·logp; no metrics of its own (no pg_clipfrac, pg_clipfrac_lower, ppo_kl)
    dro      L = −(A·logp − β/2·d²), β = policy_loss.dro_beta; ppo_kl from the unclamped d, no clip fractions
    kl_cov   L = −A·e^d (+ ppo_kl_coef·|d| on the call's top-k tokens by cov(A, logp)); ppo_kl = mm|d| only
    clip_cov L = max(−A·e^d, −A·clip(e^d, ...)), 0 on the tokens verl zeroes; pg_clipfrac = their count / n, ppo_kl
             (the choice of tokens, and what the run leaves open of it: :mod:`grpolens.metrics.verl_cov`)
    ppo_kl = mm(−d) (d clamped except gspo);  L ×= w

``mm`` is verl's masked mean over the call, Σ x·m / (Σ m + 1e-8). Each call's loss terms are
aggregated by ``agg_loss`` with the engine's global information: ``dp`` ranks, the mini-batch's
token count ``N`` over all ranks and ``G = ppo_mini_batch_size · rollout_n`` sequences:

    token-mean  Σ L·m / N · dp                 token-sum  Σ L·m · dp
    seq-mean-token-sum  Σ_{T_b>0} Σ_t L·m / G · dp (…-norm: ÷ loss_scale_factor, default the padded width:
                        the call's longest response, or the legacy trainer's rollout.response_length)
    seq-mean-token-mean Σ_{T_b>0} (Σ_t L·m / (T_b + 1e-8)) / G · dp

Bypass mode (``rollout_correction.bypass_mode``): the stored ``old_logp`` is the rollout's; with
``loss_type: ppo_clip`` the loss is vanilla whatever ``loss_mode`` says, with no IS weight; with
``reinforce`` it is ``L = −A·logp·w`` (``w`` the call's IS weight, current policy against the
rollout), ``ppo_kl`` unclamped and no clip fractions. ``m`` for the policy-loss terms (``pg_loss``,
the clip fractions, ``ppo_kl``) loses the tokens verl's loss rejects per call (its filters on
``logp`` against ``rollout_logp``); ``N`` stays the mini-batch's tokens before that rejection. The
loss' own rollout-correction statistics are ``actor/rollout_corr/*`` (:func:`_bypass_corr_values`).
``rollout_is_batch_normalize`` divides ``w`` by its batch mean: the step's (decoupled mode) or, in
bypass mode, that of the ranks' calls made together (verl all-reduces it).

``actor/entropy`` is verl's driver's: the old-log-prob pass' entropy (``old_entropy``), aggregated
over the whole step with ``agg_loss`` on the mask before rollout rejection.
``actor/pg_loss``, ``actor/entropy_loss`` (the forward's entropy, logged when ``calculate_entropy``
or ``entropy_coeff ≠ 0``) and ``actor/kl_loss`` (``kl_penalty`` of ``kl_loss_type`` against the
reference, when ``use_kl_loss``) are SUM metrics: per mini-batch the mean over ranks of the sum over
the rank's calls; ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower`` and ``actor/ppo_kl`` are MEAN
metrics: the mean over every call of the mini-batch; ``actor/loss`` is per mini-batch Σ over calls
of ``pg_loss − entropy_coeff·entropy_loss + kl_loss_coef·kl_loss``, averaged over ranks. Each is
then averaged over the step's mini-batches and PPO epochs (verl's ``reduce_metrics``). A rank's
mini-batch is its next ``rows / mini-batches`` rows of loss calls, in call order.
"""

from __future__ import annotations

import numpy as np

from grpolens.errors import UserError
from grpolens.functional import estimators as est
from grpolens.functional import rollout_is as ris
from grpolens.functional.rollout_is import ISConfig, loss_weights
from grpolens.metrics.batch import KEY_COLUMNS, TokenBatch
from grpolens.metrics.engine import Visitor, visitor
from grpolens.metrics.partials import producer
from grpolens.metrics import verl_cov
from grpolens.metrics.verl_policy_loss import (COV_MODES, actor_cfg, bypass_corr, clip_bounds, geo_mean_row, is_weight, loss_mode,
                                            policy_terms, unsupported)
from grpolens.metrics.registry import REGISTRY, Family, register_family, Metric, register
from grpolens.metrics.rollout_is import RSPartials, _mismatch_partials, rs_summary
from grpolens.metrics.verl_rollout_corr import VERL_KEYS, verl_batch_summary, verl_summary

_COLS = ("va.n", "va.n_pg", "va.pg", "va.pg_tm", "va.clip", "va.clip_low", "va.kl", "va.ent", "va.ent_tm", "va.kld",
         "va.kld_tm", "va.width", "va.old_n", "va.old_ent", "va.pg_row")
_MERGE = {c: "sum" for c in _COLS} | {"va.width": "max"}


_unsupported = unsupported


def bypass(cfg: dict) -> bool:
    """verl's ``algorithm.rollout_correction.bypass_mode``: old log-probs are the rollout's and the
    policy loss does the rollout correction per loss call, from the current policy against the
    rollout (its rejection applied to the policy loss' mask; its metrics logged as
    ``actor/rollout_corr/*``)."""
    return bypass_corr(cfg) is not None


def bypass_loss(cfg: dict) -> str | None:
    """The loss of verl's bypass mode (``rollout_correction.loss_type``): ``ppo_clip`` (verl's
    vanilla PPO loss, no IS weight) or ``reinforce`` (−A·log π·w); None outside bypass mode."""
    corr = bypass_corr(cfg)
    if corr is None:
        return None
    kind = str(corr.get("loss_type") or "ppo_clip")
    if kind not in ("ppo_clip", "reinforce"):  # not silently one of them: the loss and its metrics differ
        raise UserError(f"config key 'verl_algorithm.rollout_correction.loss_type': the verl profile supports "
                        f"ppo_clip and reinforce, got {kind!r}")
    return kind


def _current(b: TokenBatch) -> TokenBatch:
    """``b`` with the current policy's log-probs as the "old" ones: what verl's bypass-mode loss
    hands its rollout correction (π_current against π_rollout; the stored ``old_logp`` is the rollout's)."""
    return TokenBatch({**b.cols, "old_logp": b.logp}, b.present | {"old_logp"})


def _bypass_keep(b: TokenBatch, cfg: dict) -> np.ndarray:
    """The tokens verl's bypass-mode loss keeps: its rejection filters on the current policy against
    the rollout, decided per sequence of the loss call."""
    isc = ISConfig.from_cfg(cfg)
    if not (isc.configured and b.has("rollout_logp")):
        return np.ones(b.n, dtype=bool)
    return loss_weights(_current(b), isc)[1]


def kl_penalty(logp: np.ndarray, ref: np.ndarray, kind: str) -> np.ndarray:
    """verl's ``kl_penalty`` forward value (a ``+`` suffix changes only the gradient)."""
    kind = kind[:-1] if kind.endswith("+") else kind
    if kind in ("kl", "k1"):
        return est.k1(ref - logp)
    if kind == "abs":
        return np.abs(logp - ref)
    if kind in ("mse", "k2"):
        return est.k2(logp - ref)
    if kind in ("low_var_kl", "k3"):
        x = est.clip_log_ratio(ref - logp)
        # verl clips the estimate to ±10; e^x − 1 − x >= 0 in floating point (expm1 is monotone and
        # faithfully rounded, so expm1(x) >= x), so only the upper side can bind
        return np.minimum(est.k3(x), 10.0)
    raise _unsupported("kl_loss_type", kind, "kl, k1, abs, mse, k2, low_var_kl and k3, each optionally with +")


_mode = loss_mode  # noqa: E305


def _global_batch(a: dict) -> int:
    """verl's mini-batch in sequences over all ranks, ``ppo_mini_batch_size · rollout_n``; 0 when
    the run's actor config does not say (then no loss call can be placed in a mini-batch)."""
    return int(a.get("ppo_mini_batch_size") or 0) * int(a.get("rollout_n") or 1)


@producer("verl_actor", merge=_MERGE)
def _verl_actor(b: TokenBatch, cfg: dict) -> dict[str, np.ndarray]:
    a = actor_cfg(cfg)
    if a is None or b.n_seq == 0:
        return {c: np.zeros(b.n_seq) for c in _COLS}
    m = b.valid_policy
    by = bypass(cfg)
    # the policy loss' mask: in bypass mode, minus the loss' own per-call rejection
    mp = m & _bypass_keep(b, cfg) if by else m
    mf = mp.astype(np.float64)
    n = b.count(m)
    n_pg = b.count(mp) if by else n
    A = np.where(m, b.adv, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.where(m, b.logp - b.old, 0.0)
        dc = est.clip_log_ratio(d)
        r = np.exp(dc)
        el, eh = clip_bounds(a)
        # bypass mode: ppo_clip is verl's vanilla loss whatever loss_mode says, reinforce its own
        mode = {"ppo_clip": "vanilla", "reinforce": "reinforce"}[bypass_loss(cfg)] if by else _mode(a)
        L, clip, low, kl_tok = policy_terms(b, a, mode, m, A, d, dc, r, el, eh)
        isc = ISConfig.from_cfg(cfg)
        w = is_weight(b, cfg)
        if w is not None:
            L = L * w
        elif isc.configured and isc.has_band and b.has("rollout_logp") and mode == "reinforce":
            # bypass reinforce: the loss' own IS weights, current policy against the rollout
            # (bypass ppo_clip applies none: its ratio is already against the rollout)
            L = L * loss_weights(_current(b), isc)[0]
        row = geo_mean_row(b, m, A, d, el, eh, w) if mode == "geo_mean" else np.zeros(b.n_seq)
        L = np.where(mp, L, 0.0)
        ent = np.where(m, b.cols["entropy"], 0.0) if b.has("entropy") else np.zeros(b.n)
        if b.has("ref_logp") and a.get("use_kl_loss"):
            kld = np.where(m, kl_penalty(b.logp, b.cols["ref_logp"], str(a.get("kl_loss_type", "low_var_kl"))), 0.0)
        else:
            kld = np.zeros(b.n)
    per = lambda x: b.seq_sum(x)  # noqa: E731
    tm = lambda s, k=n: s / (k + 1e-8)  # noqa: E731
    pg, es, ks = per(L), per(ent), per(kld)
    # the old-log-prob pass' entropy, on the response mask before rollout rejection (verl's driver)
    pre = b.pre_rejection_mask
    old_ent = per(np.where(pre, b.cols["old_entropy"], 0.0)) if b.has("old_entropy") else np.zeros(b.n_seq)
    return {"va.n": n, "va.n_pg": n_pg, "va.pg": pg, "va.pg_tm": tm(pg, n_pg), "va.clip": per(clip * mf),
            "va.clip_low": per(low * mf), "va.kl": per(np.where(mp, kl_tok, 0.0)), "va.ent": es, "va.ent_tm": tm(es), "va.kld": ks,
            "va.kld_tm": tm(ks), "va.width": b.lengths.astype(np.float64), "va.old_n": b.count(pre),
            "va.old_ent": old_ent, "va.pg_row": row}



# ---------------------------------------------------------------------------------------------
# Reductions
# ---------------------------------------------------------------------------------------------

def loss_calls(rank: np.ndarray, micro_batch: np.ndarray, sample_id: np.ndarray, a: dict) -> list | None:
    """verl's loss calls of a step from its rows' keys: per (rank, micro_batch) in order, its
    mini-batch index and its row indices; None when the rows cannot be split into verl's
    mini-batches (``ppo_mini_batch_size · rollout_n`` sequences over all ranks)."""
    rank, mb, sid = (np.asarray(x, dtype=np.int64) for x in (rank, micro_batch, sample_id))
    G = _global_batch(a)
    ranks = np.unique(rank)
    rows = {int(r): len(np.unique(sid[rank == r])) for r in ranks}
    total = sum(rows.values())
    if G <= 0 or total % G:
        return None
    n_mini = total // G
    calls = []  # (rank, micro_batch, mini index, row indices)
    for r in ranks:
        if rows[int(r)] % n_mini:
            return None
        per_mini, seen = rows[int(r)] // n_mini, 0
        for u in np.unique(mb[rank == r]):
            idx = np.flatnonzero((rank == r) & (mb == u))
            calls.append((int(r), int(u), seen // per_mini, idx))
            seen += len(idx)
    return calls


def _calls(sd):
    """:func:`loss_calls` of the step's sequences (cached)."""
    a = actor_cfg(sd.cfg)
    if a is None or not sd.n_seq:
        return None
    key = ("verl_actor", "calls")
    if key not in sd.extra:
        sd.extra[key] = loss_calls(sd.col("rank"), sd.col("micro_batch"), sd.col("sample_id"), a)
    return sd.extra[key]


_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")


def _agg_mode(a: dict) -> str:
    """verl's ``loss_agg_mode`` (``agg_loss``), refused by name when the profile does not know it."""
    mode = str(a.get("loss_agg_mode", "token-mean"))
    if mode not in _AGG_MODES:
        raise _unsupported("loss_agg_mode", mode, f"{', '.join(_AGG_MODES[:-1])} and {_AGG_MODES[-1]}")
    return mode


def _agg(sd, idx: np.ndarray, s: str | np.ndarray, tm: str | np.ndarray, N: float, dp: int, G: int) -> float:
    """agg_loss of one call, of the per-row sums ``s`` and token means ``tm`` (columns, or the
    call's rows' values). verl's seq-mean modes sum over the sequences with a token of the term's
    mask; a sequence without one has 0 in every partial here (sum and token mean), so all are summed."""
    a = actor_cfg(sd.cfg)
    mode = _agg_mode(a)
    s = sd.col(s)[idx] if isinstance(s, str) else s
    tm = sd.col(tm)[idx] if isinstance(tm, str) else tm
    if mode == "token-mean":
        return float(s.sum() / N * dp)
    if mode == "token-sum":
        return float(s.sum() * dp)
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        v = float(s.sum() / G * dp)
        if mode.endswith("norm"):
            v /= float(a.get("loss_scale_factor") or response_length(sd.cfg) or sd.col("va.width")[idx].max())
        return v
    return float(tm.sum() / G * dp)  # seq-mean-token-mean


def _agg_changed(sd, idx: np.ndarray, change: np.ndarray, N: float, dp: int, G: int) -> float:
    """agg_loss of one call's policy loss with ``change`` added to its rows' sums (verl_cov)."""
    tm = sd.col("va.pg_tm")[idx] + change / (sd.col("va.n_pg")[idx] + 1e-8)
    return _agg(sd, idx, sd.col("va.pg")[idx] + change, tm, N, dp, G)


def _values(sd) -> dict[str, float]:
    key = ("verl_actor", "values")
    if key in sd.extra:
        return sd.extra[key]
    calls = _calls(sd)
    out: dict[str, float] = {}
    norm = _norm_factors(sd) if calls else 1.0
    if calls:
        a = actor_cfg(sd.cfg)
        dp = len({c[0] for c in calls})
        G = _global_batch(a)
        sapo = _mode(a) == "sapo" and not bypass(sd.cfg)
        geo = _mode(a) == "geo_mean" and not bypass(sd.cfg)
        with_ent = bool(a.get("calculate_entropy")) or float(a.get("entropy_coeff", 0.0) or 0.0) != 0.0
        with_kl = bool(a.get("use_kl_loss")) and "ref_logp" in sd.present
        ec, kc = float(a.get("entropy_coeff", 0.0) or 0.0), float(a.get("kl_loss_coef", 0.001))
        # KL-Cov / Clip-Cov: the tokens each call treats apart change its rows' loss sums
        cov = verl_cov.call_changes(sd, calls) if _mode(a) in COV_MODES and not bypass(sd.cfg) else {}
        per_mini: dict[int, dict[str, list]] = {}
        for mini in sorted({c[2] for c in calls}):
            cs = [c for c in calls if c[2] == mini]
            N = float(sum(sd.col("va.n")[c[3]].sum() for c in cs))
            acc: dict[str, list] = {k: [] for k in ("pg", "pg_e", "ent", "kl", "clip", "low", "ppo_kl", "loss")}
            for r, u, _, idx in cs:
                nt = sd.col("va.n_pg")[idx].sum()
                if geo:  # verl's GMPO: the mean of its rows' terms, whatever loss_agg_mode says
                    pg = float(sd.col("va.pg_row")[idx].sum() / len(idx))
                elif sapo:  # verl's SAPO always aggregates seq-mean-token-mean
                    pg = float(sd.col("va.pg_tm")[idx].sum() / G * dp)
                elif (r, u) in cov:  # NaN where the run does not determine it (or its expectation)
                    call, change, expect = cov[(r, u)]
                    pg = _agg_changed(sd, idx, change, N, dp, G) if call.sure else np.nan
                    pg_e = _agg_changed(sd, idx, expect, N, dp, G) if expect is not None else np.nan
                else:
                    pg = _agg(sd, idx, "va.pg", "va.pg_tm", N, dp, G)
                if (r, u) not in cov:
                    pg_e = pg
                f = norm.get((r, u), 1.0) if isinstance(norm, dict) else norm  # linear in the IS weights
                pg, pg_e = pg / f, pg_e / f
                acc["pg_e"].append(pg_e)
                ent = _agg(sd, idx, "va.ent", "va.ent_tm", N, dp, G)
                kl = _agg(sd, idx, "va.kld", "va.kld_tm", N, dp, G)
                acc["pg"].append(pg)
                acc["ent"].append(ent)
                acc["kl"].append(kl)
                for k, col in (("clip", "va.clip"), ("low", "va.clip_low"), ("ppo_kl", "va.kl")):
                    acc[k].append(float(sd.col(col)[idx].sum() / (nt + 1e-8)))
                if (r, u) in cov:  # Clip-Cov's clip fraction: the tokens it zeroes (a count even when drawn)
                    count = cov[(r, u)][0].count
                    acc["clip"][-1] = np.nan if count is None else count / (nt + 1e-8)
                acc["loss"].append(pg - (ec * ent if with_ent else 0.0) + (kc * kl if with_kl else 0.0))
            per_mini[mini] = {"pg": sum(acc["pg"]) / dp, "pg_e": sum(acc["pg_e"]) / dp, "ent": sum(acc["ent"]) / dp, "kl": sum(acc["kl"]) / dp,
                              "loss": sum(acc["loss"]) / dp, "clip": np.mean(acc["clip"]),
                              "low": np.mean(acc["low"]), "ppo_kl": np.mean(acc["ppo_kl"])}
        mean = lambda k: float(np.mean([v[k] for v in per_mini.values()]))  # noqa: E731
        out = {"pg_loss": mean("pg"), "loss": mean("loss")}
        # a call whose pg_loss the run does not determine (NaN: verl_cov) leaves the step's empty
        out = {k: v for k, v in out.items() if not np.isnan(v)}
        # the policy loss' own metrics: verl's REINFORCE and DRO report ppo_kl only, GPG nothing
        pg_mode = "reinforce" if bypass_loss(sd.cfg) == "reinforce" else ("vanilla" if bypass(sd.cfg) else _mode(a))
        if pg_mode != "gpg":
            out["ppo_kl"] = mean("ppo_kl")
        if pg_mode == "clip_cov":  # verl's Clip-Cov logs no pg_clipfrac_lower, KL-Cov no clip fraction
            out.update({} if np.isnan(mean("clip")) else {"pg_clipfrac": mean("clip")})
        elif pg_mode not in ("reinforce", "gpg", "dro", "kl_cov"):
            out.update(pg_clipfrac=mean("clip"), pg_clipfrac_lower=mean("low"))
        if pg_mode == "clip_cov" and not np.isnan(mean("pg_e")):  # grpolens' own: over verl's draw
            out["pg_loss_expected"] = mean("pg_e")
        if cov:  # how many calls leave their policy loss to what the run does not record, by why
            reasons = [c.reason for c, *_ in cov.values()]
            out["pg_loss_random_calls"] = float(reasons.count(verl_cov.RANDOM))
            out["pg_loss_unsure_calls"] = float(sum(r in (verl_cov.ORDER, verl_cov.ROUNDING) for r in reasons))
        if with_ent:
            out["entropy_loss"] = mean("ent")
        if with_kl:
            out["kl_loss"] = mean("kl")
    sd.extra[key] = out
    return out


def _norm_factors(sd) -> float | dict:
    """What divides the policy loss' IS weights under ``rollout_is_batch_normalize``: 1.0 without
    it; verl's driver factor over the whole step (decoupled mode); in bypass mode with
    ``reinforce`` the loss' own factor per loss call ``{(rank, micro_batch): factor}`` (all-reduced
    over the data-parallel ranks' calls made together: :func:`_bypass_corr_values`)."""
    c = ISConfig.from_cfg(sd.cfg)
    if not (c.batch_normalize and c.configured and c.has_band):
        return 1.0
    if not bypass(sd.cfg):
        return verl_summary(sd).get("rollout_is/batch_norm_factor") or 1.0
    if bypass_loss(sd.cfg) != "reinforce":
        return 1.0  # ppo_clip applies no IS weight
    _bypass_corr_values(sd)
    # every call's factor is set (1.0 where verl leaves the weights as they are), under the condition above
    return {k: v["rollout_is/batch_norm_factor"] for k, v in sd.extra[("verl_actor", "bypass_calls")].items()}


def response_length(cfg: dict) -> int | None:
    """The padded response width of verl's legacy trainer (``trainer.use_v1: false``), when the run
    recorded it (``verl_config(..., rollout=..., trainer=...)``); None under the default trainer,
    which pads to the longest response of what it aggregates."""
    r = cfg.get("verl_rollout")
    return int(r["response_length"]) if isinstance(r, dict) and r.get("response_length") else None


def _old_entropy(sd) -> float | None:
    """``actor/entropy``: verl's driver aggregates the old-log-prob pass' entropy over the whole
    batch (every rank's rows, each completion once) with ``agg_loss`` on one process: the response
    mask before rollout rejection, ``dp_size`` 1, the global sequence count of sequences with a
    token, and for ``seq-mean-token-sum-norm`` ``loss_scale_factor``, else the batch's padded
    response width: the longest response of the step (verl's default trainer pads its nested
    entropies so), or the legacy trainer's ``rollout.response_length`` when the run recorded it."""
    # the metric's ``when`` and ``requires`` keep away runs without verl_actor and steps without an
    # old entropy (a step without sequences has none: an optional column is present only with a value)
    if bypass(sd.cfg):  # verl's bypass mode has no old-log-prob pass, so it logs no actor/entropy
        return None
    a = actor_cfg(sd.cfg)
    _, first = np.unique(np.asarray(sd.col("sample_id"), dtype=np.int64), return_index=True)
    n, s = sd.col("va.old_n")[first], sd.col("va.old_ent")[first]
    has = n > 0
    mode = _agg_mode(a)
    with np.errstate(invalid="ignore", divide="ignore"):
        if mode == "token-mean":
            v = s.sum() / n.sum()
        elif mode == "token-sum":
            v = s.sum()
        elif mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
            v = s[has].sum() / has.sum()
            if mode.endswith("norm"):
                v /= float(a.get("loss_scale_factor") or response_length(sd.cfg) or sd.col("va.width").max())
        else:  # seq-mean-token-mean
            v = (s[has] / (n[has] + 1e-8)).sum() / has.sum()
    return None if np.isnan(v) else float(v)


def _value(name: str):
    def fn(sd):
        return _values(sd).get(name)
    return fn


_FAM = "verl_actor"
_WHEN = lambda cfg: actor_cfg(cfg) is not None  # noqa: E731
_DOCS = {
    "pg_loss": "verl's policy loss of the step: per mini-batch the mean over ranks of the sum over the rank's loss calls of agg_loss(L) with the global mini-batch counts, then the mean over mini-batches and epochs.",
    "pg_clipfrac": "verl's clip fraction (vanilla/gspo: −A·clip(r) > −A·r; cispo: r outside the clip range; sapo 0): masked mean per loss call, mean over calls, mini-batches and epochs.",
    "pg_clipfrac_lower": "verl's dual-clip fraction (vanilla: max(L1, L2) > −A·clip_ratio_c with A < 0; others 0), reduced like pg_clipfrac.",
    "ppo_kl": "verl's ppo_kl: masked mean of old_logp − logp (clamped to ±20 except under gspo) per loss call, reduced like pg_clipfrac.",
    "entropy_loss": "verl's entropy loss: agg_loss of the forward's entropy, reduced like pg_loss (when calculate_entropy or entropy_coeff ≠ 0).",
    "kl_loss": "verl's KL loss: agg_loss of kl_penalty(logp, ref_logp, kl_loss_type), reduced like pg_loss (when use_kl_loss).",
    "loss": "verl's actor loss: per mini-batch Σ over a rank's calls of pg_loss − entropy_coeff·entropy_loss + kl_loss_coef·kl_loss, mean over ranks, then over mini-batches and epochs.",
}
for _k, _doc in _DOCS.items():
    register(Metric(f"verl_actor/{_k}", _FAM, _doc, kind="custom", fn=_value(_k), when=_WHEN,
                    config=("verl_actor", "rollout_is")))
_COV_WHEN = lambda cfg: _WHEN(cfg) and _mode(actor_cfg(cfg)) in COV_MODES and not bypass(cfg)  # noqa: E731
_COV_DOCS = {
    "pg_loss_expected": "grpolens' own (verl logs no such key): the expectation of verl's Clip-Cov pg_loss over its random "
                        "draw, each candidate zeroed with probability clip_num / candidates (pg_loss itself where no call "
                        "draws); empty where a call's candidates are not determined.",
    "pg_loss_random_calls": "verl's Clip-Cov: the step's loss calls with more candidate tokens than clip_num, of "
                            "which verl zeroes a random choice (torch.randperm): pg_loss and loss are then left empty.",
    "pg_loss_unsure_calls": "verl's KL-Cov / Clip-Cov: the step's loss calls whose chosen tokens the run leaves open "
                            "(a top-k tie broken by a row order the run does not record, or covariances within "
                            "verl's float32 rounding of each other or of a Clip-Cov bound): pg_loss and loss left empty.",
}
for _k, _doc in _COV_DOCS.items():
    register(Metric(f"verl_actor/{_k}", _FAM, _doc, kind="custom", fn=_value(_k), when=_COV_WHEN,
                    config=("verl_actor", "rollout_is")))
_ENTROPY_DOC = (
    "verl's actor/entropy: the old-log-prob pass' entropy (old_entropy), agg_loss over the whole step on one "
    "process (each completion once, the mask before rollout rejection, loss_agg_mode; seq-mean modes over the "
    "sequences with a token; -norm: loss_scale_factor, else the step's longest response)."
)
register(Metric("verl_actor/entropy", _FAM, _ENTROPY_DOC, kind="custom", fn=_old_entropy, when=_WHEN,
                requires=("old_entropy",), config=("verl_actor",)))


# ---------------------------------------------------------------------------------------------
# Bypass mode: the loss' own rollout correction (actor/rollout_corr/*)
# ---------------------------------------------------------------------------------------------

BYPASS_VISITOR = "verl_actor.bypass_corr"
#: the rejection filters' partial columns carry this prefix (their names clash with nothing else then)
_RS = "rs."


class BypassCorrection(Visitor):
    """Per sequence of each loss call, the rollout-correction partials of the current policy against
    the rollout (IS, mismatch and rejection-filter partials, as the driver-side summary reads them).
    Combined: the step's rows, keyed like the token shards (one row per loss call and sequence)."""

    name = BYPASS_VISITOR

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.c = ISConfig.from_cfg(cfg)

    def shard(self, b: TokenBatch, shard) -> dict | None:
        if not bypass(self.cfg) or not b.has("rollout_logp") or b.n_seq == 0:
            return None
        cur = _current(b)
        out = dict(cur.seq_keys)
        out.update(ris.sequence_partials(cur, ris.inputs(cur), self.c))
        out.update(_mismatch_partials(cur, self.cfg))
        if self.c.rs:
            rs = RSPartials(self.c).shard(cur, shard)
            out.update({_RS + k: v for k, v in rs.items() if k not in KEY_COLUMNS})
        return out

    def combine(self, step: int, pieces: list) -> dict | None:
        return verl_cov.concat_in_order(pieces, KEY_COLUMNS)


@visitor(BYPASS_VISITOR, families=("verl_actor",))
def _bypass_visitor(cfg: dict) -> BypassCorrection:
    return BypassCorrection(cfg)


def _bypass_corr_values(sd) -> dict[str, float]:
    """verl's ``actor/rollout_corr/*`` in bypass mode: its loss runs the driver's rollout correction
    (:func:`~grpolens.metrics.verl_rollout_corr.verl_batch_summary`) on each loss call's rows, current
    policy against rollout, with the call's response mask (no rejection before it in bypass mode).
    Each value is a MEAN metric of the call: the mean over a mini-batch's calls (every rank's), then
    verl's ``reduce_metrics`` over mini-batches and PPO epochs by the logged name: max if it
    contains ``max``, else min if it contains ``min``, else the mean."""
    key = ("verl_actor", "bypass_corr")
    if key in sd.extra:
        return sd.extra[key]
    out: dict[str, float] = {}
    per_call: dict[tuple[int, int], dict] = {}
    sd.extra[("verl_actor", "bypass_calls")] = per_call
    p = (sd.extra.get("pieces") or {}).get(BYPASS_VISITOR)
    a = actor_cfg(sd.cfg)
    calls = loss_calls(p["rank"], p["micro_batch"], p["sample_id"], a) if p and a is not None else None
    if calls:
        c = ISConfig.from_cfg(sd.cfg)
        per_mini: dict[int, list[dict]] = {}
        norm_parts: dict[tuple[int, int], list] = {}  # (mini, k-th call of a rank in it) -> [Σ w, count]
        seen: dict[tuple[int, int], int] = {}
        for r, u, mini, idx in calls:
            rows = {k: v[idx] for k, v in p.items()}
            rs = rs_summary({k[len(_RS):]: v for k, v in rows.items() if k.startswith(_RS)}, c) if c.rs else None
            per_call[(r, u)] = verl_batch_summary(rows, c, rs)
            per_mini.setdefault(mini, []).append(per_call[(r, u)])
            if c.batch_normalize and c.configured and c.has_band:
                k = seen.get((r, mini), 0)
                seen[(r, mini)] = k + 1
                part = norm_parts.setdefault((mini, k), [0.0, 0.0, []])
                w, n = _weight_sum(rows, c)
                part[0] += w
                part[1] += n
                part[2].append((r, u))
        # the loss' batch mean of the weights is all-reduced over the ranks' k-th calls
        # (distributed_masked_mean): every rank's call gets the group's factor
        for w, n, members in norm_parts.values():
            factor = w / n if n > 0 else 0.0
            for ru in members:
                per_call[ru]["rollout_is/batch_norm_factor"] = float(factor) if factor > 1e-8 else 1.0
        minis = [{k: float(np.mean([d.get(k) for d in ds])) for k in ds[0]
                  if all(d.get(k) is not None for d in ds)} for ds in per_mini.values()]
        for k in minis[0]:
            vals = [m[k] for m in minis if k in m]
            if len(vals) < len(minis):
                continue
            # verl's rule reads its logged name, which has "max" / "min" where the key has them (the
            # verl profile's names; tests/metrics/test_verl_actor.py checks every key), whatever the
            # profile the recompute names the metrics in
            out[k] = float(np.max(vals) if "max" in k else np.min(vals) if "min" in k else np.mean(vals))
    sd.extra[key] = out
    return out


def _weight_sum(rows: dict, c: ISConfig) -> tuple[float, float]:
    """What verl's bypass-mode loss sums for the weights' batch mean on one call: the applied token
    weights and the response tokens (token level), or the sequences' weights and the sequences with
    a token (sequence level)."""
    sv = ris.seq_view(rows, c)
    ok = sv.n > 0
    if c.level == "token":
        return float(ris._col(rows, "ris.ta").sum()), float(sv.n.sum())
    return float(sv.a[ok].sum()), float(ok.sum())


def _bypass_value(name: str):
    def fn(sd):
        return _bypass_corr_values(sd).get(name)
    fn.__name__ = f"verl_actor.rollout_corr[{name}]"
    return fn


_BYPASS_KEYS = VERL_KEYS + tuple(k for k in REGISTRY if k.startswith("rollout_rs/"))
for _k in _BYPASS_KEYS:
    register(Metric(
        f"verl_actor/rollout_corr/{_k}", _FAM,
        f"verl bypass mode: {_k} as verl's loss computes it on each loss call (current policy against the "
        "rollout), the mean over a mini-batch's calls, then over mini-batches and epochs the max (a logged "
        "name containing max), the min (containing min) or the mean.",
        kind="custom", fn=_bypass_value(_k), when=bypass, requires=("rollout_logp",),
        config=("verl_actor", "verl_algorithm", "rollout_is")))


register_family(Family("verl_actor", page="policy"))
