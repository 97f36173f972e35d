"""Child process for the kill tests: writes deterministic steps through ShardWriter until killed.

    python kill_writer.py RUN [--stall-at-step K]

Prints "started" once writing begins. With --stall-at-step K it stops forever inside the fsync of
step K's temporary file and prints "stalled", so the parent can kill it in the middle of a write.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np


def expected_step(step: int) -> dict[str, np.ndarray]:
    """The columns written for ``step`` (already in the shard's sorted order)."""
    n = 20_000 + (step % 7) * 1_000
    i = np.arange(n)
    return {"sample_id": i // 100, "pos": (i % 100).astype(np.int32),
            "logp": (-(i % 977) * 1e-3 - step).astype(np.float32),
            "advantage": np.full(n, step % 3 - 1, np.float32), "mask": i % 5 != 0}


def main() -> None:
    from grpolens.run.format import Manifest
    from grpolens.capture.writer import ShardWriter

    run = sys.argv[1]
    stall = int(sys.argv[sys.argv.index("--stall-at-step") + 1]) if "--stall-at-step" in sys.argv else None
    if stall is not None:
        real_fsync = os.fsync

        def fsync(fd):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.endswith(".tmp") and f"step={stall:08d}" in target:
                print("stalled", flush=True)
                time.sleep(600)
            real_fsync(fd)

        os.fsync = fsync
    w = ShardWriter(run, manifest=Manifest(run_name="killed"), max_queue_bytes=4 * 2**20)
    print("started", flush=True)
    for step in range(100_000):
        w.add_tokens(step, 0, expected_step(step))
        w.end_step(step)


if __name__ == "__main__":
    main()
