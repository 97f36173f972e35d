"""One step's data for an explanation: the per-sequence partials the metric reduces (the same pass
as ``recompute --only FAMILY``), and the same producers evaluated on a batch whose units are single
tokens.

The second pass is what makes a token-level decomposition exact without a second copy of any
formula: each token is handed to the family's producers as a sequence of its own, so its partial
columns are that token's terms under the metric's own code. Whether a column really is a sum of
token terms is not assumed but checked (:func:`token_additive`): a producer that works per sequence
(GSPO's sequence ratio, a loss normalised per sequence) fails the check, and its metrics are then
decomposed along sequence-level dimensions only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from grpolens.metrics.engine import Visitor
from grpolens.metrics.batch import KEY_COLUMNS, TokenBatch
from grpolens.metrics.partials import PRODUCERS, merge_rules
from grpolens.metrics.reduce import StepData

#: Token columns an explanation keeps per token (beside the producers' terms).
TOKEN_KEYS = ("rank", "micro_batch", "sample_id", "pos", "token_id", "mask")


def unit_batch(b: TokenBatch) -> TokenBatch:
    """``b`` with every token a sequence of its own (the sequence keys kept per token elsewhere)."""
    cols = dict(b.cols)
    cols["sample_id"] = np.arange(b.n, dtype=np.int64)
    return TokenBatch(cols, set(b.present))


def token_terms(b: TokenBatch, cfg: dict, families: frozenset[str]) -> dict[str, np.ndarray]:
    """Per token of ``b``: the partial columns of the producers of ``families``, each token
    evaluated as its own sequence, plus the token's keys (:data:`TOKEN_KEYS`)."""
    unit = unit_batch(b)
    out: dict[str, np.ndarray] = {}
    for p in PRODUCERS.values():
        if families.isdisjoint(p.families) or not unit.has(*p.requires):
            continue
        out.update(p.fn(unit, cfg))
    for k in TOKEN_KEYS:
        if k == "token_id":
            out[k] = b.cols[k] if "token_id" in b.present else np.full(b.n, -1, dtype=np.int64)
        else:
            out[k] = b.cols[k]
    return out


class TokenTermsVisitor(Visitor):
    """A visitor of the engine's pass (:mod:`grpolens.metrics.engine`): each shard's
    :func:`token_terms`, concatenated per step."""

    name = "explain_token_terms"

    def __init__(self, cfg: dict, families: frozenset[str]):
        self.cfg, self.families = cfg, families

    def shard(self, batch: TokenBatch, shard) -> dict[str, np.ndarray]:
        return token_terms(batch, self.cfg, self.families)

    def combine(self, step: int, pieces: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        pieces = [p for p in pieces if len(p["pos"])]
        if not pieces:
            return {}
        names = set.intersection(*(set(p) for p in pieces))  # a producer skipped on some shard: dropped
        return {c: np.concatenate([p[c] for p in pieces]) for c in names}


@dataclass
class StepTerms:
    """What one step contributes to an explanation."""

    step: int
    sd: StepData
    #: per token (empty without token shards): keys, ``seq`` (row of ``sd.seqs``), producer terms
    tokens: dict[str, np.ndarray] = field(default_factory=dict)
    #: per sequence of ``sd.seqs``: group_id and reward from the samples (-1 / NaN when unknown)
    group: np.ndarray | None = None
    reward: np.ndarray | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def n_seq(self) -> int:
        return self.sd.n_seq


def sequence_index(seqs: dict[str, np.ndarray], tokens: dict[str, np.ndarray]) -> np.ndarray:
    """For each token, the row of its sequence in the step's partial table (sorted by the key
    columns, as :func:`grpolens.metrics.partials.merge_arrays` leaves it)."""
    keys = [k for k in KEY_COLUMNS if k != "step"]
    n_seq = len(seqs["sample_id"])
    both = {k: np.concatenate([np.asarray(seqs[k], dtype=np.int64), np.asarray(tokens[k], dtype=np.int64)])
            for k in keys}
    order = np.lexsort([both[k] for k in keys[::-1]])
    new = np.zeros(len(order), dtype=bool)
    new[0] = True
    for k in keys:
        c = both[k][order]
        new[1:] |= c[1:] != c[:-1]
    code = np.empty(len(order), dtype=np.int64)
    code[order] = np.cumsum(new) - 1
    seq_of_code = np.full(code.max() + 1, -1, dtype=np.int64)
    seq_of_code[code[:n_seq]] = np.arange(n_seq)
    return seq_of_code[code[n_seq:]]


def token_additive(seq_col: np.ndarray, tok_col: np.ndarray, seq: np.ndarray, n_seq: int) -> bool:
    """Whether a partial column is the sum of its tokens' terms, sequence by sequence (to float
    rounding: the per-sequence and per-token sums add in different orders)."""
    with np.errstate(invalid="ignore", over="ignore"):
        sums = np.bincount(seq, tok_col, n_seq)
        scale = np.bincount(seq, np.abs(tok_col), n_seq)
        close = np.abs(sums - seq_col) <= 1e-9 * scale + 1e-300
    same = (sums == seq_col) | (np.isnan(sums) & np.isnan(seq_col))  # inf == inf, NaN as NaN
    return bool(np.all(close | same))


def sum_merged(col: str) -> bool:
    return merge_rules().get(col, "sum") == "sum"


def read_step(reader, step: int, cfg: dict, profile, families: frozenset[str], sample_index: Any,
              with_tokens: bool = True) -> StepTerms:
    """One step's :class:`StepTerms`: the engine's pass over its token shards (the metric's
    families' producers and visitors, plus :class:`TokenTermsVisitor`), its samples."""
    from grpolens.analysis.recompute import step_visitors
    from grpolens.metrics.engine import InlineEngine, iter_steps
    from grpolens.run import format as fmt

    samples = reader.samples(step)
    if step not in set(reader.steps(fmt.TOKENS)):
        sd = StepData(step, {}, cfg, profile, samples, set(), {})
        return StepTerms(step, sd)
    visitors = step_visitors(cfg, families)
    extra = TokenTermsVisitor(cfg, families) if with_tokens else None
    res = next(iter_steps(reader.path, [step], visitors + ([extra] if extra else []), engine=InlineEngine()))
    seqs, present = res.pieces[visitors[0].name]
    sd = StepData(step, seqs, cfg, profile, samples, present, {})
    sd.extra["pieces"] = res.pieces
    sd.extra["run_has_samples"] = sample_index.has_samples
    terms = StepTerms(step, sd)
    if extra is not None and sd.n_seq:
        tok = res.pieces[extra.name]
        if tok:
            tok["seq"] = sequence_index(seqs, tok)
            terms.tokens = tok
    if sd.n_seq:
        terms.group, terms.reward = sample_index.lookup(seqs["sample_id"], step)
    return terms


class SampleIndex:
    """sample_id -> (group_id, reward) from the samples shards. A completion is often trained on
    at a later step than it was generated (TRL's steps_per_generation, reused completions), so a
    step's completions are looked up in its own samples and then in earlier steps' until found."""

    #: how many earlier sample steps are read before a completion counts as unknown
    LOOKBACK = 64

    def __init__(self, reader):
        from grpolens.run import format as fmt

        self.reader = reader
        self.sample_steps = reader.steps(fmt.SAMPLES)
        self.has_samples = bool(self.sample_steps)
        self._loaded: set[int] = set()
        self._group: dict[int, int] = {}
        self._reward: dict[int, float] = {}
        self.has_reward = False

    def _load(self, step: int) -> None:
        self._loaded.add(step)
        df = self.reader.samples(step)
        if df is None or df.height == 0 or "sample_id" not in df.columns:
            return
        sid = df["sample_id"].to_numpy()
        gid = df["group_id"].to_numpy() if "group_id" in df.columns else np.full(len(sid), -1)
        if "reward" in df.columns and df["reward"].null_count() < df.height:
            rew = df["reward"].cast(float).fill_null(float("nan")).to_numpy()
            self.has_reward = True
        else:
            rew = np.full(len(sid), np.nan)
        for s, g, r in zip(sid.tolist(), gid.tolist(), rew.tolist()):
            self._group.setdefault(s, g)
            self._reward.setdefault(s, r)

    def lookup(self, sample_ids: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
        """group_id (-1 unknown) and reward (NaN unknown) of each sample id trained on at ``step``."""
        want = set(np.asarray(sample_ids).tolist())
        earlier = [s for s in self.sample_steps if s <= step][::-1][: self.LOOKBACK]
        for s in earlier:
            if want.issubset(self._group):
                break
            if s not in self._loaded:
                self._load(s)
        g = np.array([self._group.get(s, -1) for s in np.asarray(sample_ids).tolist()], dtype=np.int64)
        r = np.array([self._reward.get(s, np.nan) for s in np.asarray(sample_ids).tolist()], dtype=np.float64)
        return g, r
