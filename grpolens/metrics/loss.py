"""The loss each GRPO variant optimises, recomputed from the stored tokens.

Per valid token (finite logp, old_logp, advantage; and ref_logp when β ≠ 0), with ``c`` the
importance weight (token ratio e^d, or under sequence-level importance sampling / GSPO the sequence
ratio exp(Σ_t d·v / max(Σ_t v, 1)) on every token; d is clamped to ± ``log_ratio_clamp`` first
when that is set, as Twinkle, verl and xtuner do with 20):

    grpo, bnpo, dr_grpo, dapo, luspo, gspo   L = −min(min(c, delta)·A, clip(c, 1 − ε, 1 + ε_high)·A)
    cispo                                    L = −min(c, ε_high)·A·logp     (ε_high: absolute cap)
    sapo                                     L = −(4/τ)·σ(τ(c − 1))·A,  τ = τ_pos if A > 0 else τ_neg
    vespo                                    L = −φ·A·logp, φ = e^(λ + k·ℓ − λ·e^ℓ) per sequence,
                                             ℓ = clamp(Σ_t clamp(d, ±20)·v, ln 1e-8, 20), (k, λ) by A ≥ 0
                                             (with rollout_is: + Σ_t clamp(ln a, ln 1e-8, 20)·M in ℓ, no ×a)
    with a rollout IS config (rollout_is)     L ×= a,  tokens the correction rejects leave v
    all, when β ≠ 0                          L += β·k3,  k3 = e^x − x − 1, x = ref − logp
                                             (× c when use_bias_correction_kl, c before delta)

``a`` is the applied rollout importance-sampling weight of :func:`grpolens.functional.rollout_is.loss_weights`
(the same weights and rejections the ``rollout_is/*`` metrics count): TRL's vLLM correction
(``per_token_loss *= importance_sampling_ratio`` before ``+ β·kl``; token or sequence level, Σδ,
``*_truncate`` clamps, ``*_mask`` zeroes), verl's TIS/IcePop and xtuner's modes alike. It applies
in both profiles whenever the run's config has ``rollout_is`` set (the TRL integration records it
only when TRL's correction is on), because it is part of the loss the trainer optimised; mode
``none`` weights nothing. A run with such a config but no ``rollout_logp`` has a null ``loss``.

``loss`` (grpolens profile) is the loss of the whole optimizer step, every rank and micro-batch
pooled, normalised the way the variant normalises:

    grpo, sapo, gspo   mean over the step's sequences of Σ_t L / max(Σ_t v, 1)
    bnpo, dapo, cispo, vespo  Σ L / Σ v   (bnpo's per-micro-batch token mean, pooled over the step)
    dr_grpo            Σ L / (sequences · max_completion_length)   (null if that is unset)
    luspo              mean over sequences of Σ_t L

Fully masked sequences count as sequences (they contribute 0), as in TRL and Twinkle; a step
without any valid token is null. The **trl profile** reproduces TRL's logged ``loss`` for one
optimizer step: the value ``_compute_loss`` returns per micro-batch (grpo/sapo:
mean_b[Σ_t L·M / max(Σ_t M, 1)] / G; bnpo: Σ L·M / max(Σ M, 1) / G; dr_grpo: Σ L·M / (B·max_len) / G;
luspo: mean_b Σ_t L·M / G; dapo/cispo: Σ L·M / (N/P · G/S)), summed over the rank's G micro-batches
and averaged over ranks. For dapo/cispo N is the token count of the micro-batch's generation
round (all ranks): with the samples column ``generation`` the value is (S/G) Σ_calls Σ L / N_round,
where N_round counts the valid tokens of the round's completions once each; when a round straddles
optimizer steps (``steps_per_generation > gradient_accumulation_steps``) N_round is the round's
``completion_len`` total from the run's samples (less truncated completions under
``mask_truncated_completions``, from TRL 1.9), and the G/S factor applies from TRL 1.10 (see
:mod:`grpolens.profiles.trl`). Without the column, Σ L / N_step with N the tokens of the step --
exact when ``steps_per_generation`` equals ``gradient_accumulation_steps`` (TRL's default). Not included: the entropy bonus, the off-policy and
entropy masks, MoE aux loss.
Non-finite tokens are excluded here; the trainer's own loss would have been NaN.

The per-token terms (PPO clip, CISPO, VESPO) are written once in
:mod:`grpolens.functional.policy_terms`; :func:`loss_partials` evaluates them with the masks, the
IS weight and β·k3 in one compiled pass over the tokens (:func:`grpolens.metrics.kernels.loss_sums`).
"""

from __future__ import annotations

import numpy as np

from grpolens.functional import estimators as est
from grpolens.metrics.batch import TokenBatch
from grpolens.metrics.clip import PPO_CLIP_LOSSES
from grpolens.metrics.partials import producer
from grpolens.metrics.kl import kl_k3
from grpolens.metrics.ratios import adv_masked, coef_input
from grpolens.metrics.reduce import SEQ_MEAN_LOSSES, normalise_like_loss
from grpolens.metrics.registry import Family, Metric, register, register_family
from grpolens.metrics.rollout_is import batch_inputs, batch_partials
from grpolens.functional.rollout_is import ISConfig, loss_weights

#: Loss types that average each sequence's tokens first, then the sequences.
#: Loss types normalised by a (global) token count.
TOKEN_MEAN_LOSSES = ("bnpo", "dapo", "cispo", "vespo")
#: VESPO's sequence weight: TRL clamps the summed log-ratio to [ln 1e-8, 20] (``get_gamma_weights``)
_VESPO_LOG_MIN = float(np.log(1e-8))


def _sigmoid(z: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def sapo_term(c, a, cfg):
    """SAPO's loss per token (arrays): −(4/τ)·σ(τ(c − 1))·A, τ = τ_pos if A > 0 else τ_neg."""
    tau = np.where(a > 0, cfg["sapo_temperature_pos"], cfg["sapo_temperature_neg"])
    return -(4.0 / tau) * _sigmoid(tau * (c - 1.0)) * a


def loss_partials(b: TokenBatch, cfg: dict, entropy_coef: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Per sequence Σ L over its valid tokens and their count, L the variant's per-token loss
    (minus ``entropy_coef``·H, Twinkle's entropy bonus, when given): one pass over the tokens
    (:func:`grpolens.metrics.kernels.loss_sums`).

    Valid: masked, logp, old_logp and the advantage finite (ref_logp too when β ≠ 0), less the
    tokens the rollout correction rejects. A is 0 off them, so the policy term vanishes there;
    the IS weight and the β·k3 term are applied on valid tokens only."""
    from grpolens.metrics import kernels

    beta = cfg.get("beta", 0.0)
    with_kl = beta != 0.0 and b.has("ref_logp")
    lt = cfg["loss_type"]
    c, c_masked = coef_input(b, cfg, cfg.get("log_ratio_clamp"))
    given = phi = None
    if lt in PPO_CLIP_LOSSES:
        kind = kernels.PPO
    elif lt == "cispo":
        kind = kernels.CISPO
    elif lt == "vespo":
        kind, phi = kernels.VESPO, vespo_phi(b, cfg)
    elif lt == "sapo":  # σ needs exp: numpy's, as every other transcendental of the kernels
        kind = kernels.GIVEN
        with np.errstate(over="ignore", invalid="ignore"):
            given = sapo_term(c, adv_masked(b), cfg)
    else:  # config.check_config only lets known loss types through
        raise ValueError(f"loss_type {lt!r} has no loss formula")
    w = keep = None
    isc = ISConfig.from_cfg(cfg)
    # the trainer's rollout IS correction, before + β·kl (VESPO has it inside φ instead, as TRL does)
    if isc.configured and b.has("rollout_logp") and lt != "vespo":
        w, keep = loss_weights(b, isc, batch_inputs(b), batch_partials(b, isc))
    ent = b.cols["entropy"] if entropy_coef and b.has("entropy") else None
    delta = cfg.get("delta")
    # the kernel reads every array in full: a neutral one where a term is off (its flag says so)
    zeros = np.zeros(b.n)
    return kernels.loss_sums(
        b.logp, b.old, b.adv, b.mask, c, c_masked, kind,
        1.0 - cfg.get("epsilon", 0.0), 1.0 + cfg.get("epsilon_high", 0.0), np.inf if delta is None else float(delta),
        float(cfg.get("epsilon_high", 0.0)), zeros if given is None else given, np.zeros(b.n_seq) if phi is None else phi,
        w is not None, np.ones(b.n) if w is None else w, np.ones(b.n, dtype=bool) if keep is None else keep,
        with_kl, b.cols["ref_logp"] if with_kl else b.logp, kl_k3(b) if with_kl else zeros, float(beta),
        bool(cfg.get("use_bias_correction_kl")), zeros if ent is None else ent,
        float(entropy_coef) if ent is not None else 0.0, b.starts, b.lengths)


def vespo_phi(b: TokenBatch, cfg: dict) -> np.ndarray:
    """VESPO's gamma weight per sequence (TRL's ``get_gamma_weights``):
    φ = exp(λ + k·ℓ − λ·e^ℓ), ℓ the sequence's Σ of clamp(logp − old, ±20) over its masked tokens
    with both log-probs finite (TRL sums over the mask), plus, with a rollout IS config (TRL's vLLM
    correction), Σ clamp(ln a, ln 1e-8, 20) over its masked tokens (a: the applied IS weight, 0 under
    ``token_mask`` outside the band), clamped to [ln 1e-8, 20]; k, λ the ``vespo_*_pos`` values where
    the sequence's advantage is >= 0, else ``vespo_*_neg`` (λ at least 1e-4); a non-finite φ is 0.
    NaN per sequence when the config has rollout IS but the batch no ``rollout_logp``."""
    isc = ISConfig.from_cfg(cfg)
    if isc.configured and not b.has("rollout_logp"):
        return np.full(b.n_seq, np.nan)  # the IS term TRL folded in is unknown: no number, not a wrong one
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        v = b.mask & np.isfinite(b.logp) & np.isfinite(b.old)
        d = np.where(v, est.clip_log_ratio(b.logp - b.old), 0.0)
        ell = b.seq_sum(d)
        if isc.configured:
            # TRL sums over every position; off the mask its ratio is 1 (δ zeroed), which the
            # config check guarantees the mode keeps at 1 (a band around 1): ln 1 = 0 there
            w, _ = loss_weights(b, isc, batch_inputs(b), batch_partials(b, isc))
            ell = ell + b.seq_sum(np.where(b.mask, np.clip(np.log(w), _VESPO_LOG_MIN, est.LOG_RATIO_BOUND), 0.0))
        ell = np.clip(ell, _VESPO_LOG_MIN, est.LOG_RATIO_BOUND)
        pos = b.seq_first(b.adv) >= 0
        k = np.where(pos, cfg["vespo_k_pos"], cfg["vespo_k_neg"])
        lam = np.maximum(np.where(pos, cfg["vespo_lambda_pos"], cfg["vespo_lambda_neg"]), 1e-4)
        phi = np.exp(lam + k * ell - lam * np.exp(ell))
    return np.where(np.isfinite(phi), phi, 0.0)


@producer("loss", merge={"loss.sum": "sum", "loss.n": "sum"})
def _loss(b: TokenBatch, cfg: dict) -> dict[str, np.ndarray]:
    s, n = loss_partials(b, cfg)
    return {"loss.sum": s, "loss.n": n}


# φ is non-linear in a sequence's summed log-ratio and ``loss.rows`` counts sequences, so these two columns
# need whole sequences (as GSPO's ratio does; the run format never splits one): a producer of their own keeps
# the token-level ``loss`` partials mergeable over any cut of a sequence.
@producer("loss_vespo", merge={"loss.phi": "sum", "loss.rows": "sum"}, families=("loss",))
def _loss_vespo(b: TokenBatch, cfg: dict) -> dict[str, np.ndarray]:
    phi = vespo_phi(b, cfg) if cfg["loss_type"] == "vespo" else np.zeros(b.n_seq)
    return {"loss.phi": phi, "loss.rows": np.ones(b.n_seq)}


# ---------------------------------------------------------------------------------------------
# Reductions
# ---------------------------------------------------------------------------------------------

def _pooled(sd, s: np.ndarray, n: np.ndarray) -> float | None:
    return normalise_like_loss(sd.cfg["loss_type"], s, n, sd.cfg.get("max_completion_length"))


def _round_tokens(sd, n: np.ndarray) -> np.ndarray | None:
    """N of each sequence's generation round: the valid tokens of that round's completions, each
    completion counted once (num_iterations reuses it). None unless every sequence's round is known
    from the step's samples (``generation``) and every completion of those rounds is in the step."""
    df = sd.samples
    if df is None or df.height == 0 or "generation" not in df.columns or df["generation"].null_count():
        return None
    sid, gen = df["sample_id"].to_numpy(), df["generation"].to_numpy()
    seq_sid = sd.col("sample_id").astype(np.int64)
    order = np.argsort(sid)  # sample ids are unique in the samples table
    at = order[np.minimum(np.searchsorted(sid, seq_sid, sorter=order), len(sid) - 1)]
    if not np.array_equal(sid[at], seq_sid):
        return None  # a sequence generated at another step (a round that straddles steps)
    rounds, seq_round = np.unique(gen[at], return_inverse=True)
    if not np.isin(sid[np.isin(gen, rounds)], seq_sid).all():
        return None  # part of a round is trained on at a later step
    _, first = np.unique(seq_sid, return_index=True)
    per_round = np.bincount(seq_round[first], n[first])  # each round has a sequence here
    return per_round[seq_round]


def per_call_loss(sd, s: np.ndarray, n: np.ndarray) -> float | None:
    """The loss each loss call returns, summed over a rank's calls, then the mean over ranks
    (TRL's logged ``loss``; its profile reduces with this)."""
    lt = sd.cfg["loss_type"]
    if lt in TOKEN_MEAN_LOSSES and lt != "bnpo":
        # Σ over a rank's calls of Σ L·M / (N/P · G/S), mean over P ranks = (S/G) Σ_all calls Σ L / N
        N = _round_tokens(sd, n)
        ctx = sd.extra.get("schedule")
        if N is None and ctx is not None:  # a round that straddles steps: N from the run's samples
            N = ctx.round_tokens_of(sd.col("sample_id").astype(np.int64))
        if N is None:
            return float(s.sum() / max(n.sum(), 1.0))  # one round per step: S = G, N = the step's tokens
        G = sd.cfg.get("gradient_accumulation_steps") or 1
        S = sd.cfg.get("steps_per_generation") or G
        v = ctx.rules.version if ctx is not None else None
        factor = S / G if v is None or v >= (1, 10) else 1.0  # TRL 1.10 (PR #6024): N/P x G/S
        return float(factor * np.sum(s / np.maximum(N, 1.0)))
    g, ng = sd.groups(("rank", "micro_batch"))
    rows = np.bincount(g).astype(np.float64)  # every call id in 0..ng-1 occurs in g
    if lt in SEQ_MEAN_LOSSES:
        call = np.bincount(g, s / np.maximum(n, 1.0)) / rows
    elif lt == "luspo":
        ctx = sd.extra.get("schedule")
        v = ctx.rules.version if ctx is not None else None
        per_token = sd.cfg.get("beta", 0.0) != 0.0 or sd.cfg.get("importance_sampling_level", "token") == "token"
        if v is not None and v < (1, 10) and per_token:
            # TRL < 1.10 averaged L·len over every padded position once L is per token (huggingface/trl#6654):
            # padding positions' log-probs are not in the run, so that number cannot be reproduced
            return None
        call = np.bincount(g, s) / rows
    elif lt == "bnpo":
        call = np.bincount(g, s) / np.maximum(np.bincount(g, n), 1.0)
    else:  # dr_grpo
        length = sd.cfg.get("max_completion_length")
        if not length:
            return None
        call = np.bincount(g, s) / (rows * length)
    rank_of_call = np.zeros(ng)
    rank_of_call[g] = sd.col("rank")
    _, r = np.unique(rank_of_call, return_inverse=True)
    per_rank = np.bincount(r, call) / np.bincount(r)  # Σ over the rank's G calls of value / G
    return float(np.mean(per_rank))


def loss_value(sd, per_call: bool = False) -> float | None:
    """The step's loss; ``per_call``: reduced by :func:`per_call_loss` instead of over the whole step."""
    if not sd.n_seq:
        return None
    if sd.cfg.get("beta", 0.0) != 0.0 and "ref_logp" not in sd.present:
        return None  # the trainer added a KL term the run cannot reproduce
    if ISConfig.from_cfg(sd.cfg).configured and "rollout_logp" not in sd.present:
        return None  # the trainer weighted the loss by rollout IS weights the run cannot reproduce
    s, n = sd.col("loss.sum"), sd.col("loss.n")
    if per_call:
        return per_call_loss(sd, s, n)
    if n.sum() == 0:
        return None
    return _pooled(sd, s, n)


register(Metric(
    "loss", "loss",
    "The step's loss as its variant computes and normalises it: per-token L (PPO clip with delta; "
    "CISPO −min(c, ε_high)·A·logp; SAPO soft gate; VESPO −φ·A·logp) + β·k3 (× c if use_bias_correction_kl); grpo/"
    "sapo/gspo: mean over sequences of their token mean; bnpo/dapo/cispo/vespo: Σ L / Σ tokens; dr_grpo: "
    "Σ L / (sequences · max_completion_length); luspo: mean of per-sequence sums. trl: TRL's `loss` "
    "(per-micro-batch returned loss summed over a rank's micro-batches, mean over ranks; dapo/cispo/vespo: "
    "÷ the tokens of the call's generation round (samples column `generation`, also for a round spanning "
    "optimizer steps; without it the step's tokens, exact when steps_per_generation = "
    "gradient_accumulation_steps); over a logging window the mean of the window's steps). With a rollout_is config (TRL: its vLLM "
    "IS correction on) the policy term is × the applied IS weight a and rejected tokens leave the mask, in "
    "both profiles (null without rollout_logp); VESPO instead folds ln a into φ, as TRL does. No entropy bonus.",
    kind="custom", fn=loss_value,
    config=("loss_type", "epsilon", "epsilon_high", "delta", "beta", "use_bias_correction_kl",
            "importance_sampling_level", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
            "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
            "max_completion_length", "log_ratio_clamp", "rollout_is", "steps_per_generation",
            "gradient_accumulation_steps"),
    reads_samples=True,  # the samples' generation rounds (see _round_tokens)
))


register(Metric(
    "loss/vespo_phi_mean", "loss",
    "VESPO's gamma weight φ = exp(λ + k·ℓ − λ·e^ℓ) per sequence (ℓ: its Σ clamp(logp − old_logp, ±20) over "
    "valid tokens, plus with a rollout_is config (TRL's vLLM IS correction, token_truncate or token_mask) "
    "Σ clamp(ln a, ln 1e-8, 20) over its masked tokens, a the applied IS weight; clamped to [ln 1e-8, 20]; "
    "k, λ = vespo_k/lambda_pos for A >= 0, else _neg), the mean over every sequence, fully masked ones "
    "included (φ = 1 there without IS). trl: per micro-batch slot over all ranks, then the mean over slots "
    "(TRL's vespo/phi_seq_mean). Null with a rollout_is config but no rollout_logp.",
    kind="token_mean", num="loss.phi", den="loss.rows",
    when=lambda cfg: cfg.get("loss_type") == "vespo",
    config=("loss_type", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "rollout_is"),
))


register_family(Family(
    'loss', page='policy',
    key_metrics=('loss',),
))
