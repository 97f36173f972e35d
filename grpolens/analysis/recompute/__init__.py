"""``grpolens recompute`` (and ``grpolens.recompute()``): every registered metric, per step, from a run's shards.

The work is one streaming pass (:func:`grpolens.metrics.engine.iter_steps`): per step, the
per-sequence partials of all shards are merged and every metric is reduced from them under the
chosen profile. Results are cached per step with a fingerprint of the step's shards and of the
config, so that re-running on a run that has grown reads only the new (or changed) steps.

Outputs (atomically, under ``RUN/grpolens/`` for the default profile, ``RUN/grpolens/<profile>/``
otherwise): ``metrics.parquet`` (one row per step, one column per metric) and ``metrics.jsonl``
(one JSON object per step, null keys omitted, like a trainer's log).

The package, in the order a recompute runs: :mod:`.entry` (:func:`recompute`: its steps top to
bottom, the lock), :mod:`.plan` (the request, every decision taken once and named, the resolved
run), :mod:`.cache` (the per-step cache and its keys), :mod:`.steps` (the metrics and the
per-step body, here or in a worker process), :mod:`.compute` (the steps computed and tabulated),
:mod:`.outputs` (where outputs go, the tables and notes written).
"""

from grpolens.analysis.recompute.cache import CACHE_VERSION
from grpolens.analysis.recompute.entry import RecomputeResult, recompute, recompute_lock
from grpolens.analysis.recompute.outputs import finalize, key_columns, to_jsonl
from grpolens.analysis.recompute.plan import Decisions, Plan, Request, plan_recompute
from grpolens.analysis.recompute.steps import (StepWork, WorkerSpec, metrics_for, select_metrics, step_values,
                                              step_visitors)

__all__ = ["CACHE_VERSION", "Decisions", "Plan", "RecomputeResult", "Request", "StepWork", "WorkerSpec", "finalize",
           "key_columns", "metrics_for", "plan_recompute", "recompute", "recompute_lock", "select_metrics",
           "step_values", "step_visitors", "to_jsonl"]
