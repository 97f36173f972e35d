"""Cost of the rollout_is family in a recompute, and a one-pass sweep vs one recompute per grid point.

    python benchmarks/bench_rollout_is.py [RUN]     (default: a synthetic 2M-token run in /tmp)

CPU seconds (process time, best of 2) with GRPOLENS_THREADS=1 so that numbers from a shared
machine are comparable.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("GRPOLENS_THREADS", "1")

import grpolens  # noqa: E402
from grpolens.analysis import sweep as sw  # noqa: E402
from grpolens.metrics import engine, partials, registry  # noqa: E402


def best(fn, k: int = 2) -> float:
    out = float("inf")
    for _ in range(k):
        t = time.process_time()
        fn()
        out = min(out, time.process_time() - t)
    return out


def main() -> None:
    run = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/grpolens-bench-ris")
    if not run.exists():
        from grpolens.adapters.synth import synth_run

        synth_run(run, steps=8, ranks=4, micro_batches=4, groups=16, generations=8, max_len=1024, seed=0,
                  inject=["rollout-drift@4"])
    grpolens.recompute(run, write=False, incremental=False, steps="0:0")  # warm imports
    params = sw.parse_params(["rollout_is.upper=1.5,2,3,5", "rollout_is.veto_lower=1e-4,1e-3"])
    t_sweep = best(lambda: sw.sweep(run, params))
    t_one = best(lambda: grpolens.recompute(run, write=False, incremental=False,
                                            overrides={"rollout_is": {"upper": 2.0, "veto_lower": 1e-4}}))
    t_all = best(lambda: grpolens.recompute(run, write=False, incremental=False))
    for n in ("rollout_is", "mismatch"):
        partials.PRODUCERS.pop(n)
    for n in ("rollout_is.delta", "rollout_is.hist", "rollout_is.rs"):
        engine.VISITORS.pop(n)
    for k in [k for k, m in registry.REGISTRY.items() if m.family == "rollout_is"]:
        registry.REGISTRY.pop(k)
    t_without = best(lambda: grpolens.recompute(run, write=False, incremental=False))
    print(f"recompute, every family:         {t_all:6.2f} s CPU")
    print(f"recompute, without rollout_is:   {t_without:6.2f} s CPU  (rollout_is: +{t_all - t_without:.2f} s)")
    print(f"sweep, 8 grid points, one pass:  {t_sweep:6.2f} s CPU  (8 recomputes: ~{8 * t_one:.2f} s)")


if __name__ == "__main__":
    main()
