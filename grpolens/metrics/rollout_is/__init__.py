"""Rollout importance sampling and train–inference mismatch (family ``rollout_is``).

Formulas live in :mod:`grpolens.functional.rollout_is` (config, weights, modes, veto, rejection
filters, partials, the canonical summary); this package runs them on a batch and registers them:

``inputs``     δ, the valid tokens and the IS partials of a batch, computed once per batch
``producers``  the per-sequence partials (IS, and the mismatch KL / perplexities / χ²)
``summary``    the canonical step summary and the mismatch summary the profiles' own summaries reuse
``visitors``   per-step pieces besides the partials: δ quantiles, rejection-filter partials
``offset``     the constant train–rollout offset: its thresholds and ``recompute``'s note
``catalogue``  the metrics, their docs, the family and its ``grpolens check`` rules

Each trainer's own summary is in its profile (``rollout_is_summary`` of
``grpolens/profiles/xtuner.py`` and ``trl.py``; verl's, which its actor family shares, in
:mod:`grpolens.metrics.verl_rollout_corr`); the outputs it writes (``is_hist.parquet``,
``--is-weights``) in :mod:`grpolens.analysis.is_weights`.

Aggregation per profile (names change, and the grouping each trainer uses; never a formula):

``grpolens``  pooled over the step: token fractions over valid tokens, sequence summaries over
              sequences with a valid token; ``None`` when there is nothing to average.
``xtuner``    the reference's per-*pack* (rank, micro_batch) values -- the mismatch metrics treat a
              pack as one row -- then the mean over valid packs, max/min for keys naming max/min,
              0.0 when no pack is valid (as ``merge_rollout_is_metrics``).
``verl``      newest verl: one computation over the global batch (the step); sequence summaries
              over *all* rows (an empty row counts as 0), IS statistics on applied weights.
``trl``       ``sampling/*``: per rank (each completion once), then the plain mean over ranks
              (min/max for the extremes); sequence modes average over sequences.
"""

from grpolens.metrics.rollout_is import producers, visitors, catalogue  # noqa: F401  (each registers on import)
from grpolens.metrics.rollout_is.catalogue import IS_METRICS, MISMATCH_METRICS, RS_STATS, RULES, WHEN
from grpolens.metrics.rollout_is.inputs import (DELTA_VISITOR, FAMILY, REQ, RS_VISITOR, batch_applied_weights, batch_inputs,
                                              batch_partials, batch_token_weights, batch_valid_weights)
from grpolens.metrics.rollout_is.offset import OFFSET_MIN_AGREEMENT, OFFSET_MIN_NATS, offset_notes
from grpolens.metrics.rollout_is.producers import MM_MERGE, _mismatch_partials
from grpolens.metrics.rollout_is.summary import (canonical_summary, mismatch_rows, mismatch_summary, step_summary, step_rows,
                                               sub_rows)
from grpolens.metrics.rollout_is.visitors import DeltaQuantiles, RSPartials, rs_summary

__all__ = [
    "IS_METRICS", "MISMATCH_METRICS", "RS_STATS", "RULES", "WHEN", "DELTA_VISITOR", "FAMILY", "REQ", "RS_VISITOR",
    "batch_applied_weights", "batch_inputs", "batch_partials", "batch_token_weights", "batch_valid_weights", "OFFSET_MIN_AGREEMENT",
    "OFFSET_MIN_NATS", "offset_notes", "MM_MERGE", "_mismatch_partials", "canonical_summary", "mismatch_rows",
    "mismatch_summary", "step_summary", "step_rows", "sub_rows", "DeltaQuantiles", "RSPartials", "rs_summary",
]
