"""The run format's names, schemas and paths: directories, the columns of ``tokens`` and ``samples``
(types, nullability, meaning), the keys, the config defaults metrics assume, and the names of
shards, completion markers and finished records (:class:`Shard`).

Part of :mod:`grpolens.run.format`, which re-exports every name here: import them from there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa


FORMAT_NAME = "grpolens-run"
FORMAT_VERSION = 1
MANIFEST_NAME = "grpolens.json"
TOKENS = "tokens"
SAMPLES = "samples"
TABLES = (TOKENS, SAMPLES)
#: Directory inside a run where grpolens writes what it derives.
DERIVED_DIR = "grpolens"
#: Completion records: one marker per (step, rank), written last, and one finished record per rank.
COMPLETE_DIR = "complete"
REWARD_PREFIX = "reward/"


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType
    nullable: bool
    doc: str


TOKEN_COLUMNS: tuple[Column, ...] = (
    Column("step", pa.int64(), False, "optimizer step the loss call belongs to"),
    Column("rank", pa.int32(), False, "data-parallel rank that computed it"),
    Column("micro_batch", pa.int32(), False, "index of the loss call within (step, rank), from 0"),
    Column("sample_id", pa.int64(), False, "completion id, unique within the run; kept when the completion is reused"),
    Column("pos", pa.int32(), False, "token position in the completion, from 0"),
    Column("token_id", pa.int32(), True, "sampled token id"),
    Column("logp", pa.float32(), False, "log-prob under the current policy at this loss call"),
    Column("old_logp", pa.float32(), True, "behaviour (old) policy log-prob; null: on-policy, ratio 1"),
    Column("ref_logp", pa.float32(), True, "reference policy log-prob"),
    Column("rollout_logp", pa.float32(), True, "the inference engine's log-prob of the sampled token"),
    Column("advantage", pa.float32(), False, "advantage applied to this token"),
    Column("mask", pa.bool_(), False, "the token counts in the loss"),
    Column("entropy", pa.float32(), True, "policy entropy at this position"),
    Column("old_entropy", pa.float32(), True,
           "behaviour (old) policy entropy at this position (verl: the old-log-prob pass', its actor/entropy)"),
    Column("rollout_rejected", pa.bool_(), True,
           "the trainer's rollout correction removed this token from the loss (mask is false); "
           "mask OR rollout_rejected is the mask before rejection"),
)

SAMPLE_COLUMNS: tuple[Column, ...] = (
    Column("step", pa.int64(), False, "optimizer step during which the completion was generated"),
    Column("rank", pa.int32(), False, "data-parallel rank that generated it"),
    Column("sample_id", pa.int64(), False, "joins tokens.sample_id"),
    Column("group_id", pa.int64(), False, "prompt group: completions of one prompt share it"),
    Column("prompt_len", pa.int32(), True, "prompt tokens"),
    Column("completion_len", pa.int32(), False, "completion tokens generated"),
    Column("truncated", pa.bool_(), False, "generation stopped at the length limit without EOS"),
    Column("reward", pa.float64(), True, "total (weighted) reward; null when nothing could score it"),
    Column("advantage", pa.float32(), True, "the completion's advantage"),
    Column("generation", pa.int64(), True, "the trainer's generation-round index, unique within the run"),
    Column("prompt", pa.string(), True, "prompt text (optional, untrusted)"),
    Column("completion", pa.string(), True, "completion text (optional, untrusted)"),
)
#: Per-reward-function columns: ``reward/<name>``, float64, nullable, raw (unweighted) value.
REWARD_COLUMN_TYPE = pa.float64()

#: Columns a file must contain (the others are optional and may be absent altogether).
REQUIRED = {
    TOKENS: ("step", "rank", "micro_batch", "sample_id", "pos", "logp", "advantage", "mask"),
    SAMPLES: ("step", "rank", "sample_id", "group_id", "completion_len", "truncated"),
}
COLUMNS = {TOKENS: TOKEN_COLUMNS, SAMPLES: SAMPLE_COLUMNS}
KEY = {
    TOKENS: ("step", "rank", "micro_batch", "sample_id", "pos"),
    SAMPLES: ("sample_id",),
}

#: Algorithm settings that metrics depend on, with the defaults grpolens assumes when a run's
#: manifest does not say. ``None`` means "not set" (e.g. no delta clamp).
CONFIG_DEFAULTS: dict[str, Any] = {
    "loss_type": "grpo",
    "epsilon": 0.2,
    "epsilon_high": None,  # None: same as epsilon
    "delta": None,
    "beta": 0.0,
    "importance_sampling_level": "token",
    "temperature": 1.0,
    "max_completion_length": None,
    "num_generations": None,
    "gradient_accumulation_steps": 1,
    "steps_per_generation": None,
    "num_iterations": 1,
    "scale_rewards": "group",
    "use_bias_correction_kl": False,
    "reward_weights": None,
    "sapo_temperature_pos": 1.0,
    "sapo_temperature_neg": 1.05,
    "vespo_k_pos": 2.0,
    "vespo_lambda_pos": 3.0,
    "vespo_k_neg": 3.0,
    "vespo_lambda_neg": 2.0,
    "log_ratio_clamp": None,  # the loss clamps log(pi/pi_old) to +-this before exp (Twinkle, verl: 20)
    "rollout_is": None,  # {level, mode, lower, upper, veto_lower, veto_upper}
    "entropy_coef": 0.0,  # the loss subtracts entropy_coef * entropy per token (Twinkle's entropy bonus)
    "rollout_metrics": True,  # the trainer logs train-inference mismatch metrics (verl: rollout_correction set)
}


def column_types(table: str) -> dict[str, pa.DataType]:
    return {c.name: c.type for c in COLUMNS[table]}


def arrow_schema(table: str, present: Iterable[str]) -> pa.Schema:
    """Schema for the columns ``present`` (in canonical order; ``reward/*`` columns last)."""
    present = list(present)
    types = column_types(table)
    fields = [pa.field(c.name, c.type, nullable=c.nullable) for c in COLUMNS[table] if c.name in present]
    if table == SAMPLES:
        fields += [pa.field(n, REWARD_COLUMN_TYPE, nullable=True) for n in sorted(present) if n.startswith(REWARD_PREFIX)]
    unknown = [n for n in present if n not in types and not (table == SAMPLES and n.startswith(REWARD_PREFIX))]
    fields += [pa.field(n, pa.float64(), nullable=True) for n in unknown]
    return pa.schema(fields)


# ---------------------------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------------------------

# [0-9], not \d: a str pattern's \d matches every Unicode digit (Arabic-Indic, fullwidth...), which
# int() then reads as a step; a folder named with them is not this format's
_SHARD_RE = re.compile(r"^rank=([0-9]{5})(?:-([0-9]{4}))?\.parquet$")
_STEP_RE = re.compile(r"^step=([0-9]{8})$")
#: Ranks are written as 5 digits: world_size can be at most this.
MAX_WORLD_SIZE = 100_000


def shard_relpath(table: str, step: int, rank: int, part: int | None = None) -> str:
    if step < 0 or rank < 0:
        raise ValueError(f"step and rank must be >= 0, got step={step} rank={rank}")
    suffix = "" if part is None else f"-{part:04d}"
    return f"{table}/step={step:08d}/rank={rank:05d}{suffix}.parquet"


def marker_relpath(step: int, rank: int) -> str:
    """The completion marker of (step, rank): written after every shard of it is on disk."""
    return f"{COMPLETE_DIR}/step={step:08d}.rank={rank:05d}.json"


def finished_relpath(rank: int) -> str:
    """The record a rank's writer leaves when it was closed normally (training finished)."""
    return f"{COMPLETE_DIR}/finished.rank={rank:05d}.json"


MARKER_RE = re.compile(r"^step=([0-9]{8})\.rank=([0-9]{5})\.json$")
FINISHED_RE = re.compile(r"^finished\.rank=([0-9]{5})\.json$")


@dataclass(frozen=True, order=True)
class Shard:
    step: int
    rank: int
    part: int
    path: Path = field(compare=False)  # a storage Location for a run on object storage
    table: str = field(compare=False, default=TOKENS)
    #: (size, mtime_ns) from the listing of a run on object storage (a local file is stat'ed)
    stat: tuple[int, int | None] | None = field(compare=False, default=None)

    def relpath(self) -> str:
        return shard_relpath(self.table, self.step, self.rank, None if self.part < 0 else self.part)

    def fingerprint(self) -> list:
        """What the per-step cache compares: path, size, modification time (no read of the file)."""
        if self.stat is not None:
            return [self.relpath(), *self.stat]
        st = Path(self.path).stat()
        return [self.relpath(), st.st_size, st.st_mtime_ns]


def parse_shard_path(path: Path, table: str) -> Shard | None:
    m = _SHARD_RE.match(path.name)
    s = _STEP_RE.match(path.parent.name)
    if not m or not s:
        return None
    part = int(m.group(2)) if m.group(2) is not None else -1
    return Shard(int(s.group(1)), int(m.group(1)), part, path, table)
