"""``grpolens recompute`` (and ``grpolens.recompute()``): every registered metric, per step, from a run's shards.

The work is one streaming pass (:func:`grpolens.metrics.engine.iter_steps`): per step, the
per-sequence partials of all shards are merged and every metric is reduced from them under the
chosen profile. Results are cached per step with a fingerprint of the step's shards and of the
config, so that re-running on a run that has grown reads only the new (or changed) steps.

Outputs (atomically, under ``RUN/grpolens/`` for the default profile, ``RUN/grpolens/<profile>/``
otherwise): ``metrics.parquet`` (one row per step, one column per metric) and ``metrics.jsonl``
(one JSON object per step, null keys omitted, like a trainer's log).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import polars as pl
import pyarrow.parquet as pq

from grpolens.run import format as fmt
from grpolens.errors import UserError
from grpolens.run.format import RunFormatError
from grpolens.metrics import reduce
from grpolens.metrics.engine import VISITORS, SequencePartials, iter_steps
from grpolens.metrics.registry import PROFILES, REGISTRY, Metric, load_builtins
from grpolens.metrics.config import check_config

CACHE_VERSION = 1


@dataclass
class RecomputeResult:
    metrics: pl.DataFrame
    out_dir: Path | None
    computed_steps: list[int]
    reused_steps: list[int]
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------

def parse_steps(spec: str | None) -> tuple[int | None, int | None]:
    """``A:B`` (inclusive both ends, either side optional) or a single step ``N``."""
    if spec is None or spec == "":
        return None, None
    try:
        if ":" in spec:
            a, b = spec.split(":", 1)
            lo = int(a) if a.strip() else None
            hi = int(b) if b.strip() else None
        else:
            lo = hi = int(spec)
    except ValueError:
        raise UserError(f"--steps: expected A:B or N with integer steps, got {spec!r}") from None
    if lo is not None and hi is not None and lo > hi:
        raise UserError(f"--steps: start {lo} is after end {hi}")
    return lo, hi


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        low = text.lower()
        if low in ("none", "null"):
            return None
        if low in ("true", "false"):
            return low == "true"
        return text


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``key=value`` pairs; values are JSON when they parse as JSON; ``a.b=v`` sets a nested key."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"--set: expected key=value, got {item!r}")
        key, text = item.split("=", 1)
        key = key.strip()
        if not key:
            raise UserError(f"--set: empty key in {item!r}")
        value = _parse_value(text.strip())
        parts = key.split(".")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise UserError(f"--set: {key!r} conflicts with another --set")
        node[parts[-1]] = value
    return out


def load_config_file(path: os.PathLike | str) -> dict[str, Any]:
    """A JSON or TOML file with config keys (a top-level ``config`` table is also accepted)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config: no such file {p}")
    text = p.read_text()
    try:
        if p.suffix.lower() == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - any parse error is the user's file
        raise UserError(f"--config: {p} is not valid {'TOML' if p.suffix.lower() == '.toml' else 'JSON'}: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"--config: {p} must contain a table/object of config keys")
    if isinstance(data.get("config"), dict):
        data = data["config"]
    return data


def deep_update(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_update(out[k], v)
        else:
            out[k] = v
    return out


# ---------------------------------------------------------------------------------------------
# Per-step computation
# ---------------------------------------------------------------------------------------------

def read_samples(run: Path, step: int) -> pl.DataFrame | None:
    shards = fmt.list_shards(run, fmt.SAMPLES, steps=[step])
    if not shards:
        return None
    frames = []
    for sh in shards:
        try:
            frames.append(pl.from_arrow(pq.read_table(sh.path)))
        except Exception as e:  # noqa: BLE001
            raise RunFormatError(sh.path, f"unreadable Parquet file: {e}") from None
    return pl.concat(frames, how="diagonal_relaxed")


def sample_columns(run: Path) -> set[str]:
    """Every column name in the run's samples shards (Parquet footers only). Template metrics
    (``rewards/<name>/*``) are expanded over these, so the output has the same columns whatever
    ``--steps`` selects."""
    cols: set[str] = set()
    for sh in fmt.list_shards(run, fmt.SAMPLES):
        try:
            cols.update(pq.read_schema(sh.path).names)
        except Exception as e:  # noqa: BLE001
            raise RunFormatError(sh.path, f"unreadable Parquet file: {e}") from None
    return cols


def metrics_for(profile: str, cfg: dict, columns: Iterable[str] = ()) -> list[Metric]:
    """The metrics ``profile`` logs under ``cfg``, templates expanded over the run's sample ``columns``.

    When two applicable metrics carry the same name in ``profile``, the first registered keeps it
    (e.g. Twinkle's ``train/clip_ratio_low`` is the gated clip fraction, or under CISPO, where that
    metric does not apply, the unconditional one)."""
    load_builtins()
    columns = list(columns)
    out, taken = [], set()
    for m in REGISTRY.values():
        if m.name_in(profile) is None or not m.applies(cfg):
            continue
        for c in m.expand(columns):
            if c.name_in(profile) not in taken:
                taken.add(c.name_in(profile))
                out.append(c)
    return out


def step_values(sd: reduce.StepData, metrics: list[Metric]) -> dict[str, Any]:
    row: dict[str, Any] = {"step": sd.step}
    for m in metrics:
        if m.source == "tokens" and m.requires and not all(c in sd.present for c in m.requires):
            val = None
        elif m.source == "samples" and sd.samples is None:
            val = None
        elif sd.profile in m.generation_only and sd.samples is None and sd.extra.get("run_has_samples"):
            val = None
        else:
            val = reduce.compute(m, sd)
        row[m.name] = val
    return row


def _fingerprint(shards: list[fmt.Shard]) -> list:
    out = []
    for sh in shards:
        st = sh.path.stat()
        out.append([f"{sh.table}/{sh.path.parent.name}/{sh.path.name}", st.st_size, st.st_mtime_ns])
    return out


def _config_hash(cfg: dict, profile: str) -> str:
    blob = json.dumps({"cfg": cfg, "profile": profile, "cache": CACHE_VERSION, "metrics": sorted(REGISTRY)},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_out_dir(run: Path, profile: str) -> Path:
    d = fmt.derived_dir(run)
    return d if profile == "grpolens" else d / profile


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------

def recompute(
    run: os.PathLike | str,
    *,
    out: os.PathLike | str | None = None,
    profile: str = "grpolens",
    steps: str | tuple[int | None, int | None] | None = None,
    overrides: dict[str, Any] | None = None,
    config_file: os.PathLike | str | None = None,
    write: bool = True,
    incremental: bool = True,
    progress: Callable[[int, int], None] | None = None,
    extra_visitors: list | None = None,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
    result: bool = False,
) -> pl.DataFrame | RecomputeResult:
    """Recompute every metric of ``run`` per step; returns a polars DataFrame (one row per step).

    ``profile`` picks names and reductions (``grpolens``, ``trl``, ``twinkle``, ``maxent``,
    ``xtuner``, ``verl``); ``overrides`` replace manifest config keys (what-if analysis);
    ``steps`` is ``"A:B"``. ``extra_visitors`` join the same pass over the tokens (see
    :mod:`grpolens.metrics.engine`); ``on_step(step, pieces)`` receives their combined results.

    >>> import grpolens                                                   # doctest: +SKIP
    >>> grpolens.recompute("sample_runs/tiny").select("step", "entropy")   # doctest: +SKIP
    """
    run = Path(run)
    if profile not in PROFILES:
        raise UserError(f"--profile: unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    manifest = fmt.read_manifest(run)
    cfg = manifest.resolved_config()
    if config_file is not None:
        cfg = deep_update(cfg, load_config_file(config_file))
    if overrides:
        cfg = deep_update(cfg, overrides)
    cfg = check_config(cfg)
    lo, hi = parse_steps(steps) if isinstance(steps, (str, type(None))) else steps

    token_steps = fmt.list_steps(run, fmt.TOKENS)
    sample_steps = fmt.list_steps(run, fmt.SAMPLES)
    all_steps = sorted(set(token_steps) | set(sample_steps))
    if not all_steps:
        raise RunFormatError(run, "the run has no token or sample shards (expected tokens/step=*/rank=*.parquet)")
    sel = [s for s in all_steps if (lo is None or s >= lo) and (hi is None or s <= hi)]
    if not sel:
        raise UserError(f"--steps: no steps of the run fall in {lo}:{hi} (the run has steps {all_steps[0]}..{all_steps[-1]})")

    metrics = metrics_for(profile, cfg, sample_columns(run))
    out_dir = Path(out) if out is not None else default_out_dir(run, profile)
    chash = _config_hash(cfg, profile)

    # -- incremental: reuse rows whose shards and config are unchanged ----------------------------
    cache_path = fmt.derived_dir(run) / "cache" / f"steps-{profile}.parquet"
    state_path = fmt.derived_dir(run) / "cache" / f"state-{profile}.json"
    fingerprints = {
        s: _fingerprint(fmt.list_shards(run, fmt.TOKENS, [s]) + fmt.list_shards(run, fmt.SAMPLES, [s])) for s in all_steps
    }
    # every step of the run whose cached row is still valid (not only the selected ones: the
    # cache is rewritten whole, and cumulative metrics need the steps before --steps)
    valid_cache: dict[int, dict] = {}
    if incremental and not extra_visitors and cache_path.is_file() and state_path.is_file():
        try:
            state = json.loads(state_path.read_text())
            if state.get("config_hash") == chash:
                old = pl.read_parquet(cache_path)
                for row in old.iter_rows(named=True):
                    s = row["step"]
                    if s in fingerprints and state.get("steps", {}).get(str(s)) == fingerprints[s]:
                        valid_cache[s] = row
        except Exception:  # noqa: BLE001 - a damaged cache is simply rebuilt
            valid_cache = {}
    cached_rows = {s: valid_cache[s] for s in sel if s in valid_cache}
    todo = [s for s in sel if s not in cached_rows]

    seqv = SequencePartials(cfg)
    visitors = [seqv, *(factory(cfg) for factory in VISITORS.values()), *(extra_visitors or [])]
    rows: dict[int, dict] = dict(cached_rows)
    present_any: set[str] = set()
    done = 0

    def tick(_step: int) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, len(todo))

    tok_todo = [s for s in todo if s in set(token_steps)]
    collected: dict[str, dict[int, Any]] = {}  # visitor name -> step -> piece (visitors with collect=True)
    computed: set[int] = set()
    for res in iter_steps(run, tok_todo, visitors, on_step=tick):
        seqs, present = res.pieces[seqv.name]
        present_any |= present
        sd = reduce.StepData(res.step, seqs, cfg, profile, read_samples(run, res.step), present, {})
        sd.extra["pieces"] = res.pieces
        sd.extra["run_has_samples"] = bool(sample_steps)
        rows[res.step] = step_values(sd, metrics)
        computed.add(res.step)
        for v in visitors:
            if getattr(v, "collect", False):
                collected.setdefault(v.name, {})[res.step] = res.pieces[v.name]
        if on_step:
            on_step(res.step, res.pieces)
    for s in todo:
        if s in computed:
            continue
        # a step with samples but no token shards: sample-side metrics only
        sd = reduce.StepData(s, {}, cfg, profile, read_samples(run, s), set(), {})
        rows[s] = step_values(sd, metrics)
        tick(s)

    names = ["step"] + [m.name for m in metrics]
    records = [{k: rows[s].get(k) for k in names} for s in sorted(rows)]
    schema = {"step": pl.Int64, **{m.name: pl.Float64 for m in metrics}}
    raw = pl.DataFrame(records, schema=schema, orient="row")
    final = finalize(raw, metrics, profile, _cumulative_offsets(run, metrics, all_steps, lo, valid_cache, cfg, profile))

    notes = _absent_notes(run, metrics, raw, present_any, computed)
    from grpolens.metrics.rollout_is import offset_notes  # constant train-rollout offset diagnosis

    notes += offset_notes(raw)
    if write:
        out_dir.mkdir(parents=True, exist_ok=True)
        fmt.atomic_write_table(out_dir / "metrics.parquet", final.to_arrow())
        fmt.atomic_write_bytes(out_dir / "metrics.jsonl", to_jsonl(final).encode())
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        kept = set(cached_rows)
        for v in visitors:
            if getattr(v, "collect", False) and hasattr(v, "finish"):
                v.finish(run, out_dir, collected.get(v.name, {}), kept)
        # the state goes last: if anything above fails, the next run recomputes these steps
        keep = {s: r for s, r in valid_cache.items() if s not in rows}
        cache = pl.DataFrame([{k: r.get(k) for k in names} for _, r in sorted({**keep, **rows}.items())],
                             schema=schema, orient="row")
        fmt.atomic_write_table(cache_path, cache.to_arrow())
        state = {"config_hash": chash, "steps": {str(s): fingerprints[s] for s in sorted({*keep, *rows})}}
        fmt.atomic_write_bytes(state_path, json.dumps(state).encode())
    if result:
        return RecomputeResult(final, out_dir if write else None, sorted(computed | (set(todo) - computed)),
                               sorted(cached_rows), notes)
    return final


def _cumulative_offsets(run, metrics, all_steps, lo, valid_cache, cfg, profile) -> dict[str, float]:
    """Totals of cumulative metrics over the steps before ``--steps`` starts (samples only:
    cumulative metrics count generated tokens, so no token shard is read)."""
    cum = [m for m in metrics if m.cumulative]
    if not cum or lo is None:
        return {}
    totals = {m.name: 0.0 for m in cum}
    for s in all_steps:
        if s >= lo:
            break
        row = valid_cache.get(s)
        if row is None:
            row = step_values(reduce.StepData(s, {}, cfg, profile, read_samples(run, s), set(), {}), cum)
        for m in cum:
            totals[m.name] += row.get(m.name) or 0.0
    return totals


def finalize(raw: pl.DataFrame, metrics: list[Metric], profile: str, offsets: dict[str, float] | None = None) -> pl.DataFrame:
    """Rename to the profile's names; cumulative metrics become running totals (from ``offsets``)."""
    exprs = [pl.col("step")]
    for m in metrics:
        e = pl.col(m.name)
        if m.cumulative:
            start = (offsets or {}).get(m.name, 0.0)
            e = pl.when(e.is_not_null()).then(e.fill_null(0).cum_sum() + start).otherwise(None)
        exprs.append(e.alias(m.name_in(profile)))
    return raw.select(exprs)


def to_jsonl(df: pl.DataFrame) -> str:
    lines = []
    for row in df.iter_rows(named=True):
        clean = {}
        for k, v in row.items():
            if v is None or (isinstance(v, float) and not np.isfinite(v)):
                continue
            clean[k] = v
        lines.append(json.dumps(clean))
    return "\n".join(lines) + ("\n" if lines else "")


def _absent_notes(run, metrics, raw, present, computed) -> list[str]:
    """One line per optional column the run lacks, naming the metrics that are therefore empty."""
    if not computed:
        return []
    notes = []
    for col in ("old_logp", "ref_logp", "rollout_logp", "entropy"):
        if col in present:
            continue
        hit = [m.name for m in metrics if col in m.requires]
        if hit:
            notes.append(f"no {col} in this run: {len(hit)} metric(s) left empty ({', '.join(hit[:4])}{', ...' if len(hit) > 4 else ''})")
    return notes
