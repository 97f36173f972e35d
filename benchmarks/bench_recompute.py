"""Recompute speed and memory on a synthetic run, against the read floor and two hand-written baselines.

    python benchmarks/bench_recompute.py --tokens 10e6                 # the main table, both step shapes
    python benchmarks/bench_recompute.py --tokens 10e6 --shapes large  # only few large steps
    python benchmarks/bench_recompute.py --tokens 10e6 --reps 3        # alternate every command 3 times
    python benchmarks/bench_recompute.py --tokens 10e6 --sizes 25e6,50e6,100e6,200e6   # + RSS by size
    python benchmarks/bench_recompute.py --tokens 10e6 --rerun-steps 1000 --write-readme
    python benchmarks/bench_recompute.py --tokens 0 --sizes 25e6,50e6 --write-readme   # a block of its own

Every figure comes from its own fresh process tree, on one synthetic run (``grpolens synth``):
wall time; CPU time (user + system) of the process, its threads and the worker processes it
started and waited for (``wait4``'s usage counts every descendant reaped before the process
exits, and ``recompute`` waits for each worker it starts); peak RSS of the whole tree, the
process and its worker processes together: the largest sum of their ``VmRSS``
(``/proc/PID/status``) sampled every 10 ms, or the process's own ``ru_maxrss`` if larger.

1. *polars read floor* (the floor): one polars lazy scan of exactly the columns recompute reads,
   with a trivial reduction per column (a sum, or a non-null count), as a whole process
   (``benchmarks/read_floor_polars.py``): the fastest read of the input measured here;
   *engine read path*: the run read the engine's way on ``--threads`` threads, the value and
   key-order checks and the conversion to float64 arrays included, no metric
   (``benchmarks/read_floor.py``);
2. *full recompute*: ``grpolens recompute RUN --full`` -- every default metric and output file;
3. *DuckDB*: the core subset of metrics in one SQL query (``benchmarks/subset_sql.py``, which
   documents the subset; needs the ``bench`` extra);
4. *torch*: the same subset the trainers' way, per step on padded (B, T) tensors
   (``benchmarks/subset_torch.py``);
5. *grpolens subset*: ``grpolens recompute RUN --only <the subset>``.

on each step shape of ``--shapes``: *small*, many steps of ~130 K tokens (2 ranks x 16 groups
x 8 completions), and *large*, few steps of ~650 K tokens (8 ranks x 20 groups x 8 completions);
and the ratios full/floor (the polars floor; beside it the engine's read path), DuckDB/grpolens-subset, torch/grpolens-subset. Commands run
alternately (``--reps``), so that a load change on a shared machine hits all of them alike; the
table gives medians and the ratios' range over the repetitions, with the load average. Then rows/s
of the full recompute at each ``--workers`` count (``recompute --workers N``: N processes
computing steps; the read floor beside it reads with N threads) and, with ``--threads``, in one
process at each ``GRPOLENS_THREADS`` count; peak RSS and the ratio to the polars read floor at each of
``--sizes`` on each step shape of ``--shapes``, and (``--rerun-steps N``) on an N+1-step run: a re-run with nothing new, and the
cost of one new step after N. ``--write-readme`` puts the tables into README.md's Performance
section, with the machine, the date and this command.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by the tests
from doc_block import header as doc_header, shown_command, write_block  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: the core subset (documented in subset_sql.py), as ``recompute --only`` takes it
SUBSET = ("clip/low,clip/high,kl/k3,entropy,rollout_is/applied/mean,rollout_is/applied/seq_mean,"
          "rollout_is/veto/seq_fraction,mismatch/kl_k3")
#: synth's shape: 2 ranks x 4 micro-batches x 16 groups x 8 completions, ~127 stored tokens each
SHAPE = ("--ranks", "2", "--micro-batches", "4", "--groups", "16", "--generations", "8", "--max-len", "1024")
PER_STEP = 2 * 4 * 16 * 8 * 127
#: the two step shapes: many small steps (~130 K tokens) and few large ones (~650 K tokens)
SHAPES = {
    "small": (SHAPE, PER_STEP),
    "large": (("--ranks", "8", "--micro-batches", "4", "--groups", "20", "--generations", "8", "--max-len", "1024"),
              8 * 4 * 20 * 8 * 127),
}


def env(threads: int | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a measured command (``threads``: ``GRPOLENS_THREADS``, also the read
    floor's and the baselines' thread count)."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [e.get("PYTHONPATH")])])
    if threads:
        e["GRPOLENS_THREADS"] = str(threads)
    e.update(extra or {})
    return e


#: the rows of the main table that are grpolens' own commands, run with its defaults
GRPOLENS_COMMANDS = ("full recompute", "grpolens subset")


def timed(cmd: list[str], threads: int | None = None, extra_env: dict[str, str] | None = None) -> dict:
    """Wall s, CPU s (user + system: the process, its threads and the worker processes it waited
    for), peak RSS MiB of the process tree and stdout of one fresh process."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env(threads, extra_env), cwd=ROOT)
        sampler = TreeRSS(proc.pid)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t
        tree_peak = sampler.stop()
        if os.waitstatus_to_exitcode(status) != 0:
            err.seek(0)
            sys.exit(f"{' '.join(cmd)} failed:\n{err.read()[-3000:]}")
        out.seek(0)
        return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "rss": max(usage.ru_maxrss * 1024, tree_peak) / 2**20,
                "out": out.read()}


class TreeRSS:
    """The peak of the summed resident memory of a process and its descendants, sampled on a thread
    (``ru_maxrss`` alone is the largest single process, not the sum over a parent and its workers)."""

    def __init__(self, pid: int, every: float = 0.01):
        import threading

        self.pid, self.every, self.peak = pid, every, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, sum(_rss(p) for p in _tree(self.pid)))
            self._done.wait(self.every)

    def stop(self) -> int:
        """Stop sampling; the peak in bytes."""
        self._done.set()
        self._thread.join()
        return self.peak


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from ``/proc/*/stat``'s parent pids)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += [c for c, pp in parent.items() if pp == p]
    return out


def _rss(pid: int) -> int:
    """``VmRSS`` of ``pid`` in bytes (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def grpolens(*args: str) -> list[str]:
    return [sys.executable, "-m", "grpolens.cli", *args]


def synth(run: Path, steps: int, shape: tuple[str, ...] = SHAPE) -> None:
    if (run / "grpolens.json").exists():
        return
    t = time.perf_counter()
    timed(grpolens("synth", str(run), "--steps", str(steps), *shape, "--seed", "1"))
    print(f"synth {run.name}: {steps} steps in {time.perf_counter() - t:.0f} s", flush=True)


def rows_of(run: Path) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in (run / "tokens").glob("step=*/*.parquet"))


def commands(run: Path, scratch: Path, threads: int) -> dict[str, list[str]]:
    py = sys.executable
    return {
        "polars read floor": [py, str(HERE / "read_floor_polars.py"), str(run)],
        "read floor": [py, str(HERE / "read_floor.py"), str(run), "--threads", str(threads)],
        "full recompute": grpolens("recompute", str(run), "--full", "--quiet", "--out", str(scratch / "full")),
        "DuckDB subset": [py, str(HERE / "subset_sql.py"), str(run), "--threads", str(threads),
                          "--json", str(scratch / "sql.json")],
        "torch subset": [py, str(HERE / "subset_torch.py"), str(run), "--threads", str(threads),
                         "--json", str(scratch / "torch.json")],
        "grpolens subset": grpolens("recompute", str(run), "--only", SUBSET, "--quiet", "--out", str(scratch / "only")),
    }


def agreement(scratch: Path) -> dict[str, float]:
    """Largest relative difference of each baseline's values from grpolens' subset values."""
    import polars as pl

    ours = {r["step"]: r for r in pl.read_parquet(scratch / "only" / "metrics.parquet").iter_rows(named=True)}
    out = {}
    for name in ("sql", "torch"):
        worst = 0.0
        for r in json.loads((scratch / f"{name}.json").read_text()):
            mine = ours[r["step"]]
            for k, v in r.items():
                a, b = mine.get(k), v
                if a is None or b is None:
                    worst = max(worst, 0.0 if a is None and b is None else math.inf)
                else:
                    worst = max(worst, abs(a - b) / max(abs(a), 1e-300) if a != b else 0.0)
        out[name] = worst
    return out


def main_table(run: Path, rows: int, reps: int, threads: int) -> tuple[list[str], dict]:
    scratch = Path(tempfile.mkdtemp(prefix="grpolens-bench-out-"))
    cmds = commands(run, scratch, threads)
    got: dict[str, list[dict]] = {k: [] for k in cmds}
    load = [os.getloadavg()[0]]
    for _ in range(reps):
        for name, cmd in cmds.items():  # alternate: each repetition runs every command once
            # recompute runs as a user runs it (its own default workers and threads); the thread
            # count is the read floor's and the baselines'
            got[name].append(timed(cmd, None if name in GRPOLENS_COMMANDS else threads))
            load.append(os.getloadavg()[0])
    agree = agreement(scratch)
    shutil.rmtree(scratch)
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("wall", "cpu", "rss")} for k, v in got.items()}

    def ratio(a: str, b: str, m: str = "wall") -> str:
        rs = [x[m] / y[m] for x, y in zip(got[a], got[b])]
        return f"{statistics.median(rs):.2f}" + (f" ({min(rs):.2f}–{max(rs):.2f})" if len(rs) > 1 else "")

    names = {"read floor": "engine read path"}
    lines = [f"| what | wall s | M rows/s | CPU s | peak RSS MiB |", "|---|---:|---:|---:|---:|"]
    for k, v in med.items():
        lines.append(f"| {names.get(k, k)} | {v['wall']:.2f} | {rows / v['wall'] / 1e6:.2f} | {v['cpu']:.2f} | {v['rss']:.0f} |")
    lines += ["", "| ratio | wall | CPU |", "|---|---:|---:|",
              f"| **full recompute / polars read floor** (target ≤ 2.0) | {ratio('full recompute', 'polars read floor')} | "
              f"{ratio('full recompute', 'polars read floor', 'cpu')} |",
              f"| full recompute / engine read path | {ratio('full recompute', 'read floor')} | {ratio('full recompute', 'read floor', 'cpu')} |",
              f"| DuckDB / grpolens subset (target ≥ 1.0) | {ratio('DuckDB subset', 'grpolens subset')} | {ratio('DuckDB subset', 'grpolens subset', 'cpu')} |",
              f"| torch / grpolens subset | {ratio('torch subset', 'grpolens subset')} | {ratio('torch subset', 'grpolens subset', 'cpu')} |",
              "",
              f"Baselines agree with grpolens' subset values to {agree['sql']:.1e} (DuckDB, float64) and "
              f"{agree['torch']:.1e} (torch, float32) relative; load average during the runs "
              f"{min(load):.1f}–{max(load):.1f} ({os.cpu_count()} cores); medians of {reps} alternating repetition(s)."]
    return lines, med


def thread_table(run: Path, rows: int, counts: list[int]) -> list[str]:
    """Rows/s of the full recompute in one process (``--workers 1``) with N threads reading the
    shards (``GRPOLENS_THREADS``), beside the read floor with N threads."""
    scratch = Path(tempfile.mkdtemp(prefix="grpolens-bench-out-"))
    lines = ["| threads (--workers 1) | full recompute wall s | M rows/s | CPU s | read floor wall s | ratio |",
             "|---:|---:|---:|---:|---:|---:|"]
    for n in counts:
        full = timed(grpolens("recompute", str(run), "--full", "--quiet", "--out", str(scratch), "--workers", "1"), n)
        floor = timed(commands(run, scratch, n)["read floor"], n)
        lines.append(f"| {n} | {full['wall']:.2f} | {rows / full['wall'] / 1e6:.2f} | {full['cpu']:.2f} | "
                     f"{floor['wall']:.2f} | {full['wall'] / floor['wall']:.2f} |")
    shutil.rmtree(scratch)
    return lines


def workers_table(run: Path, rows: int, counts: list[int]) -> list[str]:
    """Rows/s of the full recompute with N worker processes (``--workers N``), beside the read
    floor with N threads."""
    scratch = Path(tempfile.mkdtemp(prefix="grpolens-bench-out-"))
    lines = ["| workers | full recompute wall s | M rows/s | CPU s | peak RSS MiB | polars read floor wall s | ratio |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for n in counts:
        full = timed(grpolens("recompute", str(run), "--full", "--quiet", "--out", str(scratch), "--workers", str(n)))
        # the floor on N threads of polars' pool, as the recompute on N processes
        floor = timed(commands(run, scratch, n)["polars read floor"], n, {"POLARS_MAX_THREADS": str(n)})
        lines.append(f"| {n} | {full['wall']:.2f} | {rows / full['wall'] / 1e6:.2f} | {full['cpu']:.2f} | {full['rss']:.0f} | "
                     f"{floor['wall']:.2f} | {full['wall'] / floor['wall']:.2f} |")
    shutil.rmtree(scratch)
    return lines


def size_table(base: Path, sizes: list[float], shapes: list[str], keep: bool, threads: int) -> list[str]:
    """Cost against the polars read floor and peak RSS at each size, on each step shape: the ratio
    must not grow with the size, and RSS must stay flat (one step's shards in memory per worker)."""
    lines = ["| step shape | token rows | steps | polars read floor CPU s | full recompute CPU s | "
             "**ratio (CPU)** (target ≤ 2.0) | polars read floor wall s | full recompute wall s | ratio (wall) | "
             "full recompute peak RSS MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for shape in shapes:
        flags, per_step = SHAPES[shape]
        for size in sizes:
            run = base / f"run-{shape}-{size:.0e}"
            steps = max(2, int(size / per_step))
            synth(run, steps, flags)
            rows = rows_of(run)
            scratch = Path(tempfile.mkdtemp(prefix="grpolens-bench-out-"))
            # read once untimed first: a big run synthesized earlier is partly out of the page cache,
            # and a floor read from disk (what the first command would pay alone) flatters the ratio
            timed(commands(run, scratch, threads)["polars read floor"], threads)
            floor = timed(commands(run, scratch, threads)["polars read floor"], threads)
            full = timed(grpolens("recompute", str(run), "--full", "--quiet", "--out", str(scratch)))
            shutil.rmtree(scratch)
            lines.append(f"| {shape} | {rows / 1e6:.1f} M | {steps} | {floor['cpu']:.1f} | {full['cpu']:.1f} | "
                         f"{full['cpu'] / floor['cpu']:.2f} | {floor['wall']:.1f} | {full['wall']:.1f} | "
                         f"{full['wall'] / floor['wall']:.2f} | {full['rss']:.0f} |")
            print(lines[-1], flush=True)
            if not keep:
                shutil.rmtree(run)
    return lines


def rerun_table(base: Path, n: int, keep: bool) -> list[str]:
    """An (n+1)-step run of small steps: the first n steps recomputed, then nothing new, then step n added."""
    run = base / f"run-{n + 1}-steps"
    synth(run, n + 1, ("--ranks", "1", "--groups", "2", "--generations", "2", "--max-len", "64"))
    # step n's shards and its completion markers, set aside and brought back as a writer would add them
    last = [d / f"step={n:08d}" for d in (run / "tokens", run / "samples")] + sorted((run / "complete").glob(f"step={n:08d}.*"))
    aside = [base / f"aside-{d.parent.name}-{d.name}" for d in last]
    shutil.rmtree(run / "grpolens", ignore_errors=True)
    for a, b in zip(last, aside):
        a.rename(b)
    first = timed(grpolens("recompute", str(run), "--quiet"))
    again = timed(grpolens("recompute", str(run), "--quiet"))
    for a, b in zip(last, aside):
        b.rename(a)
    one_more = timed(grpolens("recompute", str(run), "--quiet"))
    scratch = Path(tempfile.mkdtemp(prefix="grpolens-bench-out-"))
    alone = timed(grpolens("recompute", str(run), "--only", "*", "--steps", str(n), "--quiet", "--out", str(scratch)))
    shutil.rmtree(scratch)
    if not keep:
        shutil.rmtree(run)
    # CPU s beside wall s: on a shared machine the wall time of a short process is mostly waiting
    return ["| on a run of small steps | wall s | CPU s | peak RSS MiB |", "|---|---:|---:|---:|",
            f"| first recompute, {n} steps | {first['wall']:.2f} | {first['cpu']:.2f} | {first['rss']:.0f} |",
            f"| re-run, nothing new ({n} steps) | {again['wall']:.2f} | {again['cpu']:.2f} | {again['rss']:.0f} |",
            f"| re-run after step {n} was added | {one_more['wall']:.2f} | {one_more['cpu']:.2f} | {one_more['rss']:.0f} |",
            f"| that one step alone (`--only '*' --steps {n}`, for scale) | {alone['wall']:.2f} | {alone['cpu']:.2f} | "
            f"{alone['rss']:.0f} |"]


def write_readme(text: str, block: str = "bench_recompute") -> None:
    """Into README.md's Performance section; a block not there yet goes after the last one that is."""
    after = "## Performance\n"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for earlier in ("bench_recompute", "bench_recompute_sizes"):
        if earlier != block and f"<!-- {earlier}: end -->\n" in readme:
            after = f"<!-- {earlier}: end -->\n"
    write_block("README.md", block, "benchmarks/bench_recompute.py", text, flag="--write-readme", after=after)


def shape_tables(base: Path, shape: str, args, counts: list[int], threads: int) -> list[str]:
    """The main table and the rows/s tables on one step shape."""
    flags, per_step = SHAPES[shape]
    run = base / f"run-{shape}-{args.tokens:.0e}"
    synth(run, max(2, int(args.tokens / per_step)), flags)
    rows = rows_of(run)
    size = sum(f.stat().st_size for f in run.rglob("*.parquet")) / 2**20
    steps = len(list((run / "tokens").iterdir()))
    out = [f"**{shape} steps** ({rows / steps / 1e3:.0f} K token rows a step). "
           f"Run: {rows:,} token rows, {steps} steps, {size:.0f} MiB (`grpolens synth --steps {steps} "
           f"{' '.join(flags)} --seed 1`); the default worker processes of `recompute` "
           f"(`--workers`: {os.environ.get('GRPOLENS_WORKERS') or min(8, os.cpu_count() or 1)}), polars' default "
           f"threads for the polars read floor and {threads} threads for the engine's read path and the baselines, unless stated.", ""]
    lines, _ = main_table(run, rows, args.reps, threads)
    out += lines
    print("\n".join(out), flush=True)
    if counts:
        t = workers_table(run, rows, counts)
        print("\n".join(t), flush=True)
        out += ["", *t]
    thread_counts = [int(x) for x in args.threads.split(",") if x.strip()]
    if thread_counts:
        t = thread_table(run, rows, thread_counts)
        print("\n".join(t), flush=True)
        out += ["", *t]
    if not args.keep and args.dir is None:
        shutil.rmtree(run)
    return out + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=float, default=10e6,
                    help="approximate token rows of the main run (0: only --sizes and --rerun-steps, each in a README block of its own)")
    ap.add_argument("--shapes", default="small,large",
                    help="step shapes, comma-separated: small (~130 K tokens a step), large (~650 K tokens a step)")
    ap.add_argument("--reps", type=int, default=1, help="alternating repetitions of the main commands")
    ap.add_argument("--workers", default="1,2", help="worker counts (recompute --workers) for the rows/s table, comma-separated")
    ap.add_argument("--threads", default="", help="thread counts (GRPOLENS_THREADS, one process) for a second rows/s table, comma-separated")
    ap.add_argument("--sizes", default="", help="token row counts for the table by size (ratio to the polars floor, peak RSS) on each of --shapes, e.g. 50e6,200e6")
    ap.add_argument("--rerun-steps", type=int, default=0, help="N: time a re-run and one added step on an N+1-step run")
    ap.add_argument("--dir", type=Path, default=None, help="where to put the runs (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the runs afterwards")
    ap.add_argument("--write-readme", action="store_true", help="write the tables into README.md's Performance section")
    args = ap.parse_args()
    counts = [int(x) for x in args.workers.split(",") if x.strip()]
    bad = [x for x in args.shapes.split(",") if x.strip() and x.strip() not in SHAPES]
    if bad:
        sys.exit(f"--shapes: unknown shape {bad[0]!r} (one of: {', '.join(SHAPES)})")
    threads = int(os.environ.get("GRPOLENS_THREADS") or min(4, os.cpu_count() or 1))

    base = args.dir or Path(tempfile.mkdtemp(prefix="grpolens-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.timezone.utc)
    out: list[str] = []
    for shape in [x.strip() for x in args.shapes.split(",") if x.strip()] if args.tokens > 0 else []:
        out += shape_tables(base, shape, args, counts, threads)
    shapes = [x.strip() for x in args.shapes.split(",") if x.strip()]
    sizes = size_table(base, [float(s) for s in args.sizes.split(",")], shapes, args.keep, threads) if args.sizes else []
    out += ["", *sizes] if sizes else []
    rerun = rerun_table(base, args.rerun_steps, args.keep) if args.rerun_steps else []
    if rerun:
        print("\n".join(rerun), flush=True)
        out += ["", *rerun]
    if args.dir is None and not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    header = doc_header(shown_command("benchmarks/bench_recompute.py", sys.argv[1:]), started)
    if args.write_readme:
        if args.tokens > 0:
            write_readme(header + "\n\n" + "\n".join(out).strip())
        else:  # --tokens 0: the size and re-run tables each in a block of their own, after the main one
            for block, table in (("sizes", sizes), ("rerun", rerun)):
                if table:
                    write_readme(header + "\n\n" + "\n".join(table), f"bench_recompute_{block}")
        print("README.md updated")


if __name__ == "__main__":
    main()
