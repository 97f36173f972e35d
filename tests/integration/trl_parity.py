"""Compare ``grpolens.recompute(run, profile="trl")`` with the metrics TRL itself logged in that run.

    python tests/integration/trl_parity.py RUN            # prints one line per (step, metric)

TRL's log is ``RUN/grpolens/trl_log.jsonl`` (written by the integration from ``on_log``). Both sides
use TRL's ``step`` (the integration records ``state.global_step + 1`` at each call, the step TRL
logs). Only metrics grpolens can recompute from the run are compared; ``loss``, ``grad_norm``,
``learning_rate``, ``step_time``, ``epoch`` and the ``train_*`` summary are the optimiser's.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

#: TRL's metric keys grpolens reproduces (exact names, or prefixes ending in "/").
COMPARED = ("loss", "kl", "entropy", "clip_ratio/", "cispo_clip_ratio", "completions/", "rewards/", "reward", "reward_std",
            "frac_reward_zero_std", "num_tokens", "sampling/")
NOT_COMPARED = ("grad_norm", "learning_rate", "step_time", "epoch", "step", "total_flos")
REL = 1e-5
ABS = 1e-8
#: Absolute floors where TRL's own float32 arithmetic is the larger error. TRL computes the k3 term
#: exp(ref - logp) - (ref - logp) - 1 in float32: near 0 it cancels to ~1e-8 absolute (measured:
#: kl 2.30922e-4 logged, 2.30937e-4 in float64, 2.30922e-4 when recomputed in float32 like TRL).
#: TRL's `loss` is a float32 sum of O(1) terms (advantage x ratio) that cancel to ~1e-4..1e-8: its
#: rounding is ~1e-7..1e-6 absolute (measured 8.55178e-4 logged vs 8.55126e-4 in float64).
ABS_FLOOR = {"kl": 1e-7, "loss": 1e-6}


def compared(key: str) -> bool:
    return any(key == c or (c.endswith("/") and key.startswith(c)) for c in COMPARED)


@dataclass
class Row:
    step: int
    key: str
    trl: float | None
    ours: float | None
    status: str  # "ok", "mismatch", "missing" (TRL logged it, grpolens has no value), "extra"

    def __str__(self) -> str:
        return f"{self.status:8s} step {self.step:3d} {self.key:40s} trl={self.trl!r:24s} grpolens={self.ours!r}"


def close(a: float, b: float, rel: float = REL, abs_: float = ABS) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= abs_ + rel * max(abs(a), abs(b))


def trl_log(run: Path) -> dict[int, dict]:
    """Step -> TRL's logged values (the per-step logs; the final summary line is left out)."""
    out: dict[int, dict] = {}
    for line in (Path(run) / "grpolens" / "trl_log.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "train_runtime" in rec:
            continue
        out.setdefault(int(rec["step"]), {}).update(rec)
    return out


def compare(run: Path, *, rel: float = REL) -> list[Row]:
    import grpolens

    logged = trl_log(run)
    df = grpolens.recompute(run, profile="trl", write=False)
    ours = {int(r["step"]): r for r in df.iter_rows(named=True)}
    rows: list[Row] = []
    for step, rec in sorted(logged.items()):
        mine = ours.get(step, {})
        for key, val in rec.items():
            if not compared(key):
                continue
            got = mine.get(key)
            if val is None and got is None:
                rows.append(Row(step, key, val, got, "ok"))
            elif got is None:
                rows.append(Row(step, key, val, None, "missing"))
            else:
                ok = close(float(val), float(got), rel, max(ABS, ABS_FLOOR.get(key, 0.0)))
                rows.append(Row(step, key, val, got, "ok" if ok else "mismatch"))
        for key, got in mine.items():  # values grpolens gives for a TRL metric TRL did not log at that step
            if key != "step" and compared(key) and key not in rec and got is not None:
                rows.append(Row(step, key, None, got, "extra"))
    return rows


def summary(rows: list[Row]) -> str:
    bad = [r for r in rows if r.status != "ok"]
    keys = sorted({r.key for r in rows})
    ok_keys = sorted({r.key for r in rows} - {r.key for r in bad})
    lines = [f"{len(rows) - len(bad)}/{len(rows)} values agree; metrics all agreeing: {len(ok_keys)}/{len(keys)}"]
    lines += [str(r) for r in bad]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    rows = compare(Path(sys.argv[1]))
    print(summary(rows))
    sys.exit(0 if all(r.status == "ok" for r in rows) else 1)
