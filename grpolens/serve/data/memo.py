"""Caches: results memoised per run and step, keyed by a fingerprint of the files they came from."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Hashable

from grpolens.run import format as fmt


class Memo:
    """A small thread-safe LRU cache (the Dash server answers callbacks from several threads).

    Hand-written rather than ``cachetools.LRUCache`` behind a lock: ``benchmarks/bench_serve_libs.py``
    measured cachetools no faster per hit (0.8x to 1.5x of this one's time over repeated runs on a
    loaded machine) and 2x to 3.5x slower per miss (its pure-Python bookkeeping); the value is
    computed outside the lock here, which ``cachetools.cached`` offers too but no faster."""

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


#: run URL -> the digest of its listing at the last ``--watch`` poll (:mod:`grpolens.serve.watch`)
_LISTINGS_SEEN: dict[str, tuple] = {}


def note_listing(run: Any, digest: tuple) -> None:
    """Record what the ``--watch`` poller last saw of an ``s3://`` run (its :func:`run_version`)."""
    _LISTINGS_SEEN[str(run)] = digest


def run_version(run: Path) -> tuple:
    """Changes whenever the run's metrics are rewritten or a step appears or completes (cheap:
    four stats). For a run on object storage, whose prefixes have no modification time, and
    which the page's poll must not list every few seconds: the metrics' stat and the listing
    digest of the last ``--watch`` poll."""
    if fmt.is_remote_run(run):
        return (_stat(metrics_path(run)), _LISTINGS_SEEN.get(str(run)))
    return (_stat(metrics_path(run)), _stat(run / fmt.TOKENS), _stat(run / fmt.SAMPLES),
            _stat(run / fmt.COMPLETE_DIR))


def _step_fingerprint(run: Path, step: int) -> tuple:
    shards = fmt.list_shards(run, fmt.TOKENS, [step]) + fmt.list_shards(run, fmt.SAMPLES, [step])
    # path, size, mtime: from the listing for a run on object storage (no request per shard)
    return tuple(tuple(sh.fingerprint()) for sh in shards)

def metrics_path(run: Path) -> Path:
    return fmt.derived_dir(run) / "metrics.parquet"
