"""xtuner's RL trainer: per-pack (rank, micro-batch) token means Σ / (Σ m + 1e-8), averaged over packs
with a valid token; its train-policy values with the log-ratio clamped to ±20 and 0.0 when no token
is valid; its rollout-IS module's ``mismatch/`` keys, merged over packs."""

import numpy as np

from grpolens.functional import rollout_is as ris
from grpolens.functional.estimators import LOG_RATIO_BOUND
from grpolens.functional.rollout_is import ISConfig
from grpolens.metrics import policy
from grpolens.metrics.profile import Profile, register_profile
from grpolens.metrics.rollout_is import step_rows, sub_rows

#: xtuner's rollout-IS module logs under this prefix
PREFIX = "mismatch/"

_ROLLOUT = {
    "rollout_is/raw/mean": "rollout_is_mean",
    "rollout_is/raw/min": "rollout_is_min",
    "rollout_is/raw/max": "rollout_is_max",
    "rollout_is/raw/fraction_high": "rollout_is_ratio_fraction_high",
    "rollout_is/raw/fraction_low": "rollout_is_ratio_fraction_low",
    "rollout_is/raw/seq_mean": "rollout_is_seq_mean",
    "rollout_is/raw/seq_std": "rollout_is_seq_std",
    "rollout_is/raw/seq_min": "rollout_is_seq_min",
    "rollout_is/raw/seq_max": "rollout_is_seq_max",
    "rollout_is/raw/seq_max_deviation": "rollout_is_seq_max_deviation",
    "rollout_is/raw/seq_fraction_high": "rollout_is_seq_fraction_high",
    "rollout_is/raw/seq_fraction_low": "rollout_is_seq_fraction_low",
    "rollout_is/clamped/std": "rollout_is_std",
    "rollout_is/clamped/ess": "rollout_is_eff_sample_size",
    "rollout_is/mask/token_fraction": "rollout_is_masked_fraction",
    "rollout_is/mask/seq_fraction": "rollout_is_seq_masked_fraction",
    "rollout_is/veto/seq_fraction": "rollout_is_veto_fraction",
    "rollout_is/veto/catastrophic_token_fraction": "rollout_is_catastrophic_token_fraction",
    "mismatch/kl_k1": "mismatch_kl",
    "mismatch/kl_k3": "mismatch_k3_kl",
    "mismatch/abs_logp_diff": "mismatch_logprob_abs_diff",
    "mismatch/training_ppl": "mismatch_training_ppl",
    "mismatch/training_log_ppl": "mismatch_training_log_ppl",
    "mismatch/rollout_ppl": "mismatch_rollout_ppl",
    "mismatch/rollout_log_ppl": "mismatch_rollout_log_ppl",
    "mismatch/log_ppl_diff": "mismatch_log_ppl_diff",
    "mismatch/log_ppl_abs_diff": "mismatch_log_ppl_abs_diff",
    "mismatch/log_ppl_diff_max": "mismatch_log_ppl_diff_max",
    "mismatch/log_ppl_diff_min": "mismatch_log_ppl_diff_min",
    "mismatch/ppl_ratio": "mismatch_ppl_ratio",
}

_POLICY = {
    "policy/k1": "reduced_train_policy_kl1",
    "policy/approx_kl": "reduced_train_policy_kl3",
    "policy/ratio_abs_dev_mean": "reduced_train_policy_ratio_abs_dev_mean",
    "policy/ratio_max": "reduced_train_policy_ratio_max",
    "policy/ratio_min": "reduced_train_policy_ratio_min",
    "clip/ratio_below": "reduced_train_policy_clip_frac_low",
    "clip/ratio_above": "reduced_train_policy_clip_frac_high",
}

NAMES = {**_POLICY, **{k: PREFIX + v for k, v in _ROLLOUT.items()}}


# ---------------------------------------------------------------------------------------------
# Its rollout-IS module's values: per pack, then merged over packs
# ---------------------------------------------------------------------------------------------

def xtuner_pack(p: dict, c: ISConfig) -> tuple[dict, dict]:
    """The reference's values for one pack: (mismatch dict or {} if invalid, IS dict or {})."""
    f = ris._f
    mm: dict[str, float | None] = {}
    nf = ris._col(p, "mm.n").sum()
    if nf > 0:  # the pack is one row: token means over the whole pack
        lo, lr = ris._col(p, "mm.old").sum() / nf, ris._col(p, "mm.roll").sum() / nf
        d = lr - lo
        mm = {"mismatch/training_ppl": f(np.exp(-lo)), "mismatch/training_log_ppl": f(-lo),
              "mismatch/rollout_ppl": f(np.exp(-lr)), "mismatch/rollout_log_ppl": f(-lr),
              "mismatch/kl_k1": f(-ris._col(p, "mm.d").sum() / nf), "mismatch/kl_k3": f(ris._col(p, "mm.k3").sum() / nf),
              "mismatch/log_ppl_diff": f(d), "mismatch/log_ppl_abs_diff": f(abs(d)),
              "mismatch/log_ppl_diff_max": f(d), "mismatch/log_ppl_diff_min": f(d),
              "mismatch/ppl_ratio": f(np.exp(d)), "mismatch/abs_logp_diff": f(ris._col(p, "mm.absd").sum() / nf)}
    if not (c.configured and c.has_band):
        return mm, {}
    sv = ris.seq_view(p, c)
    n = sv.n
    N = n.sum()
    if N == 0:
        return mm, {}
    col = lambda name: ris._col(p, name)  # noqa: E731
    ok = n > 0
    U, Lo = c.upper, c.lower
    logU = np.log(U)
    with np.errstate(divide="ignore"):
        logLo = np.log(Lo) if Lo is not None else -np.inf
    o: dict[str, float | None] = {
        "veto/seq_fraction": f(np.sum(sv.vetoed & ok) / ok.sum()),
        "veto/catastrophic_token_fraction": f(col("ris.cat").sum() / N),
    }
    if c.level == "token":
        w_sum = col("ris.tw").sum()
        o["raw/max"], o["raw/min"] = f(col("ris.twmax")[ok].max()), f(col("ris.twmin")[ok].min())
        o["raw/fraction_high"], o["raw/fraction_low"] = f(col("ris.thi").sum() / N), f(col("ris.tlo").sum() / N)
        c1, c2 = col("ris.tc").sum(), col("ris.tc2").sum()
    else:
        X = sv.X  # every row of the pack, empty ones included (their X is 0)
        w_sum = (n * sv.w).sum()
        o["raw/max"], o["raw/min"] = f(np.exp(min(X.max(), LOG_RATIO_BOUND))), f(np.exp(X.min()))
        if c.level == "sequence":
            o["raw/fraction_high"], o["raw/fraction_low"] = f(np.mean(X > logU)), f(np.mean(X < logLo))
        else:
            o["raw/fraction_high"], o["raw/fraction_low"] = f((n * (X > logU)).sum() / N), f((n * (X < logLo)).sum() / N)
        cw = np.clip(sv.w, Lo or 0.0, U)
        c1, c2 = (n * cw).sum(), (n * cw * cw).sum()
    o["raw/mean"] = f(w_sum / N)
    m = c1 / N
    o["clamped/std"] = float(np.sqrt(max(0.0, c2 / N - m * m))) if N > 1 else 0.0
    o["clamped/ess"] = f(1.0 / ((c2 / N) / (m + 1e-8) ** 2))
    ris._seq_stats(sv.w[ok], Lo, U, "raw/", o, undefined=0.0)
    if c.masks:
        if c.level == "token":
            o["mask/token_fraction"] = f(col("ris.tband").sum() / N)
            o["mask/seq_fraction"] = f(np.mean(col("ris.tband") > 0))  # over every row of the pack
        else:
            o["mask/token_fraction"] = f((n * sv.band_rej).sum() / N)
            o["mask/seq_fraction"] = f(np.mean(sv.band_rej))
    return mm, {f"rollout_is/{k}": v for k, v in o.items()}


def xtuner_summary(sd) -> dict[str, float | None]:
    p = step_rows(sd)
    if p is None:
        return {}
    c = ISConfig.from_cfg(sd.cfg)
    g, ng = sd.groups(("rank", "micro_batch"))
    mms, iss = [], []
    for k in range(ng):
        mm, o = xtuner_pack(sub_rows(p, g == k), c)
        mms.append(mm)
        iss.append(o)
    out: dict[str, float | None] = {}
    # what the profile logs of each part, and how packs merge: by its names (max/min/mean)
    logged = sd.profile.names
    mm_keys = {k: v for k, v in logged.items() if k.startswith("mismatch/")}
    is_keys = {k: v for k, v in logged.items() if k.startswith("rollout_is/")}
    for packs, keys in ((mms, mm_keys), (iss, is_keys if c.configured and c.has_band else {})):
        valid = [d for d in packs if d]
        for key, name in keys.items():
            vals = [d[key] for d in valid if d.get(key) is not None]
            if not valid:
                out[key] = 0.0
            elif "max" in name:  # each valid pack holds a finite value for every max/min key
                out[key] = max(vals)
            elif "min" in name:
                out[key] = min(vals)
            else:
                out[key] = sum(vals) / len(valid)
    return out


PROFILE = register_profile(Profile(
    "xtuner", "xtuner's train-policy and rollout-IS keys", reference="xtuner's rollout-IS module",
    token_mean="pack_mean", extrema="max/min over packs", empty="valid = false",
    names=NAMES,
    reductions={
        # log-ratio clamped to ±20 before k3 and before the ratio extremes
        "policy/approx_kl": policy.token_mean("policy.k3_c20.sum", "policy.n"),
        "policy/ratio_max": policy.ratio_extreme("max", clamp=LOG_RATIO_BOUND),
        "policy/ratio_min": policy.ratio_extreme("min", clamp=LOG_RATIO_BOUND),
    },
    # its train-policy values are 0.0 when no token of the step is valid
    zero_when_empty=frozenset(_POLICY), zero_needs_sequences=True,
    rollout_is_summary=xtuner_summary,
))
