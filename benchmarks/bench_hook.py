"""Cost of GRPOLensHook on CPU, and writer throughput.

    python benchmarks/bench_hook.py [--batch 64] [--seq 2048] [--calls 32] [--valid 0.7]

Measures, for a padded (B, T) batch with ~`valid` real tokens:
  * a loss-like step alone (clipped ratio surrogate + k3 KL, masked mean, backward): the baseline;
  * the same step with ``hook.log_loss_call`` inside it, and the call alone (training-thread time);
  * end-to-end hook throughput: stored rows / (first call .. close() returned);
  * ShardWriter throughput on ready numpy columns (conversion, sort check, zstd Parquet, fsync).
The writer thread runs concurrently with the timed steps, as it would in training.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from grpolens import format as fmt
from grpolens.hook import GRPOLensHook
from grpolens.writer import ShardWriter


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


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def ms(xs: list[float]) -> str:
    return f"{1e3 * statistics.median(xs):8.2f} ms (min {1e3 * min(xs):.2f}, p90 {1e3 * sorted(xs)[int(0.9 * (len(xs) - 1))]:.2f})"


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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    d = make_batch(args.batch, args.seq, args.valid)
    rows_per_call = int(d["mask"].sum())
    hook_args = {k: d[k] for k in ("logp", "old_logp", "ref_logp", "entropy", "mask", "sample_ids", "advantages")}
    hook_args["token_ids"] = d["token_ids"]

    for _ in range(3):
        loss_step(d)
    base = timed(lambda: loss_step(d), args.calls)

    with tempfile.TemporaryDirectory() as tmp:
        calls = []
        counter = iter(range(10**9))
        t_start = time.perf_counter()
        with GRPOLensHook(Path(tmp) / "run") as hook:
            def with_hook():
                i = next(counter)
                step = i // args.calls_per_step
                t0 = time.perf_counter()
                hook.log_loss_call(step=step, **hook_args)
                calls.append(time.perf_counter() - t0)
                loss_step(d)
                if i % args.calls_per_step == args.calls_per_step - 1:
                    hook.end_step(step)

            hooked = timed(with_hook, args.calls)
            t_calls_done = time.perf_counter()
        t_end = time.perf_counter()
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
        t0 = time.perf_counter()
        with ShardWriter(tmp) as w:
            for i in range(args.calls):
                w.add_tokens(i // args.calls_per_step, i % args.calls_per_step, {k: v.copy() for k, v in cols.items()})
                if i % args.calls_per_step == args.calls_per_step - 1:
                    w.end_step(i // args.calls_per_step)
        writer_s = time.perf_counter() - t0

    print(f"batch {args.batch} x {args.seq}, {rows_per_call} real tokens per call ({rows_per_call / d['mask'].numel():.0%}), "
          f"{args.calls} calls, {args.calls_per_step} per step, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'measure':48s} value")
    print(f"{'loss step, no hook (median)':48s} {ms(base)}")
    print(f"{'loss step + log_loss_call (median)':48s} {ms(hooked)}")
    print(f"{'log_loss_call alone, training thread (median)':48s} {ms(calls)}")
    print(f"{'overhead per step':48s} {1e3 * (statistics.median(hooked) - statistics.median(base)):8.2f} ms "
          f"({statistics.median(hooked) / statistics.median(base) - 1:+.0%})")
    print(f"{'close() after the last call':48s} {1e3 * (t_end - t_calls_done):8.2f} ms")
    print(f"{'hook end to end (calls + writing), rows/s':48s} {stored / (t_end - t_start) / 1e6:8.2f} M")
    print(f"{'ShardWriter alone, rows/s':48s} {stored / writer_s / 1e6:8.2f} M")
    print(f"{'on disk per stored token (zstd, 9 columns)':48s} {disk / stored:8.2f} bytes ({len(shards)} shards)")


if __name__ == "__main__":
    main()
