"""From a step to the tokens behind it: per-token scores, mergeable top-K, completion context.

Scores (higher = worse), over masked tokens whose inputs are finite:

``kl``         k3 estimate of KL(π‖π_ref) at the token: e^x − x − 1, x = ref_logp − logp
``mismatch``   |old_logp − rollout_logp|: trainer vs inference engine
``ratio``      |logp − old_logp|: how far the policy moved from the behaviour policy
``entropy``    the policy entropy at the position
``adv_ratio``  |A|·|π/π_old − 1|: ratio drift weighted by how much the token matters

Top-K is mergeable: the K best of a union are among the K best of each part, so each shard
keeps its own K and a step keeps the K best of its shards' rows. "Best" is one total order
everywhere -- score descending, then the position keys -- so equal scores are no exception.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import polars as pl

from grpolens.functional import estimators as est
from grpolens.functional.jit import inline, kernel
from grpolens.metrics.batch import TokenBatch
from grpolens.metrics.engine import Visitor, visitor
from grpolens.metrics.kl import kl_k3, kl_valid
from grpolens.run.reader import RunReader
from grpolens.run.step_table import write_step_table

SCORES = {
    "kl": ("ref_logp",),
    "mismatch": ("rollout_logp",),
    "ratio": ("old_logp",),
    "entropy": ("entropy",),
    "adv_ratio": ("old_logp",),
}
DEFAULT_TOP_K = 32
TOP_COLUMNS = ("step", "rank", "micro_batch", "sample_id", "pos")


def token_scores(b: TokenBatch, by: str, masked_only: bool = True) -> np.ndarray | None:
    """Per-token score ``by``: NaN where an input is not finite, and (``masked_only``, the
    default) where the token does not count in the loss. None when the run lacks an input."""
    scored = _scores(b, by, masked_only)
    if scored is None:
        return None
    s, keep = scored
    return np.where(keep, s, np.nan)


def _scores(b: TokenBatch, by: str, masked_only: bool = True) -> tuple[np.ndarray, np.ndarray] | None:
    """(raw score per token, which tokens have one): the scores of :func:`token_scores` before
    the tokens without one are set to NaN."""
    inputs = _inputs(b, by, masked_only)
    if inputs is None:
        return None
    s, keep = np.empty(b.n), np.empty(b.n, dtype=bool)
    _fill_scores(*inputs, s, keep)
    return s, keep


def _inputs(b: TokenBatch, by: str, masked_only: bool = True) -> tuple | None:
    """(formula code of :func:`_score`, its two input arrays, the tokens that may have a score):
    what the kernels below read for score ``by``; None when the run lacks an input."""
    if by not in SCORES:
        raise ValueError(f"unknown score {by!r}; choose one of {', '.join(SCORES)}")
    if not b.has(*SCORES[by]):
        return None
    c = b.cols
    valid = b.mask if masked_only else np.ones(b.n, dtype=bool)
    if by == "kl":
        if masked_only:
            # the kl family's per-token k3, which its producer already made for this batch: the same
            # values on its valid tokens (masked, both log-probs finite); on the other masked tokens
            # the score is not finite (x = ±inf or NaN), so none of them has one either way
            s = kl_k3(b)
            return _AS_IS, s, s, kl_valid(b)
        with np.errstate(all="ignore"):
            s = est.k3(c["ref_logp"] - b.logp)  # the kl family's formula (accurate for small x)
        return _AS_IS, s, s, valid
    if by == "mismatch":
        return _ABS_DIFF, b.old, c["rollout_logp"], valid
    if by == "ratio":
        return _ABS, b.log_ratio, b.log_ratio, valid
    if by == "entropy":
        return _AS_IS, c["entropy"], c["entropy"], valid
    return _ADV_RATIO, b.adv, b.ratio, valid


_AS_IS, _ABS, _ABS_DIFF, _ADV_RATIO = range(4)


@inline
def _score(code, x, y):
    """One token's score from its inputs: x, |x|, |x − y| (mismatch), or |A|·|ratio − 1|."""
    if code == 1:
        return abs(x)
    if code == 2:
        return abs(x - y)
    if code == 3:
        return abs(x) * abs(y - 1.0)
    return x


@kernel
def _fill_scores(code, x, y, valid, s, keep):
    """Every token's score into ``s``, and whether it has one (valid and finite) into ``keep``."""
    for i in range(len(x)):
        s[i] = _score(code, x[i], y[i])
        keep[i] = valid[i] and np.isfinite(s[i])


def token_frame(b: TokenBatch, idx: np.ndarray) -> dict[str, np.ndarray]:
    """The stored columns (plus the ratio) of the tokens at ``idx``."""
    out = {k: b.cols[k][idx] for k in TOP_COLUMNS}
    out["token_id"] = b.cols["token_id"][idx] if "token_id" in b.present else np.full(len(idx), -1)
    for k in ("logp", "old_logp", "ref_logp", "rollout_logp", "entropy", "advantage"):
        out[k] = b.cols[k][idx] if (k in b.present or k in ("logp", "advantage")) else np.full(len(idx), np.nan)
    out["ratio"] = b.ratio[idx]
    out["mask"] = b.mask[idx]
    return out


def top_k(b: TokenBatch, by: str, k: int) -> pl.DataFrame:
    """The ``k`` highest-scoring tokens of ``b`` by ``by`` (fewer when fewer have a score)."""
    rows = _top_rows(b, by, k)
    return pl.DataFrame(rows) if rows is not None else pl.DataFrame()


def _top_rows(b: TokenBatch, by: str, k: int) -> dict[str, np.ndarray] | None:
    """The columns of :func:`top_k`'s rows (None when the run lacks an input of ``by``)."""
    top = _top_positions(b, by, k)
    if top is None:
        return None
    pos, score = top
    cols = token_frame(b, pos)
    cols["score"] = score
    cols["by"] = np.full(len(pos), by)
    return cols


def _top_positions(b: TokenBatch, by: str, k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(positions, scores) of the ``k`` highest-scoring tokens of ``b`` by ``by`` in
    :func:`_largest`'s order, from one pass over the tokens (None when the run lacks an input)."""
    inputs = _inputs(b, by)
    return None if inputs is None else _top(*inputs, k)


def _largest(x: np.ndarray, k: int) -> np.ndarray:
    """Positions of the ``k`` largest values of ``x`` (k < len(x), no NaN): those above the k-th
    largest, then the first positions holding it. A batch's rows are in key order, so a shard
    keeps the rows :func:`keep_top` would keep of it, and the merge of shards is the global top-K
    even when many tokens share a score (as bf16 log-probs make them do)."""
    return _top(_AS_IS, x, x, np.ones(len(x), dtype=bool), k)[0]


@kernel
def _top(code, x, y, valid, k):
    """(positions, scores) of the k best tokens that have a score (:func:`_fill_scores`), best
    meaning score descending, then position: :func:`_largest`'s rule. A heap of the k best so far
    whose root is the worst of them (lowest score, then last position); positions arrive in
    order, so a token enters only with a score above the root's, one comparison for most tokens."""
    hs = np.empty(max(k, 1))
    hp = np.empty(max(k, 1), dtype=np.int64)
    m = 0
    seen = 0
    for i in range(len(x)):
        if not valid[i]:
            continue
        s = _score(code, x[i], y[i])
        if not np.isfinite(s):
            continue
        seen += 1
        if m < k:  # push, then move up past every better parent
            j = m
            m += 1
            while j > 0:
                p = (j - 1) >> 1
                if hs[p] < s or (hs[p] == s and hp[p] > i):
                    break  # the parent is worse than the new token: the root stays the worst
                hs[j], hp[j] = hs[p], hp[p]
                j = p
            hs[j], hp[j] = s, i
        elif k > 0 and s > hs[0]:  # replace the root, then move it down past worse children
            j = 0
            while True:
                c = 2 * j + 1
                if c >= m:
                    break
                if c + 1 < m and (hs[c + 1] < hs[c] or (hs[c + 1] == hs[c] and hp[c + 1] > hp[c])):
                    c += 1
                if hs[c] > s or (hs[c] == s and hp[c] < i):
                    break
                hs[j], hp[j] = hs[c], hp[c]
                j = c
            hs[j], hp[j] = s, i
    order = np.argsort(hp[:m])
    pos, score = hp[:m][order], hs[:m][order]
    if seen <= k:
        return pos, score
    t = hs[0]  # the k-th largest score: the tokens above it first, then the first ones holding it
    first = np.concatenate((np.flatnonzero(score > t), np.flatnonzero(score == t)))
    return pos[first], score[first]


def keep_top(df: pl.DataFrame, k: int) -> pl.DataFrame:
    """The K highest scores per (step, by); ties broken by position keys so results are stable."""
    if df.height == 0:
        return df
    kept = _kept_rows({c: df[c].to_numpy() for c in (*TOP_COLUMNS, "score", "by")}, k)
    return df[kept][_output_columns(df.columns)]


def _kept_rows(cols: Mapping[str, np.ndarray], k: int) -> np.ndarray:
    """:func:`keep_top`'s rows of the columns ``cols``, in its order: numpy's sort and one gather
    (a step's few hundred rows cost ~1 ms per polars query)."""
    step = cols["step"]
    _, by = np.unique(cols["by"], return_inverse=True)  # codes in the names' sorted order
    order = np.lexsort([*(cols[c] for c in reversed(TOP_COLUMNS)), -cols["score"], by, step])
    group = np.stack([step[order], by.reshape(-1)[order]], axis=1)
    starts = np.flatnonzero(np.concatenate(([True], (group[1:] != group[:-1]).any(axis=1))))
    rank = np.arange(len(order)) - np.repeat(starts, np.diff(np.append(starts, len(order))))
    return order[rank < k]


def _output_columns(names) -> list[str]:
    """The group keys first, as group_by(...).head() puts them."""
    return ["step", "by", *(c for c in names if c not in ("step", "by"))]


@dataclass
class TopTokens(Visitor):
    """Visitor collecting the top-K tokens of each step for every available score."""

    k: int = DEFAULT_TOP_K
    name: str = "top_tokens"
    collect: bool = True

    def shard(self, batch: TokenBatch, shard) -> dict[str, np.ndarray] | None:
        # every score's rows as columns, gathered once for all scores; the step's frame is built
        # once, in combine (a polars frame per shard, or per score, cost more than the scoring)
        names, picks = [], []
        for by in SCORES:
            top = _top_positions(batch, by, self.k)
            if top is not None and len(top[0]):
                names.append(by)
                picks.append(top)
        if not picks:
            return None
        cols = token_frame(batch, np.concatenate([pos for pos, _ in picks]))
        cols["score"] = np.concatenate([score for _, score in picks])
        cols["by"] = np.repeat(np.array(names), [len(pos) for pos, _ in picks])
        return cols

    def combine(self, step: int, pieces: list[dict[str, np.ndarray] | None]) -> pl.DataFrame:
        pieces = [p for p in pieces if p is not None]
        if not pieces:
            return pl.DataFrame()
        # every shard's rows have token_frame's columns (NaN or -1 for one its run lacks)
        cols = {c: np.concatenate([p[c] for p in pieces]) for c in pieces[0]}
        kept = _kept_rows(cols, self.k)
        return pl.DataFrame({c: cols[c][kept] for c in _output_columns(cols)})

    def finish(self, run: Path, out_dir: Path, by_step: Mapping[int, pl.DataFrame], kept_steps: set[int]) -> None:
        """Write ``top_tokens.parquet``: fresh rows for recomputed steps, earlier rows for the rest."""
        write_step_table(out_dir / "top_tokens.parquet", by_step, kept_steps, sort=["step", "by", "score"],
                         descending=[False, False, True], schemas=getattr(by_step, "schemas", None))


@visitor("top_tokens")
def _top_tokens(cfg: dict) -> TopTokens:
    return TopTokens(int(cfg.get("top_k_tokens") or DEFAULT_TOP_K))


# ---------------------------------------------------------------------------------------------
# One step, on demand (``grpolens tokens``): reads only that step's shards
# ---------------------------------------------------------------------------------------------

def load_step(run: Path, step: int) -> TokenBatch | None:
    table = RunReader(run).tokens(step)
    return None if table is None else TokenBatch.from_arrow(table)


def completion_tokens(b: TokenBatch, sample_id: int, by: str) -> dict[str, np.ndarray] | None:
    """Every stored token of one completion (its first loss call of the step), with the score."""
    seq = np.flatnonzero(b.seq_keys["sample_id"] == sample_id)
    if len(seq) == 0:
        return None
    i = seq[0]
    idx = np.arange(b.starts[i], b.starts[i] + b.lengths[i])
    cols = token_frame(b, idx)
    s = token_scores(b, by)
    cols["score"] = s[idx] if s is not None else np.full(len(idx), np.nan)
    return cols
