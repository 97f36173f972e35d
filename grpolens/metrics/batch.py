"""Token rows of whole sequences as numpy arrays, with the segment reductions every family uses.

A :class:`TokenBatch` holds the rows of one shard (or any set of whole loss-call sequences). Rows
are ordered so that each sequence -- one (step, rank, micro_batch, sample_id) -- is one contiguous
run; per-sequence reductions are then ``np.add.reduceat`` over the run starts, which is the cheap
path the design notes measured. Float columns are widened to float64 so that sums are exact
enough to compare with an independent float64 reference; nulls become NaN.

Null conventions (from the run format): ``old_logp`` null means the trainer had no behaviour
policy -- the ratio is 1, so ``old`` falls back to ``logp`` token by token.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from grpolens.functional.jit import kernel
from grpolens.run.token_columns import bools, numeric, values

FLOAT_COLUMNS = ("logp", "old_logp", "ref_logp", "rollout_logp", "advantage", "entropy", "old_entropy")
KEY_COLUMNS = ("step", "rank", "micro_batch", "sample_id")


def _to_float64(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    # a null becomes NaN; float64 stays a view of the Arrow buffer, float32 is widened (one copy)
    if not numeric(col):
        return _converted(col, np.float64)
    return values(col, null=np.nan).astype(np.float64, copy=False)


def _to_int64(col: pa.ChunkedArray | pa.Array, null: int) -> np.ndarray:
    if not numeric(col):
        return _converted(col.fill_null(null) if col.null_count else col, np.int64)
    return values(col, null=null).astype(np.int64, copy=False)


def _converted(col: pa.ChunkedArray | pa.Array, dtype) -> np.ndarray:
    """A column of a type that is not a plain number (one the footer check refuses before any read;
    a caller that skipped it): Arrow's own conversion, as before."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=dtype)


@kernel
def _sequence_starts(step, rank, micro_batch, sample_id, pos):
    """(the first row of each run of rows with one (step, rank, micro_batch, sample_id), whether
    every row's full key is above the previous row's), in one pass over the keys."""
    n = len(pos)
    starts = np.empty(n, dtype=np.int64)
    k = 0
    ordered = True
    for i in range(n):
        if i == 0:
            starts[0] = 0
            k = 1
            continue
        s, r, m, q = step[i], rank[i], micro_batch[i], sample_id[i]
        ps, pr, pm, pq = step[i - 1], rank[i - 1], micro_batch[i - 1], sample_id[i - 1]
        if s != ps or r != pr or m != pm or q != pq:
            starts[k] = i
            k += 1
            if ordered and (s < ps or (s == ps and (r < pr or (r == pr and (m < pm or (m == pm and q < pq)))))):
                ordered = False
        elif pos[i] <= pos[i - 1]:
            ordered = False  # out of order within a sequence, or the same key twice
    return starts[:k].copy(), ordered


@kernel
def _seq_count(valid, starts):
    """Per segment (rows from each start to the next), the number of true values, as float64."""
    n, m = len(valid), len(starts)
    out = np.empty(m, dtype=np.float64)
    for j in range(m):
        # a segment as its own array indexed from 0: numba then knows no index is negative and
        # vectorises the loop (indices from ``starts`` would each be checked for wrapping around)
        seg = valid[starts[j]:starts[j + 1] if j + 1 < m else n]
        c = 0
        for k in range(len(seg)):
            c += seg[k]
        out[j] = c
    return out


@kernel
def _seq_any(x, starts):
    """Per segment, whether any value is true."""
    n, m = len(x), len(starts)
    out = np.zeros(m, dtype=np.bool_)
    for j in range(m):
        seg = x[starts[j]:starts[j + 1] if j + 1 < m else n]
        for k in range(len(seg)):
            if seg[k]:
                out[j] = True
                break
    return out


class per_batch:
    """A property computed once per batch and kept in its cache (:meth:`TokenBatch.cached`)."""

    def __init__(self, fn):
        self.fn, self.name, self.__doc__ = fn, fn.__name__, fn.__doc__

    def __get__(self, b, owner=None):
        if b is None:
            return self
        hit = b._cache.get(self.name, _MISSING)
        return b.cached(self.name, lambda: self.fn(b)) if hit is _MISSING else hit


_MISSING = object()


class TokenBatch:
    """Per-token arrays plus sequence boundaries.

    ``present`` names the optional columns the data actually has (a column that exists but is
    entirely null counts as absent: e.g. a run without a reference model).

    One cache per batch holds whatever several families or visitors of a pass derive from it
    (the masks, d and e^d, the rollout-IS inputs, the engine's partials): :meth:`cached` for a
    keyed value, :class:`per_batch` for a property. Each full-length pass costs about as much as
    the read, so computing it once matters.
    """

    def __init__(self, cols: dict[str, np.ndarray], present: set[str], starts: np.ndarray | None = None):
        self.cols = cols
        self.present = present
        self._cache: dict = {}
        self.n = len(cols["logp"])
        if starts is None:
            starts, _ = _sequence_starts(cols["step"], cols["rank"], cols["micro_batch"], cols["sample_id"], cols["pos"])
        #: the first row of each sequence (a change of any of step, rank, micro_batch, sample_id)
        self.starts = starts
        self.n_seq = len(self.starts)
        self.lengths = np.diff(np.append(self.starts, self.n))

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_arrow(cls, table: pa.Table) -> "TokenBatch":
        """Build from a tokens table; sorts by (step, rank, micro_batch, sample_id, pos) if needed."""
        names = set(table.column_names)
        cols: dict[str, np.ndarray] = {k: _to_int64(table.column(k), -1) for k in (*KEY_COLUMNS, "pos")}
        starts, ordered = _sequence_starts(*(cols[k] for k in (*KEY_COLUMNS, "pos")))
        if not ordered:  # also when a key repeats: sorted stably, the repeats stay
            order = np.lexsort((cols["pos"], cols["sample_id"], cols["micro_batch"], cols["rank"], cols["step"]))
            table = table.take(pa.array(order))
            for k in (*KEY_COLUMNS, "pos"):
                cols[k] = cols[k][order]
            starts = None
        present = set()
        old_null = None
        if "old_logp" in names and table.column("old_logp").null_count:
            old_null = bools(table.column("old_logp").is_null())
        for k in FLOAT_COLUMNS:
            if k in names and table.column(k).null_count < len(table):
                cols[k] = _to_float64(table.column(k))
                present.add(k)
            elif k in ("logp", "advantage"):
                cols[k] = np.full(len(table), np.nan)  # absent, or every value null
        cols["mask"] = bools(table.column("mask"))
        if "rollout_rejected" in names and table.column("rollout_rejected").null_count < len(table):
            cols["rollout_rejected"] = bools(table.column("rollout_rejected"))
            present.add("rollout_rejected")
        if "token_id" in names and table.column("token_id").null_count < len(table):
            cols["token_id"] = _to_int64(table.column("token_id"), -1)
            present.add("token_id")
        if "old_logp" in present and old_null is not None:
            # null = "no behaviour policy for this token": ratio 1. A stored NaN stays NaN (non-finite).
            cols["old_logp"] = np.where(old_null, cols["logp"], cols["old_logp"])
        return cls(cols, present, starts)

    # -- segment reductions ----------------------------------------------------------------------
    def seq_sum(self, x: np.ndarray) -> np.ndarray:
        if self.n_seq == 0:
            return np.zeros(0)
        return np.add.reduceat(x, self.starts)

    def seq_max(self, x: np.ndarray, where: np.ndarray, empty: float = -np.inf) -> np.ndarray:
        """Max of x over tokens where ``where`` holds; ``empty`` for sequences without any."""
        if self.n_seq == 0:
            return np.zeros(0)
        return np.maximum.reduceat(np.where(where, x, empty), self.starts)

    def seq_min(self, x: np.ndarray, where: np.ndarray, empty: float = np.inf) -> np.ndarray:
        if self.n_seq == 0:
            return np.zeros(0)
        return np.minimum.reduceat(np.where(where, x, empty), self.starts)

    def seq_any(self, x: np.ndarray) -> np.ndarray:
        if self.n_seq == 0:
            return np.zeros(0, dtype=bool)
        if x.dtype == np.bool_:
            return _seq_any(x, self.starts)
        return np.maximum.reduceat(x.astype(np.int8), self.starts).astype(bool)

    def broadcast(self, per_seq: np.ndarray) -> np.ndarray:
        """Repeat one value per sequence onto that sequence's tokens."""
        return np.repeat(per_seq, self.lengths)

    def seq_first(self, x: np.ndarray) -> np.ndarray:
        return x[self.starts]

    def masked_sum(self, x: np.ndarray, valid: np.ndarray) -> np.ndarray:
        """Per-sequence Σ x over valid tokens (invalid tokens contribute exactly 0, even if NaN)."""
        return self.seq_sum(np.where(valid, x, 0.0))

    def count(self, valid: np.ndarray) -> np.ndarray:
        """Per-sequence number of true ``valid`` tokens, as float64 (exact: a count below 2**53)."""
        if valid.dtype == np.bool_ and self.n_seq:
            return _seq_count(valid, self.starts)  # without a float64 copy of the mask
        return self.seq_sum(valid.astype(np.float64))

    # -- shared per-token quantities (computed once, used by several families) --------------------
    def cached(self, key, make):
        """``make()``, computed once per batch under ``key`` (any hashable: a name, or a name and
        the config it depends on)."""
        try:
            return self._cache[key]
        except KeyError:
            value = self._cache[key] = make()
            return value

    @property
    def partials(self) -> dict[str, np.ndarray] | None:
        """The per-sequence partial columns, once the engine has computed them for this batch
        (visitors after it in the same pass reuse them instead of recomputing)."""
        return self._cache.get("partials")

    @partials.setter
    def partials(self, cols: dict[str, np.ndarray]) -> None:
        self._cache["partials"] = cols

    def has(self, *columns: str) -> bool:
        return all(c in self.present for c in columns)

    @per_batch
    def mask(self) -> np.ndarray:
        return self.cols["mask"]

    @per_batch
    def pre_rejection_mask(self) -> np.ndarray:
        """The mask the trainer's rollout correction (IS weights, rejection filters, mismatch
        metrics) was computed on: ``mask`` plus the tokens it rejected (``rollout_rejected``); the
        loss mask itself when the run does not say which tokens were rejected."""
        if "rollout_rejected" in self.present:
            return self.mask | self.cols["rollout_rejected"]
        return self.mask

    @per_batch
    def logp(self) -> np.ndarray:
        return self.cols["logp"]

    @per_batch
    def old(self) -> np.ndarray:
        """Behaviour-policy log-prob; the current one where the trainer had none (ratio 1)."""
        return self.cols["old_logp"] if "old_logp" in self.present else self.logp

    @per_batch
    def adv(self) -> np.ndarray:
        return self.cols["advantage"]

    @per_batch
    def log_ratio(self) -> np.ndarray:
        """logp - old_logp (current vs behaviour)."""
        with np.errstate(invalid="ignore"):
            return self.logp - self.old

    @per_batch
    def ratio(self) -> np.ndarray:
        with np.errstate(over="ignore", invalid="ignore"):
            return np.exp(self.log_ratio)

    @per_batch
    def valid_policy(self) -> np.ndarray:
        """Masked tokens whose current and old log-probs and advantage are finite."""
        return self.mask & np.isfinite(self.logp) & np.isfinite(self.old) & np.isfinite(self.adv)

    @per_batch
    def seq_keys(self) -> dict[str, np.ndarray]:
        return {k: self.cols[k][self.starts] for k in KEY_COLUMNS}
