"""The completions table of one step: its rows, filter queries, paging, one completion, the token
decoder and the score scales of the colouring."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import polars as pl

from grpolens.run import format as fmt
from grpolens.errors import UserError
from grpolens.serve.data.memo import _RUN_MEMO, _STEP_MEMO, _stat, _step_fingerprint, run_key
from grpolens.serve.data.tokens import DIVERGING, _run_config, step_samples, step_tokens


#: Columns of the completions table, in display order (the sidecar table's names, see
#: :mod:`grpolens.analysis.sidecars`); ``reward/<name>`` columns follow ``reward_total``. Text
#: first: what a completion says is read before its numbers.
COMPLETION_COLUMNS = ("sample_id", "prompt", "completion", "rank", "group_id", "reward_rank_desc", "reward_total",
                      "advantage", "completion_len", "truncated", "tokens", "masked_tokens", "kl_mean", "kl_max",
                      "mismatch_mean", "is_weight_max", "entropy_mean", "clip_frac", "is_vetoed")
_AFTER_REWARDS = COMPLETION_COLUMNS.index("reward_total") + 1
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
        order = [c for c in COMPLETION_COLUMNS[:_AFTER_REWARDS] if c in out.columns] + rewards + \
                [c for c in COMPLETION_COLUMNS[_AFTER_REWARDS:] if c in out.columns]
        out = out.select(order)
        for c in ("prompt", "completion"):
            if c in out.columns:
                out = out.with_columns(pl.col(c).str.slice(0, PREVIEW_CHARS))
        return out.sort("sample_id")

    key = ("seqtable", run_key(run), step, _step_fingerprint(run, step), _stat(completions_file(run)))
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
    from grpolens.serve.inputs import check_clauses

    check_clauses(query)  # each clause is an expression: a thousand of them cost half a minute
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
    if not row and toks.height:  # trained at this step, generated at an earlier one (rollout reuse)
        from grpolens.analysis.sidecars import generating_samples

        for _, gen, _found in generating_samples(run, step, [sample_id]):
            row = gen.filter(pl.col("sample_id") == sample_id).to_dicts()
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
