"""Diversity of the completions of each prompt group (MaxEnt-GRPO's definitions).

For a group of completions (each a list of tokens):

* ``distinct_n`` = |unique n-grams| / (L − n + 1) over the *concatenation* of the group's
  completions (so n-grams cross completion boundaries), 0 when L < n;
* ``jaccard`` = mean over pairs i < j of 1 − |S_i ∩ S_j| / |S_i ∪ S_j| on token *sets* (a
  distance: 0 identical, 1 disjoint); an empty union counts as 0, a group of one gives 0.

Per step, groups are averaged plainly (macro) and weighted by group size (micro). Tokens are the
completion's ``token_id`` s when the run stores them, whitespace tokens of the completion text
otherwise; a step with neither has no diversity values. grpolens sees every rank, so a group
whose completions were generated on different ranks is still one group.

Worked example: the group ["a b c", "a b d"] has 6 tokens with 4 distinct (distinct_1 = 4/6),
5 bigrams ab, bc, ca, ab, bd with 4 distinct (distinct_2 = 4/5), and sets {a,b,c}, {a,b,d}
sharing 2 of 4 (jaccard = 1 − 2/4 = 0.5).

A step's values come from one compiled pass over its completions' tokens (:func:`flat_diversity`),
fed flat arrays (the shards' token-id columns and each completion's bounds) rather than a list per
completion; :func:`distinct_n` and :func:`jaccard_distance` are the plain one-group numpy versions,
and the pass equals them bit for bit (tests/metrics/test_diversity_kernel.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import polars as pl

from grpolens.functional.jit import inline, kernel
from grpolens.metrics.batch import TokenBatch
from grpolens.metrics.engine import Visitor, visitor
from grpolens.metrics.registry import Family, Metric, register, register_family


def _as_ids(completions: Sequence[Sequence]) -> list[np.ndarray]:
    """Completions as int64 arrays (strings are numbered first, so text and ids share one path)."""
    if all(isinstance(c, np.ndarray) and c.dtype.kind in "iu" for c in completions):
        return [c.astype(np.int64, copy=False) for c in completions]
    vocab: dict = {}
    return [np.array([vocab.setdefault(t, len(vocab)) for t in c], dtype=np.int64) for c in completions]


def distinct_n(tokens: Sequence, n: int) -> float:
    """|unique n-grams| / (L − n + 1) for n in {1, 2}; 0 when L < n."""
    (ids,) = _as_ids([tokens])
    if len(ids) < n:
        return 0.0
    if n == 1:
        grams = ids
    elif n == 2:
        # one int per bigram, collision-free: the ids' ranks (0 <= rank < u) rather than the ids,
        # which may be negative (a null token id is -1) or large enough to overflow the product
        u, rank = _dense_ranks(ids)
        grams = rank[:-1] * u + rank[1:]
    else:
        raise ValueError("distinct_n supports n = 1 or 2")
    return _n_unique(grams) / (len(ids) - n + 1)


def _unique(x: np.ndarray) -> np.ndarray:
    """Sorted distinct values (same dtype). Sort-based on purpose: numpy 2's hash-based
    ``np.unique`` measured 20-40x slower than a sort on a step's few hundred thousand int keys,
    and a hash pass (polars' ``unique``) no faster than polars' sort. The sort is polars', not
    numpy's, and on one thread: on 650 K int64 keys 9.8 ms of CPU, against 22 ms for polars'
    multithreaded sort (in the same wall time: its threads mostly wait on 2 cores) and 39 ms for
    numpy's; it runs without the GIL, so the engine's other threads go on meanwhile, and the
    recompute's parallelism is its worker processes (``benchmarks/bench_recompute.py``)."""
    if len(x) == 0:
        return x
    u = pl.Series(x).sort(multithreaded=False).to_numpy()
    return u[np.concatenate(([True], u[1:] != u[:-1]))]


def _dense_ranks(x: np.ndarray) -> tuple[int, np.ndarray]:
    """Number of distinct values and each element's rank among them (``np.unique`` inverse)."""
    u = _unique(x)
    return len(u), np.searchsorted(u, x)


def _n_unique(x: np.ndarray) -> int:
    # sort-based: for the few thousand ints of a group this beats np.unique's hash path
    if len(x) == 0:
        return 0
    u = np.sort(x)
    return 1 + int(np.count_nonzero(u[1:] != u[:-1]))


def jaccard_distance(completions: Sequence[Sequence]) -> float:
    ids = _as_ids(completions)
    g = len(ids)
    if g < 2:
        return 0.0
    # One sort of (token, completion) pairs gives the membership matrix (distinct tokens ×
    # completions); M.T @ M then holds every pairwise intersection size at once.
    owner = np.repeat(np.arange(g), [len(c) for c in ids])
    # ranks, not the ids: id × g would overflow int64 for ids beyond 2**63 / g (and collide)
    pairs = _unique(_dense_ranks(np.concatenate(ids))[1] * g + owner)
    tok, own = pairs // g, pairs % g
    row = np.cumsum(np.concatenate(([True], tok[1:] != tok[:-1]))) - 1 if len(tok) else tok
    member = np.zeros((int(row[-1]) + 1 if len(row) else 0, g))
    member[row, own] = 1.0
    inter = member.T @ member
    size = np.diag(inter)
    iu, ju = np.triu_indices(g, k=1)
    union = size[iu] + size[ju] - inter[iu, ju]
    dist = np.where(union > 0, 1.0 - inter[iu, ju] / np.where(union > 0, union, 1.0), 0.0)
    return float(dist.mean())


def group_diversity(completions: Sequence[Sequence]) -> dict[str, float]:
    d1, d2, jac = groups_diversity([completions])[0]
    return {"distinct_1": float(d1), "distinct_2": float(d2), "jaccard": float(jac)}


def groups_diversity(groups: Sequence[Sequence[Sequence]]) -> np.ndarray:
    """(distinct_1, distinct_2, jaccard) of every group, shape (groups, 3): :func:`flat_diversity`
    of the groups' completions laid end to end."""
    sizes = np.array([len(g) for g in groups], dtype=np.int64)
    ids = _as_ids([c for g in groups for c in g])
    if not ids:
        return np.zeros((len(groups), 3))
    lens = np.array([len(c) for c in ids], dtype=np.int64)
    return flat_diversity(np.concatenate(ids), np.cumsum(lens) - lens, lens, sizes)


#: Token values used as they are (minus the smallest) when they span fewer values than this and
#: not many more than the step has tokens: the "seen in this group" marks are one slot per value
DENSE_SPAN = 2**24


def _dense(tok: np.ndarray) -> tuple[int, np.ndarray]:
    """(u, tok as whole numbers 0 <= v < u): equal tokens map to equal numbers, distinct ones to
    distinct numbers, which is all distinct-n and Jaccard look at. A vocabulary's ids (or -1 for a
    null id) only shift; ids spread wider are ranked (one sort)."""
    if len(tok) == 0:
        return 0, tok.astype(np.int64)
    lo, hi = int(tok.min()), int(tok.max())
    span = hi - lo + 1  # Python ints: no overflow for ids near ±2**63
    if span <= DENSE_SPAN and span <= 4 * len(tok) + 2**16:
        return span, (tok - lo if lo else tok).astype(np.int64, copy=False)
    return _dense_ranks(tok.astype(np.int64, copy=False))


def flat_diversity(tok: np.ndarray, start: np.ndarray, length: np.ndarray, sizes: np.ndarray,
                   u: int | None = None) -> np.ndarray:
    """(distinct_1, distinct_2, jaccard) of every group, shape (len(sizes), 3), from flat arrays:
    completion c is ``tok[start[c]:start[c] + length[c]]``, the completions are listed group by
    group (group k holds ``sizes[k]`` of them, in order). ``u``: when given, ``tok`` already holds
    whole numbers below it (else :func:`_dense` makes them so)."""
    if u is None:
        u, tok = _dense(tok)
    group_off = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    return _groups_kernel(tok, np.asarray(start, np.int64), np.asarray(length, np.int64), group_off, u)


@inline
def _popcount(x):
    """Set bits of a uint64 (the SWAR sum: a dozen integer operations, no table)."""
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return np.int64((x * np.uint64(0x0101010101010101)) >> np.uint64(56))


@inline
def _block_sum(a, lo, n):
    """numpy's sum of at most 128 values: in order below 8, else 8 interleaved sums combined as a tree."""
    if n < 8:
        res = 0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = lo + 8
    end = lo + n - n % 8
    while i < end:
        r0 += a[i]
        r1 += a[i + 1]
        r2 += a[i + 2]
        r3 += a[i + 3]
        r4 += a[i + 4]
        r5 += a[i + 5]
        r6 += a[i + 6]
        r7 += a[i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < lo + n:
        res += a[i]
        i += 1
    return res


@kernel
def numpy_sum(a, lo, n):
    """``a[lo:lo + n].sum()`` added in numpy's order, to the last bit: blocks of at most 128 values
    (:func:`_block_sum`), and above that the sum of two halves cut at a multiple of 8. The halving
    walks an explicit stack: numba's cache cannot hold a recursive function (the cached machine
    code of one crashed on loading)."""
    if n <= 128:
        return _block_sum(a, lo, n)
    node_lo = np.empty(64, np.int64)  # depth <= log2(n) < 64
    node_n = np.empty(64, np.int64)
    node_state = np.empty(64, np.int64)  # 0: left half next, 1: right half next, 2: both summed
    vals = np.empty(64)
    top, nv = 0, 0
    node_lo[0], node_n[0], node_state[0] = lo, n, 0
    while top >= 0:
        m = node_n[top]
        if m <= 128:
            vals[nv] = _block_sum(a, node_lo[top], m)
            nv += 1
            top -= 1
            continue
        half = m // 2
        half -= half % 8
        state = node_state[top]
        node_state[top] = state + 1
        if state == 2:
            vals[nv - 2] = vals[nv - 2] + vals[nv - 1]
            nv -= 1
            top -= 1
        else:
            child_lo = node_lo[top] + (half if state == 1 else 0)
            top += 1
            node_lo[top], node_n[top], node_state[top] = child_lo, (m - half if state == 1 else half), 0
    return vals[0]


@kernel
def _groups_kernel(tok, start, length, group_off, u):
    """One pass per group over its tokens. Each distinct value gets the next *slot* of the group
    (``mark[v]`` = group << 32 | slot, so another group's mark reads as unseen: no reset), which
    counts distinct_1; bigrams are pairs of slots (slot × distinct + slot < tokens², exact) in an
    open-addressing set whose entries are stamped with the group (no reset either) and compared by
    their whole key; Jaccard reads each completion's bitset over the group's slots (any number of
    completions): |S_i| and |S_i ∩ S_j| are popcounts, and the pair distances are averaged as
    ``jaccard_distance``'s numpy mean adds them."""
    n_groups = len(group_off) - 1
    out = np.zeros((n_groups, 3))
    longest = 0
    for g in range(n_groups):
        n = 0
        for c in range(group_off[g], group_off[g + 1]):
            n += length[c]
        longest = max(longest, n)
    mark = np.full(u, -1, np.int64)
    seq = np.empty(longest, np.int64)  # the group's tokens as slots
    cap = 16
    while cap < 2 * longest:
        cap *= 2
    keys = np.empty(cap, np.int64)
    stamp = np.full(cap, -1, np.int64)
    for g in range(n_groups):
        c0, c1 = group_off[g], group_off[g + 1]
        n = 0
        distinct = 0
        for c in range(c0, c1):
            for i in range(start[c], start[c] + length[c]):
                m = mark[tok[i]]
                if (m >> 32) != g:
                    m = (g << 32) | distinct
                    mark[tok[i]] = m
                    distinct += 1
                seq[n] = m & 0xFFFFFFFF
                n += 1
        bits = 4
        while (1 << bits) < 2 * n:
            bits += 1
        mask = (1 << bits) - 1
        shift = np.uint64(64 - bits)
        pairs = 0
        for i in range(n - 1):
            key = seq[i] * distinct + seq[i + 1]
            h = np.int64((np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)) >> shift)
            while stamp[h] == g and keys[h] != key:
                h = (h + 1) & mask
            if stamp[h] != g:
                stamp[h] = g
                keys[h] = key
                pairs += 1
        if n >= 1:
            out[g, 0] = distinct / np.float64(n)
        if n >= 2:
            out[g, 1] = pairs / np.float64(n - 1)
        k = c1 - c0
        if k >= 2:
            out[g, 2] = _group_jaccard(seq, length, c0, k, distinct)
    return out


@kernel
def _group_jaccard(seq, length, c0, k, distinct):
    """Mean pairwise Jaccard distance of the group's k completions, ``seq`` holding its tokens'
    slots completion after completion."""
    words = (distinct + 63) >> 6
    sets = np.zeros(k * words, np.uint64)
    size = np.zeros(k, np.int64)
    at = 0
    for j in range(k):
        row = j * words
        for _ in range(length[c0 + j]):
            s = seq[at]
            at += 1
            sets[row + (s >> 6)] |= np.uint64(1) << np.uint64(s & 63)
        for w in range(row, row + words):
            size[j] += _popcount(sets[w])
    n_pairs = k * (k - 1) // 2
    dist = np.empty(n_pairs)
    p = 0
    for i in range(k):  # numpy's triu_indices order: (0, 1), (0, 2), ..., (1, 2), ...
        for j in range(i + 1, k):
            both = 0
            for w in range(words):
                both += _popcount(sets[i * words + w] & sets[j * words + w])
            union = size[i] + size[j] - both
            dist[p] = 1.0 - np.float64(both) / np.float64(union) if union > 0 else 0.0
            p += 1
    return numpy_sum(dist, 0, n_pairs) / np.float64(n_pairs)


@dataclass
class CompletionIds:
    """Token ids of completions as flat arrays: completion i (``sample_id[i]``) is
    ``ids[start[i]:start[i] + length[i]]``."""

    sample_id: np.ndarray
    start: np.ndarray
    length: np.ndarray
    ids: np.ndarray


class SampleTokens(Visitor):
    """Visitor: the token ids of each completion of the step, by sample_id (a shard's token_id
    column as it is, with its sequences' bounds: no per-sequence work).

    A completion used in several loss calls of a step is stored several times; its first
    occurrence is kept (the tokens are the same).
    """

    name = "sample_tokens"

    def shard(self, batch: TokenBatch, shard) -> CompletionIds | None:
        if "token_id" not in batch.present or batch.n_seq == 0:
            return None
        return CompletionIds(batch.seq_keys["sample_id"], batch.starts, batch.lengths, batch.cols["token_id"])

    def combine(self, step: int, pieces: list[CompletionIds | None]) -> CompletionIds | None:
        pieces = [p for p in pieces if p is not None]
        if not pieces:
            return None
        offset = np.cumsum([0] + [len(p.ids) for p in pieces[:-1]])
        sid = np.concatenate([p.sample_id for p in pieces])
        start = np.concatenate([p.start + o for p, o in zip(pieces, offset)])
        # sorted sample ids and each one's first occurrence (np.unique's index is the first one)
        sid, first = np.unique(sid, return_index=True)
        return CompletionIds(sid, start[first], np.concatenate([p.length for p in pieces])[first],
                             np.concatenate([p.ids for p in pieces]))


@visitor("sample_tokens", families=("diversity",))
def _sample_tokens(cfg: dict) -> SampleTokens:
    return SampleTokens()


@dataclass
class StepGroups:
    """A step's completions as :func:`flat_diversity` reads them: ``tok`` whole numbers below
    ``u``, completion c is ``tok[start[c]:start[c] + length[c]]``, group by group (``sizes``)."""

    tok: np.ndarray
    start: np.ndarray
    length: np.ndarray
    sizes: np.ndarray
    u: int


def step_groups(sd) -> StepGroups | None:
    """The step's groups (token ids, else whitespace tokens of the text); None when no completion
    has either. Groups are in the order of their first completion in the samples table, and a
    group's completions in the table's order."""
    if "_diversity_groups" not in sd.extra:
        sd.extra["_diversity_groups"] = _step_groups(sd.samples, (sd.extra.get("pieces") or {}).get("sample_tokens"))
    return sd.extra["_diversity_groups"]


def _step_groups(s, ids: CompletionIds | None) -> StepGroups | None:
    if s is None or s.height == 0:
        return None
    sid = s["sample_id"].to_numpy()
    found = np.zeros(s.height, dtype=bool)
    at = np.zeros(s.height, dtype=np.int64)
    if ids is not None and len(ids.sample_id):
        at = np.minimum(np.searchsorted(ids.sample_id, sid), len(ids.sample_id) - 1)
        found = ids.sample_id[at] == sid
    text = ~found
    if "completion" in s.columns:
        text &= s["completion"].is_not_null().to_numpy()
    else:
        text[:] = False
    rows = np.flatnonzero(found | text)  # a completion with neither tokens nor text is left out
    if len(rows) == 0:
        return None
    # group codes in order of first appearance, completions in table order within a group
    _, first, inverse = np.unique(s["group_id"].to_numpy()[rows], return_index=True, return_inverse=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first)] = np.arange(len(first))
    code = rank[inverse.reshape(-1)]
    rows = rows[np.argsort(code, kind="stable")]
    sizes = np.bincount(code, minlength=len(first))
    u, tok = _dense(ids.ids) if ids is not None else (0, np.zeros(0, dtype=np.int64))
    start, length = np.zeros(len(rows), dtype=np.int64), np.zeros(len(rows), dtype=np.int64)
    by_ids = found[rows]
    if by_ids.any():
        pick = at[rows[by_ids]]
        start[by_ids], length[by_ids] = ids.start[pick], ids.length[pick]
    if not by_ids.all():  # text: its words numbered after the token values, so neither meets the other
        vocab: dict[str, int] = {}
        words = [[vocab.setdefault(w, u + len(vocab)) for w in t.split()]
                 for t in s["completion"].gather(rows[~by_ids]).to_list()]
        length[~by_ids] = [len(w) for w in words]
        start[~by_ids] = len(tok) + np.cumsum(length[~by_ids]) - length[~by_ids]
        tok = np.concatenate([tok, np.fromiter((c for w in words for c in w), dtype=np.int64)])
        u += len(vocab)
    return StepGroups(tok, start, length, sizes, u)


_COLUMN = {"distinct_1": 0, "distinct_2": 1, "jaccard": 2}


def step_diversity(sd) -> np.ndarray:
    """Each group's values (see :func:`flat_diversity`), computed once per step for all six metrics."""
    if "_diversity_values" not in sd.extra:
        g = step_groups(sd)
        sd.extra["_diversity_values"] = flat_diversity(g.tok, g.start, g.length, g.sizes, g.u)
    return sd.extra["_diversity_values"]


def _reducer(key: str, micro: bool):
    def fn(sd) -> float | None:
        groups = step_groups(sd)
        if groups is None:
            return None
        vals = step_diversity(sd)[:, _COLUMN[key]]
        if micro:
            w = groups.sizes.astype(np.float64)
            return float((vals * w).sum() / w.sum())
        return float(vals.mean())

    return fn


for _key, _what in (("distinct_1", "distinct unigrams / tokens"), ("distinct_2", "distinct bigrams / bigrams"),
                    ("jaccard", "mean pairwise Jaccard distance of token sets")):
    register(Metric(
        f"diversity/{_key}", "diversity",
        f"Per prompt group, {_what} over the group's completions; plain mean over the step's groups.",
        kind="custom", fn=_reducer(_key, micro=False), source="samples",
    ))
    register(Metric(
        f"diversity/{_key}_micro", "diversity",
        f"As diversity/{_key}, averaged over groups weighted by group size.",
        kind="custom", fn=_reducer(_key, micro=True), source="samples",
    ))


register_family(Family(
    'diversity', page='rewards',
))
