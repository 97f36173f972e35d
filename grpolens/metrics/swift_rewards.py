"""ms-swift 4.6.0's reward metrics per generation round (``GRPOTrainer._compute_advantages`` and
``swift/rl_core/advantage.py``'s ``compute_reward_metrics``), from a round's samples.

``reward`` is the mean of the round's total rewards, ``reward_std`` the mean over prompt groups of
each group's sample std (``scale_rewards`` batch: the round's sample std; 0.0 with one completion
per prompt), ``frac_reward_zero_std`` the share of groups whose std is ``isclose`` to 0 (≤ 1e-8)
whatever ``scale_rewards`` (1.0 with one completion per prompt; TRL's rule uses the batch std under
``batch``). With ``kl_in_reward`` and β ≠ 0 all three are of the shaped reward, the total minus
β·Σ_t (old_logp − ref_logp) over the completion's tokens, and ``kl`` is the round's mean of that sum.
"""

from __future__ import annotations

import numpy as np


def _shaping(s: dict) -> bool:
    return bool(s["kl_in_reward"]) and float(s["beta"]) != 0.0


def completion_kl(sd) -> np.ndarray | None:
    """Σ_t (old_logp − ref_logp) of each of the round's completions, from the step's sequence
    partials (the first loss call of each); None when one has no tokens at this step."""
    df = sd.samples
    ids = np.asarray(sd.col("sample_id"), dtype=np.int64)
    if df is None or "ref_logp" not in sd.present or not len(ids):
        return None
    uniq, first = np.unique(ids, return_index=True)
    want = df["sample_id"].to_numpy().astype(np.int64)
    pos = np.minimum(np.searchsorted(uniq, want), len(uniq) - 1)
    if not np.array_equal(uniq[pos], want):
        return None
    return np.asarray(sd.col("sw.okl"), dtype=np.float64)[first[pos]]


def shaped(sd, s: dict) -> np.ndarray | None:
    """The round's rewards as ms-swift's reward metrics see them (None without samples or rewards)."""
    df = sd.samples
    if df is None or df.height == 0 or "reward" not in df.columns:
        return None
    r = df["reward"].cast(float).fill_null(float("nan")).to_numpy().astype(np.float64)
    if not _shaping(s):
        return r
    kl = completion_kl(sd)
    return None if kl is None else r - float(s["beta"]) * kl


def _groups(sd, r: np.ndarray) -> list[np.ndarray]:
    _, inv = np.unique(sd.samples["group_id"].to_numpy(), return_inverse=True)
    return [r[inv == k] for k in range(inv.max() + 1)]


def reward_mean(sd, s: dict) -> float | None:
    r = shaped(sd, s)
    return None if r is None else float(np.mean(r))


def reward_std(sd, s: dict) -> float | None:
    r = shaped(sd, s)
    if r is None:
        return None
    if s["scale_rewards"] == "batch":
        return float(np.std(r, ddof=1)) if len(r) > 1 else 0.0
    if s["num_generations"] <= 1:
        return 0.0
    return float(np.mean([np.std(x, ddof=1) for x in _groups(sd, r)]))


def frac_reward_zero_std(sd, s: dict) -> float | None:
    r = shaped(sd, s)
    if r is None:
        return None
    if s["num_generations"] <= 1:
        return 1.0
    return float(np.mean([np.std(x, ddof=1) <= 1e-8 for x in _groups(sd, r)]))


def kl_mean(sd, s: dict) -> float | None:
    """``kl`` with kl_in_reward: the round's nanmean of the completions' Σ_t (old − ref)."""
    kl = completion_kl(sd) if sd.samples is not None and sd.samples.height else None
    return None if kl is None or np.isnan(kl).all() else float(np.nanmean(kl))


def func_std(sd, column: str) -> float | None:
    """``rewards/<name>/std``: the sample std of the function's scored (non-NaN) values in the round,
    0.0 for a single one, nothing when it scored none (ms-swift then logs no key)."""
    df = sd.samples
    if df is None or column not in df.columns:
        return None
    x = df[column].cast(float).fill_null(float("nan")).to_numpy().astype(np.float64)
    x = x[~np.isnan(x)]
    if not len(x):
        return None
    return float(np.std(x, ddof=1)) if len(x) > 1 else 0.0
