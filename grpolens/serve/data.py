"""The dashboard's data layer: everything the pages show, computed server-side with polars.

Each function takes run *directories* (already checked against the allow-list by the caller, see
:mod:`grpolens.serve.runs`) and returns small frames or numpy arrays. Nothing here returns raw
token tables to the browser: curves are per step and downsampled, token views cover one step
(the top-K table) or one completion. Results are memoised per run and step, keyed by a
fingerprint of the files they were read from, so a growing run (``--watch``) is re-read only
where it changed.
"""

from __future__ import annotations

import math
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Hashable

import numpy as np
import polars as pl
import pyarrow.parquet as pq

from grpolens.run import format as fmt
from grpolens.errors import UserError

#: Points per curve sent to the browser; longer curves are min/max-downsampled (spikes survive).
CURVE_POINTS = 2000
#: Prefix of the per-step series derived from the samples table (rewards, lengths).
SAMPLES_PREFIX = "samples/"
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


# ---------------------------------------------------------------------------------------------
# Caching
# ---------------------------------------------------------------------------------------------

class Memo:
    """A small thread-safe LRU cache (the Dash server answers callbacks from several threads)."""

    def __init__(self, size: int):
        self.size = size
        self._d: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._d:
                self._d.move_to_end(key)
                return self._d[key]
        value = make()  # computed outside the lock: two threads may both compute; both are right
        with self._lock:
            self._d[key] = value
            self._d.move_to_end(key)
            while len(self._d) > self.size:
                self._d.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self._d.clear()


_RUN_MEMO = Memo(64)    # per-run series (metrics, samples summary, IS heat map)
_STEP_MEMO = Memo(32)   # per-(run, step) tables: tokens, sequence table


def clear_caches() -> None:
    _RUN_MEMO.clear()
    _STEP_MEMO.clear()


def _stat(path: Path) -> tuple:
    try:
        st = path.stat()
        return (st.st_size, st.st_mtime_ns)
    except OSError:
        return (None, None)


def run_version(run: Path) -> tuple:
    """Changes whenever the run's metrics are rewritten or a step appears (cheap: two stats)."""
    return (_stat(metrics_path(run)), _stat(run / fmt.TOKENS), _stat(run / fmt.SAMPLES))


def _step_fingerprint(run: Path, step: int) -> tuple:
    shards = fmt.list_shards(run, fmt.TOKENS, [step]) + fmt.list_shards(run, fmt.SAMPLES, [step])
    return tuple((sh.table, sh.path.name, *_stat(sh.path)) for sh in shards)


# ---------------------------------------------------------------------------------------------
# Per-step series: metrics.parquet plus what the samples table gives directly
# ---------------------------------------------------------------------------------------------

def metrics_path(run: Path) -> Path:
    return fmt.derived_dir(run) / "metrics.parquet"


def read_metrics(run: Path) -> pl.DataFrame:
    """``RUN/grpolens/metrics.parquet`` (an empty frame with ``step`` when there is none)."""
    p = metrics_path(run)

    def make() -> pl.DataFrame:
        if not p.is_file():
            return pl.DataFrame({"step": pl.Series([], dtype=pl.Int64)})
        try:
            return pl.read_parquet(p)
        except Exception as e:  # noqa: BLE001 - a damaged file is the user's to fix
            raise fmt.RunFormatError(p, f"unreadable Parquet file: {e}") from None

    return _RUN_MEMO.get(("metrics", str(run), _stat(p)), make)


def _reward_columns(files: list[Path]) -> list[str]:
    cols: set[str] = set()
    for f in files[:1] + files[-1:]:
        try:
            cols |= {n for n in pq.read_schema(f).names if n.startswith(fmt.REWARD_PREFIX)}
        except Exception:  # noqa: BLE001
            pass
    return sorted(cols)


def samples_summary(run: Path) -> pl.DataFrame:
    """Per step, from the samples table: reward quantiles (total and per reward function), mean
    completion length and its quantiles, truncated fraction, zero-std group fraction.

    Column names start with ``samples/`` so they never clash with recomputed metrics.
    """
    def make() -> pl.DataFrame:
        files = [sh.path for sh in fmt.list_shards(run, fmt.SAMPLES)]
        if not files:
            return pl.DataFrame({"step": pl.Series([], dtype=pl.Int64)})
        rewards = _reward_columns(files)
        want = ["step", "group_id", "completion_len", "truncated", "reward", *rewards]
        lf = pl.scan_parquet(files, hive_partitioning=False, missing_columns="insert", extra_columns="ignore")
        names = lf.collect_schema().names()
        df = lf.select([c for c in want if c in names]).collect()
        if "reward" not in df.columns:
            df = df.with_columns(pl.lit(None, dtype=pl.Float64).alias("reward"))
        aggs: list[pl.Expr] = []
        for col in ["reward", *rewards]:
            x = pl.col(col).filter(pl.col(col).is_finite())
            aggs.append(x.mean().alias(f"{SAMPLES_PREFIX}{col}/mean"))
            for q in QUANTILES:
                aggs.append(x.quantile(q, "linear").alias(f"{SAMPLES_PREFIX}{col}/p{int(q * 100):02d}"))
        L = pl.col("completion_len").cast(pl.Float64)
        aggs += [L.mean().alias(f"{SAMPLES_PREFIX}length/mean")]
        aggs += [L.quantile(q, "linear").alias(f"{SAMPLES_PREFIX}length/p{int(q * 100):02d}") for q in QUANTILES]
        aggs.append(pl.col("truncated").cast(pl.Float64).mean().alias(f"{SAMPLES_PREFIX}truncated_frac"))
        per_step = df.group_by("step").agg(aggs)
        # A group whose rewards are all equal gives zero advantage to every completion in it.
        groups = (df.group_by("step", "group_id")
                  .agg(pl.col("reward").n_unique().alias("distinct"), pl.col("reward").count().alias("n"))
                  .group_by("step")
                  .agg(((pl.col("distinct") <= 1) & (pl.col("n") >= 1)).cast(pl.Float64).mean()
                       .alias(f"{SAMPLES_PREFIX}zero_std_group_frac")))
        return per_step.join(groups, on="step", how="left").sort("step")

    return _RUN_MEMO.get(("samples", str(run), run_version(run)), make)


def series(run: Path, with_samples: bool = False) -> pl.DataFrame:
    """All per-step series of a run: recomputed metrics, joined with :func:`samples_summary` when
    ``with_samples`` or when the metrics lack the reward and length curves (older runs)."""
    def make() -> pl.DataFrame:
        m = read_metrics(run)
        need = with_samples or not {"reward/mean", "completions/length/mean"} <= set(m.columns)
        s = samples_summary(run) if need else pl.DataFrame({"step": pl.Series([], dtype=pl.Int64)})
        if m.height == 0:
            return s
        if s.height == 0:
            return m
        return m.join(s, on="step", how="full", coalesce=True).sort("step")

    return _RUN_MEMO.get(("series", str(run), run_version(run), with_samples), make)


def metric_families() -> dict[str, str]:
    """Metric name -> family, from the registry (so pages follow new metrics automatically)."""
    from grpolens.metrics.catalogue import catalogue_rows

    return {r["name"]: r["family"] for r in catalogue_rows()}


def metric_docs() -> dict[str, str]:
    from grpolens.metrics.catalogue import catalogue_rows

    return {r["name"]: r["doc"] for r in catalogue_rows()}


def page_families() -> dict[str, tuple[str, ...]]:
    """Curve page -> the metric families drawn on it (each family declares its page)."""
    from grpolens.metrics.registry import FAMILIES, PAGES
    from grpolens.plugins import load_plugins

    load_plugins()
    return {page: tuple(f.name for f in FAMILIES.values() if f.page == page) for page in PAGES}


def family_metrics(frames: list[pl.DataFrame], families: tuple[str, ...]) -> list[str]:
    """Columns of any of ``frames`` whose family is one of ``families``, in catalogue order,
    skipping columns that are null in every frame."""
    fam = metric_families()
    order = {n: i for i, n in enumerate(fam)}
    present: set[str] = set()
    for f in frames:
        for c in f.columns:
            if c != "step" and c in fam and f[c].null_count() < f.height:
                present.add(c)

    def match(family: str) -> bool:
        return any(family == x or family.startswith(x + "/") for x in families)

    return sorted((c for c in present if match(fam[c])), key=lambda c: order[c])


def overview_slots() -> list[tuple[str, tuple[str, ...]]]:
    """Overview slots, in their places: a label and the metric names to try, in order (regular
    expressions), as the families declare them. The first column present in any selected run fills
    the slot; samples-derived series are the fallback."""
    from grpolens.metrics.registry import FAMILIES
    from grpolens.plugins import load_plugins

    load_plugins()
    slots = sorted(s for f in FAMILIES.values() for s in f.overview)
    return [(label, patterns) for _, label, patterns in slots]


def overview_metrics(frames: list[pl.DataFrame]) -> list[tuple[str, str]]:
    """``(label, column)`` for each overview slot some selected run can fill."""
    cols: list[str] = []
    for f in frames:
        cols += [c for c in f.columns if c not in cols and f[c].null_count() < f.height]
    out = []
    for label, patterns in overview_slots():
        for pat in patterns:
            hit = next((c for c in cols if re.search(pat, c)), None)
            if hit is not None:
                if hit not in [h for _, h in out]:
                    out.append((label, hit))
                break
    return out


def ema(y: np.ndarray, weight: float) -> np.ndarray:
    """Debiased exponential moving average (TensorBoard/W&B style); NaNs are skipped, not spread."""
    if weight <= 0 or len(y) == 0:
        return y
    out = np.full(len(y), np.nan)
    acc, norm = 0.0, 0.0
    for i, v in enumerate(y):
        if not math.isfinite(v):
            continue
        acc = weight * acc + (1 - weight) * v
        norm = weight * norm + (1 - weight)
        out[i] = acc / norm
    return out


def downsample_minmax(n: int, y: np.ndarray, max_points: int = CURVE_POINTS) -> np.ndarray:
    """Indices to keep so that at most ``max_points`` remain: per bucket, its min and its max
    (a one-step spike is never averaged away). Sorted; first and last are always kept."""
    if n <= max_points:
        return np.arange(n)
    buckets = max(1, max_points // 2)
    edges = np.linspace(0, n, buckets + 1).astype(int)
    keep = [0, n - 1]
    yy = np.where(np.isfinite(y), y, np.nan)
    for a, b in zip(edges[:-1], edges[1:]):
        if b <= a:
            continue
        seg = yy[a:b]
        if np.all(np.isnan(seg)):
            keep.append(a)
            continue
        keep += [a + int(np.nanargmin(seg)), a + int(np.nanargmax(seg))]
    return np.unique(np.asarray(keep))


def curve(df: pl.DataFrame, column: str, lo: int | None = None, hi: int | None = None,
          smoothing: float = 0.0, max_points: int = CURVE_POINTS) -> dict[str, np.ndarray]:
    """One curve of one run: ``x`` (steps), ``y`` (raw), ``smooth`` (EMA, or None), downsampled."""
    if column not in df.columns:
        return {"x": np.zeros(0, np.int64), "y": np.zeros(0), "smooth": None}
    d = df.select("step", column)
    if lo is not None:
        d = d.filter(pl.col("step") >= lo)
    if hi is not None:
        d = d.filter(pl.col("step") <= hi)
    x = d["step"].to_numpy().astype(np.int64)
    y = d[column].cast(pl.Float64).fill_null(float("nan")).to_numpy()
    y = np.where(np.isfinite(y), y, np.nan)
    smooth = ema(y, smoothing) if smoothing > 0 else None
    idx = downsample_minmax(len(x), y if smooth is None else smooth, max_points)
    return {"x": x[idx], "y": y[idx], "smooth": None if smooth is None else smooth[idx]}


def step_bounds(frames: list[pl.DataFrame]) -> tuple[int, int]:
    steps = [f["step"] for f in frames if f.height]
    if not steps:
        return (0, 0)
    return (min(int(s.min()) for s in steps), max(int(s.max()) for s in steps))


def compare(a: pl.DataFrame, b: pl.DataFrame, lo: int | None = None, hi: int | None = None) -> pl.DataFrame:
    """Per metric over the common steps in [lo, hi]: mean of A, mean of B, the mean of B - A (and
    relative to the larger mean), max |B - A| and its step; largest relative difference first.
    Metrics without a finite value in both runs at a common step are left out."""
    common = [c for c in a.columns if c != "step" and c in b.columns
              and a[c].dtype.is_numeric() and b[c].dtype.is_numeric()]
    j = a.select("step", *common).join(b.select("step", *common), on="step", how="inner", suffix="__b")
    if lo is not None:
        j = j.filter(pl.col("step") >= lo)
    if hi is not None:
        j = j.filter(pl.col("step") <= hi)
    rows = []
    steps = j["step"].to_numpy()
    for c in common:
        va = j[c].cast(pl.Float64).fill_null(np.nan).to_numpy()
        vb = j[f"{c}__b"].cast(pl.Float64).fill_null(np.nan).to_numpy()
        ok = np.isfinite(va) & np.isfinite(vb)
        if not ok.any():
            continue
        d = vb[ok] - va[ok]
        k = int(np.argmax(np.abs(d)))
        ma, mb = float(va[ok].mean()), float(vb[ok].mean())
        scale = max(abs(ma), abs(mb))
        rows.append({"metric": c, "steps": int(ok.sum()), "mean_a": ma, "mean_b": mb, "mean_delta": float(d.mean()),
                     "rel_delta": float(d.mean()) / scale if scale > 0 else 0.0,
                     "max_abs_delta": float(abs(d[k])), "at_step": int(steps[ok][k])})
    schema = {"metric": pl.String, "steps": pl.Int64, "mean_a": pl.Float64, "mean_b": pl.Float64,
              "mean_delta": pl.Float64, "rel_delta": pl.Float64, "max_abs_delta": pl.Float64, "at_step": pl.Int64}
    # the metrics that differ most (relative to their size) first
    return pl.DataFrame(rows, schema=schema).sort(pl.col("rel_delta").abs(), descending=True, maintain_order=True)


def delta_curve(a: pl.DataFrame, b: pl.DataFrame, column: str, lo=None, hi=None, max_points=CURVE_POINTS):
    """``B - A`` per common step for one metric (downsampled like :func:`curve`)."""
    if column not in a.columns or column not in b.columns:
        return {"x": np.zeros(0, np.int64), "y": np.zeros(0), "smooth": None}
    j = a.select("step", pl.col(column).alias("a")).join(b.select("step", pl.col(column).alias("b")), on="step")
    j = j.with_columns((pl.col("b") - pl.col("a")).alias("delta"))
    return curve(j, "delta", lo, hi, 0.0, max_points)


# ---------------------------------------------------------------------------------------------
# One step: tokens with per-token scores, the completions table, one completion
# ---------------------------------------------------------------------------------------------

#: Per-token scores (name -> definition shown in the UI). Sequential scores are >= 0.
SCORES = {
    "kl": "KL to reference, k3 estimator: exp(ref - logp) - (ref - logp) - 1",
    "mismatch": "|train - rollout| log-prob: |old_logp - rollout_logp| (old_logp = logp when on-policy)",
    "ratio": "policy ratio exp(logp - old_logp); ranked by |log ratio|",
    "entropy": "policy entropy at the position",
    "adv_ratio": "|advantage * (ratio - 1)|: how much the token moves the loss",
    "advantage": "advantage applied to the token",
}
#: Scores a top-K table can rank by, and scores a completion can be coloured by.
RANK_BY = ("kl", "mismatch", "ratio", "entropy", "adv_ratio")
COLOR_BY = ("kl", "mismatch", "ratio", "entropy", "advantage")
#: Scores drawn on a diverging scale (signed, centred at 0): the value drawn is this column.
DIVERGING = {"ratio": "log_ratio", "advantage": "advantage"}

_TOKEN_READ = ("sample_id", "rank", "micro_batch", "pos", "token_id", "logp", "old_logp", "ref_logp",
               "rollout_logp", "advantage", "mask", "entropy")


def _finite(e: pl.Expr) -> pl.Expr:
    e = e.cast(pl.Float64)
    return pl.when(e.is_finite()).then(e).otherwise(None)


def step_tokens(run: Path, step: int) -> pl.DataFrame:
    """Every token of one step (all ranks and loss calls) with derived per-token scores.

    Reads only this step's shards. Non-finite scores become null (they are counted by the
    health metrics, and would otherwise sort above every real value).
    """
    from grpolens.run.reader import read_tokens

    def make() -> pl.DataFrame:
        import pyarrow as pa

        from grpolens.analysis import drilldown
        from grpolens.metrics.batch import TokenBatch
        from grpolens.functional.is_weights import bounded_exp

        shards = fmt.list_shards(run, fmt.TOKENS, [step])
        if not shards:
            return pl.DataFrame()
        table = pa.concat_tables([read_tokens(sh.path, ("step", *_TOKEN_READ)) for sh in shards],
                                 promote_options="default")
        df = pl.from_arrow(table).drop("step")
        for c in ("token_id", "old_logp", "ref_logp", "rollout_logp", "entropy"):
            if c not in df.columns:
                df = df.with_columns(pl.lit(None, dtype=pl.Float32 if c != "token_id" else pl.Int32).alias(c))
        df = df.sort("rank", "micro_batch", "sample_id", "pos")  # TokenBatch's row order
        # The scores are drilldown's (one definition for `grpolens tokens` and this page), on every
        # stored token: masked ones are shown too, struck through.
        b = TokenBatch.from_arrow(table)
        nan = np.full(b.n, np.nan)

        def score(by: str) -> np.ndarray:
            s = drilldown.token_scores(b, by, masked_only=False)
            return nan if s is None else s

        with np.errstate(all="ignore"):
            rollout = b.cols.get("rollout_logp", nan)
            derived = {
                "log_ratio": b.log_ratio, "ratio": b.ratio, "kl": score("kl"), "mismatch": score("mismatch"),
                "is_weight": bounded_exp(b.old - rollout), "adv_ratio": score("adv_ratio"),
            }
        df = df.with_columns(*[_finite(pl.Series(k, v)) for k, v in derived.items()], _finite(pl.col("entropy")))
        return df

    return _STEP_MEMO.get(("tokens", str(run), step, _step_fingerprint(run, step)), make)


def _score_expr(by: str) -> pl.Expr:
    if by == "ratio":
        return pl.col("log_ratio").abs()
    return pl.col(by)


def top_tokens_file(run: Path) -> Path:
    return fmt.derived_dir(run) / "top_tokens.parquet"


def top_tokens(run: Path, step: int, by: str = "kl", k: int = 50, masked_only: bool = True) -> pl.DataFrame:
    """The ``k`` tokens of ``step`` with the largest score ``by`` (see :data:`SCORES`), across all
    ranks and loss calls. Uses ``RUN/grpolens/top_tokens.parquet`` when recompute wrote one that
    covers this step and score; otherwise ranks this step's tokens on the fly."""
    if by not in RANK_BY:
        raise UserError(f"unknown score {by!r}; choose one of {', '.join(RANK_BY)}")
    pre = _precomputed_top(run, step, by, k)
    if pre is not None:
        return pre
    df = step_tokens(run, step)
    if df.height == 0:
        return df
    if masked_only:
        df = df.filter(pl.col("mask"))
    score = _score_expr(by)
    out = (df.filter(score.is_not_null()).with_columns(score.alias("score"))
           .sort("score", descending=True, maintain_order=True).head(k))
    return out.select([c for c in TOP_COLUMNS if c in out.columns])


#: Columns of a top-K table, in display order.
TOP_COLUMNS = ("score", "sample_id", "rank", "micro_batch", "pos", "token_id", "logp", "old_logp", "ref_logp",
               "rollout_logp", "ratio", "entropy", "advantage", "mask")


def _precomputed_top(run: Path, step: int, by: str, k: int) -> pl.DataFrame | None:
    """This step's rows of ``top_tokens.parquet`` for score ``by`` (a filtered scan: the file
    holds every step), or None when it has fewer than ``k`` of them."""
    p = top_tokens_file(run)
    if not p.is_file():
        return None

    def make() -> pl.DataFrame | None:
        try:
            lf = pl.scan_parquet(p)
            if not {"step", "by", "score"} <= set(lf.collect_schema().names()):
                return None
            return lf.filter((pl.col("step") == step) & (pl.col("by") == by)).collect()
        except Exception:  # noqa: BLE001 - fall back to ranking the step's tokens here
            return None

    sel = _STEP_MEMO.get(("top", str(run), step, by, _stat(p)), make)
    if sel is None or sel.height < k:  # recompute kept fewer than asked for: rank this step's tokens here
        return None
    sel = sel.sort("score", descending=True, maintain_order=True).head(k)
    return sel.select([c for c in TOP_COLUMNS if c in sel.columns])


def step_samples(run: Path, step: int) -> pl.DataFrame:
    """The samples rows of one step (all ranks), texts included."""
    def make() -> pl.DataFrame:
        from grpolens.run.reader import read_samples

        df = read_samples(run, step)
        return pl.DataFrame() if df is None else df

    return _STEP_MEMO.get(("samples", str(run), step, _step_fingerprint(run, step)), make)


def _run_config(run: Path) -> dict:
    """The run's config with defaults, ``rollout_is`` normalised as the metric families see it."""
    def make() -> dict:
        from grpolens.run.reader import RunReader

        reader = RunReader(run)
        try:
            return reader.config()
        except Exception:  # noqa: BLE001 - display only: fall back to the raw config
            return reader.config(check=False)

    return _RUN_MEMO.get(("config", str(run), _stat(run / fmt.MANIFEST_NAME)), make)


#: Columns of the completions table, in display order (the sidecar table's names, see
#: :mod:`grpolens.analysis.sidecars`); ``reward/<name>`` columns follow ``reward_total``.
COMPLETION_COLUMNS = ("sample_id", "rank", "group_id", "reward_rank_desc", "reward_total", "advantage",
                      "completion_len", "truncated", "tokens", "masked_tokens", "kl_mean", "kl_max", "mismatch_mean",
                      "is_weight_max", "entropy_mean", "clip_frac", "is_vetoed", "prompt", "completion")
#: Characters of prompt/completion text shown in the table (the completion view shows all).
PREVIEW_CHARS = 80


def completions_file(run: Path) -> Path:
    from grpolens.analysis.sidecars import COMPLETIONS_FILE

    return fmt.derived_dir(run) / COMPLETIONS_FILE


def sequence_table(run: Path, step: int) -> pl.DataFrame:
    """One row per completion of ``step`` (:data:`COMPLETION_COLUMNS`), texts cut to a preview.

    Read from the sidecar table ``RUN/grpolens/completions.parquet`` that recompute writes (only
    this step's rows); for runs without one, computed here from the step's samples and tokens.
    """
    def make() -> pl.DataFrame:
        out = _sidecar_rows(run, step)
        if out is None:
            out = _computed_rows(run, step)
        if out.height == 0:
            return out
        rewards = sorted(c for c in out.columns if c.startswith(fmt.REWARD_PREFIX))
        order = [c for c in COMPLETION_COLUMNS[:5] if c in out.columns] + rewards + \
                [c for c in COMPLETION_COLUMNS[5:] if c in out.columns]
        out = out.select(order)
        for c in ("prompt", "completion"):
            if c in out.columns:
                out = out.with_columns(pl.col(c).str.slice(0, PREVIEW_CHARS))
        return out.sort("sample_id")

    key = ("seqtable", str(run), step, _step_fingerprint(run, step), _stat(completions_file(run)))
    return _STEP_MEMO.get(key, make)


def _sidecar_rows(run: Path, step: int) -> pl.DataFrame | None:
    p = completions_file(run)
    if not p.is_file():
        return None
    try:
        df = pl.scan_parquet(p).filter(pl.col("step") == step).collect()
    except Exception:  # noqa: BLE001 - a damaged sidecar: compute from the shards instead
        return None
    return df if df.height else None


def _computed_rows(run: Path, step: int) -> pl.DataFrame:
    """The completions table of one step computed from its shards by the same code that writes
    ``completions.parquet`` during recompute (for a run that was never recomputed)."""
    from grpolens.analysis.sidecars import build_steps

    return build_steps(run, [step])


_FILTER_CLAUSE = re.compile(r"^\s*\{(?P<col>[^}]+)\}\s+(?P<op>\S+)\s+(?P<val>.+?)\s*$")
_OPS = {"=": "eq", "eq": "eq", "s=": "eq", "!=": "ne", "ne": "ne", "s!=": "ne", "<": "lt", "lt": "lt", "s<": "lt",
        "<=": "le", "le": "le", "s<=": "le", ">": "gt", "gt": "gt", "s>": "gt", ">=": "ge", "ge": "ge", "s>=": "ge",
        "contains": "contains", "scontains": "contains", "icontains": "icontains", "i=": "ieq"}


def parse_filter_query(query: str | None, columns: list[str], schema: dict[str, pl.DataType]) -> pl.Expr | None:
    """A DataTable ``filter_query`` (``{col} op value`` clauses joined by ``&&``) as a polars
    expression. Only known columns and operators are accepted; anything else is a UserError."""
    if not query or not query.strip():
        return None
    expr = None
    for clause in query.split("&&"):
        m = _FILTER_CLAUSE.match(clause)
        if not m or m["op"] not in _OPS or m["col"] not in columns:
            raise UserError(f"cannot filter on {clause.strip()!r}: use {{column}} op value with op one of "
                            "=, !=, <, <=, >, >=, contains")
        col, op, raw = m["col"], _OPS[m["op"]], m["val"]
        if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'`":
            raw = raw[1:-1]
        dtype = schema[col]
        c = pl.col(col)
        if op == "contains":
            e = c.cast(pl.String).str.contains(raw, literal=True)
        elif op in ("icontains", "ieq"):
            low = c.cast(pl.String).str.to_lowercase()
            e = low.str.contains(raw.lower(), literal=True) if op == "icontains" else low == raw.lower()
        else:
            if dtype == pl.Boolean:
                value: Any = raw.lower() in ("true", "1", "yes")
            elif dtype.is_numeric():
                try:
                    value = float(raw)
                except ValueError:
                    raise UserError(f"cannot filter {col} by {raw!r}: not a number") from None
            else:
                value = raw
            e = {"eq": c == value, "ne": c != value, "lt": c < value, "le": c <= value,
                 "gt": c > value, "ge": c >= value}[op]
        expr = e if expr is None else expr & e
    return expr


def completions_page(run: Path, step: int, page: int = 0, page_size: int = 20,
                     sort_by: list[dict] | None = None, filter_query: str | None = None,
                     group: int | None = None, truncated: bool | None = None, vetoed: bool | None = None,
                     max_rank: int | None = None) -> tuple[pl.DataFrame, int]:
    """One page of the completions table of ``step``, after filtering and sorting on the server.
    Returns ``(rows, total_rows_after_filtering)``."""
    t = sequence_table(run, step)
    if t.height == 0:
        return t, 0
    if group is not None and "group_id" in t.columns:
        t = t.filter(pl.col("group_id") == group)
    if truncated is not None and "truncated" in t.columns:
        t = t.filter(pl.col("truncated") == truncated)
    if vetoed is not None and "is_vetoed" in t.columns:
        t = t.filter(pl.col("is_vetoed").fill_null(False) == vetoed)
    if max_rank is not None and "reward_rank_desc" in t.columns:
        t = t.filter(pl.col("reward_rank_desc") <= max_rank)
    e = parse_filter_query(filter_query, t.columns, dict(t.schema))
    if e is not None:
        t = t.filter(e)
    for spec in reversed(sort_by or []):  # stable sorts, last key first
        col = spec.get("column_id")
        if col in t.columns:
            t = t.sort(col, descending=spec.get("direction") == "desc", nulls_last=True, maintain_order=True)
    total = t.height
    page = max(0, int(page or 0))
    return t.slice(page * page_size, page_size), total


def completion(run: Path, step: int, sample_id: int) -> dict[str, Any] | None:
    """One completion: its samples row (full texts) and its tokens with scores, by position."""
    t = step_tokens(run, step)
    toks = t.filter(pl.col("sample_id") == sample_id).sort("pos") if t.height else t
    s = step_samples(run, step)
    row = s.filter(pl.col("sample_id") == sample_id).to_dicts() if s.height else []
    if toks.height == 0 and not row:
        return None
    return {"sample": row[0] if row else {"sample_id": sample_id}, "tokens": toks}


def decoder(run: Path):
    """``(id -> text, source)`` for token labels (see :mod:`grpolens.run.decode`); the text is
    untrusted and is only ever shown as text."""
    def make():
        try:
            from grpolens.run.decode import make_decoder

            return make_decoder(run, _run_config(run))
        except Exception:  # noqa: BLE001
            return (lambda i: f"⟨{i}⟩"), "ids"

    return _RUN_MEMO.get(("decoder", str(run), _stat(run / fmt.MANIFEST_NAME)), make)


def score_scale(run: Path, step: int, by: str) -> float:
    """The value at which the colour of score ``by`` saturates: the step's 99th percentile (of
    |value| for diverging scores), so colours compare across the completions of a step."""
    def make() -> float:
        t = step_tokens(run, step)
        col = DIVERGING.get(by, by)
        if t.height == 0 or col not in t.columns:
            return 1.0
        v = t.filter(pl.col("mask"))[col].cast(pl.Float64).drop_nulls().abs()
        q = v.quantile(0.99) if v.len() else None
        return float(q) if q is not None and q > 0 else 1.0

    return _STEP_MEMO.get(("scale", str(run), step, by, _step_fingerprint(run, step)), make)


# ---------------------------------------------------------------------------------------------
# Rollout importance-sampling weights
# ---------------------------------------------------------------------------------------------

#: Log-spaced bins of the IS weight exp(old - rollout): log10 edges from 1e-3 to 1e3, 0.025 wide
#: (a 6 % step in the weight, fine enough to see a 1e-2 mismatch).
IS_LOG10_EDGES = np.linspace(-3, 3, 241)


def is_hist_file(run: Path) -> Path:
    return fmt.derived_dir(run) / "is_hist.parquet"


def _hist_log10(w: np.ndarray) -> np.ndarray:
    """Counts per bin of log10(w); values beyond the edges land in the first/last bin."""
    lw = np.log10(w[(w > 0) & np.isfinite(w)])
    lw = np.clip(lw, IS_LOG10_EDGES[0], IS_LOG10_EDGES[-1] - 1e-12)
    return np.histogram(lw, IS_LOG10_EDGES)[0].astype(np.float64)


def is_hist_table(run: Path) -> pl.DataFrame | None:
    """``RUN/grpolens/is_hist.parquet`` (long form: step, kind raw/applied, weight bin [lo, hi),
    count), written by recompute's IS-histogram visitor; None when absent or unreadable."""
    p = is_hist_file(run)
    if not p.is_file():
        return None

    def make():
        try:
            df = pl.read_parquet(p)
        except Exception:  # noqa: BLE001 - fall back to computing from tokens
            return None
        return df if {"step", "kind", "lo", "hi", "count"} <= set(df.columns) else None

    return _RUN_MEMO.get(("ishist", str(run), _stat(p)), make)


def _hist_from_table(df: pl.DataFrame, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(steps, log10 edges, counts steps x bins)`` of one kind; bins with lo <= 0 (the applied
    weights' exact zeros) are left out."""
    d = df.filter((pl.col("kind") == kind) & (pl.col("lo") > 0)).sort("step", "lo")
    bins = d.select("lo", "hi").unique().sort("lo")
    steps = d["step"].unique().sort().to_numpy()
    edges = np.log10(np.append(bins["lo"].to_numpy(), bins["hi"].to_numpy()[-1:]))
    counts = np.zeros((len(steps), bins.height))
    si = np.searchsorted(steps, d["step"].to_numpy())
    bi = np.searchsorted(bins["lo"].to_numpy(), d["lo"].to_numpy())
    np.add.at(counts, (si, bi), d["count"].to_numpy().astype(np.float64))
    return steps, edges, counts


def is_heatmap(run: Path, max_steps: int = 64) -> dict[str, Any]:
    """IS-weight distribution per step: ``{steps, log10_edges, counts (steps x bins), source}``.

    From ``RUN/grpolens/is_hist.parquet`` when recompute wrote it (every step, mergeable
    histograms); otherwise computed here from the tokens of at most ``max_steps`` evenly spaced
    steps (``source`` says which)."""
    tab = is_hist_table(run)
    if tab is not None and tab.height:
        def from_file() -> dict[str, Any]:
            steps, edges, counts = _hist_from_table(tab, "raw")
            return {"steps": steps, "log10_edges": edges, "counts": counts, "source": is_hist_file(run).name}

        return _RUN_MEMO.get(("ishist-map", str(run), _stat(is_hist_file(run))), from_file)

    def make() -> dict[str, Any]:
        all_steps = fmt.list_steps(run, fmt.TOKENS)
        steps = all_steps
        if len(steps) > max_steps:
            steps = [steps[i] for i in np.linspace(0, len(steps) - 1, max_steps).round().astype(int)]
        rows = []
        for s in steps:
            t = step_tokens(run, s)
            w = t.filter(pl.col("mask"))["is_weight"].drop_nulls().to_numpy() if t.height else np.zeros(0)
            rows.append(_hist_log10(w))
        counts = np.vstack(rows) if rows else np.zeros((0, len(IS_LOG10_EDGES) - 1))
        src = "tokens" if len(steps) == len(all_steps) else f"tokens of {len(steps)} sampled steps"
        return {"steps": np.asarray(steps, np.int64), "log10_edges": IS_LOG10_EDGES, "counts": counts, "source": src}

    return _RUN_MEMO.get(("ishist-tokens", str(run), run_version(run), max_steps), make)


#: Step metrics shown beside one step's IS weights, when the run has them.
IS_STEP_METRICS = ("mismatch/kl_k3", "mismatch/abs_logp_diff", "mismatch/delta_median", "mismatch/delta_iqr",
                   "mismatch/delta_sign_agreement", "mismatch/constant_offset", "rollout_is/raw/max",
                   "rollout_is/raw/ess", "rollout_is/truncated_fraction", "rollout_is/zeroed_fraction",
                   "rollout_is/modified/token_fraction", "rollout_is/veto/seq_fraction",
                   "rollout_is/mask/seq_fraction")


def is_step_detail(run: Path, step: int) -> dict[str, Any]:
    """One step's raw and applied IS weights (log10 bins), with the step's mismatch/rollout-IS
    metrics and the mean/sd of log(train/rollout) for the constant-offset check.

    Histograms come from ``is_hist.parquet`` (the rollout-IS family's exact weights) when
    present; otherwise raw weights are binned here and "applied" follows the manifest's
    ``rollout_is`` (truncate at ``upper``; mask outside [lower, upper]; veto whole sequences)."""
    t = step_tokens(run, step)
    cfg = _run_config(run).get("rollout_is") or {}
    cfg = cfg if isinstance(cfg, dict) else {}
    out: dict[str, Any] = {"config": cfg, "edges": IS_LOG10_EDGES, "source": "tokens"}
    m = read_metrics(run)
    row = m.filter(pl.col("step") == step).row(0, named=True) if m.height and step in set(m["step"]) else {}
    out["metrics"] = {k: row[k] for k in IS_STEP_METRICS if row.get(k) is not None}
    if t.height == 0:
        return out
    t = t.filter(pl.col("mask") & pl.col("is_weight").is_not_null())
    w = t["is_weight"].to_numpy()
    out["tokens"] = int(len(w))
    out["seqs"] = int(t["sample_id"].n_unique())
    if len(w) == 0:
        return out
    d = np.log(w)
    out["offset_mean"] = float(d.mean())
    out["offset_sd"] = float(d.std(ddof=1)) if len(d) > 1 else float("nan")
    tab = is_hist_table(run)
    if tab is not None and step in set(tab["step"]):
        one = tab.filter(pl.col("step") == step)
        _, edges, raw = _hist_from_table(one, "raw")
        _, edges_a, applied = _hist_from_table(one, "applied")
        if len(edges_a) == len(edges):
            out.update(edges=edges, raw=raw[0], applied=applied[0], source=is_hist_file(run).name)
            zero = one.filter((pl.col("kind") == "applied") & (pl.col("lo") <= 0))["count"].sum()
            out["zeroed"] = int(zero or 0)
            return out
    # No is_hist.parquet for this step: the rollout-IS family's own per-token decisions, on the
    # step's shards (one implementation of truncation, masking and veto for every view).
    from grpolens.analysis import drilldown
    from grpolens.functional.is_weights import ISConfig, token_weights
    from grpolens.run.reader import resolve_config

    b = drilldown.load_step(run, step)
    tw = token_weights(b, ISConfig.from_cfg(resolve_config(run)))
    valid = tw["valid"]
    out["raw"] = _hist_log10(tw["is_weight_raw"][valid])
    out["applied"] = _hist_log10(tw["is_weight"][valid & tw["is_mask"]])
    out["zeroed"] = int((valid & ~tw["is_mask"]).sum())
    return out


# ---------------------------------------------------------------------------------------------
# Checks and runs list
# ---------------------------------------------------------------------------------------------

def check_verdicts(run: Path, baseline: Path | None = None) -> list[dict]:
    """Failed ``grpolens check`` rules (the built-in defaults, against ``baseline`` when given)
    as ``{metric, step, status, message}``, to mark on the curves. Evaluated on the metrics
    already read (no recompute); empty when the check module cannot judge them."""
    def make() -> list[dict]:
        try:
            from grpolens.check.baseline import no_data_steps, run_series
            from grpolens.check.rules import default_rules
            from grpolens.check.evaluate import ERROR, FAIL, NO_DATA, evaluate

            df = read_metrics(run)
            cand, empty = run_series(df), no_data_steps(df)
            base = run_series(read_metrics(baseline)) if baseline is not None else None
            outs = []
            for rule in default_rules().rules:
                got = evaluate(rule, cand, base, empty, df["step"].to_list())
                outs += got if isinstance(got, list) else [got]
        except Exception:  # noqa: BLE001 - verdicts are an overlay; never break a page for them
            return []
        return [{"metric": o.metric, "step": o.step, "status": o.status, "message": o.message}
                for o in outs if o.status in (FAIL, NO_DATA, ERROR)]

    bkey = None if baseline is None else (str(baseline), run_version(baseline))
    return _RUN_MEMO.get(("verdicts", str(run), run_version(run), bkey), make)
