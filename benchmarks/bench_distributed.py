"""Object storage and the Ray engine, side by side with local disk and the default engine.

    python benchmarks/bench_distributed.py s3 --tokens 10e6        # recompute from a local S3 server vs disk
    python benchmarks/bench_distributed.py listing --shards 10000  # listing cost against the shard count
    python benchmarks/bench_distributed.py ray --tokens 10e6       # --engine ray (local, 2 CPUs) vs default
    python benchmarks/bench_distributed.py pieces --tokens 10e6    # partial-state bytes, driver merge cost
    python benchmarks/bench_distributed.py commands --tokens 10e6  # validate, tokens, completions: s3:// vs disk
    python benchmarks/bench_distributed.py writer --tokens 10e6    # the shard writer: s3:// vs disk

The S3 server is moto's (``tests/helpers/s3_server.py``, the dev extra) on 127.0.0.1, in its own
process; it counts requests by kind. Every recompute runs in a fresh process (``timed``).
``--write-doc`` writes the command's report, with the machine and the date, into its block of
docs/distributed.md (``bench_distributed-<command>``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_recompute import timed  # noqa: E402
from doc_block import header, shown_command, write_block  # noqa: E402

#: what the command reports (printed as it comes, and written into the doc with --write-doc)
REPORT: list[str] = []


def say(line: str) -> None:
    print(line, flush=True)
    REPORT.append(line.rstrip())

SERVER = ROOT / "tests" / "helpers" / "s3_server.py"


def synth(tokens: float, base: Path) -> Path:
    """The same synthetic run shape as bench_recompute.py (2 ranks x 4 micro-batches, 16 x 8 groups)."""
    run = base / f"run-{int(tokens / 1e6)}M"
    if not run.exists():
        steps = max(2, int(tokens / (2 * 4 * 16 * 8 * 127)))
        wall = timed([sys.executable, "-m", "grpolens.cli", "synth", str(run), "--steps", str(steps), "--ranks", "2",
                            "--micro-batches", "4", "--groups", "16", "--generations", "8", "--max-len", "1024",
                            "--seed", "1"])["wall"]
        print(f"synth: {steps} steps in {wall:.1f} s")
    return run


def rows_of(run: Path) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in run.glob("tokens/*/*.parquet"))


class Server:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, str(SERVER)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.endpoint = f"http://127.0.0.1:{int(self.proc.stdout.readline().split('=')[1])}"
        os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1",
                           "AWS_ENDPOINT_URL": self.endpoint, "AWS_EC2_METADATA_DISABLED": "true"})
        self.client().create_bucket(Bucket="bench")

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")

    def counts(self, reset: bool = False) -> dict:
        req = urllib.request.Request(f"{self.endpoint}/_counts", method="POST" if reset else "GET")
        with urllib.request.urlopen(req) as r:
            return json.loads(r.read())

    def upload(self, run: Path, prefix: str) -> str:
        c = self.client()
        files = [f for f in run.rglob("*") if f.is_file() and "grpolens" not in f.relative_to(run).parts]
        with ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda f: c.put_object(Bucket="bench", Key=f"{prefix}/{f.relative_to(run).as_posix()}",
                                               Body=f.read_bytes()), files))
        return f"s3://bench/{prefix}"

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


def cmd_s3(args) -> None:
    base = Path(args.dir or tempfile.mkdtemp(prefix="grpolens-bench-"))
    run = synth(args.tokens, base)
    rows = rows_of(run)
    size = sum(f.stat().st_size for f in run.rglob("*.parquet"))
    n_shards = len(list(run.glob("tokens/*/*.parquet"))) + len(list(run.glob("samples/*/*.parquet")))
    say(f"run: {rows:,} token rows, {n_shards} shards, {size / 2**20:.0f} MiB")
    srv = Server()
    try:
        t = time.perf_counter()
        url = srv.upload(run, "run")
        say(f"upload to the local S3 server: {time.perf_counter() - t:.1f} s")
        out = base / "out"
        say(f"{'what':<44}{'wall s':>8}{'peak RSS MiB':>14}  requests")
        r = timed([sys.executable, "-m", "grpolens.cli", "recompute", str(run), "--full", "-q", "--out", str(out / "local")])
        wall, rss = r["wall"], r["rss"]
        say(f"{'local disk, recompute --full':<44}{wall:>8.2f}{rss:>14.0f}")
        for label, extra in (("s3://, recompute --full", ["--full"]), ("s3://, again (nothing new: cache)", [])):
            srv.counts(reset=True)
            r = timed([sys.executable, "-m", "grpolens.cli", "recompute", url, "-q", "--out", str(out / "s3"), *extra])
            wall, rss = r["wall"], r["rss"]
            say(f"{label:<44}{wall:>8.2f}{rss:>14.0f}  {json.dumps(srv.counts())}")
    finally:
        srv.stop()


def cmd_commands(args) -> None:
    """Each reading command on the same run, local and s3://, in a fresh process: wall time and
    the server's requests."""
    base = Path(args.dir or tempfile.mkdtemp(prefix="grpolens-bench-"))
    run = synth(args.tokens, base)
    from grpolens.run import format as fmt

    step = fmt.list_steps(run)[len(fmt.list_steps(run)) // 2]
    say(f"run: {rows_of(run):,} token rows, {len(fmt.list_steps(run))} steps; one step: {step}")
    srv = Server()
    try:
        url = srv.upload(run, "cmds")
        say(f"{'command':<36}{'disk s':>8}{'s3:// s':>9}  requests (s3://)")
        for cmd in (["validate"], ["tokens", "--step", str(step), "--json"],
                    ["completions", "--step", str(step), "--json"]):
            wall_local = timed([sys.executable, "-m", "grpolens.cli", cmd[0], str(run), *cmd[1:]])["wall"]
            srv.counts(reset=True)
            wall_s3 = timed([sys.executable, "-m", "grpolens.cli", cmd[0], url, *cmd[1:]])["wall"]
            say(f"{' '.join(cmd):<36}{wall_local:>8.2f}{wall_s3:>9.2f}  {json.dumps(srv.counts())}")
    finally:
        srv.stop()


def cmd_writer(args) -> None:
    """The run's shards written again by one ShardWriter per rank, to disk and to s3:// (uploads
    on the writer thread): wall time from the first add to close() returning."""
    import pyarrow.parquet as pq

    from grpolens.capture.writer import ShardWriter
    from grpolens.run import format as fmt

    base = Path(args.dir or tempfile.mkdtemp(prefix="grpolens-bench-"))
    run = synth(args.tokens, base)
    m = fmt.read_manifest(run)
    steps = fmt.list_steps(run)
    tables = {(t, sh.step, sh.rank): pq.read_table(sh.path) for t in fmt.TABLES for sh in fmt.list_shards(run, t)}
    say(f"run: {rows_of(run):,} token rows, {len(tables)} shards, held in memory")
    srv = Server()
    try:
        for label, dest in (("disk", str(base / "rewritten")), ("s3://", "s3://bench/rewritten")):
            t0 = time.perf_counter()
            for rank in range(m.world_size):
                w = ShardWriter(dest, rank, m.world_size, manifest=m, mode="overwrite")
                for step in steps:
                    tok = tables.get((fmt.TOKENS, step, rank))
                    if tok is not None:
                        for mb in sorted(set(tok.column("micro_batch").to_pylist())):
                            part = tok.filter(tok.column("micro_batch").to_numpy() == mb)
                            w.add_tokens(step, mb, {c: part.column(c).to_numpy(zero_copy_only=False)
                                                    for c in part.column_names if c not in ("step", "rank", "micro_batch")})
                    sam = tables.get((fmt.SAMPLES, step, rank))
                    if sam is not None:
                        w.add_samples(step, {c: (sam.column(c).to_pylist() if sam.schema.field(c).type == "string"
                                                 else sam.column(c).to_numpy(zero_copy_only=False))
                                             for c in sam.column_names if c not in ("step", "rank")})
                    w.end_step(step)
                w.close()
            srv.counts(reset=True) if label == "disk" else None
            say(f"{label:<8} {time.perf_counter() - t0:8.2f} s" + (f"  {json.dumps(srv.counts())}" if label != "disk" else ""))
    finally:
        srv.stop()


def cmd_listing(args) -> None:
    srv = Server()
    try:
        from grpolens.run import format as fmt

        c = srv.client()
        c.put_object(Bucket="bench", Key="list/grpolens.json", Body=b"{}")
        done = 0
        say(f"{'shards':>8}{'steps':>8}{'list_shards s':>15}{'LIST requests':>15}")
        for n in sorted(set([1000, args.shards])):
            ranks = 8
            keys = [f"list/tokens/step={i // ranks:08d}/rank={i % ranks:05d}.parquet" for i in range(done, n)]
            with ThreadPoolExecutor(8) as ex:
                list(ex.map(lambda k: c.put_object(Bucket="bench", Key=k, Body=b""), keys))
            done = n
            fmt.forget_listings()
            srv.counts(reset=True)
            t = time.perf_counter()
            shards = fmt.list_shards("s3://bench/list", fmt.TOKENS)
            wall = time.perf_counter() - t
            assert len(shards) == n
            say(f"{n:>8}{n // ranks:>8}{wall:>15.2f}{srv.counts().get('LIST', 0):>15}")
    finally:
        srv.stop()


def cmd_ray(args) -> None:
    base = Path(args.dir or tempfile.mkdtemp(prefix="grpolens-bench-"))
    wall = timed([sys.executable, "-c", "import ray; ray.init(num_cpus=2, include_dashboard=False); ray.shutdown()"])["wall"]
    say(f"Ray local start + shutdown alone (2 CPUs): {wall:.1f} s")
    for tokens in args.tokens_list:
        run = synth(tokens, base)
        rows = rows_of(run)
        say(f"run: {rows:,} token rows")
        for label, extra in (("default engine", []), ("--engine ray (local, 2 CPUs)", ["--engine", "ray"])):
            r = timed([sys.executable, "-m", "grpolens.cli", "recompute", str(run), "--full", "-q",
                       "--out", str(base / "out"), *extra])
            wall, rss = r["wall"], r["rss"]
            say(f"  {label:<32}{wall:>8.2f} s{rows / wall / 1e6:>8.2f} M tok/s  driver peak RSS {rss:.0f} MiB")


def cmd_pieces(args) -> None:
    """Partial-state bytes per shard and per step (pickled, as Ray ships them) and driver merge time."""
    from grpolens.analysis.recompute import recompute  # noqa: F401  (loads the registry)
    from grpolens.metrics.engine import VISITORS, SequencePartials, shard_pieces
    from grpolens.metrics.registry import load_families
    from grpolens.run import format as fmt
    from grpolens.run.reader import RunReader

    load_families()
    base = Path(args.dir or tempfile.mkdtemp(prefix="grpolens-bench-"))
    run = synth(args.tokens, base)
    cfg = RunReader(run).config()
    steps = fmt.list_steps(run, fmt.TOKENS)[: args.steps]
    per_visitor: dict[str, int] = {}
    from grpolens.analysis.recompute import metrics_for, step_values
    from grpolens.metrics import reduce
    from grpolens.run.reader import read_samples

    from grpolens import plugins

    prof = plugins.get("grpolens")
    metrics = metrics_for(prof, cfg, RunReader(run).sample_columns())  # loads every plugin's visitors too
    visitors = (SequencePartials(cfg), *(f(cfg) for f in VISITORS.values()))
    shard_bytes, step_bytes, merge_s, reduce_s, work_s, rows = [], [], [], [], 0.0, 0
    for s in steps:
        shards = fmt.list_shards(run, fmt.TOKENS, [s])
        t = time.perf_counter()
        results = [shard_pieces(sh, visitors, tuple(c.name for c in fmt.TOKEN_COLUMNS)) for sh in shards]
        work_s += time.perf_counter() - t
        rows += sum(int(r["sequences"][0]["seq_tokens"].sum()) for r in results)
        for r in results:
            b = len(pickle.dumps(r, protocol=5))
            shard_bytes.append(b)
            for k, v in r.items():
                per_visitor[k] = per_visitor.get(k, 0) + len(pickle.dumps(v, protocol=5))
        step_bytes.append(sum(shard_bytes[-len(results):]))
        t = time.perf_counter()
        pieces = {v.name: v.combine(s, [r[v.name] for r in results]) for v in visitors}
        merge_s.append(time.perf_counter() - t)
        # what the driver does next with the merged pieces: every metric's reduction of the step
        t = time.perf_counter()
        seqs, present = pieces["sequences"]
        sd = reduce.StepData(s, seqs, cfg, prof, read_samples(run, s), present, {"pieces": pieces,
                                                                                       "run_has_samples": True})
        step_values(sd, metrics)
        reduce_s.append(time.perf_counter() - t)
    n = len(shard_bytes)
    say(f"{len(steps)} steps, {n} shards, {rows:,} token rows ({rows / n:,.0f} per shard)")
    say(f"pieces per shard: mean {sum(shard_bytes) / n / 1024:.0f} KiB ({sum(shard_bytes) / rows:.1f} bytes per token row)")
    say(f"pieces per step:  mean {sum(step_bytes) / len(step_bytes) / 1024:.0f} KiB")
    for k, v in sorted(per_visitor.items(), key=lambda kv: -kv[1]):
        say(f"  {k:<22}{v / n / 1024:>8.1f} KiB per shard")
    say(f"per-shard work (read + every visitor), one thread: {rows / work_s / 1e6:.2f} M token rows/s")
    say(f"driver merge (every visitor's combine) per step: mean {1e3 * sum(merge_s) / len(merge_s):.1f} ms")
    say(f"driver reduction (every metric from the merged step) per step: mean {1e3 * sum(reduce_s) / len(reduce_s):.1f} ms")
    # per token row: the parallel part (read + visitors) and the serial part (the driver's merge and reduction)
    work_us = 1e6 * work_s / rows
    driver_us = 1e6 * (sum(merge_s) + sum(reduce_s)) / rows
    say(f"per token row: {work_us:.2f} µs of per-shard work, {driver_us:.2f} µs on the driver "
        f"(the driver's serial share: {driver_us / (work_us + driver_us):.0%})")
    estimate(run, work_us, driver_us, sum(shard_bytes) / rows, per_visitor.get("sample_tokens", 0) / rows)


#: the scale of the paper estimate: token rows, nodes, cores per node, and the bandwidth assumed
#: for reading Parquet on each node and for the pieces arriving at the driver
EST_ROWS, EST_NODES, EST_CORES, EST_GB_S = 1e10, 32, 16, 1.0


def estimate(run: Path, work_us: float, driver_us: float, piece_bytes: float, token_id_bytes: float) -> None:
    """The measured per-row costs scaled to EST_ROWS rows on a cluster (arithmetic, not a measurement)."""
    parquet = sum(f.stat().st_size for f in run.rglob("*.parquet")) / rows_of(run)
    cores = EST_NODES * EST_CORES
    work = EST_ROWS * work_us / 1e6 / cores
    read = EST_ROWS * parquet / 1e9 / (EST_GB_S * EST_NODES)
    pieces_gb = EST_ROWS * piece_bytes / 1e9
    driver = EST_ROWS * driver_us / 1e6
    say(f"paper estimate at these per-row costs, {EST_ROWS:,.0f} token rows on {EST_NODES} nodes x {EST_CORES} cores "
        f"({EST_GB_S:g} GB/s per node and into the driver):")
    say(f"  per-shard work: {work / 60:.1f} min on {cores} cores, plus reading {EST_ROWS * parquet / 1e9:.0f} GB "
        f"of Parquet ({parquet:.1f} B/row): {read / 60:.1f} min")
    say(f"  pieces to the driver: {pieces_gb:.0f} GB ({pieces_gb / EST_GB_S / 60:.1f} min before deserialising), "
        f"{EST_ROWS * (piece_bytes - token_id_bytes) / 1e9:.0f} GB without the diversity metrics' token ids")
    say(f"  driver merge + reduction: {driver / 60:.0f} min")
    bound = "the driver" if driver > work + read else "the per-shard work"
    alone = EST_ROWS * (work_us / EST_CORES + driver_us) / 1e6
    say(f"  so the run is bound by {bound}: {(work + read + driver) / 3600:.1f} h in all, against "
        f"{alone / 3600:.1f} h for the default engine on one {EST_CORES}-core machine using every core")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("s3", "pieces", "commands", "writer"):
        p = sub.add_parser(name)
        p.add_argument("--tokens", type=float, default=10e6)
        p.add_argument("--dir", default=None, help="where runs are made (and reused)")
        p.add_argument("--steps", type=int, default=8, help="pieces: steps measured")
    p = sub.add_parser("listing")
    p.add_argument("--shards", type=int, default=10_000)
    p = sub.add_parser("ray")
    p.add_argument("--tokens", dest="tokens_list", type=float, nargs="+", default=[10e6, 50e6])
    p.add_argument("--dir", default=None)
    for p in sub.choices.values():
        p.add_argument("--write-doc", action="store_true", help="write the report into docs/distributed.md")
    args = ap.parse_args()
    started = dt.datetime.now(dt.timezone.utc)
    {"s3": cmd_s3, "listing": cmd_listing, "ray": cmd_ray, "pieces": cmd_pieces, "commands": cmd_commands,
     "writer": cmd_writer}[args.cmd](args)
    if args.write_doc:
        script = "benchmarks/bench_distributed.py"
        write_block("docs/distributed.md", f"bench_distributed-{args.cmd}", script,
                    header(shown_command(script, sys.argv[1:]), started) + "\n\n```text\n" + "\n".join(REPORT) + "\n```")
        print("docs/distributed.md updated")


if __name__ == "__main__":
    main()
