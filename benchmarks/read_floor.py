"""The engine's own read path: read a run the way ``grpolens recompute`` reads it, and compute nothing.

    python benchmarks/read_floor.py RUN [--threads N]            # the engine's read, checks included
    python benchmarks/read_floor.py RUN [--threads N] --plain    # pyarrow alone, no grpolens

Token shards: the per-shard work of the engine with no visitor (``grpolens.metrics.engine.shard_pieces``:
``read_tokens`` -- the columns the engine reads, the value and key-order checks every reader makes --
then ``TokenBatch.from_arrow``: float64 columns, sequence starts, rows against the path); sample
shards: each step's samples as the engine reads them (``RunReader.samples``). What a recompute
adds to this is the metrics. Shards are read by ``--threads`` threads, like the engine's.

``--plain``: the same columns through pyarrow alone, shard by shard, each column reduced to one
number (a sum, or a count) so that every value is touched; this process then imports no grpolens.
The gap between the two is what the engine's checks and conversions cost. Prints the token row
count.
"""

from __future__ import annotations

import argparse
import glob
import os
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

# the engine's list, spelled out so that --plain imports no grpolens (a test checks they agree)
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


def plain(run: str, threads: int) -> int:
    tokens = sorted(glob.glob(os.path.join(run, "tokens", "step=*", "*.parquet")))
    samples = sorted(glob.glob(os.path.join(run, "samples", "step=*", "*.parquet")))
    jobs = [(f, TOKEN_COLUMNS) for f in tokens] + [(f, None) for f in samples]
    with ThreadPoolExecutor(threads) as ex:
        return sum(ex.map(lambda j: read(*j), jobs))


def engine(run: str, threads: int) -> int:
    """The engine's read: every tokens shard through ``shard_pieces`` without visitors (as the
    engine's threads run it), then every step's samples, as a recompute reads them."""
    from grpolens.allocator import keep_freed_memory
    from grpolens.metrics.engine import READ_COLUMNS, shard_pieces
    from grpolens.run import format as fmt
    from grpolens.run.no_pandas import pyarrow_without_pandas
    from grpolens.run.reader import RunReader

    pyarrow_without_pandas(program=True)  # as the command line does
    keep_freed_memory()
    reader = RunReader(run)
    shards = reader.shards(fmt.TOKENS)

    class Rows:  # the one "visitor": the shard's row count, so that nothing is read twice
        name = "rows"

        def shard(self, batch, shard) -> int:
            return batch.n

    def one(sh) -> int:
        return shard_pieces(sh, (Rows(),), tuple(READ_COLUMNS))["rows"]

    rows = one(shards[0]) if shards else 0  # in this thread: the lazy imports with no other thread working
    with ThreadPoolExecutor(threads) as ex:
        rows += sum(ex.map(one, shards[1:]))
    for step in reader.steps(fmt.SAMPLES):
        reader.samples(step)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("GRPOLENS_THREADS") or min(4, os.cpu_count() or 1)))
    ap.add_argument("--plain", action="store_true", help="pyarrow alone: no checks, no conversions, no grpolens")
    args = ap.parse_args()
    print((plain if args.plain else engine)(args.run, args.threads))


if __name__ == "__main__":
    main()
