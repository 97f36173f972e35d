"""TRL's ``GRPOTrainer`` (0.29 to 1.16): its logged keys, how it reduces them, and when it logs.

Token means per micro-batch *slot* (one loss call on all ranks) Σ / max(Σ m, 1); generation-side
values once per generation round; at sequence level the clip fractions count every sequence (GSPO).

When it logs. TRL does not log one value per optimizer step. Each metric has a list (``self._metrics``) that
grows during training, and every ``log()`` call writes the mean of each list and clears it:

* loss-side metrics (``kl``, ``entropy``, ``clip_ratio/*``, ``cispo_clip_ratio``) get one value
  per micro-batch *slot* (one loss call on all ranks together);
* generation-side metrics (``completions/*``, ``rewards/*``, ``reward``, ``reward_std``,
  ``frac_reward_zero_std``, ``sampling/*``) one value per generation round, so a window that
  generated something carries them even to a step that generated nothing;
* ``num_tokens`` is overwritten with the running total at each generation (the window's last);
* ``loss`` is the Trainer's: the summed loss of the window's micro-batches, mean over ranks,
  divided by the window's optimizer steps (the mean of the per-step losses).

``log()`` runs where the Trainer's callback says so (``logging_strategy``, ``logging_steps``,
``logging_first_step``); what is left of the last window when training ends is logged by TRL
with the training summary (``train_runtime``...), without ``loss``.

The rules changed over TRL releases, read from the manifest's ``trainer.version``:

* < 1.9: token metrics are each rank's masked mean of a slot, then the plain mean over ranks;
  ``clip_ratio/low_min`` / ``high_max`` the min / max over ranks of those per-rank means
  (per-sequence fractions, pooled over ranks, from 1.9 on);
* < 1.0: ``log()`` does not drop NaN values (one NaN makes the window's mean NaN: logged null);
* < 1.10: ``use_bias_correction_kl`` defaults to false and the dapo/cispo normaliser has no G/S.

Per step, :func:`step_value` gives the mean of the values TRL appended during that step and how
many there were; :func:`log_view` turns the per-step table into TRL's logging windows. The
per-step table is what ``grpolens recompute --profile trl --per-step`` writes: what TRL would
have logged with ``logging_steps=1``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np
import polars as pl

from grpolens.functional import rollout_is as ris
from grpolens.functional.rollout_is import ISConfig
from grpolens.metrics import clip, completions, loss
from grpolens.metrics.rollout_is import step_rows, sub_rows
from grpolens.metrics.profile import Profile, register_profile
from grpolens.metrics.rewards import per_round

NAMES = {
    "entropy": "entropy",
    "reward/mean": "reward",
    "reward/std": "reward_std",
    "reward/frac_zero_std": "frac_reward_zero_std",
    "rewards/<name>/mean": "rewards/<name>/mean",
    "rewards/<name>/std": "rewards/<name>/std",
    "completions/length/mean": "completions/mean_length",
    "completions/length/min": "completions/min_length",
    "completions/length/max": "completions/max_length",
    "completions/truncated_frac": "completions/clipped_ratio",
    "completions/terminated_length/mean": "completions/mean_terminated_length",
    "completions/terminated_length/min": "completions/min_terminated_length",
    "completions/terminated_length/max": "completions/max_terminated_length",
    "tokens/seen": "num_tokens",
    "kl/penalty": "kl",
    "clip/low": "clip_ratio/low_mean",
    "clip/high": "clip_ratio/high_mean",
    "clip/region": "clip_ratio/region_mean",
    "clip/low_min": "clip_ratio/low_min",
    "clip/high_max": "clip_ratio/high_max",
    "clip/cispo": "cispo_clip_ratio",
    "loss": "loss",
    "loss/vespo_phi_mean": "vespo/phi_seq_mean",
    "rollout_is/applied/mean": "sampling/importance_sampling_ratio/mean",
    "rollout_is/applied/min": "sampling/importance_sampling_ratio/min",
    "rollout_is/applied/max": "sampling/importance_sampling_ratio/max",
    "mismatch/abs_logp_diff": "sampling/sampling_logp_difference/mean",
    "mismatch/abs_logp_diff_max": "sampling/sampling_logp_difference/max",
}

REDUCTIONS = {
    # at sequence level TRL counts every sequence, fully masked ones too ("gt" partial columns)
    **{f"clip/{p}": clip.fraction(p, counted="gt") for p in ("low", "high", "region", "cispo")},
    "clip/low_min": clip.seq_extreme("low", "min", counted="gt"),
    "clip/high_max": clip.seq_extreme("high", "max", counted="gt"),
    # TRL logs 0 for a round where no completion ended with EOS
    **{f"completions/terminated_length/{w}": per_round(completions.length_stat(w, "eos", empty=0.0))
       for w in ("mean", "min", "max")},
    # the loss each call returns, summed over a rank's calls, mean over ranks
    "loss": partial(loss.loss_value, per_call=True),
}

#: Suffixes of the hidden per-step columns: finite values appended, NaN values appended.
COUNT, NANS = "#n", "#nan"
#: What the TRL integration records of the Trainer's schedule (rank 0, ``RUN/grpolens/``):
#: ``{"max_steps": N, "epoch_ends": [optimizer steps that ended an epoch]}``.
STATE_NAME = "trl_state.json"


def read_state(run) -> dict:
    """The run's recorded Trainer schedule (empty when the run has none or it is unreadable: the
    logging schedule then comes from ``trl_args`` alone)."""
    from grpolens.errors import UserError
    from grpolens.run.format import as_run

    path = as_run(run) / "grpolens" / STATE_NAME  # the trainer's record, in the run (on disk or in the bucket)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, UserError):  # UserError: no such object in the bucket
        return {}
    return data if isinstance(data, dict) else {}


def parse_version(text: Any) -> tuple[int, ...] | None:
    """``"1.8.0"`` -> (1, 8, 0); ``"1.10.0.dev0"`` -> (1, 10, 0); None when unreadable."""
    if not isinstance(text, str):
        return None
    m = re.match(r"([0-9]+)\.([0-9]+)(?:\.([0-9]+))?", text.strip())
    return tuple(int(x) for x in m.groups(default="0")) if m else None


def default_bias_correction_kl(version: Any) -> bool:
    """TRL's default of ``use_bias_correction_kl``: True from 1.10 (PR #6503), False before (and
    for a version that cannot be read: the key's absence then means it did not exist)."""
    v = parse_version(version)
    return v is not None and v >= (1, 10)


@dataclass(frozen=True)
class Rules:
    """The TRL release's aggregation rules and the run's logging schedule."""

    version: tuple[int, ...] | None = None
    strategy: str = "steps"
    logging_steps: float = 1
    first_step: bool = False
    max_steps: int | None = None
    epoch_ends: tuple[int, ...] = ()

    @property
    def rank_means(self) -> bool:
        """Before 1.9: per-rank means of each slot, then the mean (or min/max) over ranks."""
        return self.version is not None and self.version < (1, 9)

    @property
    def drops_nan(self) -> bool:
        return self.version is None or self.version >= (1, 0)

    @classmethod
    def from_run(cls, trainer: dict | None, cfg: dict, state: dict | None = None) -> "Rules":
        args = cfg.get("trl_args") or {}
        state = state or {}
        strategy = str(args.get("logging_strategy") or "steps").lower()
        if "." in strategy:  # "IntervalStrategy.STEPS" from an older serialisation
            strategy = strategy.rsplit(".", 1)[1]
        max_steps = args.get("max_steps")
        max_steps = int(max_steps) if isinstance(max_steps, (int, float)) and max_steps > 0 else None
        if isinstance(state.get("max_steps"), int) and state["max_steps"] > 0:  # the Trainer's own count
            max_steps = state["max_steps"]
        epoch_ends = tuple(int(s) for s in state.get("epoch_ends") or () if isinstance(s, int))
        steps = args.get("logging_steps", 1)
        steps = float(steps) if isinstance(steps, (int, float)) and not isinstance(steps, bool) else 1.0
        if 0 < steps < 1:  # a fraction of the training steps (transformers' TrainerState.compute_steps)
            steps = float(math.ceil(max_steps * steps)) if max_steps else 1.0
        trainer = trainer or {}
        # a version is TRL's only in a run TRL wrote; any other run gets the current rules
        version = parse_version(trainer.get("version")) if trainer.get("name") == "trl" else None
        return cls(version=version, strategy=strategy,
                   logging_steps=max(steps, 1.0), first_step=bool(args.get("logging_first_step", False)),
                   max_steps=max_steps, epoch_ends=epoch_ends)

    def logs_at(self, step: int) -> bool:
        """Does the Trainer log at the end of optimizer step ``step`` (1-based)?"""
        if step == 1 and self.first_step:
            return True
        if self.strategy == "steps":
            return step % self.logging_steps == 0  # as transformers tests it (a float modulo)
        if self.strategy == "epoch":
            return step in self.epoch_ends
        return False


@dataclass
class Context:
    """What the trl profile's reductions read besides one step's data (``StepData.extra["trl"]``)."""

    rules: Rules
    #: (sorted sample ids, the token count N of each one's generation round) over the whole run
    round_tokens: tuple[np.ndarray, np.ndarray] | None = None

    #: suffixes of the hidden per-step columns recompute keeps for :meth:`log_view`
    hidden = (COUNT, NANS)

    def step_value(self, metric, sd) -> tuple[float | None, int, int]:
        return step_value(metric, sd, self.rules)

    def log_view(self, final: pl.DataFrame, raw: pl.DataFrame, metrics: list) -> pl.DataFrame:
        return log_view(final, raw, metrics, self.rules)

    def round_tokens_of(self, sample_ids: np.ndarray) -> np.ndarray | None:
        """N of each sample's generation round, from the run's samples (None if one is unknown)."""
        if self.round_tokens is None:
            return None
        ids, n = self.round_tokens
        if not len(ids):
            return None
        pos = np.minimum(np.searchsorted(ids, sample_ids), len(ids) - 1)
        return n[pos] if np.array_equal(ids[pos], sample_ids) else None


def read_round_tokens(run, cfg: dict, rules: Rules) -> tuple[np.ndarray, np.ndarray] | None:
    """TRL's dapo/cispo normaliser N per generation round (``num_items_in_batch``: the loss-mask
    tokens of every completion of the round, all ranks) from the samples table: ``completion_len``,
    less truncated completions under ``mask_truncated_completions`` (from TRL 1.9 on; before, N
    counted them). A round that straddles optimizer steps (``steps_per_generation >
    gradient_accumulation_steps``) has its samples at the step that generated it, its loss calls
    at later steps too: hence a table of the whole run. None without the ``generation`` column."""
    from grpolens.run import format as fmt

    import pyarrow.parquet as pq

    shards = fmt.list_shards(run, fmt.SAMPLES)
    if not shards:
        return None
    frames = []
    for sh in shards:  # four columns of each shard, on disk or on object storage
        pf = pq.ParquetFile(fmt.parquet_source(sh.path))
        if "generation" not in pf.schema_arrow.names:
            return None
        df = pl.from_arrow(pf.read(columns=["sample_id", "generation", "completion_len", "truncated"]))
        if df["generation"].null_count():
            return None
        frames.append(df)
    df = pl.concat(frames)
    drop = bool(cfg.get("mask_truncated_completions")) and not rules.rank_means
    df = df.with_columns(tokens=pl.when(pl.lit(drop) & pl.col("truncated").fill_null(False)).then(0)
                         .otherwise(pl.col("completion_len")).cast(pl.Float64))
    df = df.with_columns(N=pl.col("tokens").sum().over("generation")).sort("sample_id")
    return df["sample_id"].to_numpy().astype(np.int64), df["N"].to_numpy()


def prepare(reader, cfg: dict, overrides: dict | None, config_file) -> tuple[Context, dict]:
    """The trl profile's context for a run (a :class:`~grpolens.run.reader.RunReader`) and its
    config with TRL's defaults for what the run does not say: ``use_bias_correction_kl`` is the
    recorded release's default when neither the manifest nor the user sets it."""
    from grpolens.run.reader import load_config_file

    manifest = reader.manifest
    said = set(manifest.config) | set(overrides or {}) | (set(load_config_file(config_file)) if config_file else set())
    if "use_bias_correction_kl" not in said and manifest.trainer.get("name") == "trl":
        cfg = {**cfg, "use_bias_correction_kl": default_bias_correction_kl(manifest.trainer.get("version"))}
    rules = Rules.from_run(manifest.trainer, cfg, read_state(reader.path))
    return Context(rules, read_round_tokens(reader.path, cfg, rules)), cfg


# ---------------------------------------------------------------------------------------------
# Per step: the values TRL appends
# ---------------------------------------------------------------------------------------------

def _sub(sd, keep: np.ndarray):
    """The step restricted to the sequences ``keep`` (a boolean mask)."""
    extra = {k: v for k, v in sd.extra.items() if k == "run_has_samples"}
    return replace(sd, seqs={c: a[keep] for c, a in sd.seqs.items()}, extra=extra)


def _rank_values(metric, sd) -> list[float]:
    from grpolens.metrics import reduce

    r = sd.col("rank")
    return [v if (v := reduce.compute(metric, _sub(sd, r == k))) is not None else math.nan for k in np.unique(r)]


def _slot_value(metric, sd, rules: Rules) -> float | None:
    """One loss call on all ranks: the value TRL appends for ``metric``."""
    from grpolens.metrics import reduce
    from grpolens.metrics.registry import REGISTRY

    if not rules.rank_means:
        return reduce.compute(metric, sd)
    # TRL < 1.9: each rank's masked mean (clamped denominator), gathered; nanmean, or nanmin/nanmax
    # of the low/high clip means for clip_ratio/low_min and high_max
    if metric.name in ("clip/low_min", "clip/high_max"):
        part = REGISTRY["clip/low" if metric.name == "clip/low_min" else "clip/high"]
        vals = [v for v in _rank_values(part, sd) if not math.isnan(v)]
        if not vals:
            return None
        return min(vals) if metric.name == "clip/low_min" else max(vals)
    vals = [v for v in _rank_values(metric, sd) if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else None


def appended(metric, sd, rules: Rules) -> list[float]:
    """The values TRL appends to ``metric``'s list during the step (None/NaN: TRL's NaN)."""
    from grpolens.metrics import reduce
    from grpolens.metrics.rewards import generation_rounds

    if metric.cumulative:  # the step's increment of a running total (num_tokens), every round's
        return [reduce.compute(metric, sd)]
    if metric.source == "samples":
        if sd.samples is None:
            return []
        rounds = generation_rounds(sd) or [sd]
        return [reduce.compute(metric, r) for r in rounds]
    if (metric.template or metric.name) in sd.profile.generation_only or metric.name == "loss":
        return [reduce.compute(metric, sd)]  # once per generation round / the Trainer's per-step loss
    if not sd.n_seq:
        return []
    g, n = sd.groups(("micro_batch",))
    return [_slot_value(metric, _sub(sd, g == k), rules) for k in range(n)]


def step_value(metric, sd, rules: Rules) -> tuple[float | None, int, int]:
    """(mean of the step's appended values as TRL's ``log()`` takes it, finite values, NaN values)."""
    vals = appended(metric, sd, rules)
    finite = [float(v) for v in vals if v is not None and not math.isnan(v)]
    nans = len(vals) - len(finite)
    if (nans and not rules.drops_nan) or not finite:
        return None, len(finite), nans
    return sum(finite) / len(finite), len(finite), nans


# ---------------------------------------------------------------------------------------------
# Logging windows
# ---------------------------------------------------------------------------------------------

def windows(steps: list[int], rules: Rules) -> list[tuple[int, list[int], bool]]:
    """(logged step, the recorded steps of its window, is the end-of-training summary) per TRL log.

    A window holds the steps after the previous log up to its own. Windows that reach before the
    first recorded step (``--steps`` started inside one) are left out, as is the open window of a
    run that has not reached ``max_steps``. The end-of-training summary carries what is left when
    the last step is not a logging step."""
    if not steps:
        return []
    out: list[tuple[int, list[int], bool]] = []
    recorded = set(steps)
    first = steps[0]
    start_ok = first == 1 or rules.logs_at(first - 1)
    current: list[int] = []
    for s in range(first, steps[-1] + 1):
        current.append(s)
        if rules.logs_at(s):
            members = [x for x in current if x in recorded]
            if start_ok and members:  # a window with nothing recorded (a gap in the run) is not shown
                out.append((s, members, False))
            current, start_ok = [], True
    members = [x for x in current if x in recorded]
    if members and start_ok and rules.max_steps is not None and steps[-1] == rules.max_steps:
        out.append((steps[-1], members, True))
    return out


def log_view(final: pl.DataFrame, raw: pl.DataFrame, metrics: list, rules: Rules, profile: str = "trl",
             step_means: tuple[str, ...] = ("loss",)) -> pl.DataFrame:
    """One row per TRL log (``step`` = the step TRL logged at) from the per-step tables: ``final``
    (``profile``'s names, running totals) and ``raw`` (canonical names and the appended-value counts).
    ``step_means``: metrics with one value per optimizer step (the Trainer's ``loss``): the window's
    mean of its steps, left out of the end-of-training summary."""
    steps = final["step"].to_list()
    index = {s: i for i, s in enumerate(steps)}
    cols = {m.name: raw[m.name].to_list() for m in metrics}
    counts = {m.name: raw[m.name + COUNT].to_list() if m.name + COUNT in raw.columns else None for m in metrics}
    nans = {m.name: raw[m.name + NANS].to_list() if m.name + NANS in raw.columns else None for m in metrics}
    shown = {m.name: final[m.name_in(profile)].to_list() for m in metrics}
    rows = []
    for logged, members, summary in windows(steps, rules):
        idx = [index[s] for s in members]
        row: dict[str, Any] = {"step": logged}
        for m in metrics:
            key = m.name_in(profile)
            if summary and m.name in step_means:
                row[key] = None  # the summary line has train_loss, not loss
                continue
            if m.cumulative:  # overwritten at each generation: the window's last value
                vals = [shown[m.name][i] for i in idx if shown[m.name][i] is not None]
                row[key] = vals[-1] if vals else None
                continue
            if m.name in step_means:  # the Trainer's: mean over the window's optimizer steps
                vals = [cols[m.name][i] for i in idx]
                row[key] = None if not vals or any(v is None for v in vals) else sum(vals) / len(vals)
                continue
            n = [counts[m.name][i] or 0 for i in idx] if counts[m.name] else [0] * len(idx)
            k = sum(nans[m.name][i] or 0 for i in idx) if nans[m.name] else 0
            total = sum(c for c in n)
            if total == 0 or (k and not rules.drops_nan):
                row[key] = None
                continue
            row[key] = sum(cols[m.name][i] * c for i, c in zip(idx, n) if c) / total
        rows.append(row)
    schema = {"step": pl.Int64, **{m.name_in(profile): pl.Float64 for m in metrics}}
    return pl.DataFrame(rows, schema=schema, orient="row")



def trl_summary(sd) -> dict[str, float | None]:
    """TRL ``sampling/*``: per rank over its completions (each once), then across ranks."""
    p = step_rows(sd)
    c = ISConfig.from_cfg(sd.cfg)
    if p is None or not c.configured:
        return {}
    keys = np.stack([np.asarray(p["rank"], dtype=np.int64), np.asarray(p["sample_id"], dtype=np.int64)], axis=1)
    _, first = np.unique(keys, axis=0, return_index=True)
    p = sub_rows(p, np.sort(first))
    sv = ris.seq_view(p, c)
    ranks = np.asarray(p["rank"])
    nf, absd, absdmax = ris._col(p, "mm.n"), ris._col(p, "mm.absd"), ris._col(p, "mm.absdmax")
    # a rank without a token logs 0.0 for each (TRL's ``numel() > 0`` guards), and the gather over
    # ranks takes that 0.0 (into the mean, and into ``nanmin``)
    means, maxes, rmin, rmean, rmax = [], [], [], [], []
    for r in np.unique(ranks):
        s = ranks == r
        has = nf[s] > 0
        means.append(absd[s].sum() / nf[s].sum() if has.any() else 0.0)
        maxes.append(absdmax[s][has].max() if has.any() else 0.0)
        n = sv.n[s]
        if c.level == "token":
            ok = n > 0
            if ok.any():
                rmin.append(ris._col(p, "ris.tamin")[s][ok].min())
                rmax.append(ris._col(p, "ris.tamax")[s][ok].max())
                rmean.append(ris._col(p, "ris.ta")[s].sum() / n.sum())
            else:
                rmin.append(0.0)
                rmax.append(0.0)
                rmean.append(0.0)
        else:  # one ratio per completion, empty ones included (their log-ratio sum is 0)
            a = sv.a[s]
            rmin.append(a.min())
            rmax.append(a.max())
            rmean.append(a.mean())
    f = ris._f
    return {  # one entry per rank in each list: the partials of a step have at least one row
        "mismatch/abs_logp_diff": f(np.mean(means)), "mismatch/abs_logp_diff_max": f(max(maxes)),
        "rollout_is/applied/min": f(min(rmin)), "rollout_is/applied/mean": f(np.mean(rmean)),
        "rollout_is/applied/max": f(max(rmax)),
    }


PROFILE = register_profile(Profile(
    "trl", "TRL's GRPOTrainer keys, as TRL logged them (its logging windows)",
    reference="TRL 0.29–1.16 by the run's `trainer.version` (run on 0.29.0, 1.8.0, 1.9.0, 1.16.0)",
    token_mean="trl_slot",
    extrema="`low_min`/`high_max`: per-sequence fractions, nanmin/nanmax per slot, mean over slots",
    empty="0.0 for a slot, as TRL logs",
    names=NAMES, reductions=REDUCTIONS, per_generation_round=True,
    settings={"clip_low": "epsilon", "clip_high": "epsilon_high", "kl_coef": "beta", "entropy_coef": "entropy_coef",
              "learning_rate": "learning_rate", "max_grad_norm": "max_grad_norm", "num_iterations": "num_iterations",
              "num_generations": "num_generations", "max_completion_length": "max_completion_length",
              "temperature": "temperature", "rollout_is": "vllm_importance_sampling_correction",
              "overlong": "mask_truncated_completions", "reward_weights": "reward_weights"},
    generation_only=frozenset(k for k in NAMES if k.startswith(("rollout_is/", "mismatch/"))),
    rollout_is_summary=trl_summary,
    log_file="trl_log.jsonl",
    # TRL computes the k3 term exp(ref − logp) − (ref − logp) − 1 in float32, which cancels to ~1e-8
    # absolute near 0, and its loss is a float32 sum of O(1) terms (rounding ~1e-7..1e-6)
    float32_floors={"kl": 1e-7, "loss": 1e-6},
    log_schedule=prepare,
))
