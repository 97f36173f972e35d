"""What explaining one step costs, against recomputing that step (issue #30's budget: at most 2×).

    python benchmarks/bench_explain.py [--steps 4] [--ranks 2] [--micro-batches 4] [--groups 16]
                                       [--max-len 1024] [--repeat 3] [--write-doc]

Builds a synthetic run (once, in /tmp; ``--run DIR`` uses another), then, for a few metrics of
different reductions, times in this process, side by side and best of ``--repeat``:

* ``recompute``: ``grpolens.recompute(run, steps="S:S", write=False, incremental=False)``, every
  metric of step S (one read of its shards, every family);
* ``recompute --only``: the same restricted to the metric's family;
* ``explain``: ``explain(run, metric, S)`` against the previous step (it reads *two* steps, runs
  the family's producers twice on each -- per sequence and per token -- and probes the reduction).

CPU seconds (process time) with GRPOLENS_THREADS=1, so that a shared machine's numbers compare.
``--write-doc`` writes the table into docs/explain.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("GRPOLENS_THREADS", "1")
os.environ.setdefault("GRPOLENS_WORKERS", "1")  # every step computed in this process: its CPU time is counted
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by the tests

METRICS = ("kl/k3", "entropy", "clip/region", "loss", "mismatch/kl_k3", "policy/ratio_max", "reward/mean")


def best(fn, k: int) -> float:
    out = float("inf")
    for _ in range(k):
        t = time.process_time()
        fn()
        out = min(out, time.process_time() - t)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--run", type=Path, default=None)
    ap.add_argument("--metrics", default=",".join(METRICS))
    ap.add_argument("--write-doc", action="store_true")
    args = ap.parse_args(argv)

    import grpolens
    from grpolens.adapters.synth import synth_run
    from grpolens.analysis.explain import explain
    from grpolens.metrics.registry import resolve

    run = args.run or Path(f"/tmp/grpolens-bench-explain-{args.steps}-{args.ranks}-{args.micro_batches}-"
                           f"{args.groups}-{args.max_len}")
    if not run.exists():
        synth_run(run, steps=args.steps, ranks=args.ranks, micro_batches=args.micro_batches, groups=args.groups,
                  generations=8, max_len=args.max_len, seed=0, texts=False)
    step = args.steps - 1
    started = dt.datetime.now(dt.timezone.utc)
    grpolens.recompute(run, steps=f"{step}:{step}", write=False, incremental=False)  # warm imports
    t_all = best(lambda: grpolens.recompute(run, steps=f"{step}:{step}", write=False, incremental=False), args.repeat)
    tokens = int(grpolens.recompute(run, steps=f"{step}:{step}", write=False, incremental=False)["health/tokens"][0])
    rows = []
    for name in args.metrics.split(","):
        fam = resolve(name).family
        t_only = best(lambda: grpolens.recompute(run, steps=f"{step}:{step}", write=False, incremental=False,
                                                 only=[fam]), args.repeat)
        e = explain(run, name, step)
        t_exp = best(lambda: explain(run, name, step), args.repeat)
        rows.append({"metric": name, "units": e.units or ("extremum" if e.extremum else "note"), "recompute": t_all, "only": t_only,
                     "explain": t_exp, "ratio": t_exp / t_all, "ratio_only": t_exp / t_only})
    lines = [f"Step {step} of a synthetic run: {args.ranks} ranks × {args.micro_batches} loss calls, "
             f"{args.groups} prompts × 8 completions per rank, up to {args.max_len} tokens ({tokens:,} tokens "
             "in the step). CPU seconds, best of "
             f"{args.repeat}, one thread:", "",
             "| metric | explained as | recompute the step | recompute `--only` its family | explain (two steps read) "
             "| explain / recompute | explain / `--only` |", "|---|---|--:|--:|--:|--:|--:|"]
    for r in rows:
        lines.append(f"| `{r['metric']}` | {r['units']} | {r['recompute']:.3f} s | {r['only']:.3f} s | "
                     f"{r['explain']:.3f} s | {r['ratio']:.2f}× | {r['ratio_only']:.2f}× |")
    text = "\n".join(lines)
    print(text)
    if args.write_doc:
        from doc_block import header, shown_command, write_block

        cmd = shown_command("benchmarks/bench_explain.py", argv if argv is not None else sys.argv[1:])
        write_block("docs/explain.md", "explain-cost", "benchmarks/bench_explain.py",
                    header(cmd, started) + "\n\n" + text, after="## Cost\n")
    return rows


if __name__ == "__main__":
    main()
