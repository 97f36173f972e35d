"""The dashboard's hand-written helpers against the libraries that could replace them, side by side.

    python benchmarks/bench_serve_libs.py                 # both comparisons, default sizes
    python benchmarks/bench_serve_libs.py --points 1e4 1e6 --repeat 5

* **min-max downsampling** of one curve to ``CURVE_POINTS`` points: the numpy loop over buckets
  (per-bucket nanargmin/nanargmax) that ``grpolens.serve.data.downsample_minmax`` was until this
  comparison, kept here as the baseline, against ``downsample_minmax`` now, which calls
  ``tsdownsample.MinMaxDownsampler`` (Rust, SIMD). Both keep, per bucket, the indices of its
  minimum and maximum; the bucket edges differ, so their picks are compared by what matters, the
  extremes kept (the global min and max of the curve are among both picks).
* **the LRU cache with a lock** the callbacks share: ``grpolens.serve.data.memo.Memo``
  (OrderedDict and a lock) against ``cachetools.LRUCache`` behind a ``threading.Lock`` (what
  ``cachetools.cached(cache, lock=...)`` does), per hit and per miss with eviction.

Times are the best of ``--repeat`` runs; the ratio is the library's time over the hand-written
code's (below 1: the library is faster). Nothing here is asserted: tests/test_bench_scripts.py runs the script on small
sizes so that it keeps working.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path
import sys

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, run as a script


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def numpy_minmax(n: int, y: np.ndarray, max_points: int) -> np.ndarray:
    """The hand-written baseline: per bucket, nanargmin and nanargmax in a Python loop."""
    buckets = max(1, max_points // 2)
    edges = np.linspace(0, n, buckets + 1).astype(int)
    keep = [0, n - 1]
    yy = np.where(np.isfinite(y), y, np.nan)
    for a, b in zip(edges[:-1], edges[1:]):
        seg = yy[a:b]
        if b <= a:
            continue
        if np.all(np.isnan(seg)):
            keep.append(a)
            continue
        keep += [a + int(np.nanargmin(seg)), a + int(np.nanargmax(seg))]
    return np.unique(np.asarray(keep))


def downsampling(sizes: list[int], repeat: int) -> list[dict]:
    from grpolens.serve.data import CURVE_POINTS, downsample_minmax

    rng = np.random.default_rng(0)
    rows = []
    for n in sizes:
        y = np.cumsum(rng.normal(size=n)) + 50 * (rng.random(n) < 1e-4)  # a random walk with rare spikes
        ours = _best(lambda: numpy_minmax(n, y, CURVE_POINTS), repeat)
        theirs = _best(lambda: downsample_minmax(n, y, CURVE_POINTS), repeat)
        a, b = numpy_minmax(n, y, CURVE_POINTS), downsample_minmax(n, y, CURVE_POINTS)
        same_extremes = {int(np.argmin(y)), int(np.argmax(y))} <= set(a.tolist()) & set(b.tolist())
        rows.append({"what": f"min-max downsampling, {n:,} points -> {CURVE_POINTS}", "ours_ms": ours * 1e3,
                     "library_ms": theirs * 1e3, "ratio": theirs / ours, "note": f"extremes kept by both: {same_extremes}"})
    return rows


def lru(repeat: int, ops: int = 20000) -> list[dict]:
    from cachetools import LRUCache

    from grpolens.serve.data.memo import Memo

    keys = [("series", f"/runs/r{i}", (i, i)) for i in range(200)]
    value = object()

    def ours_hits():
        m = Memo(64)
        for k in keys[:64]:
            m.get(k, lambda: value)
        for i in range(ops):
            m.get(keys[i % 64], lambda: value)

    def lib_hits():
        c, lock = LRUCache(64), threading.Lock()
        for k in keys[:64]:
            with lock:
                c[k] = value
        for i in range(ops):
            k = keys[i % 64]
            with lock:
                try:
                    c[k]
                    continue
                except KeyError:
                    pass
            with lock:
                c[k] = value

    def ours_misses():
        m = Memo(64)
        for i in range(ops):
            m.get(keys[i % 200], lambda: value)

    def lib_misses():
        c, lock = LRUCache(64), threading.Lock()
        for i in range(ops):
            k = keys[i % 200]
            with lock:
                hit = k in c
                if hit:
                    c[k]
            if not hit:
                with lock:
                    c[k] = value

    rows = []
    for label, a, b in (("hits", ours_hits, lib_hits), ("misses, each evicting", ours_misses, lib_misses)):
        ours, theirs = _best(a, repeat), _best(b, repeat)
        rows.append({"what": f"LRU with a lock, {ops:,} {label}", "ours_ms": ours * 1e3, "library_ms": theirs * 1e3,
                     "ratio": theirs / ours, "note": f"{ours / ops * 1e9:.0f} ns vs {theirs / ops * 1e9:.0f} ns per get"})
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", nargs="+", type=float, default=[1e4, 1e5, 1e6], help="curve lengths to downsample")
    ap.add_argument("--repeat", type=int, default=5, help="runs per timing (the best is kept)")
    ap.add_argument("--ops", type=int, default=20000, help="cache gets per LRU timing")
    args = ap.parse_args(argv)
    rows = downsampling([int(p) for p in args.points], args.repeat) + lru(args.repeat, args.ops)
    print("| what | hand-written (ms) | library (ms) | library / hand-written | |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['what']} | {r['ours_ms']:.3f} | {r['library_ms']:.3f} | {r['ratio']:.2f} | {r['note']} |")
    return rows


if __name__ == "__main__":
    main()
