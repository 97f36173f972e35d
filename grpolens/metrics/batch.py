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

FLOAT_COLUMNS = ("logp", "old_logp", "ref_logp", "rollout_logp", "advantage", "entropy", "old_entropy")
KEY_COLUMNS = ("step", "rank", "micro_batch", "sample_id")


def _to_float64(arr: pa.ChunkedArray | pa.Array) -> np.ndarray:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    # Arrow turns the nulls of a floating-point array into NaN (a copy, hence zero_copy_only=False)
    return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=np.float64)


def _to_numpy(arr: pa.ChunkedArray | pa.Array, dtype) -> np.ndarray:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=dtype)


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

    def __init__(self, cols: dict[str, np.ndarray], present: set[str]):
        self.cols = cols
        self.present = present
        self._cache: dict = {}
        self.n = len(cols["logp"])
        mb, sid = cols["micro_batch"], cols["sample_id"]
        rank, step = cols["rank"], cols["step"]
        if self.n:
            change = np.empty(self.n, dtype=bool)
            change[0] = True
            change[1:] = (mb[1:] != mb[:-1]) | (sid[1:] != sid[:-1]) | (rank[1:] != rank[:-1]) | (step[1:] != step[:-1])
            self.starts = np.flatnonzero(change)
        else:
            self.starts = np.zeros(0, dtype=np.int64)
        self.n_seq = len(self.starts)
        self.lengths = np.diff(np.append(self.starts, self.n))

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_arrow(cls, table: pa.Table) -> "TokenBatch":
        """Build from a tokens table; sorts by (step, rank, micro_batch, sample_id, pos) if needed."""
        names = set(table.column_names)
        cols: dict[str, np.ndarray] = {}
        for k in KEY_COLUMNS:
            cols[k] = _to_numpy(table.column(k), np.int64)
        cols["pos"] = _to_numpy(table.column("pos"), np.int64)
        if not _is_sorted(cols):
            order = np.lexsort((cols["pos"], cols["sample_id"], cols["micro_batch"], cols["rank"], cols["step"]))
            table = table.take(pa.array(order))
            for k in (*KEY_COLUMNS, "pos"):
                cols[k] = cols[k][order]
        present = set()
        old_null = None
        if "old_logp" in names and table.column("old_logp").null_count:
            old_null = _to_numpy(table.column("old_logp").is_null(), bool)
        for k in FLOAT_COLUMNS:
            if k in names and table.column(k).null_count < len(table):
                cols[k] = _to_float64(table.column(k))
                present.add(k)
            elif k in ("logp", "advantage"):
                cols[k] = np.full(len(table), np.nan)  # absent, or every value null
        mask = table.column("mask")
        cols["mask"] = _to_numpy(mask.fill_null(False) if mask.null_count else mask, bool)
        if "rollout_rejected" in names and table.column("rollout_rejected").null_count < len(table):
            rej = table.column("rollout_rejected")
            cols["rollout_rejected"] = _to_numpy(rej.fill_null(False) if rej.null_count else rej, bool)
            present.add("rollout_rejected")
        if "token_id" in names and table.column("token_id").null_count < len(table):
            tid = table.column("token_id")
            cols["token_id"] = _to_numpy(tid.fill_null(-1) if tid.null_count else tid, np.int64)
            present.add("token_id")
        if "old_logp" in present and old_null is not None:
            # null = "no behaviour policy for this token": ratio 1. A stored NaN stays NaN (non-finite).
            cols["old_logp"] = np.where(old_null, cols["logp"], cols["old_logp"])
        return cls(cols, present)

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


def _is_sorted(cols: dict[str, np.ndarray]) -> bool:
    n = len(cols["pos"])
    if n < 2:
        return True
    keys = [cols["step"], cols["rank"], cols["micro_batch"], cols["sample_id"], cols["pos"]]
    # lexicographic non-decreasing check, vectorised: compare each adjacent pair key by key
    undecided = np.ones(n - 1, dtype=bool)
    for k in keys:
        a, b = k[:-1], k[1:]
        if np.any(undecided & (b < a)):
            return False
        undecided &= b == a
    return not undecided.any()  # equal full keys are duplicates: treat as unsorted input
