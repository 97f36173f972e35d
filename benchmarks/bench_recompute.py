"""Recompute speed and memory on a synthetic run, against the read floor.

    python benchmarks/bench_recompute.py --tokens 10e6            # ~10M tokens
    python benchmarks/bench_recompute.py --tokens 100e6 --keep    # the 100M-token figure in the README

Each measurement runs in a fresh process; peak RSS is that process's max resident set size.
The *read floor* is reading every token column of every shard with pyarrow and nothing else.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLOOR = """
import glob, sys, pyarrow.parquet as pq
from concurrent.futures import ThreadPoolExecutor
files = sorted(glob.glob(sys.argv[1] + '/tokens/**/*.parquet', recursive=True))
with ThreadPoolExecutor(2) as ex:
    n = sum(ex.map(lambda f: pq.read_table(f).num_rows, files))
print(n)
"""


def timed(cmd: list[str]) -> tuple[float, float, str]:
    """Wall time, the child's own peak RSS in MiB (from wait4), and its stdout."""
    import os

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{err.read()[-2000:]}")
        return wall, usage.ru_maxrss / 1024, out.read()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=float, default=10e6, help="approximate token rows in the run")
    ap.add_argument("--dir", type=Path, default=None, help="where to put the run (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the run afterwards")
    args = ap.parse_args()

    base = args.dir or Path(tempfile.mkdtemp(prefix="grpolens-bench-"))
    run = base / "run"
    # ~127 stored tokens per completion on average at max-len 1024 in synth's length model (measured)
    per_step = 2 * 4 * 16 * 8 * 127
    steps = max(2, int(args.tokens / per_step))
    if not run.exists():
        wall, rss, _ = timed([sys.executable, "-m", "grpolens.cli", "synth", str(run), "--steps", str(steps),
                              "--ranks", "2", "--micro-batches", "4", "--groups", "16", "--generations", "8",
                              "--max-len", "1024", "--seed", "1"])
        print(f"synth: {steps} steps in {wall:.1f} s")
    wall, rss, out = timed([sys.executable, "-c", FLOOR, str(run)])
    rows = int(out.strip())
    steps = len(list((run / "tokens").iterdir()))
    print(f"run: {rows:,} token rows, {steps} steps, {sum(f.stat().st_size for f in run.rglob('*.parquet')) / 2**20:.0f} MiB")
    print(f"{'what':<34}{'wall s':>9}{'M tok/s':>9}{'peak RSS MiB':>14}")
    print(f"{'read floor (all columns)':<34}{wall:>9.2f}{rows / wall / 1e6:>9.2f}{rss:>14.0f}")
    wall, rss, _ = timed([sys.executable, "-m", "grpolens.cli", "recompute", str(run), "--full", "--quiet"])
    print(f"{'recompute --full (all metrics)':<34}{wall:>9.2f}{rows / wall / 1e6:>9.2f}{rss:>14.0f}")
    wall, rss, _ = timed([sys.executable, "-m", "grpolens.cli", "recompute", str(run), "--quiet"])
    print(f"{'recompute, nothing new (cache)':<34}{wall:>9.2f}{'':>9}{rss:>14.0f}")
    if not args.keep and args.dir is None:
        shutil.rmtree(base)


if __name__ == "__main__":
    main()
