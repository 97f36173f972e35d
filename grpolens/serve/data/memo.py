"""Caches: results memoised per run and step, keyed by a fingerprint of the files they came from."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Hashable

from grpolens.run import format as fmt


class Memo:
    """A small thread-safe LRU cache (the Dash server answers callbacks from several threads)."""

    def __init__(self, size: int):
        self.size = size
        self._d: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._d:
                self._d.move_to_end(key)
                return self._d[key]
        value = make()  # computed outside the lock: two threads may both compute; both are right
        with self._lock:
            self._d[key] = value
            self._d.move_to_end(key)
            while len(self._d) > self.size:
                self._d.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self._d.clear()


_RUN_MEMO = Memo(64)    # per-run series (metrics, samples summary, IS heat map)
_STEP_MEMO = Memo(32)   # per-(run, step) tables: tokens, sequence table


def clear_caches() -> None:
    _RUN_MEMO.clear()
    _STEP_MEMO.clear()


def _stat(path: Path) -> tuple:
    try:
        st = path.stat()
        return (st.st_size, st.st_mtime_ns)
    except OSError:
        return (None, None)


def run_key(run: Path) -> str:
    """The cache key of what grpolens derived for ``run``: its path, and for a what-if variant
    (:class:`grpolens.run.variants.VariantRun`, the same path) the variant's key too. Keys of the
    raw shards' views stay the path alone: a run and its variants share them."""
    variant = getattr(run, "variant", None)
    return str(run) if variant is None else f"{run}@{variant.key}"


def run_version(run: Path) -> tuple:
    """Changes whenever the run's metrics are rewritten or a step appears (cheap: two stats)."""
    return (_stat(metrics_path(run)), _stat(run / fmt.TOKENS), _stat(run / fmt.SAMPLES))


def _step_fingerprint(run: Path, step: int) -> tuple:
    shards = fmt.list_shards(run, fmt.TOKENS, [step]) + fmt.list_shards(run, fmt.SAMPLES, [step])
    # path, size, mtime: from the listing for a run on object storage (no request per shard)
    return tuple(tuple(sh.fingerprint()) for sh in shards)

def metrics_path(run: Path) -> Path:
    return fmt.derived_dir(run) / "metrics.parquet"
