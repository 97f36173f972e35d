"""OpenRLHF 0.11.2's actor status (``train/policy_loss``, ``train/kl`` ...), as its ``ppo_train`` reduces it.

Only for runs recorded with OpenRLHF's settings (their config has ``openrlhf_args``, written by
:func:`grpolens.integrations.openrlhf.openrlhf_config`: its own dotted argument names). Per loss
call (one micro-batch on one rank), with ``m`` the action mask, ``d = logp − old_logp`` and ``A``
the advantage (``openrlhf/models/loss.py`` ``PolicyLoss``):

    ppo   r = exp(clamp(d, ±20));  gspo  r = exp(Σ_t ld·m / max(Σ m, 1)) per sequence (ld = d, or
          logp − rollout_logp with IS correction on), × m
    s1 = r·A, s2 = clamp(r, 1 − ε_lo, 1 + ε_hi)·A;  L = −min(s1, s2)  (dual clip c: −max(min(s1, s2), c·A) for A < 0)
    IS correction (ppo only; ``algo.advantage.is_correction_*``): w = exp(old − rollout) per token,
          the gated statistic (the ratio, or binary KL / TV of the sampled token's probabilities;
          per token or the sequence's mean) outside [low, high]: mask → coefficient 0 (survivors w),
          clip → the statistic clamped; L ×= coefficient
    ppo_clip_ratio = mm[s2 < s1], ppo_kl = mm[−d], vllm_kl = mm[rollout − old], is_filter_ratio =
          mm[filtered] (token level) or the filtered rows / the call's rows (sequence level)

``aggregate_loss`` normalises each call's loss terms by the optimizer-step window
(``_optimizer_step_loss_norm``: the window's ``accumulated_gradient`` consecutive micro-batches of a
PPO epoch, on every rank): token mode Σ L·m / (N_w / gas) · dp, sample mode
Σ_{T>0} (Σ_t L·m / (T + 1e-8)) / (S_w / gas) · dp, with ``N_w`` the window's tokens and ``S_w``
its non-empty sequences over all ranks. ``policy_loss`` follows ``actor.loss_agg_mode`` (GSPO is
always sample mode); ``entropy_loss`` (the forward's entropy, when ``actor.entropy_coef`` is set)
and ``kl`` with ``algo.kl.use_loss`` (``compute_approx_kl(logp, ref)``, clamped to ±10) are token
mode. ``ppo_train`` then weighs every call's value by its action tokens (the 0-dim status) or its
rows (per-sample status: reward, return, lengths, and ``kl``/``logprobs_diff`` of the experience
maker without ``use_loss``), all-reduces over ranks and merges the step's micro-batches, every
epoch, the same way: Σ value·weight / Σ weight over every call of the step.
"""

from __future__ import annotations

import numpy as np

from grpolens.errors import UserError
from grpolens.functional import estimators as est
from grpolens.metrics.batch import TokenBatch
from grpolens.metrics.partials import producer
from grpolens.metrics.registry import Family, Metric, register, register_family

#: OpenRLHF's argument defaults (``cli/train_ppo_ray.py``) for what its actor status depends on
DEFAULTS = {
    "actor.policy_loss_type": "ppo", "actor.loss_agg_mode": "token-mean", "actor.eps_clip_low_high": [0.2, 0.2],
    "actor.dual_clip": None, "actor.entropy_coef": None, "algo.kl.use_loss": False, "algo.kl.init_coef": 0.01,
    "algo.kl.estimator": "k1", "algo.advantage.estimator": "gae", "algo.advantage.is_correction_level": "off",
    "algo.advantage.is_correction_mode": "mask", "algo.advantage.is_correction_gating": "ratio",
    "algo.advantage.is_correction_threshold": [0.5, 5.0], "rollout.n_samples_per_prompt": 1,
    "train.max_epochs": 1, "data.max_len": 2048, "reward.clip_range": [-10.0, 10.0],
    "accumulated_gradient": 1, "train.dynamic_batch_enable": False,
}
#: advantage estimators whose advantage is the return itself (no whitening after it)
_RETURN_IS_ADVANTAGE = ("group_norm", "rloo", "dr_grpo", "flash_reinforce")
_COLS = ("oa.n", "oa.pg", "oa.pg_tm", "oa.clip", "oa.kl", "oa.vllm", "oa.filt", "oa.ent", "oa.kld", "oa.lpd",
         "oa.okl", "oa.olpd", "oa.adv0")
_MERGE = {c: "sum" for c in _COLS} | {"oa.adv0": "first"}


def _bad(key: str, value, why: str) -> UserError:
    return UserError(f"config key 'openrlhf_args.{key}': {why}, got {value!r}")


def settings(cfg: dict) -> dict | None:
    """The run's OpenRLHF settings (``cfg["openrlhf_args"]`` over OpenRLHF's defaults); None when the run has none."""
    o = cfg.get("openrlhf_args")
    if not isinstance(o, dict):
        return None
    s = {**DEFAULTS, **o}
    choices = {"actor.policy_loss_type": ("ppo", "gspo"), "actor.loss_agg_mode": ("token-mean", "seq-mean-token-mean"),
               "algo.kl.estimator": ("k1", "k2", "k3"), "algo.advantage.is_correction_level": ("off", "token", "seq"),
               "algo.advantage.is_correction_mode": ("mask", "clip"),
               "algo.advantage.is_correction_gating": ("ratio", "binary_kl", "tv")}
    for k, allowed in choices.items():
        if s[k] not in allowed:
            raise _bad(k, s[k], f"must be one of {', '.join(allowed)}")
    if s["train.dynamic_batch_enable"]:
        raise _bad("train.dynamic_batch_enable", True, "the openrlhf profile reproduces the fixed micro-batch "
                   "schedule (dynamic batching normalises per replay-buffer batch)")
    for k in ("actor.eps_clip_low_high", "algo.advantage.is_correction_threshold", "reward.clip_range"):
        v = s[k]
        if not (isinstance(v, (list, tuple)) and len(v) in (1, 2) and all(isinstance(x, (int, float)) for x in v)):
            raise _bad(k, v, "must be a list of two numbers")
    if len(s["algo.advantage.is_correction_threshold"]) == 1:  # a single value is an upper bound only
        s["algo.advantage.is_correction_threshold"] = [0.0, s["algo.advantage.is_correction_threshold"][0]]
    for k in ("accumulated_gradient", "train.max_epochs", "rollout.n_samples_per_prompt", "data.max_len"):
        if isinstance(s[k], bool) or not isinstance(s[k], int) or s[k] < 1:
            raise _bad(k, s[k], "must be an integer >= 1")
    return s


def is_correction(s: dict) -> bool:
    """OpenRLHF's train/rollout IS correction runs (and logs ``vllm_kl``/``is_filter_ratio``) only for PPO."""
    return s["algo.advantage.is_correction_level"] != "off" and s["actor.policy_loss_type"] == "ppo"


def approx_kl(logp: np.ndarray, base: np.ndarray, estimator: str) -> np.ndarray:
    """``compute_approx_kl``'s forward value: k1 = x, k2 = x²/2, k3 = e^(−x') − 1 + x' with
    x' = max(x, −10), x = logp − base; every estimate clamped to ±10."""
    x = logp - base
    if estimator == "k1":
        v = x
    elif estimator == "k2":
        v = x * x / 2.0
    else:
        xc = np.maximum(x, -10.0)
        v = np.expm1(-xc) + xc
    return np.clip(v, -10.0, 10.0)


def _gate(b: TokenBatch, s: dict, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The IS correction's per-token coefficient and filtered indicator (per token, or per
    sequence broadcast to its tokens at sequence level)."""
    low, high = (float(x) for x in s["algo.advantage.is_correction_threshold"])
    seq = s["algo.advantage.is_correction_level"] == "seq"
    roll = np.where(m, b.cols["rollout_logp"], 0.0)
    old = np.where(m, b.old, 0.0)
    lw = old - roll
    w = np.exp(lw)
    gating = s["algo.advantage.is_correction_gating"]
    if gating == "ratio":
        stat = np.exp(b.broadcast(b.seq_sum(lw * m) / b.count(m))) if seq else w
    else:
        p = np.clip(np.exp(roll), 1e-6, 1 - 1e-6)
        q = np.clip(np.exp(old), 1e-6, 1 - 1e-6)
        stat = p * np.log(p / q) + (1 - p) * np.log((1 - p) / (1 - q)) if gating == "binary_kl" else np.abs(p - q)
        if seq:
            stat = b.broadcast(b.seq_sum(stat * m) / b.count(m))
    if s["algo.advantage.is_correction_mode"] == "clip":
        return np.clip(stat, low, high), (stat < low) | (stat > high)
    keep = (stat >= low) & (stat <= high)  # NaN (a sequence without tokens) is filtered, as in torch
    return np.where(keep, w, 0.0), ~keep


@producer("openrlhf_actor", merge=_MERGE)
def _openrlhf_actor(b: TokenBatch, cfg: dict) -> dict[str, np.ndarray]:
    s = settings(cfg)
    if s is None or b.n_seq == 0:
        return {c: np.zeros(b.n_seq) for c in _COLS}
    m = b.mask
    mf = m.astype(np.float64)
    n = b.count(m)
    A = np.where(m, b.adv, 0.0)
    zero = np.zeros(b.n_seq)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        d = np.where(m, b.logp - b.old, 0.0)
        lo, hi = (float(x) for x in s["actor.eps_clip_low_high"])
        corr = s["algo.advantage.is_correction_level"] != "off"
        if s["actor.policy_loss_type"] == "ppo":
            r = est.bounded_exp(d)
        else:
            ld = np.where(m, b.logp - b.cols["rollout_logp"], 0.0) if corr and b.has("rollout_logp") else d
            r = b.broadcast(np.exp(b.seq_sum(ld) / np.maximum(n, 1.0))) * mf
        s1, s2 = r * A, np.clip(r, 1 - lo, 1 + hi) * A
        L = -np.minimum(s1, s2)
        if s["actor.dual_clip"] is not None:
            L = -np.where(A < 0, np.maximum(np.minimum(s1, s2), float(s["actor.dual_clip"]) * A), np.minimum(s1, s2))
        vllm = filt = zero
        if is_correction(s) and b.has("rollout_logp"):
            coef, filtered = _gate(b, s, m)
            L = coef * L
            vllm = b.seq_sum(np.where(m, b.cols["rollout_logp"] - b.old, 0.0))
            # token level: Σ filtered·m; sequence level: the row's indicator (its tokens agree)
            filt = b.seq_sum(filtered * mf) if s["algo.advantage.is_correction_level"] == "token" else \
                b.seq_first(filtered).astype(np.float64)
        L = np.where(m, L, 0.0)
        pg = b.seq_sum(L)
        ent = b.seq_sum(np.where(m, b.cols["entropy"], 0.0)) if b.has("entropy") else zero
        kld = lpd = okl = olpd = zero
        if b.has("ref_logp") and float(s["algo.kl.init_coef"]) > 0:
            ref = b.cols["ref_logp"]
            if s["algo.kl.use_loss"]:  # the training forward against the reference
                kld = b.seq_sum(np.where(m, approx_kl(b.logp, ref, s["algo.kl.estimator"]), 0.0))
                lpd = b.seq_sum(np.where(m, b.logp - ref, 0.0))
            else:  # the experience maker's, on the old log-probs, per sample
                okl = b.seq_sum(np.where(m, approx_kl(b.old, ref, s["algo.kl.estimator"]), 0.0))
                olpd = b.seq_sum(np.where(m, b.old - ref, 0.0))
        adv0 = _first_masked(b, b.adv, m)
    return {"oa.n": n, "oa.pg": pg, "oa.pg_tm": np.where(n > 0, pg / (n + 1e-8), 0.0),
            "oa.clip": b.seq_sum(((s2 < s1) & m).astype(np.float64)), "oa.kl": b.seq_sum(-d), "oa.vllm": vllm,
            "oa.filt": filt, "oa.ent": ent, "oa.kld": kld, "oa.lpd": lpd, "oa.okl": okl, "oa.olpd": olpd,
            "oa.adv0": adv0}


def _first_masked(b: TokenBatch, x: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``x`` at each sequence's first masked token (NaN without one)."""
    idx = np.arange(b.n)
    first = b.seq_min(idx.astype(np.float64), m, empty=np.nan)
    ok = np.isfinite(first)
    out = np.full(b.n_seq, np.nan)
    out[ok] = x[first[ok].astype(np.int64)]
    return out


# ---------------------------------------------------------------------------------------------
# Reductions
# ---------------------------------------------------------------------------------------------

def loss_calls(rank: np.ndarray, micro_batch: np.ndarray, epochs: int, gas: int) -> list | None:
    """OpenRLHF's loss calls of a step: per (rank, micro_batch), its optimizer-step window
    ``(epoch, window)`` and its sequences' indices. Every rank runs the same number of
    micro-batches, ``epochs`` equal passes over its replay buffer, cut into windows of ``gas``
    micro-batches (the last one of an epoch may be shorter); None when the rows do not fit that."""
    rank, mb = np.asarray(rank, dtype=np.int64), np.asarray(micro_batch, dtype=np.int64)
    per_rank = {int(r): np.unique(mb[rank == r]) for r in np.unique(rank)}
    counts = {len(v) for v in per_rank.values()}
    if len(counts) != 1:
        return None
    k = counts.pop()
    if k % epochs:
        return None
    per_epoch = k // epochs
    calls = []
    for r, mbs in per_rank.items():
        for i, u in enumerate(mbs):
            calls.append((r, int(u), (i // per_epoch, (i % per_epoch) // gas), np.flatnonzero((rank == r) & (mb == u))))
    return calls


def _values(sd) -> dict[str, float]:
    key = ("openrlhf_actor", "values")
    if key in sd.extra:
        return sd.extra[key]
    s = settings(sd.cfg)
    out: dict[str, float] = {}
    sd.extra[key] = out
    if s is None or not sd.n_seq:
        return out
    calls = loss_calls(sd.col("rank"), sd.col("micro_batch"), s["train.max_epochs"], s["accumulated_gradient"])
    col = sd.col
    n = col("oa.n")
    tokens = n.sum()
    out["ppo_kl"] = col("oa.kl").sum() / tokens
    out["ppo_clip_ratio"] = col("oa.clip").sum() / tokens
    if is_correction(s) and "rollout_logp" in sd.present:
        out["vllm_kl"] = col("oa.vllm").sum() / tokens
    use_loss, with_ref = s["algo.kl.use_loss"], "ref_logp" in sd.present and float(s["algo.kl.init_coef"]) > 0
    if use_loss:
        out["logprobs_diff"] = col("oa.lpd").sum() / tokens if with_ref else 0.0
    else:  # the experience maker's per-sample means, each row weighed once
        with np.errstate(invalid="ignore", divide="ignore"):
            out["kl"] = float(np.mean(col("oa.okl") / n)) if with_ref else 0.0
            out["logprobs_diff"] = float(np.mean(col("oa.olpd") / n)) if with_ref else 0.0
    if calls is None:
        sd.extra[key] = {k: float(v) for k, v in out.items()}
        return sd.extra[key]
    dp = len({c[0] for c in calls})
    gas = s["accumulated_gradient"]
    win_tok: dict = {}
    win_seq: dict = {}
    for _, _, w, idx in calls:
        win_tok[w] = win_tok.get(w, 0.0) + n[idx].sum()
        win_seq[w] = win_seq.get(w, 0.0) + (n[idx] > 0).sum()
    token_mode = s["actor.loss_agg_mode"] == "token-mean" and s["actor.policy_loss_type"] == "ppo"
    acc = {"policy_loss": 0.0, "entropy_loss": 0.0, "kl": 0.0, "is_filter_ratio": 0.0}
    for _, _, w, idx in calls:
        nt = n[idx].sum()
        norm_tok, norm_seq = win_tok[w] / gas, win_seq[w] / gas
        if token_mode:
            pg = col("oa.pg")[idx].sum() / norm_tok * dp
        else:
            pg = col("oa.pg_tm")[idx].sum() / norm_seq * dp
        acc["policy_loss"] += pg * nt
        acc["entropy_loss"] += col("oa.ent")[idx].sum() / norm_tok * dp * nt
        acc["kl"] += col("oa.kld")[idx].sum() / norm_tok * dp * nt
        if s["algo.advantage.is_correction_level"] == "seq":
            acc["is_filter_ratio"] += col("oa.filt")[idx].sum() / len(idx) * nt
        else:
            acc["is_filter_ratio"] += col("oa.filt")[idx].sum()
    out["policy_loss"] = acc["policy_loss"] / tokens
    if s["actor.entropy_coef"] is not None and "entropy" in sd.present:
        out["entropy_loss"] = acc["entropy_loss"] / tokens
    if use_loss:
        out["kl"] = acc["kl"] / tokens if with_ref else 0.0
    if is_correction(s) and "rollout_logp" in sd.present:
        out["is_filter_ratio"] = acc["is_filter_ratio"] / tokens
    sd.extra[key] = {k: float(v) for k, v in out.items()}
    return sd.extra[key]


def _per_row(sd, name: str) -> np.ndarray | None:
    """A per-sample value for each trained row (a sequence of a loss call: every epoch counts)."""
    df = sd.samples
    if df is None or df.height == 0:
        return None
    ids = df["sample_id"].to_numpy()
    order = np.argsort(ids, kind="stable")
    pos = np.searchsorted(ids[order], np.asarray(sd.col("sample_id"), dtype=ids.dtype))
    pos = np.minimum(pos, len(ids) - 1)
    found = ids[order][pos] == np.asarray(sd.col("sample_id"), dtype=ids.dtype)
    if not found.all():
        return None
    rows = order[pos]
    s = settings(sd.cfg)
    with np.errstate(invalid="ignore"):
        if name == "reward":
            x = _sample_col(df, "reward")
        elif name == "response_length":
            x = _sample_col(df, "completion_len")
        elif name == "truncated":
            x = _sample_col(df, "truncated")
        elif name in ("total_length", "response_clip_ratio"):
            p, c = _sample_col(df, "prompt_len"), _sample_col(df, "completion_len")
            x = None if p is None or c is None else p + c
            if x is not None and name == "response_clip_ratio":
                x = (x >= s["data.max_len"]).astype(np.float64)
        elif name == "group_reward_std":
            x = _group_std(df)
        elif name == "return":
            return _returns(sd, df, rows, s)
        else:
            raise KeyError(name)
    return None if x is None else x[rows]


def _sample_col(df, name: str) -> np.ndarray | None:
    if name not in df.columns:
        return None
    return df[name].cast(float).to_numpy().astype(np.float64)


def _group_std(df) -> np.ndarray | None:
    """Per sample, the std of its prompt group's float32 rewards (torch.std: Bessel, NaN for one)."""
    r = _sample_col(df, "reward")
    if r is None or "group_id" not in df.columns:
        return None
    r = r.astype(np.float32).astype(np.float64)
    _, inv = np.unique(df["group_id"].to_numpy(), return_inverse=True)
    out = np.empty(len(r))
    for g in range(inv.max() + 1):
        sel = inv == g
        out[sel] = np.std(r[sel], ddof=1) if sel.sum() > 1 else np.nan
    return out


def _returns(sd, df, rows: np.ndarray, s: dict) -> np.ndarray | None:
    """``info["return"]``: Σ over the row of ``compute_reward``'s per-token reward: the shaped
    reward clamped to ``reward.clip_range`` minus ``kl_coef``·Σ KL of the experience maker. For the
    estimators whose advantage is that return (no whitening), the advantage at the first action token."""
    est = s["algo.advantage.estimator"]
    if est in _RETURN_IS_ADVANTAGE:
        return sd.col("oa.adv0")
    r = _sample_col(df, "reward")
    if r is None or est not in ("reinforce", "reinforce_baseline"):
        return None  # gae: the critic's values are not in the run
    r = r.astype(np.float32).astype(np.float64)
    if est == "reinforce_baseline":
        _, inv = np.unique(df["group_id"].to_numpy(), return_inverse=True)
        means = np.bincount(inv, weights=r) / np.bincount(inv)
        r = r - means[inv]
    lo, hi = (float(x) for x in s["reward.clip_range"])
    kl_coef = float(s["algo.kl.init_coef"]) if not s["algo.kl.use_loss"] else 0.0
    return np.clip(r, lo, hi)[rows] - max(kl_coef, 0.0) * sd.col("oa.okl")


def _actor(name: str):
    def fn(sd):
        return _values(sd).get(name)
    fn.__name__ = f"openrlhf_actor[{name}]"
    return fn


def _sample_mean(name: str):
    def fn(sd):
        x = _per_row(sd, name)
        return None if x is None or not len(x) else float(np.mean(x))
    fn.__name__ = f"openrlhf_actor.per_sample[{name}]"
    return fn


_FAM = "openrlhf_actor"
_WHEN = lambda cfg: isinstance(cfg.get("openrlhf_args"), dict)  # noqa: E731
_CONFIG = ("openrlhf_args",)
_ACTOR_DOCS = {
    "policy_loss": "OpenRLHF's policy loss (PolicyLoss: PPO/GSPO clip, dual clip, IS correction) per loss call aggregated with the optimizer-step window's normaliser (_optimizer_step_loss_norm: tokens or non-empty sequences of the window's micro-batches over all ranks ÷ accumulated_gradient, × dp), then token-weighted over the step's calls.",
    "entropy_loss": "OpenRLHF's entropy loss: the forward's entropy, token-mode aggregate_loss with the window's normaliser, token-weighted over calls (when actor.entropy_coef is set).",
    "kl": "OpenRLHF's kl: with algo.kl.use_loss, compute_approx_kl(logp, ref_logp) (clamped ±10) token-mode aggregate_loss with the window's normaliser, token-weighted; without, the experience maker's per-sample mean of compute_approx_kl(old_logp, ref_logp), sample-weighted. 0.0 without a reference (init_coef 0).",
    "logprobs_diff": "OpenRLHF's logprobs_diff: with use_loss the token mean of logp − ref_logp; without, the mean over rows of each sample's mean old_logp − ref_logp. 0.0 without a reference.",
    "ppo_clip_ratio": "OpenRLHF's ppo_clip_ratio: the token mean of surr2 < surr1 (GSPO: the sequence ratio broadcast to its tokens), token-weighted over calls: Σ / Σ m over the step.",
    "ppo_kl": "OpenRLHF's ppo_kl: the token mean of old_logp − logp over the step.",
    "vllm_kl": "OpenRLHF's vllm_kl: the token mean of rollout_logp − old_logp over the step; logged only with the IS correction on (PPO).",
    "is_filter_ratio": "OpenRLHF's is_filter_ratio: the IS correction's filtered share, per token (token level) or per row of a call (sequence level) weighted by the call's tokens; logged only with the IS correction on (PPO).",
}
_SAMPLE_DOCS = {
    "reward": "OpenRLHF's per-sample reward status: the mean over every trained row (each loss call's samples, every epoch) of the sample's reward.",
    "return": "OpenRLHF's return: Σ of compute_reward's per-token reward (the shaped reward clamped to reward.clip_range, minus kl_coef·Σ KL in the reward); for group_norm/rloo/dr_grpo/flash_reinforce the advantage at the first action token; mean over trained rows.",
    "group_reward_std": "OpenRLHF's group_reward_std: each sample's prompt-group reward std (torch.std), mean over trained rows (logged when n_samples_per_prompt > 1).",
    "response_clip_ratio": "OpenRLHF's response_clip_ratio: rows whose total length (prompt_len + completion_len) reaches data.max_len, mean over trained rows.",
    "response_length": "OpenRLHF's response_length status: completion_len (OpenRLHF's span from the first to the last action token), mean over trained rows.",
    "truncated": "OpenRLHF's truncated status: the share of trained rows whose generation hit the length limit.",
    "total_length": "OpenRLHF's total_length status: prompt_len + completion_len (the tokens of the observation), mean over trained rows.",
}
_ONLY = {
    "entropy_loss": lambda cfg: _WHEN(cfg) and settings(cfg)["actor.entropy_coef"] is not None,
    "vllm_kl": lambda cfg: _WHEN(cfg) and is_correction(settings(cfg)),
    "is_filter_ratio": lambda cfg: _WHEN(cfg) and is_correction(settings(cfg)),
    "group_reward_std": lambda cfg: _WHEN(cfg) and settings(cfg)["rollout.n_samples_per_prompt"] > 1,
}
for _k, _doc in _ACTOR_DOCS.items():
    register(Metric(f"openrlhf/{_k}", _FAM, _doc, kind="custom", fn=_actor(_k), when=_ONLY.get(_k, _WHEN),
                    config=_CONFIG))
for _k, _doc in _SAMPLE_DOCS.items():
    register(Metric(f"openrlhf/{_k}", _FAM, _doc, kind="custom", fn=_sample_mean(_k), when=_ONLY.get(_k, _WHEN),
                    config=_CONFIG, reads_samples=True))

register_family(Family("openrlhf_actor", page="policy"))
