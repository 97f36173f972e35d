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

from itertools import combinations
from typing import Sequence

import numpy as np

from grpolens.metrics.batch import TokenBatch
from grpolens.metrics.engine import visitor
from grpolens.metrics.registry import Metric, register


def distinct_n(tokens: Sequence, n: int) -> float:
    if len(tokens) < n:
        return 0.0
    grams = {tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)}
    return len(grams) / (len(tokens) - n + 1)


def jaccard_distance(completions: Sequence[Sequence]) -> float:
    sets = [set(c) for c in completions]
    if len(sets) < 2:
        return 0.0
    dists = []
    for a, b in combinations(sets, 2):
        union = len(a | b)
        dists.append(0.0 if union == 0 else 1.0 - len(a & b) / union)
    return float(np.mean(dists))


def group_diversity(completions: Sequence[Sequence]) -> dict[str, float]:
    joined = [t for c in completions for t in c]
    return {"distinct_1": distinct_n(joined, 1), "distinct_2": distinct_n(joined, 2),
            "jaccard": jaccard_distance(completions)}


class SampleTokens:
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


@visitor("sample_tokens")
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
        for sid, gid, *text in s.select(["sample_id", "group_id", *(["completion"] if has_text else [])]).iter_rows():
            if sid in ids:
                toks = ids[sid].tolist()
            elif has_text and text[0] is not None:
                toks = text[0].split()
            else:
                continue
            by_group.setdefault(gid, []).append(toks)
        groups = list(by_group.values())
    sd.extra["_diversity_groups"] = groups
    return groups


def _reducer(key: str, micro: bool):
    def fn(sd) -> float | None:
        groups = step_groups(sd)
        if not groups:
            return None
        vals = np.array([group_diversity(g)[key] for g in groups])
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
        names={"maxent": f"train/completions/diversity/{_key}"},
    ))
    register(Metric(
        f"diversity/{_key}_micro", "diversity",
        f"As diversity/{_key}, averaged over groups weighted by group size.",
        kind="custom", fn=_reducer(_key, micro=True), source="samples",
        names={"maxent": f"train/completions/diversity/{_key}_micro"},
    ))
