"""Per-step completion tables: MaxEnt-GRPO's rich-completion sidecars, and a Parquet table with
what only per-token data can add.

Rows are the completions *generated* at a step (the ``samples`` table, every rank), in gather
order -- by (rank, sample_id), rank-major as ``gather_object`` concatenates -- then grouped:

``prompt_index``      index of the prompt group (``group_id``) by first appearance in that order;
                      a group whose completions straddle ranks is one group
``completion_index``  position within the group, in the same order; ``group_size`` its size
``reward_rank_desc``  1-based rank by descending ``reward_total`` within the group, ties broken by
                      completion_index; null/NaN rewards rank last (the reference leaves that order
                      undefined), −inf just before them
``q_mass``            the optional samples column ``q_mass`` (MaxEnt listwise q); null for GRPO
``update_weight_raw`` q_mass when the whole group's q is finite and sums to > 0, else the advantage
``update_mass_proxy`` q / Σq over the group in the first case; otherwise max(A, 0) / Σ max(A, 0)
                      when every advantage of the group is finite and some is positive; else null
                      (the TRL-path writer's cascade, twinkle-maxent-notes §2.6)

NaN floats are stored as null (±inf stay). Per-sequence token columns come from the engine's
per-sequence partials (the families' producers, never re-derived here) of the **same step's**
loss calls; a completion trained in several loss calls of the step takes its **first** one (lowest
rank, micro_batch -- the one ``grpolens tokens --sample`` shows) and ``loss_calls`` counts them.
Token data of other steps is not joined: no token rows for the sample at its step gives null token
columns and ``loss_calls = 0``.

A step that trains on completions generated at an earlier step (TRL's ``steps_per_generation`` or
``num_iterations`` > 1, verl's and Twinkle's mini-batches and epochs over one rollout) has no
samples of its own for them: its table finds them **by sample_id** in the samples of the step that
generated them (searched backwards, at most :data:`REUSE_LOOKBACK` earlier steps with samples),
with that step's group columns (prompt_index, rank of the reward in its group) and this step's
token columns; ``generated_at_step`` says where each row was generated.

The package: :mod:`.table` (one step's table, both sides), :mod:`.steps` (the recompute visitor,
reused completions, on-demand builds), :mod:`.files` (the JSON sidecars).
"""

from grpolens.analysis.sidecars.files import (check_key, read_sidecar, read_sidecars, sidecar_bytes, sidecar_columns,
                                              sidecar_files, sidecar_name, sidecar_payload, write_sidecars)
from grpolens.analysis.sidecars.steps import (REUSE_LOOKBACK, Completions, build_steps, completions_path, fresh_rows,
                                              generating_samples, own_rows, reused_rows, step_table)
from grpolens.analysis.sidecars.table import (COMPLETIONS_FILE, DEFAULT_KEY, INT_COLUMNS, NEEDED_PRODUCERS,
                                              PARTIAL_COLUMNS, Q_COLUMN, REFERENCE_COLUMNS, SAMPLE_EXTRA, SIDECAR_DIR,
                                              TEXT_COLUMNS, TOKEN_COLUMNS, _STEP_FILE, column_order,
                                              completions_table, concat, empty_table, group_rows, sequence_columns,
                                              shard_partials)

__all__ = ["COMPLETIONS_FILE", "Completions", "DEFAULT_KEY", "INT_COLUMNS", "NEEDED_PRODUCERS",
           "PARTIAL_COLUMNS", "Q_COLUMN", "REFERENCE_COLUMNS", "REUSE_LOOKBACK", "SAMPLE_EXTRA",
           "SIDECAR_DIR", "TEXT_COLUMNS", "TOKEN_COLUMNS", "_STEP_FILE", "build_steps", "check_key",
           "column_order", "completions_path", "completions_table", "concat", "empty_table", "fresh_rows",
           "generating_samples", "group_rows", "own_rows", "read_sidecar", "read_sidecars", "reused_rows",
           "sequence_columns", "shard_partials", "sidecar_bytes", "sidecar_columns", "sidecar_files",
           "sidecar_name", "sidecar_payload", "step_table", "write_sidecars"]
