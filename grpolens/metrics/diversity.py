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
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import polars as pl

from grpolens.metrics.batch import TokenBatch
from grpolens.metrics.engine import Visitor, visitor
from grpolens.metrics.registry import Family, Metric, register, register_family


#: Bits one packed sort key may use: the keys are int64, and 62 leaves the sign bit and a margin.
#: Steps whose keys would not fit take the per-group paths of :func:`groups_diversity`.
KEY_BITS = 62


def _key_layout(n_groups: int, n_values: int, group_size: int) -> tuple[int, int, int, bool, bool, bool]:
    """The packed sort keys' fields and which keys fit: bit widths of (group, token, completion in
    group), whether (group, token, completion) fits in ``KEY_BITS`` and in 32 bits, and whether
    (group, token, token) fits in ``KEY_BITS``. A separate function because a guard that admits too
    much only shows past 2**62 keys, where a test cannot go: on any smaller step both paths agree."""
    gb, ub, cb = (max(int(x - 1).bit_length(), 1) for x in (n_groups, n_values, group_size))
    return gb, ub, cb, gb + ub + cb <= KEY_BITS, gb + ub + cb <= 32, gb + 2 * ub <= KEY_BITS


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
    pairs = _unique(np.concatenate(ids) * g + owner)
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
    """(distinct_1, distinct_2, jaccard) of every group, shape (groups, 3).

    The distinct-n counts of all groups come from one sort each over (group, n-gram) keys, which is
    what keeps diversity cheap on steps with many groups; Jaccard needs one small product per group.
    """
    out = np.zeros((len(groups), 3))
    comps = [c for g in groups for c in g]
    if not comps:
        return out
    ids = _as_ids(comps)
    n_groups = len(groups)
    sizes = np.array([len(g) for g in groups])
    lens = np.array([len(c) for c in ids])
    tok = np.concatenate(ids)
    if len(tok) == 0:
        return out
    if tok.min() >= 0 and tok.max() < 2**24:  # token ids of any real vocabulary: use them as they are
        u, dense = int(tok.max()) + 1, tok
    else:
        u, dense = _dense_ranks(tok)
    tg = np.repeat(np.repeat(np.arange(n_groups), sizes), lens)  # group of each token
    length = np.bincount(tg, minlength=n_groups).astype(np.float64)
    gmax = int(sizes.max())
    # keys pack (group, token[, token | completion]) into the bits of one int64: shifts and masks
    # instead of products, divisions and remainders over every token of the step
    gb, ub, cb, packed, packed32, packed_bigrams = _key_layout(n_groups, u, gmax)
    if packed:
        # one sort of (group, token, completion-in-group) serves distinct_1 and Jaccard
        first = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        local = np.arange(len(lens)) - np.repeat(first, sizes)  # completion index inside its group
        keys = (((tg << ub) | dense) << cb) | np.repeat(local, lens)
        # most steps' keys fit in 32 bits: half the bytes to sort and to pass over after
        keys = _unique(keys.astype(np.uint32) if packed32 else keys)
        gt = keys >> cb  # (group, token) of each key, sorted
        new_row = np.concatenate(([True], gt[1:] != gt[:-1]))
        uni = gt[new_row]
        out[:, 2] = _groups_jaccard(gt >> ub, keys & ((1 << cb) - 1), gt, new_row, sizes)
    else:  # the packed key would overflow: Jaccard one group at a time (below)
        keys = None
        uni = _unique((tg << ub) | dense)
    n1 = np.bincount(uni >> ub, minlength=n_groups)
    out[:, 0] = np.where(length >= 1, n1 / np.maximum(length, 1), 0.0)
    same = tg[1:] == tg[:-1]  # bigrams run across completions but never across groups
    if packed_bigrams:
        big = _unique(((((tg[1:] << ub) | dense[:-1]) << ub) | dense[1:])[same])
        n2 = np.bincount(big >> (2 * ub), minlength=n_groups)
        out[:, 1] = np.where(length >= 2, n2 / np.maximum(length - 1, 1), 0.0)
    else:  # astronomically many distinct tokens: per group, without the packed key
        start = 0
        for gi, g in enumerate(groups):
            joined = np.concatenate(ids[start:start + len(g)]) if len(g) else np.zeros(0, np.int64)
            out[gi, 1] = distinct_n(joined, 2)
            start += len(g)
    if keys is None:
        start = 0
        for gi, g in enumerate(groups):
            out[gi, 2] = jaccard_distance(ids[start:start + len(g)])
            start += len(g)
    return out


def _groups_jaccard(grp: np.ndarray, own: np.ndarray, row: np.ndarray, new_row: np.ndarray,
                    sizes: np.ndarray) -> np.ndarray:
    """:func:`jaccard_distance` of every group (the same values, bit for bit), from the sorted
    distinct (group, token, completion) keys split into their group ``grp``, completion ``own``,
    (group, token) ``row`` and whether each starts a new row ``new_row``.

    The pairwise counts come from the keys themselves, with no loop over groups: |S_i| is the
    number of keys of completion i, and |S_i ∩ S_j| the number of (group, token) rows holding both
    i and j, i.e. of key pairs d apart inside one row (d = 1 .. largest group − 1, fewer keys each
    time). The counts are whole numbers, so they are exactly the one-group function's ``M.T @ M``;
    the distances and their means are the same element-wise operations, batched over the groups of
    one size.
    """
    n_groups = len(sizes)
    res = np.zeros(n_groups)
    if n_groups == 0 or int(sizes.max()) < 2 or len(grp) == 0:
        return res
    gmax = int(sizes.max())
    diag = np.bincount(grp * gmax + own, minlength=n_groups * gmax).reshape(n_groups, gmax)  # |S_i|
    # group k's g x g block of pair counts starts at block[k] of one flat array (Σ g² cells)
    block = np.concatenate(([0], np.cumsum(sizes * sizes)))
    counts = np.zeros(int(block[-1]), dtype=np.int64)
    at = np.flatnonzero(~new_row[1:])  # keys whose next key is in the same row
    for d in range(1, gmax):
        if d > 1:  # key at + d is in at's row only if key at + d - 1 is: narrow the last list
            at = at[at + d < len(row)]
            at = at[row[at + d] == row[at]]
        if len(at) == 0:  # no row holds d + 1 completions
            break
        g = grp[at]  # keys at and at + d: completions own[at] < own[at + d] of one row
        counts += np.bincount(block[g] + own[at] * sizes[g] + own[at + d], minlength=len(counts))
    counts = counts.astype(np.float64)
    for g in np.unique(sizes):
        g = int(g)
        if g < 2:
            continue
        gids = np.flatnonzero(sizes == g)
        inter = counts[block[gids][:, None] + np.arange(g * g)].reshape(len(gids), g, g)
        inter[:, np.arange(g), np.arange(g)] = diag[gids, :g]
        size = np.diagonal(inter, axis1=1, axis2=2)
        iu, ju = np.triu_indices(g, k=1)
        both = inter[:, iu, ju]
        union = size[:, iu] + size[:, ju] - both
        dist = np.where(union > 0, 1.0 - both / np.where(union > 0, union, 1.0), 0.0)
        # C order, so each row is summed like one group's 1-D array (numpy's pairwise summation)
        res[gids] = np.ascontiguousarray(dist).mean(axis=1)
    return res


class SampleTokens(Visitor):
    """Visitor: the token ids of each completion of the step, by sample_id.

    A completion used in several loss calls of a step is stored several times; its first
    occurrence is kept (the tokens are the same).
    """

    name = "sample_tokens"

    def shard(self, batch: TokenBatch, shard) -> dict[int, np.ndarray]:
        if "token_id" not in batch.present or batch.n_seq == 0:
            return {}
        ids = batch.cols["token_id"]
        out: dict[int, np.ndarray] = {}
        for sid, start, length in zip(batch.seq_keys["sample_id"].tolist(), batch.starts.tolist(), batch.lengths.tolist()):
            out.setdefault(sid, ids[start:start + length])
        return out

    def combine(self, step: int, pieces: list[dict[int, np.ndarray]]) -> dict[int, np.ndarray]:
        merged: dict[int, np.ndarray] = {}
        for p in pieces:
            for k, v in p.items():
                merged.setdefault(k, v)
        return merged


@visitor("sample_tokens", families=("diversity",))
def _sample_tokens(cfg: dict) -> SampleTokens:
    return SampleTokens()


def step_groups(sd) -> list[list]:
    """The step's groups as lists of token sequences (token ids, else whitespace tokens of text)."""
    cache = sd.extra.get("_diversity_groups")
    if cache is not None:
        return cache
    groups: list[list] = []
    s = sd.samples
    if s is not None and s.height:
        ids = (sd.extra.get("pieces") or {}).get("sample_tokens") or {}
        has_text = "completion" in s.columns and s["completion"].null_count() < s.height
        by_group: dict[int, list] = {}
        # whole columns to Python lists (a select + iter_rows is a polars query, ~1 ms a step)
        texts = s["completion"].to_list() if has_text else [None] * s.height
        for sid, gid, text in zip(s["sample_id"].to_list(), s["group_id"].to_list(), texts):
            if sid in ids:
                toks = ids[sid]
            elif text is not None:
                toks = text.split()
            else:
                continue
            by_group.setdefault(gid, []).append(toks)
        groups = list(by_group.values())
    sd.extra["_diversity_groups"] = groups
    return groups


_COLUMN = {"distinct_1": 0, "distinct_2": 1, "jaccard": 2}


def step_diversity(sd) -> np.ndarray:
    """Each group's values (see :func:`groups_diversity`), computed once per step for all six metrics."""
    if "_diversity_values" not in sd.extra:
        sd.extra["_diversity_values"] = groups_diversity(step_groups(sd))
    return sd.extra["_diversity_values"]


def _reducer(key: str, micro: bool):
    def fn(sd) -> float | None:
        groups = step_groups(sd)
        if not groups:
            return None
        vals = step_diversity(sd)[:, _COLUMN[key]]
        if micro:
            w = np.array([len(g) for g in groups], dtype=np.float64)
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
