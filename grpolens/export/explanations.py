"""The explanation of each flagged step as a tracker table (``grpolens export --explain``).

A step is flagged when a built-in ``grpolens check`` rule fails there (its first failing step);
each is explained against the step before (:func:`grpolens.analysis.explain.explain`) along token
ids, prompts and completions, and every listed key becomes one row: the tracker shows why the
curve it draws moved, next to the curve.
"""

from __future__ import annotations

from typing import Any, Iterable

#: the table's name in the tracker (``grpolens/tables/explanations`` where names are prefixed)
NAME = "explanations"
DIMS = ("token_id", "group", "completion")
COLUMNS = ("step", "rule", "metric", "value", "baseline_steps", "delta", "dimension", "rank", "key", "label",
           "contribution", "share", "mix", "rate", "count", "headline")


def flagged(run) -> list[tuple[str, str, int]]:
    """(rule, metric, first failing step) of every built-in rule the run fails."""
    from grpolens.check.evaluate import FAIL
    from grpolens.check.runner import check

    report = check(run, explain=False)
    return [(o.rule.name, o.metric, int(o.step)) for o in report.outcomes
            if o.status == FAIL and o.step is not None and o.metric != "step"]


def rows(run, steps: Iterable[int] | None = None, top: int = 5) -> list[dict[str, Any]]:
    """One row per listed key of each flagged step's explanation (only ``steps``, when given)."""
    from grpolens.analysis.explain import explain

    keep = None if steps is None else set(steps)
    out = []
    for rule, metric, step in flagged(run):
        if keep is not None and step not in keep:
            continue
        e = explain(run, metric, step, by=DIMS, top=top)
        head = {"step": step, "rule": rule, "metric": metric, "value": e.value,
                "baseline_steps": ",".join(map(str, e.baseline_steps)), "delta": e.delta, "headline": e.headline()}
        if not e.by:
            out.append({**head, "label": e.note})
        for dim, entries in e.by.items():
            for i, x in enumerate(entries, 1):
                out.append({**head, "dimension": dim, "rank": i, "key": str(x["key"]), "label": str(x["label"]),
                            **{k: x[k] for k in ("contribution", "share", "mix", "rate", "count")}})
    return out


def table(run, steps: Iterable[int] | None = None):
    """:func:`rows` as a polars DataFrame in :data:`COLUMNS` order, or None when nothing is flagged."""
    import polars as pl

    r = rows(run, steps)
    if not r:
        return None
    schema = {c: (pl.Int64 if c in ("step", "rank", "count") else pl.Float64
                  if c in ("value", "delta", "contribution", "share", "mix", "rate") else pl.Utf8) for c in COLUMNS}
    return pl.DataFrame([{c: x.get(c) for c in COLUMNS} for x in r], schema=schema)
