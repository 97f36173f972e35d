"""How fast is ``grpolens synth``? Tokens per second for generation alone and end to end.

    python benchmarks/bench_synth.py [--steps 20 --ranks 2 --micro-batches 4 --groups 16 --generations 8 --max-len 1024]

Prints three figures: the numpy generators alone (no I/O), the whole ``synth_run`` (generation,
the ShardWriter's background Parquet encoding, atomic writes), and ``validate_run`` on the result.
Each is the best of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from grpolens.adapters.synth import SynthSpec, generate_samples, generate_tokens, synth_run
from grpolens.run.validate import validate_run


def best_of(repeat: int, fn) -> tuple[float, float]:
    """Best wall time and best CPU time (all threads) of ``repeat`` calls: on a shared machine the
    CPU time is the steadier figure."""
    wall, cpu = [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return min(wall), min(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--texts", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    shape = dict(steps=a.steps, ranks=a.ranks, micro_batches=a.micro_batches, groups=a.groups,
                 generations=a.generations, max_len=a.max_len)
    spec = SynthSpec(**shape)
    tokens = 0

    def generate() -> None:
        nonlocal tokens
        tokens = 0
        for step in range(spec.steps):
            for rank in range(spec.ranks):
                s = generate_samples(spec, step, rank)
                for mb in range(spec.micro_batches):
                    tokens += len(generate_tokens(spec, step, rank, mb, s)["logp"])

    t_gen = best_of(a.repeat, generate)
    tmp = Path(tempfile.mkdtemp(prefix="bench_synth."))
    try:
        t_run = best_of(a.repeat, lambda: synth_run(tmp / "run", texts=a.texts, overwrite=True, **shape))
        size = sum(f.stat().st_size for f in (tmp / "run").rglob("*") if f.is_file())
        t_val = best_of(a.repeat, lambda: validate_run(tmp / "run"))
    finally:
        shutil.rmtree(tmp)
    print(f"shape: {shape}, texts={a.texts}: {tokens:,} tokens, {size / 2**20:.1f} MiB on disk")
    for name, (wall, cpu) in (("generation only", t_gen), ("synth_run (disk)", t_run), ("validate_run", t_val)):
        print(f"{name:17s}: {wall:6.3f} s wall {tokens / wall / 1e6:6.2f} M tokens/s | "
              f"{cpu:6.3f} s CPU {tokens / cpu / 1e6:6.2f} M tokens per CPU-second")


if __name__ == "__main__":
    main()
