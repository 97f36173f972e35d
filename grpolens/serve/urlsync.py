"""Helpers of the callbacks that keep a page's view and its URL in step (see
:mod:`grpolens.serve.url_callbacks` for how the two directions are kept from chasing each other)."""

from __future__ import annotations

from dash import ctx, no_update

from grpolens.errors import UserError
from grpolens.serve import inputs


def url_triggered() -> bool:
    """True on the first call and when the URL (path or query) changed, not a control."""
    return not ctx.triggered_id or ctx.triggered_id == "url"


def same(new, old):
    return no_update if new == old else new


def lenient(check, value, default):
    """``check(value)``, or ``default`` when the value is out of bounds (see :mod:`grpolens.serve.inputs`)."""
    try:
        return check(value)
    except UserError:
        return default


def range_list(value) -> list[int]:
    lo, hi = inputs.step_range(value)
    if lo is None or hi is None:
        raise inputs.BadInput("step range: two steps")
    return [lo, hi]


def range_state(rng, lo, hi) -> dict[str, int]:
    """``from``/``to`` of the step range, each only when narrower than the runs' steps."""
    out: dict[str, int] = {}
    if rng and len(rng) == 2 and lo is not None and hi is not None:
        if rng[0] is not None and rng[0] > lo:
            out["from"] = int(rng[0])
        if rng[1] is not None and rng[1] < hi:
            out["to"] = int(rng[1])
    return out
