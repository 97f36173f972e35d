"""Start-up time of the command line: ``grpolens --help`` must stay under 0.3 s.

    python benchmarks/bench_cli.py

Runs each command 10 times in fresh processes and prints the median wall time, next to a bare
``python -c pass`` for the interpreter's own start-up on this machine.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time


def median_time(cmd: list[str], n: int = 10) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    rows = [
        ("python -c pass", [sys.executable, "-c", "pass"]),
        ("grpolens --help", [sys.executable, "-m", "grpolens.cli", "--help"]),
        ("grpolens recompute --help", [sys.executable, "-m", "grpolens.cli", "recompute", "--help"]),
    ]
    for label, cmd in rows:
        print(f"{label:<28}{median_time(cmd) * 1000:8.0f} ms")


if __name__ == "__main__":
    main()
