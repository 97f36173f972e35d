"""A script run in fresh interpreters over one numba cache: compiled in the first, loaded from the
cache in the others. A cached kernel can fail only on loading (a recursive one once crashed that
way while the compiling process was fine), and every recompute after the first loads them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def outputs_over_one_cache(script: str, cache: Path, runs: int = 3) -> list[str]:
    """``script``'s stdout in each of ``runs`` fresh interpreters sharing the numba cache ``cache``
    (asserting that each succeeded and that the first one cached something)."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    done = [subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
            for _ in range(runs)]
    for r in done:
        assert r.returncode == 0, r.stderr[-2000:]
    assert any(cache.rglob("*.nbi")), "nothing was cached: the reloads tested nothing"
    return [r.stdout for r in done]
