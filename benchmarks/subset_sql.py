"""The benchmark's core subset of metrics, per step, written as one DuckDB SQL query.

    python benchmarks/subset_sql.py RUN [--threads N] [--json OUT]

The *core subset* (what a hand-written script usually computes; grpolens names, default profile,
token level, the run's manifest config):

==================================  =========================================================
clip/low, clip/high                 fraction of valid tokens (mask, finite logp, old, A) with
                                    r = e^(logp − old) < 1 − ε and A < 0 / r > 1 + ε_high and A > 0
kl/k3                               mean of e^x − x − 1, x = ref − logp, over masked finite tokens
entropy                             mean entropy over masked finite tokens
rollout_is/applied/mean             mean over valid tokens (mask, δ defined) of the applied
                                    weight clip(e^clip(δ, ±20), lower, upper), δ = old − rollout
rollout_is/applied/seq_mean         mean over sequences of each sequence's mean applied weight
rollout_is/veto/seq_fraction        fraction of sequences with a token e^δ outside the veto band
mismatch/kl_k3                      mean of e^δ − 1 − δ over masked tokens, old and rollout finite
==================================  =========================================================

``old`` is ``old_logp``, or ``logp`` where it is null. Run-format edge cases that grpolens
handles (a sequence with both +inf and −inf δ, NaN stored as a value) are out of scope here: this
is the script a user would write for clean data, to compare speed with. Needs ``pip install
-e ".[bench]"`` (duckdb). Prints per-step values as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import duckdb

QUERY = """
WITH t AS (
  SELECT step, rank, micro_batch, sample_id, mask, advantage AS a, entropy AS h, logp,
         coalesce(old_logp, logp) AS old, ref_logp AS ref, rollout_logp AS roll
  FROM read_parquet('{glob}', hive_partitioning = false)
), tok AS (
  SELECT step, rank, micro_batch, sample_id,
    coalesce(mask AND isfinite(logp) AND isfinite(old) AND isfinite(a), false) AS av,
    exp(logp - old) AS r, a,
    coalesce(mask AND isfinite(logp) AND isfinite(ref), false) AS kv, ref - logp AS x,
    coalesce(mask AND isfinite(h), false) AS hv, h,
    old - roll AS d,
    coalesce(mask AND NOT isnan(old - roll), false) AS iv,
    coalesce(mask AND isfinite(old) AND isfinite(roll), false) AS mv
  FROM t
), seq AS (
  SELECT step, rank, micro_batch, sample_id,
    count(*) FILTER (av) AS n_av,
    count(*) FILTER (av AND r < {lo} AND a < 0) AS n_low,
    count(*) FILTER (av AND r > {hi} AND a > 0) AS n_high,
    count(*) FILTER (kv) AS n_kl, sum(exp(x) - x - 1) FILTER (kv) AS k3,
    count(*) FILTER (hv) AS n_h, sum(h) FILTER (hv) AS h,
    count(*) FILTER (iv) AS n_is,
    sum(least(greatest(exp(least(greatest(d, -20), 20)), {is_lower}), {is_upper})) FILTER (iv) AS w,
    bool_or(d < {log_veto_lower} OR d > {log_veto_upper}) FILTER (iv) AS veto,
    count(*) FILTER (mv) AS n_mm, sum(exp(d) - 1 - d) FILTER (mv) AS mm_k3
  FROM tok GROUP BY ALL
)
SELECT step,
  sum(n_low) / sum(n_av) AS "clip/low",
  sum(n_high) / sum(n_av) AS "clip/high",
  sum(k3) / sum(n_kl) AS "kl/k3",
  sum(h) / sum(n_h) AS "entropy",
  sum(w) / sum(n_is) AS "rollout_is/applied/mean",
  avg(w / n_is) FILTER (n_is > 0) AS "rollout_is/applied/seq_mean",
  avg(veto::DOUBLE) FILTER (n_is > 0) AS "rollout_is/veto/seq_fraction",
  sum(mm_k3) / sum(n_mm) AS "mismatch/kl_k3"
FROM seq GROUP BY step ORDER BY step
"""


def subset_config(run: str) -> dict:
    """The parameters of the subset from the run's manifest config (grpolens' defaults otherwise)."""
    with open(os.path.join(run, "grpolens.json")) as f:
        cfg = json.load(f).get("config", {})
    ris = cfg.get("rollout_is") or {}
    return {"lo": 1.0 - cfg.get("epsilon", 0.2), "hi": 1.0 + cfg.get("epsilon_high", cfg.get("epsilon", 0.2)),
            "is_lower": ris.get("lower", 0.0) or 0.0, "is_upper": ris.get("upper", math.inf),
            "log_veto_lower": math.log(ris["veto_lower"]) if ris.get("veto_lower") else -math.inf,
            "log_veto_upper": math.log(ris["veto_upper"]) if ris.get("veto_upper") else math.inf}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    p = subset_config(args.run)
    p = {k: (f"'{v}'::DOUBLE" if math.isinf(v) else repr(float(v))) for k, v in p.items()}
    con = duckdb.connect()
    con.execute(f"SET threads = {args.threads}")
    sql = QUERY.format(glob=os.path.join(args.run, "tokens", "step=*", "*.parquet"), **p)
    rel = con.execute(sql)
    names = [d[0] for d in rel.description]
    rows = [dict(zip(names, r)) for r in rel.fetchall()]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    print(len(rows))


if __name__ == "__main__":
    main()
