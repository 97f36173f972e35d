"""What refusing invalid runs costs a reading command, as a fraction of a recompute.

    python benchmarks/bench_read_checks.py --tokens 5e6

Every reading command first runs the footer check (``RunReader.check``: manifest, layout, schemas
and Parquet statistics), and the token reader checks the key order of each shard on the key
columns it has just read. This script times, on one synthetic run, in this process and best of
``--repeat``:

* the footer check over the whole run;
* the key-order check alone, over the key columns of every tokens shard (read beforehand, so only
  the check is timed: the columns are the ones a recompute reads anyway);
* a full recompute (``--full``, nothing written), which includes both;

and prints their ratio. The text check (UTF-8 of prompt and completion columns) is timed the same
way on the samples shards.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=float, default=5e6, help="approximate token rows in the run")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where to put the run (default: a temp dir)")
    args = ap.parse_args()

    import pyarrow.parquet as pq

    from grpolens.adapters.synth import synth_run
    from grpolens.analysis.recompute import recompute
    from grpolens.run import format as fmt
    from grpolens.run.text_columns import invalid_rows
    from grpolens.run.validate import check_before_reading, key_order_problems

    tmp = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        groups, generations, max_len = 32, 8, 512
        per_step = groups * generations * max_len * 0.55  # synth lengths average ~55% of max_len
        steps = max(2, int(args.tokens / per_step))
        run = synth_run(tmp / "run", steps=steps, ranks=2, groups=groups // 2, generations=generations,
                        max_len=max_len, texts=True, seed=0)
        tokens = sum(pq.ParquetFile(sh.path).metadata.num_rows for sh in fmt.list_shards(run, fmt.TOKENS))
        keys = [pq.read_table(sh.path, columns=["micro_batch", "sample_id", "pos"])
                for sh in fmt.list_shards(run, fmt.TOKENS)]
        texts = [pq.read_table(sh.path, columns=["prompt", "completion"]) for sh in fmt.list_shards(run, fmt.SAMPLES)]

        footer = best(lambda: check_before_reading(run), args.repeat)
        order = best(lambda: [key_order_problems(*(t.column(c).to_numpy() for c in t.column_names)) for t in keys],
                     args.repeat)
        text = best(lambda: [invalid_rows(t.column(c)) for t in texts for c in t.column_names], args.repeat)
        full = best(lambda: recompute(run, write=False, incremental=False), args.repeat)
        checks = footer + order + text
        print(f"run: {steps} steps x 2 ranks, {tokens:,} token rows, {len(texts)} samples shards")
        print(f"footer check      {footer * 1e3:8.1f} ms")
        print(f"key-order check   {order * 1e3:8.1f} ms")
        print(f"UTF-8 text check  {text * 1e3:8.1f} ms")
        print(f"recompute --full  {full * 1e3:8.1f} ms (includes the checks)")
        print(f"checks / recompute = {checks / full:.3f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
