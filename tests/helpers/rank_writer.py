"""One rank of a two-rank run, as a real process, for the completion tests:

    python rank_writer.py RUN RANK STEPS [--die-in-step K]

Writes steps 0..STEPS-1 (two loss calls per step, the first flushed to disk on its own so that a
step has two part files) through ShardWriter with world_size 2, printing "step N" after each
step's end, and closes normally. With --die-in-step K it writes step K's first part, prints
"mid-step K" and waits to be killed (SIGKILL) before the step's second part.
"""

from __future__ import annotations

import sys
import time

import numpy as np


def step_columns(step: int, rank: int, micro_batch: int) -> tuple[dict, dict]:
    """(tokens, samples) of one loss call: 4 completions of 10 tokens, deterministic."""
    ids = np.arange(4) + 100 * (2 * step + rank) * 10 + 4 * micro_batch
    sid = np.repeat(ids, 10)
    pos = np.tile(np.arange(10, dtype=np.int32), 4)
    tokens = {"sample_id": sid, "pos": pos, "logp": (-0.1 - 0.01 * pos - step).astype(np.float32),
              "ref_logp": (-0.12 - 0.01 * pos - step).astype(np.float32),
              "advantage": np.where(sid % 2 == 0, 1.0, -1.0).astype(np.float32), "mask": pos < 9}
    samples = {"sample_id": ids, "group_id": ids // 4, "completion_len": np.full(4, 10, np.int32),
               "truncated": np.zeros(4, bool), "reward": (ids % 2).astype(np.float64)}
    return tokens, samples


def main() -> None:
    from grpolens.capture.writer import ShardWriter
    from grpolens.run.format import Manifest

    run, rank, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    die = int(sys.argv[sys.argv.index("--die-in-step") + 1]) if "--die-in-step" in sys.argv else None
    mode = sys.argv[sys.argv.index("--mode") + 1] if "--mode" in sys.argv else "new"
    w = ShardWriter(run, rank=rank, world_size=2, manifest=Manifest(run_name="two-ranks", world_size=2), mode=mode)
    for step in range(steps):
        for mb in range(2):
            tokens, samples = step_columns(step, rank, mb)
            w.add_samples(step, samples)
            w.add_tokens(step, mb, tokens)
            if mb == 0:
                w.flush()  # the first part is on disk before the second loss call
                if step == die:
                    print(f"mid-step {step}", flush=True)
                    time.sleep(600)
        w.end_step(step)
        w.flush()
        print(f"step {step}", flush=True)
    w.close()
    print("closed", flush=True)


if __name__ == "__main__":
    main()
