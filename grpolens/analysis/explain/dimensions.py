"""The dimensions an explanation decomposes along: for each, an integer key per unit (token or
sequence) of a step, and how a key reads.

Token-level dimensions (``token_id``, ``position``) need a metric whose terms are per token; the
others are properties of a sequence and apply to both kinds of unit.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from grpolens.analysis.explain.terms import StepTerms
from grpolens.metrics.kl import BUCKET_LABELS, bucket_of

#: Every dimension, in the order they are shown.
DIMENSIONS = ("token_id", "completion", "group", "position", "length", "rank", "micro_batch", "outcome")
TOKEN_ONLY = ("token_id", "position")

#: Position buckets: powers of two (0-7, 8-15, 16-31, ... 1024+).
_POS_EDGES = np.array([8, 16, 32, 64, 128, 256, 512, 1024])
POSITION_LABELS = ("0-7",) + tuple(f"{lo}-{hi - 1}" for lo, hi in zip(_POS_EDGES[:-1], _POS_EDGES[1:])) + ("1024+",)

#: Outcome: the completion's reward sign, and its group's (all correct / all wrong / mixed), a
#: completion counting as correct when its reward is > 0.
_SIGNS = ("reward > 0", "reward = 0", "reward < 0", "no reward")
_GROUPS = ("all correct", "all wrong", "mixed", "group unknown")
OUTCOME_LABELS = tuple(f"{s}, {g}" for s in _SIGNS for g in _GROUPS)


def position_bucket(pos: np.ndarray) -> np.ndarray:
    return np.searchsorted(_POS_EDGES, pos, side="right")


def outcome_codes(reward: np.ndarray, group: np.ndarray) -> np.ndarray:
    """Per sequence: index into :data:`OUTCOME_LABELS`."""
    sign = np.select([reward > 0, reward == 0, reward < 0], [0, 1, 2], 3)
    gcode = np.full(len(reward), 3)
    known = (group >= 0) & np.isfinite(reward)
    if known.any():
        ids, inv = np.unique(group[known], return_inverse=True)
        correct = (reward[known] > 0).astype(np.int64)
        n_ok = np.bincount(inv, correct, len(ids))
        n = np.bincount(inv, minlength=len(ids))
        per_group = np.where(n_ok == n, 0, np.where(n_ok == 0, 1, 2))
        gcode[known] = per_group[inv]
    return sign * len(_GROUPS) + gcode


def seq_keys(t: StepTerms, dim: str) -> np.ndarray | None:
    """Per sequence of the step, the key of ``dim`` (None: the step cannot say)."""
    s = t.sd.seqs
    if dim == "completion":
        return np.asarray(s["sample_id"], dtype=np.int64)
    if dim in ("rank", "micro_batch"):
        return np.asarray(s[dim], dtype=np.int64)
    if dim == "length":
        return bucket_of(np.asarray(s["seq_tokens"], dtype=np.float64)).astype(np.int64)
    if dim == "group":
        return None if t.group is None or not (t.group >= 0).any() else t.group
    if dim == "outcome":
        if t.reward is None or not np.isfinite(t.reward).any():
            return None
        return outcome_codes(t.reward, t.group).astype(np.int64)
    return None


def token_keys(t: StepTerms, dim: str) -> np.ndarray | None:
    """Per token of the step, the key of ``dim`` (sequence dimensions broadcast to their tokens)."""
    tok = t.tokens
    if dim == "token_id":
        return None if not (tok["token_id"] >= 0).any() else np.asarray(tok["token_id"], dtype=np.int64)
    if dim == "position":
        return position_bucket(tok["pos"]).astype(np.int64)
    per_seq = seq_keys(t, dim)
    return None if per_seq is None else per_seq[tok["seq"]]


def labeller(dim: str, decode: Callable[[int], str] | None) -> Callable[[int], str]:
    """How a key of ``dim`` reads (untrusted text is made printable by the renderer)."""
    if dim == "token_id":
        return (lambda k: decode(k) if decode is not None and k >= 0 else f"⟨{k}⟩")
    if dim == "position":
        return lambda k: f"positions {POSITION_LABELS[k]}"
    if dim == "length":
        return lambda k: f"{BUCKET_LABELS[k]} tokens"
    if dim == "outcome":
        return lambda k: OUTCOME_LABELS[k]
    if dim == "completion":
        return lambda k: f"sample {k}"
    if dim == "group":
        return lambda k: f"group {k}" if k >= 0 else "group unknown"
    return lambda k: f"{dim.replace('_', '-')} {k}"


def json_key(dim: str, k: int):
    """The key as the --json object carries it: ids as integers, buckets and outcomes as text."""
    if dim == "position":
        return POSITION_LABELS[k]
    if dim == "length":
        return BUCKET_LABELS[k]
    if dim == "outcome":
        return OUTCOME_LABELS[k]
    return int(k)


def sample_keys(df) -> dict[str, np.ndarray]:
    """Per row of a samples table (completions generated at a step), the keys of the dimensions
    that are a completion's properties: completion, group, rank, length, outcome."""
    out = {"completion": df["sample_id"].to_numpy().astype(np.int64)}
    if "group_id" in df.columns:
        out["group"] = df["group_id"].fill_null(-1).to_numpy().astype(np.int64)
    if "rank" in df.columns:
        out["rank"] = df["rank"].to_numpy().astype(np.int64)
    if "completion_len" in df.columns:
        out["length"] = bucket_of(df["completion_len"].cast(float).fill_null(0.0).to_numpy()).astype(np.int64)
    if "reward" in df.columns and df["reward"].null_count() < df.height:
        reward = df["reward"].cast(float).fill_null(float("nan")).to_numpy()
        out["outcome"] = outcome_codes(reward, out.get("group", np.full(df.height, -1))).astype(np.int64)
    return out
