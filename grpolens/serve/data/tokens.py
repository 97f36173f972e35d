"""One step's tokens: per-token scores, the top-K table, the step's samples and the run's config."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

from grpolens.functional.estimators import formula
from grpolens.run import format as fmt
from grpolens.errors import UserError
from grpolens.serve.data.memo import _RUN_MEMO, _STEP_MEMO, _stat, _step_fingerprint, run_key


#: Per-token scores (name -> definition shown in the UI). Sequential scores are >= 0.
SCORES = {
    "kl": f"KL to reference, k3 estimator: {formula('k3', 'ref - logp')}",
    "mismatch": "|train - rollout| log-prob: |old_logp - rollout_logp| (old_logp = logp when on-policy)",
    "ratio": f"policy ratio {formula('ratio', 'logp - old_logp')}; ranked by |log ratio|",
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
        from grpolens.functional.estimators import bounded_exp

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

    sel = _STEP_MEMO.get(("top", run_key(run), step, by, _stat(p)), make)
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
