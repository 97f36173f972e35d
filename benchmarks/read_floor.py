"""The read floor of a recompute: read exactly the columns ``grpolens recompute`` reads and reduce
each to one number, and nothing else.

    python benchmarks/read_floor.py RUN [--threads N]

Token shards: the columns the engine reads (``grpolens.metrics.engine.READ_COLUMNS``, as far as a
shard has them); sample shards: every column (recompute reads them whole). Each column becomes one
sum (numbers, booleans) or one count (anything else), so that every value is really touched. The
shards are read by ``--threads`` threads, like the engine's workers. Prints the token row count.
"""

from __future__ import annotations

import argparse
import glob
import os
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

# the engine's list, spelled out so that this process imports no grpolens (a test checks they agree)
TOKEN_COLUMNS = ("step", "rank", "micro_batch", "sample_id", "pos", "token_id", "logp", "old_logp", "ref_logp",
                 "rollout_logp", "advantage", "mask", "entropy", "old_entropy", "rollout_rejected")


def reduce_table(t: pa.Table) -> float:
    total = 0.0
    for col in t.columns:
        typ = col.type
        if pa.types.is_integer(typ) or pa.types.is_floating(typ):
            v = pc.sum(col).as_py()
        elif pa.types.is_boolean(typ):
            v = pc.sum(col.cast(pa.int64())).as_py()
        else:
            v = pc.count(col).as_py()
        total += float(v or 0.0)
    return total


def read(path: str, columns: tuple[str, ...] | None) -> int:
    pf = pq.ParquetFile(path)
    cols = None if columns is None else [c for c in columns if c in pf.schema_arrow.names]
    t = pf.read(columns=cols)
    reduce_table(t)
    return t.num_rows if columns is not None else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("GRPOLENS_THREADS") or min(4, os.cpu_count() or 1)))
    args = ap.parse_args()
    tokens = sorted(glob.glob(os.path.join(args.run, "tokens", "step=*", "*.parquet")))
    samples = sorted(glob.glob(os.path.join(args.run, "samples", "step=*", "*.parquet")))
    jobs = [(f, TOKEN_COLUMNS) for f in tokens] + [(f, None) for f in samples]
    with ThreadPoolExecutor(args.threads) as ex:
        rows = sum(ex.map(lambda j: read(*j), jobs))
    print(rows)


if __name__ == "__main__":
    main()
