"""Cost of GRPOLensHook on CPU, and writer throughput.

    python benchmarks/bench_hook.py [--batch 64] [--seq 2048] [--calls 32] [--valid 0.7] [--write-doc]

Measures, for a padded (B, T) batch with ~`valid` real tokens:
  * a loss-like step alone (clipped ratio surrogate + k3 KL, masked mean, backward): the baseline;
  * the same step with ``hook.log_loss_call`` inside it, and the call alone (training-thread time);
  * end-to-end hook throughput: stored rows / (first call .. close() returned);
  * ShardWriter throughput on ready numpy columns (conversion, sort check, zstd Parquet, fsync).
The writer thread runs concurrently with the timed steps, as it would in training.
``--write-doc`` writes the report, with the machine and the date, into docs/hook.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by the tests
from doc_block import header, shown_command, write_block  # noqa: E402

from grpolens.run import format as fmt
from grpolens.hook import GRPOLensHook
from grpolens.capture.writer import ShardWriter


def make_batch(batch: int, seq: int, valid_frac: float, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lo = max(1, int(seq * (2 * valid_frac - 1)))  # uniform lengths in [lo, seq] average about valid_frac * seq
    lens = torch.randint(lo, seq + 1, (batch,), generator=g)
    mask = torch.arange(seq)[None, :] < lens[:, None]
    return {
        "logp": (-torch.rand(batch, seq, generator=g) * 3).requires_grad_(True),
        "old_logp": -torch.rand(batch, seq, generator=g) * 3,
        "ref_logp": -torch.rand(batch, seq, generator=g) * 3,
        "entropy": torch.rand(batch, seq, generator=g) * 2,
        "token_ids": torch.randint(0, 150_000, (batch, seq), generator=g),
        "advantages": torch.randn(batch, generator=g),
        "mask": mask,
        "sample_ids": torch.arange(batch),
    }


def loss_step(d: dict[str, torch.Tensor]) -> None:
    """A GRPO-like loss on the batch, forward and backward."""
    logp = d["logp"]
    ratio = torch.exp(logp - d["old_logp"])
    adv = d["advantages"][:, None]
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.28) * adv)
    delta = d["ref_logp"] - logp
    kl = torch.exp(delta) - delta - 1
    m = d["mask"].float()
    loss = -((surrogate - 0.04 * kl) * m).sum() / m.sum()
    loss.backward()
    logp.grad = None


def timed(fn, n: int) -> tuple[list[float], list[float]]:
    """Wall-clock and calling-thread CPU seconds of each of n calls. Thread CPU time is what the
    call itself costs; wall time adds waiting (for the GIL, for a core on a busy machine)."""
    wall, cpu = [], []
    for _ in range(n):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return wall, cpu


def row(name: str, wall: list[float], cpu: list[float] | None = None) -> str:
    cpu_s = f"{1e3 * statistics.median(cpu):9.2f}" if cpu else f"{'':9s}"
    return f"{name:40s} {1e3 * statistics.median(wall):9.2f} {1e3 * min(wall):9.2f} {cpu_s}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--calls", type=int, default=32)
    ap.add_argument("--valid", type=float, default=0.7)
    ap.add_argument("--calls-per-step", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: on a busy 2-core machine a 2-thread copy waits for a "
                         "descheduled worker and the timings become noise)")
    ap.add_argument("--write-doc", action="store_true", help="write the report into docs/hook.md")
    args = ap.parse_args()
    started = dt.datetime.now(dt.timezone.utc)
    torch.set_num_threads(args.threads)
    d = make_batch(args.batch, args.seq, args.valid)
    rows_per_call = int(d["mask"].sum())
    hook_args = {k: d[k] for k in ("logp", "old_logp", "ref_logp", "entropy", "mask", "sample_ids", "advantages")}
    hook_args["token_ids"] = d["token_ids"]

    for _ in range(3):
        loss_step(d)
    base = timed(lambda: loss_step(d), args.calls)

    with tempfile.TemporaryDirectory() as tmp:
        call_wall, call_cpu = [], []
        counter = iter(range(10**9))
        t_start, p_start, m_start = time.perf_counter(), time.process_time(), time.thread_time()
        with GRPOLensHook(Path(tmp) / "run") as hook:
            def with_hook():
                i = next(counter)
                step = i // args.calls_per_step
                t0, c0 = time.perf_counter(), time.thread_time()
                hook.log_loss_call(step=step, **hook_args)
                call_wall.append(time.perf_counter() - t0)
                call_cpu.append(time.thread_time() - c0)
                loss_step(d)
                if i % args.calls_per_step == args.calls_per_step - 1:
                    hook.end_step(step)

            hooked = timed(with_hook, args.calls)
            t_calls_done = time.perf_counter()
        t_end = time.perf_counter()
        # CPU of every other thread (the writer's) = process CPU - this thread's CPU
        writer_cpu = (time.process_time() - p_start) - (time.thread_time() - m_start)
        run = Path(tmp) / "run"
        shards = fmt.list_shards(run)
        disk = sum(s.path.stat().st_size for s in shards)
        stored = args.calls * rows_per_call

    # Writer alone, on ready numpy columns (what the hook hands over after dropping padding).
    n = rows_per_call
    rng = np.random.default_rng(0)
    cols = {"sample_id": np.repeat(np.arange(64), n // 64 + 1)[:n], "pos": np.arange(n, dtype=np.int32) % 2048,
            "token_id": rng.integers(0, 150_000, n).astype(np.int32), "logp": -rng.random(n, dtype=np.float32),
            "old_logp": -rng.random(n, dtype=np.float32), "ref_logp": -rng.random(n, dtype=np.float32),
            "entropy": rng.random(n, dtype=np.float32), "advantage": np.repeat(rng.standard_normal(64), n // 64 + 1)[:n].astype(np.float32),
            "mask": np.ones(n, bool)}
    with tempfile.TemporaryDirectory() as tmp:
        t0, p0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
        with ShardWriter(tmp) as w:
            for i in range(args.calls):
                w.add_tokens(i // args.calls_per_step, i % args.calls_per_step, {k: v.copy() for k, v in cols.items()})
                if i % args.calls_per_step == args.calls_per_step - 1:
                    w.end_step(i // args.calls_per_step)
        writer_s = time.perf_counter() - t0
        writer_alone_cpu = (time.process_time() - p0) - (time.thread_time() - m0)

    report: list[str] = []
    report.append(f"batch {args.batch} x {args.seq}, {rows_per_call} real tokens per call "
                  f"({rows_per_call / d['mask'].numel():.0%}), {args.calls} calls, {args.calls_per_step} per step, "
                  f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s), load average "
                  f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    report.append(f"{'per call (ms)':40s} {'wall med':>9s} {'wall min':>9s} {'CPU med':>9s}")
    report.append(row("loss step, no hook", *base))
    report.append(row("loss step + log_loss_call", *hooked))
    report.append(row("log_loss_call alone (training thread)", call_wall, call_cpu))
    report.append(row("writer thread CPU per call", [writer_cpu / args.calls]))
    report.append(f"{'close() after the last call':40s} {1e3 * (t_end - t_calls_done):9.0f} ms")
    report.append(f"{'hook end to end, stored rows/s':40s} {stored / (t_end - t_start) / 1e6:9.2f} M")
    report.append(f"{'hook writer thread, rows per CPU-second':40s} {stored / writer_cpu / 1e6:9.2f} M")
    report.append(f"{'ShardWriter alone, rows/s (wall)':40s} {stored / writer_s / 1e6:9.2f} M")
    report.append(f"{'ShardWriter alone, rows per CPU-second':40s} {stored / writer_alone_cpu / 1e6:9.2f} M")
    report.append(f"{'on disk per stored token (9 columns)':40s} {disk / stored:9.2f} bytes ({len(shards)} shards)")
    print("\n".join(report))
    if args.write_doc:
        script = "benchmarks/bench_hook.py"
        write_block("docs/hook.md", "bench_hook", script,
                    header(shown_command(script, sys.argv[1:]), started) + "\n\n```text\n"
                    + "\n".join(line.rstrip() for line in report) + "\n```")
        print("docs/hook.md updated")


if __name__ == "__main__":
    main()
