"""Start-up time of the command line: ``grpolens --help`` must stay under 0.3 s.

    python benchmarks/bench_cli.py [--write-doc]     # --write-doc: the figures into README.md

Runs each command 10 times in fresh processes and prints the median CPU and wall time, next to a
bare ``python -c pass`` for the interpreter's own start-up on this machine.
"""

from __future__ import annotations

import argparse
import resource
import datetime as dt
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by the tests
from doc_block import header, shown_command, write_block  # noqa: E402


def median_time(cmd: list[str], n: int = 10) -> tuple[float, float]:
    """Median wall time and median CPU time (user + system of the child) of N fresh runs; on a
    shared machine the CPU time is the figure to read."""
    times, cpu = [], []
    for _ in range(n):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=True)
        times.append(time.perf_counter() - t)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return statistics.median(times), statistics.median(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write-doc", action="store_true", help="write the figures into README.md's Performance section")
    args = ap.parse_args()
    started = dt.datetime.now(dt.timezone.utc)
    rows = [
        ("python -c pass", [sys.executable, "-c", "pass"]),
        ("grpolens --help", [sys.executable, "-m", "grpolens.cli", "--help"]),
        ("grpolens recompute --help", [sys.executable, "-m", "grpolens.cli", "recompute", "--help"]),
    ]
    table = ["| command | median CPU time | median wall time |", "|---|---:|---:|"]
    for label, cmd in rows:
        wall, cpu = median_time(cmd)
        print(f"{label:<28}{cpu * 1000:8.0f} ms CPU {wall * 1000:8.0f} ms wall")
        table.append(f"| `{label}` | {cpu * 1000:.0f} ms | {wall * 1000:.0f} ms |")
    if args.write_doc:
        script = "benchmarks/bench_cli.py"
        write_block("README.md", "bench_cli", script,
                    header(shown_command(script, sys.argv[1:]), started) + "\n\n" + "\n".join(table))
        print("README.md updated")


if __name__ == "__main__":
    main()
