"""Per-step curves: the metrics table, the samples summary, which metrics each page and the overview
show, smoothing, downsampling, run comparison."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq

from grpolens.run import format as fmt
from grpolens.serve.data.memo import _RUN_MEMO, _stat, metrics_path, run_key, run_version


#: Points per curve sent to the browser; longer curves are min/max-downsampled (spikes survive).
CURVE_POINTS = 2000
#: Prefix of the per-step series derived from the samples table (rewards, lengths).
SAMPLES_PREFIX = "samples/"
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def read_metrics(run: Path) -> pl.DataFrame:
    """``RUN/grpolens/metrics.parquet`` (an empty frame with ``step`` when there is none)."""
    p = metrics_path(run)

    def make() -> pl.DataFrame:
        if not p.is_file():
            return pl.DataFrame({"step": pl.Series([], dtype=pl.Int64)})
        try:
            return pl.read_parquet(p)
        except Exception as e:  # noqa: BLE001 - a damaged file is the user's to fix
            raise fmt.RunFormatError(p, f"unreadable or truncated Parquet file: {e}") from None

    return _RUN_MEMO.get(("metrics", run_key(run), _stat(p)), make)


def _reward_columns(files: list[Path]) -> list[str]:
    cols: set[str] = set()
    for f in files[:1] + files[-1:]:
        try:
            cols |= {n for n in pq.read_schema(fmt.parquet_source(f)).names if n.startswith(fmt.REWARD_PREFIX)}
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
        if fmt.is_remote_run(run):  # objects: the wanted columns of each, through the storage layer
            frames = []
            for f in files:
                pf = pq.ParquetFile(fmt.parquet_source(f))
                frames.append(pl.from_arrow(pf.read(columns=[c for c in want if c in pf.schema_arrow.names])))
            df = pl.concat(frames, how="diagonal_relaxed")
        else:
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

    return _RUN_MEMO.get(("series", run_key(run), run_version(run), with_samples), make)


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


def ema(x: np.ndarray, y: np.ndarray, weight: float) -> np.ndarray:
    """Time-weighted exponential moving average (W&B's default smoothing), by polars.

    ``weight`` is the share of the previous average kept across *one* step, so a gap of ``d`` steps
    keeps ``weight ** d``: a metric logged every other step smooths like one logged every step.
    Non-finite values are skipped (their output is NaN) and do not spread to later points.
    """
    y = np.asarray(y, dtype=np.float64)
    if weight <= 0 or len(y) == 0:
        return y
    # polars wants an integer half-life over an integer ``by`` column: express steps in units of
    # 1e-9 half-lives (fewer only if the steps are huge), so rounding the step gaps moves them by
    # under 1e-9 of a half-life.
    half_life = math.log(0.5) / math.log(weight)
    xf = np.asarray(x, dtype=np.float64)
    top = float(np.abs(xf).max()) / half_life
    scale = int(min(1e9, 2.0 ** 60 / max(top, 1.0)))
    by = np.rint(xf * (scale / half_life)).astype(np.int64)
    d = pl.DataFrame({"by": by, "y": np.where(np.isfinite(y), y, np.nan)})
    out = d.select(pl.col("y").fill_nan(None).ewm_mean_by("by", half_life=f"{scale}i"))["y"]
    return out.cast(pl.Float64).fill_null(float("nan")).to_numpy()


def downsample_minmax(n: int, y: np.ndarray, max_points: int = CURVE_POINTS) -> np.ndarray:
    """Indices to keep so that at most ``max_points`` (plus the two ends) remain: per bucket, its
    min and its max (a one-step spike is never averaged away). Sorted; first and last are always
    kept. Non-finite values are never a bucket's min or max; a bucket holding nothing else keeps
    its first index, so a long NaN stretch still breaks the line.

    The per-bucket argmin/argmax is tsdownsample's (Rust, SIMD): ``benchmarks/bench_serve_libs.py``
    measured it 100x to 1,000x faster than the numpy loop over buckets it replaced."""
    if n <= max_points:
        return np.arange(n)
    from tsdownsample import MinMaxDownsampler

    y = np.asarray(y, dtype=np.float64)
    n_out = max(2, max_points - max_points % 2)  # the library wants an even count: two per bucket
    finite = np.isfinite(y)
    keep = [np.array([0, n - 1])]
    if finite.all():
        keep.append(MinMaxDownsampler().downsample(y, n_out=n_out).astype(np.int64))
    else:
        edges = np.linspace(0, n, n_out // 2 + 1).astype(np.int64)[:-1]
        gaps = edges[np.add.reduceat(finite.astype(np.int64), edges) == 0]  # buckets with no finite value
        keep.append(gaps)
        where = np.flatnonzero(finite)
        room = max(2, n_out - 2 * gaps.size)  # the gaps' points come out of the budget
        if where.size > room:
            keep.append(where[MinMaxDownsampler().downsample(y[where], n_out=room).astype(np.int64)])
        else:
            keep.append(where)
    return np.unique(np.concatenate(keep))


def curve(df: pl.DataFrame, column: str, lo: int | None = None, hi: int | None = None,
          smoothing: float = 0.0, max_points: int = CURVE_POINTS) -> dict[str, np.ndarray]:
    """One curve of one run: ``x`` (steps), ``y`` (raw), ``smooth`` (EMA, or None), downsampled."""
    if column not in df.columns:
        return {"x": np.zeros(0, np.int64), "y": np.zeros(0), "smooth": None}
    # a step where the metric was not logged (null) is dropped, so a metric logged every other step
    # draws as a line; a logged non-finite value stays as NaN and shows as a gap
    d = df.select("step", column).filter(pl.col(column).is_not_null())
    if lo is not None:
        d = d.filter(pl.col("step") >= lo)
    if hi is not None:
        d = d.filter(pl.col("step") <= hi)
    x = d["step"].to_numpy().astype(np.int64)
    y = d[column].cast(pl.Float64).fill_null(float("nan")).to_numpy()
    y = np.where(np.isfinite(y), y, np.nan)
    smooth = ema(x, y, smoothing) if smoothing > 0 else None
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
