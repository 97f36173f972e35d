"""ms-swift 4.6.0's GRPO trainer (``swift/rlhf_trainers/grpo_trainer.py``): its loss and the
metrics its ``_compute_loss_and_metrics`` appends, as it computes them.

Only for runs recorded with ms-swift's settings (``swift_args`` in their config: its own argument
names, over its defaults :data:`DEFAULTS`). Per loss call (one micro-batch on one rank), with ``m``
the completion mask (less truncated completions under ``overlong_filter``), ``d = logp − old_logp``,
``A`` the advantage and ``c`` the importance weight (``e^d``; ``sequence``/``sequence_token``:
``exp(Σ d·m / max(Σ m, 1))`` of the sequence on every token; ``min(c, delta)`` in the clipped
objective when ``delta`` is set):

    grpo, bnpo, dr_grpo, dapo   L = −min(c·A, clip(c, 1 − ε, 1 + ε_high)·A)
    fipo                        the same × FIPO's influence weight (:mod:`grpolens.metrics.swift_fipo`)
    cispo                       L = −min(c, ε_high)·A·logp
    sapo                        L = −(4/τ)·σ(τ(c − 1))·A,  τ = tau_pos if A > 0 else tau_neg
    top_entropy_quantile < 1    L ×= [entropy ≥ the call's entropy quantile] (the policy term only)
    when β ≠ 0                  L += β·k3,  k3 = clamp(e^x − x − 1, ±10), x = clamp(ref − logp, ±20)
    an IS mode                  L ×= the rollout IS weight (:mod:`grpolens.metrics.swift_rollout_corr`)

and the call's loss, over ``m`` less the rows ``off_policy_sequence_mask_delta`` drops: grpo/sapo
the mean over rows of Σ L·m / max(Σ m, 1); bnpo Σ L·m / max(Σ m, 1); dr_grpo Σ L·m / (rows ·
max_completion_length); dapo/cispo/fipo Σ L·m / (N / P), N the completion tokens of the call's
generation round over all P ranks (before the overlong filter), × the accumulation steps
(``_undo_gradient_accumulation_scaling``); real REAL's group-level loss (:func:`real_loss`). Where this differs from TRL: the k3 clamps, the KL
metric and clip fractions at sequence level are token means (ms-swift broadcasts its per-token
advantage, so a sequence's indicator counts once per token), every loss-side metric is each rank's
masked mean (Σ / max(Σ m, 1)) then the mean over ranks (``clip_ratio/low_min``/``high_max`` the
min/max over ranks), and ``entropy/*`` are statistics of each completion's mean entropy over all
its tokens (the overlong filter does not apply).

``loss`` is transformers': each call's loss ÷ the accumulation steps, summed over a rank's calls
of the optimizer step, mean over ranks (a logging window: the mean over its steps, see
:mod:`grpolens.profiles.swift`).
"""

from __future__ import annotations

import numpy as np

from grpolens.errors import UserError
from grpolens.metrics import swift_fipo as fipo
from grpolens.metrics import swift_rewards as sr
from grpolens.metrics import swift_rollout_corr as rc
from grpolens.metrics.batch import TokenBatch
from grpolens.metrics.partials import producer
from grpolens.metrics.registry import Family, Metric, register, register_family
from grpolens.metrics.rewards import per_round

#: ms-swift 4.6.0's defaults for what its GRPO metrics depend on (``swift rlhf --rlhf_type grpo``:
#: ``GRPOArgumentsMixin`` and ``RLHFArguments._init_grpo``, which sets β 0.04 and the reward scaling)
DEFAULTS = {
    "loss_type": "grpo", "beta": 0.04, "epsilon": 0.2, "epsilon_high": None, "delta": None,
    "importance_sampling_level": "token", "tau_pos": 1.0, "tau_neg": 1.05, "num_generations": 8,
    "max_completion_length": 512, "num_iterations": 1, "gradient_accumulation_steps": 1,
    "steps_per_generation": None, "scale_rewards": None, "advantage_estimator": "grpo", "kl_in_reward": None,
    "log_entropy": False, "top_entropy_quantile": 1.0, "overlong_filter": False,
    "rollout_importance_sampling_mode": None, "rollout_importance_sampling_threshold": 2.0,
    "log_rollout_offpolicy_metrics": False, "off_policy_sequence_mask_delta": None,
    "dynamic_sample": False, "advantage_reweight": None, "sdar_loss_coef": 0.0, "teacher_model": None,
    "teacher_model_server": None, "multi_turn_scheduler": None, "use_gym_env": None, "sequence_parallel_size": 1,
    "real_tau": 0.5, "fipo_decay_rate": 32.0, "fipo_clip_range": 0.2, "fipo_clip_high_only": True, "fipo_safety_threshold": 4.0,
    "logging_steps": 5, "logging_first_step": True, "max_steps": None, "use_liger_kernel": False,
}
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "fipo", "real")
#: loss types whose loss is normalised by the generation round's tokens (ms-swift's WINDOW_NORMALIZED_LOSS_TYPES)
WINDOW_NORMALIZED = ("dapo", "cispo", "fipo")
#: what ms-swift 4.6.0 does that the profile does not reproduce, with why (refused by name)
_REFUSED = {
    "advantage_reweight": "RLSD's teacher reweighting needs the teacher's log-probs",
    "sdar_loss_coef": "SDAR's distillation loss needs the teacher's log-probs",
    "use_liger_kernel": "the Liger loss logs clip_ratio instead of clip_ratio/*",
    "teacher_model": "OPD-RL's teacher log-probs shape the advantage and log teacher_kl",
    "teacher_model_server": "OPD-RL's teacher log-probs shape the advantage and log teacher_kl",
    "multi_turn_scheduler": "multi-turn rollouts deduplicate metrics per request and chunk the loss",
    "use_gym_env": "gym rollouts deduplicate metrics per request and chunk the loss",
    "sequence_parallel_size": "sequence parallelism regroups the micro-batches",
}


def _bad(key: str, value, why: str) -> UserError:
    return UserError(f"config key 'swift_args.{key}': {why}, got {value!r}")


def settings(cfg: dict) -> dict | None:
    """The run's ms-swift settings (``cfg["swift_args"]`` over :data:`DEFAULTS`, resolved as ms-swift
    resolves them); None when the run has none. Raises a UserError naming what is not reproduced."""
    o = cfg.get("swift_args")
    if not isinstance(o, dict):
        return None
    s = {**DEFAULTS, **o}
    if s["loss_type"] not in LOSS_TYPES:
        raise _bad("loss_type", s["loss_type"], f"the swift profile reproduces {', '.join(LOSS_TYPES)}")
    if s["importance_sampling_level"] not in ("token", "sequence", "sequence_token"):
        raise _bad("importance_sampling_level", s["importance_sampling_level"], "must be token, sequence or sequence_token")
    if s["kl_in_reward"] is None:  # _init_grpo: true for rloo and reinforce_plus_plus
        s["kl_in_reward"] = s["advantage_estimator"] != "grpo"
    if s["loss_type"] == "real":  # _init_grpo: REAL does not normalise rewards
        s["scale_rewards"] = "none"
    if s["scale_rewards"] is None:
        s["scale_rewards"] = {"grpo": "group", "rloo": "none"}.get(s["advantage_estimator"], "batch")
    if s["epsilon_high"] is None:
        s["epsilon_high"] = s["epsilon"]
    if s["steps_per_generation"] is None:
        s["steps_per_generation"] = s["gradient_accumulation_steps"]
    defaults = {"sdar_loss_coef": 0.0, "use_liger_kernel": False, "sequence_parallel_size": 1}
    for key, why in _REFUSED.items():
        if s[key] != defaults.get(key):
            raise _bad(key, s[key], f"not reproduced by the swift profile ({why})")
    tq = s["top_entropy_quantile"]
    if isinstance(tq, bool) or not isinstance(tq, (int, float)) or not 0 < tq <= 1:
        raise _bad("top_entropy_quantile", tq, "must be a number in (0, 1]")
    mode = s["rollout_importance_sampling_mode"]
    if mode is not None and mode not in rc.MODES:
        raise _bad("rollout_importance_sampling_mode", mode, f"must be one of {', '.join(rc.MODES)}")
    thr = s["rollout_importance_sampling_threshold"]
    if isinstance(thr, bool) or not isinstance(thr, (int, float)) or not thr > 0:
        raise _bad("rollout_importance_sampling_threshold", thr, "must be a number > 0")
    for key in ("gradient_accumulation_steps", "steps_per_generation", "num_iterations", "num_generations",
                "max_completion_length"):
        if isinstance(s[key], bool) or not isinstance(s[key], int) or s[key] < 1:
            raise _bad(key, s[key], "must be an integer >= 1")
    return s


_COLS = ("sw.n", "sw.kl", "sw.low", "sw.high", "sw.region", "sw.cispo", "sw.kl1", "sw.low1", "sw.high1", "sw.region1",
         "sw.cispo1", "sw.okl", "sw.pg", "sw.ent", "sw.ent_n", "sw.len", "sw.thr", "ro.n", *rc.COLS)
_FIPO_COLS = ("sw.fk", "sw.fk1", "sw.fw", "sw.fw1", "sw.keep", "sw.keep1", "sw.d", "sw.adv")
_COLS += _FIPO_COLS
#: a loss call is never split across files, so its rows' threshold (one value per call) merges by max
_MERGE = {c: "max" if c == "sw.thr" else "sum" for c in _COLS}


def _sigmoid(z: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def rollout_on(s: dict) -> bool:
    """ms-swift computes its rollout correction (given the engine's log-probs) with an IS mode or
    ``log_rollout_offpolicy_metrics``."""
    return s["rollout_importance_sampling_mode"] is not None or bool(s["log_rollout_offpolicy_metrics"])


def nanquantile32(x: np.ndarray, q: float) -> float:
    """``torch.nanquantile(x.float(), q)`` (linear): in float32, the rank q·(k − 1) over the k non-NaN
    values, torch's ``lerp`` between its neighbours; NaN when every value is NaN."""
    v = np.sort(np.asarray(x, dtype=np.float32)[~np.isnan(x)])
    if not len(v):
        return float("nan")
    rank = np.float32(q) * np.float32(len(v) - 1)
    lo, hi = int(np.floor(rank)), int(np.ceil(rank))
    w = np.float32(rank - np.float32(lo))
    a, e = v[lo], v[hi]
    r = a + w * (e - a) if w < 0.5 else e - (e - a) * (np.float32(1.0) - w)
    return float(np.float32(r))


def entropy_thresholds(b: TokenBatch, top: float) -> np.ndarray:
    """Per row, its loss call's entropy threshold (``_compute_loss_and_metrics`` with
    ``top_entropy_quantile`` < 1: the (1 − top) quantile of the entropies of every completion token
    of the call, on that rank)."""
    keys = b.seq_keys
    call = keys["rank"] * (int(keys["micro_batch"].max()) + 1) + keys["micro_batch"]
    tok = b.broadcast(call)
    out = np.empty(b.n_seq)
    e = b.cols["entropy"]
    for k in np.unique(call):
        out[call == k] = nanquantile32(e[tok == k], 1 - top)
    return out


def off_policy_mask(b: TokenBatch, s: dict, m: np.ndarray, n: np.ndarray) -> np.ndarray:
    """``m`` less the rows ``off_policy_sequence_mask_delta`` drops (``_compute_off_policy_sequence_mask``):
    mean_t(π_behaviour − logp) > delta with a negative mean advantage, the behaviour policy the
    rollout engine's log-probs when the run has them, else the old policy's; ``m`` itself without a delta."""
    delta = s["off_policy_sequence_mask_delta"]
    if delta is None:
        return m
    behaviour = b.cols["rollout_logp"] if b.has("rollout_logp") else b.old
    with np.errstate(invalid="ignore"):
        gap = b.seq_sum(np.where(m, behaviour - b.logp, 0.0)) / np.maximum(n, 1.0)
        adv = b.seq_sum(np.where(m, b.adv, 0.0)) / np.maximum(n, 1.0)
    return m & ~b.broadcast((gap > float(delta)) & (adv < 0))


def _swift(b: TokenBatch, cfg: dict) -> dict[str, np.ndarray]:
    s = settings(cfg)
    if s is None or b.n_seq == 0:
        return {c: np.zeros(b.n_seq) for c in _COLS}
    m = b.mask
    n, zero = b.count(m), np.zeros(b.n_seq)
    mk = off_policy_mask(b, s, m, n)  # the mask of the loss' normaliser and the metrics
    nk = b.count(mk) if mk is not m else n
    # ``…1`` columns: the same sums over every stored token, unmasked: what ms-swift averages over the
    # rows instead of the masked tokens when a loss call is one token wide (``masked_batch_mean``)
    out = {}
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        A = b.adv
        logp = np.where(m, b.logp, 0.0)
        if s["importance_sampling_level"] == "token":
            c = np.exp(b.logp - b.old)
        else:
            c = b.broadcast(np.exp(b.seq_sum(np.where(m, b.logp - b.old, 0.0)) / np.maximum(n, 1.0)))
        lt = s["loss_type"]
        eps_lo, eps_hi = float(s["epsilon"]), float(s["epsilon_high"])
        ind = {}
        if lt == "cispo":
            L = -np.minimum(c, eps_hi) * A * logp
            ind["cispo"] = (c > eps_hi) & (A > 0)
        elif lt == "real":  # its loss is a group-level one per call (call_loss)
            L = np.zeros(b.n)
            out["sw.d"] = b.seq_sum(np.where(mk, b.logp - b.old, 0.0))
            out["sw.adv"] = b.seq_sum(np.where(mk, A, 0.0))
        elif lt == "sapo":
            tau = np.where(A > 0, float(s["tau_pos"]), float(s["tau_neg"]))
            L = -_sigmoid(tau * (c - 1.0)) * (4.0 / tau) * A
        else:
            c2 = np.clip(c, 1 - eps_lo, 1 + eps_hi)
            c1 = c if s["delta"] is None else np.minimum(c, float(s["delta"]))
            L = -np.minimum(c1 * A, c2 * A)
            if lt == "fipo":
                f = fipo.influence(b, s, m, c, A)
                L = L * f["weight"]
                for k, x in (("fk", f["future_kl"]), ("fw", f["weight"]), ("keep", f["keep"].astype(np.float64))):
                    out[f"sw.{k}"], out[f"sw.{k}1"] = b.seq_sum(np.where(mk, x, 0.0)), b.seq_sum(x)
            ind["low"], ind["high"] = (c1 < 1 - eps_lo) & (A < 0), (c1 > 1 + eps_hi) & (A > 0)
            ind["region"] = ind["low"] | ind["high"]
        for k in ("low", "high", "region", "cispo"):
            x = ind.get(k)
            out[f"sw.{k}"] = zero if x is None else b.seq_sum((x & mk).astype(np.float64))
            out[f"sw.{k}1"] = zero if x is None else b.count(x)
        thr = np.full(b.n_seq, np.nan)
        if float(s["top_entropy_quantile"]) < 1.0 and b.has("entropy"):  # only the top entropies train
            thr = entropy_thresholds(b, float(s["top_entropy_quantile"]))
            L = L * (b.cols["entropy"].astype(np.float32) >= b.broadcast(thr).astype(np.float32))
        out["sw.kl"] = out["sw.kl1"] = out["sw.okl"] = zero
        if float(s["beta"]) != 0.0 and s["kl_in_reward"] and b.has("ref_logp"):  # the reward's shaping
            out["sw.okl"] = b.seq_sum(b.old - b.cols["ref_logp"])
        if float(s["beta"]) != 0.0 and not s["kl_in_reward"] and b.has("ref_logp"):
            k3 = rc.clamped_k3(b.cols["ref_logp"] - b.logp)
            L = L + float(s["beta"]) * k3
            out["sw.kl"], out["sw.kl1"] = b.seq_sum(np.where(mk, k3, 0.0)), b.seq_sum(k3)
        ro = {}
        if rollout_on(s) and b.has("rollout_logp"):
            w = None
            if s["rollout_importance_sampling_mode"] is not None:
                w = rc.weights(b, s["rollout_importance_sampling_mode"],
                               float(s["rollout_importance_sampling_threshold"]), m, n)
                L = L * w
            ro = rc.partials(b, s, m, n, w)
        pg = b.seq_sum(np.where(mk, L, 0.0))
        ent, ent_n = zero, zero
        if b.has("entropy"):  # every stored token: the completion mask before the overlong filter
            e = b.cols["entropy"]
            ok = ~np.isnan(e)
            ent, ent_n = b.seq_sum(np.where(ok, e, 0.0)), b.count(ok)
    out.update({c: zero for c in _FIPO_COLS if c not in out})
    return {**out, "sw.n": nk, "ro.n": n, "sw.pg": pg, "sw.ent": ent, "sw.ent_n": ent_n, "sw.len": b.lengths.astype(np.float64),
            "sw.thr": thr, **{c: ro.get(c, zero) for c in rc.COLS}}


# Registered by a call, not as a decorator: mutmut skips decorated functions (docs/mutation-testing.md).
producer("swift_grpo", merge=_MERGE)(_swift)


# ---------------------------------------------------------------------------------------------
# Per loss call and per slot (one micro-batch index on every rank)
# ---------------------------------------------------------------------------------------------

def _rank_means(sd, num: str) -> list[float]:
    """Each rank's ``masked_batch_mean`` over its rows of ``sd`` (one slot): Σ num / max(Σ m, 1), or
    when the rank's micro-batch is one token wide (its longest completion has one token) the plain
    mean over its rows of the unmasked value."""
    r = sd.col("rank")
    s, s1, n, width = sd.col(num), sd.col(num + "1"), sd.col("sw.n"), sd.col("sw.len")
    out = []
    for k in np.unique(r):
        sel = r == k
        out.append(float(s1[sel].mean() if width[sel].max() == 1 else s[sel].sum() / max(n[sel].sum(), 1.0)))
    return out


def slot_values(sd) -> dict[str, float]:
    """What ``_update_metrics`` appends for one slot: ``sd`` holds that slot's rows on every rank."""
    s = settings(sd.cfg)
    out: dict[str, float] = {}
    if s is None or not sd.n_seq:
        return out
    if float(s["beta"]) != 0.0 and not s["kl_in_reward"] and "ref_logp" in sd.present:
        out["kl"] = float(np.mean(_rank_means(sd, "sw.kl")))
    if s["loss_type"] == "cispo":
        out["cispo_clip_ratio"] = float(np.mean(_rank_means(sd, "sw.cispo")))
    elif s["loss_type"] not in ("sapo", "real"):
        low, high, region = (_rank_means(sd, c) for c in ("sw.low", "sw.high", "sw.region"))
        out.update({"clip_ratio/low_mean": float(np.mean(low)), "clip_ratio/low_min": min(low),
                    "clip_ratio/high_mean": float(np.mean(high)), "clip_ratio/high_max": max(high),
                    "clip_ratio/region_mean": float(np.mean(region))})
    if s["loss_type"] == "fipo":
        for key, col in zip(fipo.KEYS, ("sw.fk", "sw.fw", "sw.keep")):
            out[f"fipo/{key}"] = float(np.mean(_rank_means(sd, col)))
    if rollout_on(s) and "rollout_logp" in sd.present:
        r = sd.col("rank")
        per_rank = [rc.rank_values(lambda c, k=k: sd.col(c)[r == k], s) for k in np.unique(r)]
        out.update({f"rollout_correction/{k}": v for k, v in rc.gathered(per_rank).items()})
    if float(s["top_entropy_quantile"]) < 1.0 and "entropy" in sd.present and (sd.col("rank") == 0).any():
        out["entropy/threshold"] = float(sd.col("sw.thr")[sd.col("rank") == 0][0])  # rank 0's, which it logs
    if s["log_entropy"] and "entropy" in sd.present:
        n = sd.col("sw.ent_n")
        with np.errstate(invalid="ignore", divide="ignore"):
            per = np.where(n > 0, sd.col("sw.ent") / np.where(n > 0, n, 1.0), np.nan)
        ok = ~np.isnan(per)
        out["entropy/mean"] = float(np.mean(per[ok])) if ok.any() else float("nan")
        out["entropy/max"] = float(np.max(per[ok])) if ok.any() else float("nan")
        out["entropy/min"] = float(np.min(per[ok])) if ok.any() else float("nan")
    return out


def _logsumexp1(x: np.ndarray) -> float:
    """log(1 + Σ e^x) (``torch.logsumexp`` over ``x`` and a 0)."""
    z = np.append(x, 0.0)
    top = z.max()
    return float(top + np.log(np.exp(z - top).sum()))


def real_loss(s: dict, d: np.ndarray, n: np.ndarray, adv: np.ndarray, kl: np.ndarray) -> float | None:
    """REAL's loss for one call whose rows (in the micro-batch's order) form groups of
    ``num_generations``: each row's score S = mean_t d, the groups with both a positive and a
    non-positive mean advantage give log(1 + Σ_neg e^(S/τ)) + log(1 + Σ_pos e^(−S/τ)), summed and
    divided by the call's groups (0 when none); + β times the call's token mean of k3."""
    G = s["num_generations"]
    if len(d) % G:
        return None  # ms-swift cannot view the call's rows as groups either
    den = np.maximum(n, 1.0)
    score, a = (d / den).reshape(-1, G) / float(s["real_tau"]), (adv / den).reshape(-1, G)
    total = 0.0
    for sc, ad in zip(score, a):
        pos, neg = ad > 0, ad <= 0
        if pos.any() and neg.any():
            total += _logsumexp1(sc[neg]) + _logsumexp1(-sc[pos])
    loss = total / len(score)
    if float(s["beta"]) != 0.0:
        loss += float(s["beta"]) * kl.sum() / max(n.sum(), 1.0)
    return loss


def call_loss(s: dict, pg: np.ndarray, n: np.ndarray, world: int, round_tokens: float | None) -> float | None:
    """The loss ``_compute_loss`` returns for one call (its rows' Σ L·m and Σ m)."""
    lt = s["loss_type"]
    if lt in ("grpo", "sapo"):
        return float(np.mean(pg / np.maximum(n, 1.0)))
    if lt == "bnpo":
        return float(pg.sum() / max(n.sum(), 1.0))
    if lt == "dr_grpo":
        return float(pg.sum() / (len(pg) * s["max_completion_length"]))
    if not round_tokens:
        return None
    return float(pg.sum() / (round_tokens / world) * s["gradient_accumulation_steps"])


_FAM = "swift_grpo"
_WHEN = lambda cfg: isinstance(cfg.get("swift_args"), dict)  # noqa: E731
_DOCS = {
    "kl": "ms-swift's kl (β ≠ 0): per loss call each rank's masked mean of its clamped k3 (x = ref − logp clamped "
          "±20, k3 clamped ±10; token mean also under sequence-level importance sampling), mean over ranks; with "
          "kl_in_reward per generation round the mean over its completions of Σ_t (old_logp − ref_logp).",
    "clip_ratio/low_mean": "ms-swift's clip_ratio/low_mean: per call each rank's masked mean of c < 1 − ε with A < 0 "
                           "(a sequence's indicator on each of its tokens at sequence level), mean over ranks.",
    "clip_ratio/low_min": "ms-swift's clip_ratio/low_min: the smallest rank's clip_ratio/low fraction of the call.",
    "clip_ratio/high_mean": "ms-swift's clip_ratio/high_mean: as low_mean for c > 1 + ε_high with A > 0.",
    "clip_ratio/high_max": "ms-swift's clip_ratio/high_max: the largest rank's clip_ratio/high fraction of the call.",
    "clip_ratio/region_mean": "ms-swift's clip_ratio/region_mean: as low_mean for either bound.",
    "cispo_clip_ratio": "ms-swift's cispo_clip_ratio: per call each rank's masked mean of c > ε_high with A > 0, "
                        "mean over ranks (cispo only).",
    "entropy/mean": "ms-swift's entropy/mean (log_entropy): per call, the mean over every rank's completions of each "
                    "completion's mean entropy over all its tokens (NaN-ignoring).",
    "entropy/max": "ms-swift's entropy/max (log_entropy): the largest completion mean entropy of the call.",
    "entropy/min": "ms-swift's entropy/min (log_entropy): the smallest completion mean entropy of the call.",
    "entropy/threshold": "ms-swift's entropy/threshold (top_entropy_quantile < 1): rank 0's (1 − top_entropy_quantile) "
                         "quantile (torch.nanquantile, float32) of the entropies of its call's completion tokens; "
                         "only tokens at or above their call's threshold keep their policy loss.",
}
_DOCS.update({f"rollout_correction/{k}": f"ms-swift's rollout_correction/{k} (log_rollout_offpolicy_metrics or an "
               "IS mode; the run's rollout_logp): per call each rank's value (grpolens/metrics/swift_rollout_corr.py), "
               + ("max" if k.endswith("_max") else "min" if k.endswith("_min") else "NaN-ignoring mean") + " over ranks."
               for k in (*rc.KEYS, *rc.IS_KEYS)})
_DOCS.update({f"fipo/{k}": f"ms-swift's fipo/{k} (loss_type fipo): per call each rank's masked mean of the "
               + {"future_kl_mean": "future KL Σ_s≥t γ^(s−t) δ_s", "influence_weight_mean": "influence weight",
                  "safety_keep_ratio": "tokens the safety rule leaves alone"}[k]
               + " (grpolens/metrics/swift_fipo.py), mean over ranks." for k in fipo.KEYS})
_ONLY = {
    "kl": lambda cfg: _WHEN(cfg) and float(settings(cfg)["beta"]) != 0.0,
    "cispo_clip_ratio": lambda cfg: _WHEN(cfg) and settings(cfg)["loss_type"] == "cispo",
    **{f"entropy/{k}": (lambda cfg: _WHEN(cfg) and bool(settings(cfg)["log_entropy"])) for k in ("mean", "max", "min")},
    "entropy/threshold": lambda cfg: _WHEN(cfg) and float(settings(cfg)["top_entropy_quantile"]) < 1.0,
    **{f"fipo/{k}": (lambda cfg: _WHEN(cfg) and settings(cfg)["loss_type"] == "fipo") for k in fipo.KEYS},
    **{f"rollout_correction/{k}": (lambda cfg: _WHEN(cfg) and rollout_on(settings(cfg))) for k in rc.KEYS},
    **{f"rollout_correction/{k}": (lambda cfg: _WHEN(cfg) and settings(cfg)["rollout_importance_sampling_mode"] is not None)
       for k in rc.IS_KEYS},
}
_CLIP = lambda cfg: _WHEN(cfg) and settings(cfg)["loss_type"] not in ("cispo", "sapo", "real")  # noqa: E731


def _slot_mean(key: str):
    """fn(sd): the mean over the step's slots of the value appended per slot (NaN kept: ms-swift's
    ``log()`` averages with ``sum(values) / len(values)``)."""
    def fn(sd):
        vals = slot_series(sd, key)
        return float(np.mean(vals)) if vals else None
    fn.__name__ = f"swift_grpo[{key}]"
    return fn


def slot_series(sd, key: str) -> list[float]:
    """The values appended for ``key`` during the step: one per slot (micro-batch index) that has it."""
    cache = ("swift_grpo", "slots")
    if cache not in sd.extra:
        from dataclasses import replace

        g, n = sd.groups(("micro_batch",))
        slots = []
        for k in range(n):
            keep = g == k
            sub = replace(sd, seqs={c: a[keep] for c, a in sd.seqs.items()}, extra={})
            slots.append(slot_values(sub))
        sd.extra[cache] = slots
    return [v[key] for v in sd.extra[cache] if key in v]


def step_loss(sd) -> float | None:
    """transformers' per-step ``loss``: each call's loss ÷ the accumulation steps, summed over a rank's
    calls, mean over ranks. dapo/cispo need each call's generation-round tokens (the profile's
    schedule reads them from the samples); null without them."""
    s = settings(sd.cfg)
    if s is None or not sd.n_seq:
        return None
    if float(s["beta"]) != 0.0 and not s["kl_in_reward"] and "ref_logp" not in sd.present:
        return None  # the KL term the loss added is not in the run
    if float(s["top_entropy_quantile"]) < 1.0 and "entropy" not in sd.present:
        return None  # the entropy mask needs the entropies
    g, ng = sd.groups(("rank", "micro_batch"))
    rank = sd.col("rank")
    world = len(np.unique(rank))
    pg, n = sd.col("sw.pg"), sd.col("sw.n")
    tokens = None
    if s["loss_type"] in WINDOW_NORMALIZED:
        ctx = sd.extra.get("schedule")
        tokens = ctx.round_tokens_of(sd.col("sample_id").astype(np.int64)) if ctx is not None else None
        if tokens is None and s["steps_per_generation"] == s["gradient_accumulation_steps"]:
            # no generation column: one round per step, whose completions are the step's rows (each once)
            tokens = np.full(sd.n_seq, sd.col("sw.len").sum())
        if tokens is None:
            return None
    per_rank: dict[int, float] = {}
    order = np.argsort(sd.col("sample_id"), kind="stable")  # a call's rows in the micro-batch's order
    for k in range(ng):
        sel = order[g[order] == k]
        if s["loss_type"] == "real":
            v = real_loss(s, sd.col("sw.d")[sel], n[sel], sd.col("sw.adv")[sel], sd.col("sw.kl")[sel])
        else:
            v = call_loss(s, pg[sel], n[sel], world, None if tokens is None else float(tokens[sel][0]))
        if v is None:
            return None
        r = int(rank[sel][0])
        per_rank[r] = per_rank.get(r, 0.0) + v / s["gradient_accumulation_steps"]
    return float(np.mean(list(per_rank.values())))


def _kl(sd) -> float | None:
    """``kl``: per loss call, or with kl_in_reward per generation round (the reward shaping's KL)."""
    s = settings(sd.cfg)
    if s is not None and s["kl_in_reward"]:
        return per_round(lambda r: sr.kl_mean(r, s))(sd)
    return _slot_mean("kl")(sd)


for _k, _doc in _DOCS.items():
    _req = {"rollout_correction": ("rollout_logp",), "kl": ("ref_logp",), "entropy": ("entropy",)}.get(_k.split("/")[0], ())
    register(Metric(f"swift/{_k}", _FAM, _doc, kind="custom", fn=_kl if _k == "kl" else _slot_mean(_k),
                    when=_ONLY.get(_k, _CLIP), config=("swift_args",), requires=_req, reads_samples=_k == "kl"))

register(Metric("swift/loss", _FAM, "ms-swift's loss (transformers' logged loss for one optimizer step): each call's "
                "loss as _compute_loss returns it (grpo/sapo mean over rows of the row's token mean, bnpo the "
                "call's token mean, dr_grpo ÷ rows·max_completion_length, dapo/cispo ÷ the generation round's "
                "tokens per rank × the accumulation steps) ÷ the accumulation steps, summed over a rank's calls, "
                "mean over ranks.", kind="custom", fn=step_loss, when=_WHEN, config=("swift_args",),
                reads_samples=True))
def _round_stat(fn):
    def stat(sd):
        s = settings(sd.cfg)
        return None if s is None else fn(sd, s)
    stat.__name__ = f"swift_rewards.{fn.__name__}"
    return per_round(stat)


_SHAPED = ("; with kl_in_reward (β ≠ 0) of the shaped reward, the total minus β·Σ_t (old_logp − ref_logp) over the "
           "completion (null when a completion of the round has no tokens at its step)")
for _k, _fn, _doc in (
        ("reward", sr.reward_mean, "ms-swift's reward: per generation round the mean of the total reward"),
        ("reward_std", sr.reward_std, "ms-swift's reward_std: per generation round the mean over prompt groups of the "
                                      "group's sample std of the total reward (scale_rewards batch: the round's std)"),
        ("frac_reward_zero_std", sr.frac_reward_zero_std, "ms-swift's frac_reward_zero_std: per generation round the "
         "share of prompt groups whose reward std is ≤ 1e-8 (per group whatever scale_rewards)")):
    register(Metric(f"swift/{_k}", _FAM, _doc + _SHAPED + ".", kind="custom", fn=_round_stat(_fn), when=_WHEN,
                    config=("swift_args",), source="samples", requires=("reward",), reads_samples=True))

register_family(Family("swift_grpo", page="policy"))
