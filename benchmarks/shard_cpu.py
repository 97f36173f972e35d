"""Where the per-shard CPU of a recompute goes: each producer's and visitor's CPU seconds.

    python benchmarks/shard_cpu.py RUN [--profile grpolens]

Runs, in this process and on one thread, the work the engine does for every tokens shard of RUN
(``grpolens.metrics.engine.shard_pieces``: read the shard, build its ``TokenBatch``, run every
producer of the per-sequence partials and every visitor of a plain recompute) and prints the CPU
seconds (``time.process_time``) each part took over all shards, largest first. The read and the
batch construction are the floor the parts above them add to. A quantity several families share
(the log-ratio, the IS weights...) is computed once per batch and counted in the part that asked
for it first. Compare two checkouts by running this with each on PYTHONPATH, alternately.
"""

from __future__ import annotations

import argparse
import collections
import time


def shard_cpu(run: str, profile: str = "grpolens") -> dict[str, float]:
    """{part: CPU seconds} over every tokens shard of ``run``."""
    from grpolens import plugins
    from grpolens.allocator import keep_freed_memory
    from grpolens.metrics.batch import TokenBatch
    from grpolens.metrics.engine import READ_COLUMNS, visitor_factories
    from grpolens.metrics.partials import PRODUCERS
    from grpolens.run import format as fmt
    from grpolens.run.reader import RunReader, read_tokens

    import pyarrow.parquet  # noqa: F401 - imported by the first read otherwise, and counted in it
    import grpolens.run.validate  # noqa: F401

    plugins.load_plugins()
    keep_freed_memory()  # as the command line does
    reader = RunReader(run)
    cfg = reader.config()
    prof = plugins.get(profile)
    if prof.log_schedule is not None:
        _, cfg = prof.log_schedule(reader, cfg, None, None)
    cpu: collections.Counter[str] = collections.Counter()
    clock = time.process_time

    def timed(part: str, fn, *args):
        t = clock()
        out = fn(*args)
        cpu[part] += clock() - t
        return out

    for sh in fmt.list_shards(run, fmt.TOKENS):
        batch = timed("read", read_tokens, sh.path, READ_COLUMNS)
        batch = timed("TokenBatch.from_arrow", TokenBatch.from_arrow, batch)
        partials = dict(batch.seq_keys)
        for p in PRODUCERS.values():  # what sequence_partials runs, one producer at a time
            if batch.has(*p.requires):
                partials.update(timed(f"producer {p.name}", p.fn, batch, cfg))
        batch.partials = partials
        for v in (factory(cfg) for factory in visitor_factories(None)):
            timed(f"visitor {v.name}", v.shard, batch, sh)
    return dict(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("--profile", default="grpolens")
    args = ap.parse_args()
    cpu = shard_cpu(args.run, args.profile)
    for part, s in sorted(cpu.items(), key=lambda kv: -kv[1]):
        print(f"{s:7.2f} s  {part}")
    print(f"{sum(cpu.values()):7.2f} s  total")


if __name__ == "__main__":
    main()
