"""pyarrow's S3 filesystem and fsspec/s3fs side by side, on the same run on a local S3 server.

    python benchmarks/bench_s3_layers.py --tokens 10e6 --shards 1000 10000   # the figures in the docs
    python benchmarks/bench_s3_layers.py --tokens 1e6 --shards 1000          # a quick run

grpolens reads ``s3://`` runs through :class:`pyarrow.fs.S3FileSystem` (``grpolens/run/storage.py``).
This script measures what choosing fsspec/s3fs instead would change, on moto's S3 server
(``tests/helpers/s3_server.py``, which counts requests by kind) started here:

- **listing**: one recursive listing of a ``tokens/`` prefix holding 1,000 and 10,000 shard keys
  (8 ranks per step), as ``grpolens.run.format.list_shards`` does: wall time and requests;
- **reading**: every shard of a synthetic run, the columns ``recompute`` reads from token shards
  (``grpolens.metrics.engine.READ_COLUMNS``) and whole sample shards, 4 threads like the engine's
  workers, each file opened as a random-access file and read with ``pyarrow.parquet.ParquetFile``:
  wall time and requests (both layers must read the same rows and values);
- **ETag**: whether the layer's listing gives each object's ETag (the per-step cache's fingerprint
  could then include it) and at what cost in requests.

Each measurement runs ``--repeat`` times, alternating the layers, with a fresh filesystem object
each time (no listing cache, no connection reuse across repeats); the table shows the median and
the ratio s3fs / pyarrow. ``--write-doc`` writes the report into docs/distributed.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from bench_distributed import Server, rows_of, synth  # noqa: E402
from doc_block import header, shown_command, write_block  # noqa: E402
from read_floor import reduce_table  # noqa: E402

REPORT: list[str] = []
DOC, BLOCK, SCRIPT = "docs/distributed.md", "bench_s3_layers", "benchmarks/bench_s3_layers.py"


def say(line: str) -> None:
    print(line, flush=True)
    REPORT.append(line.rstrip())


def pyarrow_fs(srv: Server):
    import pyarrow.fs as pafs

    return pafs.S3FileSystem(access_key="bench", secret_key="bench", region="us-east-1", scheme="http",
                             endpoint_override=srv.endpoint.split("://", 1)[1])


def s3fs_fs(srv: Server):
    import s3fs

    return s3fs.S3FileSystem(key="bench", secret="bench", skip_instance_cache=True, use_listings_cache=False,
                             client_kwargs={"endpoint_url": srv.endpoint, "region_name": "us-east-1"})


def list_pyarrow(fs, prefix: str) -> list[dict]:
    import pyarrow.fs as pafs

    infos = fs.get_file_info(pafs.FileSelector(prefix, recursive=True))
    return [{"name": i.path, "size": i.size, "mtime": i.mtime_ns, "etag": getattr(i, "etag", None)}
            for i in infos if i.type == pafs.FileType.File]


def list_s3fs(fs, prefix: str) -> list[dict]:
    return [{"name": k, "size": v["size"], "mtime": v.get("LastModified"), "etag": v.get("ETag")}
            for k, v in fs.find(prefix, detail=True).items() if v["type"] == "file"]


def open_pyarrow(fs, path: str):
    return fs.open_input_file(path)


def open_s3fs(fs, path: str):
    return fs.open(path, "rb")


LAYERS = {"pyarrow": (pyarrow_fs, list_pyarrow, open_pyarrow), "s3fs": (s3fs_fs, list_s3fs, open_s3fs)}


def measure(srv: Server, repeat: int, job) -> dict[str, dict]:
    """``job(layer)`` -> a result, ``repeat`` times per layer, alternating; wall medians, the
    requests of the last repeat, and the result of each layer (for the agreement checks)."""
    walls: dict[str, list[float]] = {name: [] for name in LAYERS}
    out: dict[str, dict] = {}
    for _ in range(repeat):
        for name in LAYERS:
            srv.counts(reset=True)
            t = time.perf_counter()
            result = job(name)
            walls[name].append(time.perf_counter() - t)
            out[name] = {"result": result, "requests": srv.counts()}
    for name in LAYERS:
        out[name]["wall"] = statistics.median(walls[name])
    return out


def requests(counts: dict) -> str:
    kinds = {k: v for k, v in counts.items() if " " not in k}  # the per-table counts repeat them
    return ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())) or "none"


def row(what: str, m: dict[str, dict]) -> str:
    a, b = m["pyarrow"], m["s3fs"]
    return (f"| {what} | {a['wall']:.2f} s | {b['wall']:.2f} s | {b['wall'] / a['wall']:.2f} | "
            f"{requests(a['requests'])} | {requests(b['requests'])} |")


def bench_listing(srv: Server, shards: list[int], repeat: int) -> list[str]:
    c = srv.client()
    done, rows = 0, []
    ranks = 8
    for n in sorted(set(shards)):
        keys = [f"list/tokens/step={i // ranks:08d}/rank={i % ranks:05d}.parquet" for i in range(done, n)]
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(lambda k: c.put_object(Bucket="bench", Key=k, Body=b"x"), keys))
        done = n

        def job(name: str):
            make, lister, _ = LAYERS[name]
            return lister(make(srv), "bench/list/tokens")

        m = measure(srv, repeat, job)
        for name in LAYERS:
            assert len(m[name]["result"]) == n, (name, len(m[name]["result"]), n)
        rows.append(row(f"list {n:,} shard keys ({n // ranks:,} steps)", m))
        if n == min(shards):
            etags = {name: m[name]["result"][0]["etag"] for name in LAYERS}
    return rows, etags


def bench_read(srv: Server, run: Path, prefix: str, repeat: int) -> str:
    import pyarrow.parquet as pq

    from grpolens.metrics.engine import READ_COLUMNS

    files = [(f"bench/{prefix}/{p.relative_to(run).as_posix()}", tuple(READ_COLUMNS) if p.parts[-3] == "tokens" else None)
             for p in sorted(run.glob("*/step=*/*.parquet"))]

    def job(name: str):
        make, _, opener = LAYERS[name]
        fs = make(srv)

        def read(item) -> tuple[int, float]:
            path, columns = item
            with opener(fs, path) as f:
                pf = pq.ParquetFile(f)
                cols = None if columns is None else [c for c in columns if c in pf.schema_arrow.names]
                t = pf.read(columns=cols)
            return t.num_rows, reduce_table(t)

        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(read, files))
        return sum(r for r, _ in got), sum(v for _, v in got)

    m = measure(srv, repeat, job)
    assert m["pyarrow"]["result"] == m["s3fs"]["result"], (m["pyarrow"]["result"], m["s3fs"]["result"])
    return row(f"read the recompute columns of {len(files)} shards", m)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=float, default=10e6, help="token rows of the synthetic run read")
    ap.add_argument("--shards", type=int, nargs="+", default=[1000, 10_000], help="shard keys listed")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the run is made (and reused)")
    ap.add_argument("--write-doc", action="store_true", help=f"write the report into {DOC}")
    args = ap.parse_args()
    started = dt.datetime.now(dt.timezone.utc)
    import pyarrow
    import s3fs

    base = Path(args.dir or tempfile.mkdtemp(prefix="grpolens-bench-"))
    run = synth(args.tokens, base)
    size = sum(f.stat().st_size for f in run.rglob("*.parquet"))
    srv = Server()
    try:
        srv.upload(run, "run")
        say(f"pyarrow {pyarrow.__version__} (S3FileSystem) vs s3fs {s3fs.__version__}; run: {rows_of(run):,} token rows, "
            f"{size / 2**20:.0f} MiB of Parquet; median of {args.repeat}, layers alternating")
        say("")
        say("| what | pyarrow | s3fs | s3fs / pyarrow | requests, pyarrow | requests, s3fs |")
        say("|---|---|---|---|---|---|")
        say(bench_read(srv, run, "run", args.repeat))
        listing, etags = bench_listing(srv, args.shards, args.repeat)
        for line in listing:
            say(line)
        say("")
        say("ETag of each object in the listing: " + "; ".join(
            f"{name}: {'yes, ' + json.dumps(v) + ' (no extra request)' if v else 'not exposed'}" for name, v in etags.items()))
    finally:
        srv.stop()
    if args.write_doc:
        write_block(DOC, BLOCK, SCRIPT, header(shown_command(SCRIPT, sys.argv[1:]), started) + "\n\n" + "\n".join(REPORT),
                    after="<!-- bench_distributed-listing: end -->")
        print(f"{DOC} updated")


if __name__ == "__main__":
    main()
