"""The fastest read floor of a recompute: one polars lazy scan of exactly the columns
``grpolens recompute`` reads, each reduced to one number, as a whole process.

    python benchmarks/read_floor_polars.py RUN

Token shards: the columns the engine reads (``read_floor.TOKEN_COLUMNS``, the ones the shards
have); sample shards: every column. One lazy scan over all token shards and one over all sample
shards, each with a trivial reduction per column -- a sum for numbers and booleans, a non-null
count for anything else -- so that every value is decoded and touched, on polars' own thread pool
(``POLARS_MAX_THREADS``). Nothing else happens: this is what reading the input costs at best, the
floor the recompute is measured against. Prints the token row count.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from pathlib import Path

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from read_floor import TOKEN_COLUMNS  # noqa: E402  (the engine's list; a test checks they agree)


def reductions(schema: pl.Schema, columns: tuple[str, ...] | None) -> list[pl.Expr]:
    names = [c for c in schema.names() if columns is None or c in columns]
    out = []
    for c in names:
        t = schema[c]
        if t.is_numeric() or t == pl.Boolean:
            out.append(pl.col(c).sum().cast(pl.Float64).alias(c))
        else:
            out.append(pl.col(c).count().cast(pl.Float64).alias(c))
    return out


def scan(files: list[str], columns: tuple[str, ...] | None) -> pl.DataFrame:
    if not files:
        return pl.DataFrame()
    lf = pl.scan_parquet(files, hive_partitioning=False)
    exprs = reductions(lf.collect_schema(), columns)
    return lf.select(pl.len().alias("_rows"), *exprs).collect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    args = ap.parse_args()
    tokens = sorted(glob.glob(os.path.join(args.run, "tokens", "step=*", "*.parquet")))
    samples = sorted(glob.glob(os.path.join(args.run, "samples", "step=*", "*.parquet")))
    t = scan(tokens, TOKEN_COLUMNS)
    scan(samples, None)
    print(int(t["_rows"][0]) if t.height else 0)


if __name__ == "__main__":
    main()
