"""The benchmark's core subset (see ``subset_sql.py``) the way a trainer computes it: per step, the
step's token rows padded into (B, T) tensors, then masked means.

    python benchmarks/subset_torch.py RUN [--threads N] [--json OUT]

Per step: read the step's shards (pyarrow), scatter each column into a zero-padded (sequences ×
longest sequence) float32 tensor (what a trainer's batch looks like), and reduce with
``(x * m).sum() / m.sum()`` as TRL and verl do. Needs torch (the ``hook`` or ``dev`` extra).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from subset_sql import subset_config  # the same parameters, from the run's manifest

COLUMNS = ("step", "rank", "micro_batch", "sample_id", "logp", "old_logp", "ref_logp", "rollout_logp", "advantage",
           "mask", "entropy")


def padded(t: pa.Table) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(B, T) float32 tensors of the float columns (NaN for null), and the padded loss mask."""
    keys = [t.column(k).to_numpy() for k in ("rank", "micro_batch", "sample_id")]
    n = t.num_rows
    change = np.ones(n, dtype=bool)
    change[1:] = (keys[0][1:] != keys[0][:-1]) | (keys[1][1:] != keys[1][:-1]) | (keys[2][1:] != keys[2][:-1])
    starts = np.flatnonzero(change)
    lengths = np.diff(np.append(starts, n))
    row = np.repeat(np.arange(len(starts)), lengths)
    col = np.arange(n) - np.repeat(starts, lengths)
    B, T = len(starts), int(lengths.max())
    idx = torch.from_numpy(row * T + col)
    out = {}
    for k in ("logp", "old_logp", "ref_logp", "rollout_logp", "advantage", "entropy"):
        x = torch.from_numpy(t.column(k).to_numpy(zero_copy_only=False).astype(np.float32))  # null -> NaN
        z = torch.zeros(B * T, dtype=torch.float32)
        z[idx] = x
        out[k] = z.view(B, T)
    m = torch.zeros(B * T, dtype=torch.bool)
    m[idx] = torch.from_numpy(t.column("mask").to_numpy(zero_copy_only=False))
    return out, m.view(B, T)


def step_values(x: dict[str, torch.Tensor], mask: torch.Tensor, p: dict) -> dict[str, float]:
    def mean(v, m):
        return float((torch.where(m, v, 0.0)).sum() / m.sum())

    logp, a = x["logp"], x["advantage"]
    old = torch.where(torch.isnan(x["old_logp"]), logp, x["old_logp"])
    av = mask & torch.isfinite(logp) & torch.isfinite(old) & torch.isfinite(a)
    r = torch.exp(logp - old)
    low = ((r < p["lo"]) & (a < 0)).float()
    high = ((r > p["hi"]) & (a > 0)).float()
    kv = mask & torch.isfinite(logp) & torch.isfinite(x["ref_logp"])
    xk = torch.where(kv, x["ref_logp"] - logp, 0.0)
    hv = mask & torch.isfinite(x["entropy"])
    d = old - x["rollout_logp"]
    iv = mask & ~torch.isnan(d)
    w = torch.clamp(torch.exp(torch.clamp(d, -20, 20)), p["is_lower"], p["is_upper"])
    w = torch.where(iv, w, 0.0)
    n_seq = iv.sum(dim=1)
    has = n_seq > 0
    seq_w = w.sum(dim=1)[has] / n_seq[has]
    veto = (iv & ((d < p["log_veto_lower"]) | (d > p["log_veto_upper"]))).any(dim=1)[has]
    mv = mask & torch.isfinite(old) & torch.isfinite(x["rollout_logp"])
    dm = torch.where(mv, d, 0.0)
    return {
        "clip/low": mean(low, av), "clip/high": mean(high, av),
        "kl/k3": mean(torch.exp(xk) - xk - 1, kv), "entropy": mean(x["entropy"], hv),
        "rollout_is/applied/mean": float(w.sum() / iv.sum()),
        "rollout_is/applied/seq_mean": float(seq_w.mean()),
        "rollout_is/veto/seq_fraction": float(veto.float().mean()),
        "mismatch/kl_k3": mean(torch.expm1(dm) - dm, mv),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    p = subset_config(args.run)
    rows = []
    for d in sorted(glob.glob(os.path.join(args.run, "tokens", "step=*"))):
        files = sorted(glob.glob(os.path.join(d, "*.parquet")))
        t = pa.concat_tables([pq.read_table(f, columns=list(COLUMNS)) for f in files])
        x, m = padded(t)
        rows.append({"step": int(t.column("step")[0].as_py()), **step_values(x, m, p)})
    rows = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    print(len(rows))


if __name__ == "__main__":
    main()
