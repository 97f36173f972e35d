"""Doctor reads recomputed metrics, it does not recompute: its cost on a long run, side by side
with the recompute it avoids.

    python benchmarks/bench_doctor.py [--steps 1000 --groups 4 --generations 4 --max-len 256 --repeat 3]

Writes a synthetic run with a KL spike and a rollout drift planted (so detectors fire and explain
has steps to decompose), then times, best of ``--repeat`` (wall and CPU):

1. ``recompute`` from scratch (``incremental=False``, outputs written): the baseline;
2. ``diagnose(run, explain=False)`` on the fresh outputs: the statistics over the metrics frame;
3. ``diagnose(run)``: the same plus explain at each finding's worst step (when explain is installed).

and prints each as a ratio to the recompute.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from grpolens.adapters.synth import synth_run
from grpolens.analysis.doctor import diagnose
from grpolens.analysis.recompute import recompute


def best_of(repeat: int, fn) -> tuple[float, float, object]:
    wall, cpu, out = [], [], None
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return min(wall), min(cpu), out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, default=1, help="recompute's worker processes (1: this one)")
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-doctor-"))
    try:
        run = synth_run(tmp / "run", steps=a.steps, groups=a.groups, generations=a.generations, max_len=a.max_len,
                        seed=0, inject=[f"kl-spike@{a.steps // 2}", f"rollout-drift@{3 * a.steps // 4}"])
        print(f"run: {a.steps} steps × {a.groups * a.generations} completions, max_len {a.max_len}")
        rw, rc, _ = best_of(1 if a.repeat < 1 else min(a.repeat, 2),
                            lambda: recompute(run, incremental=False, workers=a.workers))
        print(f"recompute (from scratch, --workers {a.workers}): {rw:8.2f} s wall  {rc:8.2f} s CPU")
        dw, dc, rep = best_of(a.repeat, lambda: diagnose(run, explain=False))
        print(f"doctor --no-explain (fresh outputs):   {dw:8.3f} s wall  {dc:8.3f} s CPU  "
              f"= {dw / rw:.4f}× the recompute's wall time; {len(rep.findings)} finding(s)")
        ew, ec, rep = best_of(a.repeat, lambda: diagnose(run))
        explained = sum("explain" in f.evidence for f in rep.findings)
        print(f"doctor (explain at worst steps):       {ew:8.3f} s wall  {ec:8.3f} s CPU  "
              f"= {ew / rw:.4f}× the recompute's wall time; {explained} finding(s) explained"
              + ("" if explained else f" ({rep.notes[0] if rep.notes else 'none flagged'})"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
