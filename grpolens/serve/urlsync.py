"""Helpers of the callbacks that keep a page's view and its URL in step (see
:mod:`grpolens.serve.url_callbacks` for how the two directions are kept from chasing each other)."""

from __future__ import annotations

from typing import Any, NamedTuple

from dash import ctx, no_update

from grpolens.errors import UserError
from grpolens.serve import inputs, urlstate


class Header(NamedTuple):
    """The header's controls as a page's URL hook gets them, each already bounded."""

    runs: list[str] | None
    smoothing: float
    bounds: dict[str, int]  # the step range's from/to where narrower than the runs' steps (range_state)
    pattern: str | None
    y_scale: list[str]
    baseline: list[str]


def has_step_range(group: str | None) -> bool:
    """Whether the URL keys ``group`` hold the header's step range (``from``/``to``)."""
    return "from" in urlstate.KEYS.get(group or "", ())


def header_runs_hooks(group: str, defaults: dict[str, Any], choices: dict | None = None):
    """``(header_search, header_runs)``, the :class:`~grpolens.serve.pages.Page` hooks of a page
    whose URL carries the header's runs (key ``runs``, left out when the default selection) beside
    its own keys (``defaults``: theirs; ``choices``: see :func:`urlstate.decode`)."""

    def header_search(runs, search: str | None, header: Header) -> str:
        from grpolens.serve.layout import default_runs

        kept = urlstate.decode(group, search, runs.names, choices)
        kept["runs"] = list(header.runs or [])
        return urlstate.encode(group, kept, {**defaults, "runs": default_runs(runs)})

    def header_runs(runs, search: str | None) -> list[str] | None:
        # a link without the key (a row's, a point's) leaves the header as it is
        return urlstate.decode(group, search, runs.names, choices).get("runs")

    return header_search, header_runs


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
