"""The first compile of a process is announced, a cached load is not: the first recompute after an
install compiles the engine's kernels (seconds of CPU), and a user should see why it waits."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import numpy as np
    from grpolens.functional.jit import kernel, on_first_compile

    @kernel
    def total(x):
        s = 0.0
        for v in x:
            s += v
        return s

    on_first_compile(lambda: print("compiling"))
    on_first_compile(lambda: print("second callback"))
    print(total(np.arange(4.0)), total(np.arange(3.0)))
""")


def _run(script: Path, cache: Path) -> list[str]:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split("\n")[:-1]


def test_the_first_compile_calls_back_once_and_a_cached_load_not_at_all(tmp_path):
    script = tmp_path / "kernels_here.py"
    script.write_text(SCRIPT)
    cache = tmp_path / "cache"
    assert _run(script, cache) == ["compiling", "second callback", "6.0 3.0"]
    assert _run(script, cache) == ["6.0 3.0"]  # loaded from the cache: nothing to announce


def test_recompute_says_it_compiles_on_a_cold_cache_only(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(ROOT / "sample_runs" / "tiny", run, ignore=shutil.ignore_patterns("grpolens"))
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "grpolens.cli", "recompute", str(run), "--full", "--workers", "1",
           "--out", str(tmp_path / "out")]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert first.stderr.count("compiling grpolens' per-token kernels") == 1
    again = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert "compiling" not in again.stderr
