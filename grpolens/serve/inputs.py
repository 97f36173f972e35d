"""Every value a callback receives from the browser, checked where it arrives.

A callback's inputs are whatever the request says: a page's script can be replaced, and a
request can be written by hand (``curl -d '{"inputs": ...}' /_dash-update-component``). The
URL's query is checked by :mod:`grpolens.serve.urlstate`; this module does the same for the
callbacks' own inputs, so that no input can make one request costly (a run list of 20,000
entries, a filter of 1,000 clauses, 20,000 sort keys) or fail inside the server (``1e300`` as
a step, a string where a number goes, a dict where a list goes).

Two flavours per kind of value:

* the strict ones (:func:`step`, :func:`run_names`, :func:`filter_query`, ...) raise
  :class:`BadInput`, a :class:`~grpolens.errors.UserError` whose one-line message the page shows
  in its error box (the renderers);
* the lenient ones (:func:`whole_or_none`) turn a bad value into ``None``, the default (the
  callbacks that only write the URL: a bad value is left out of it, and the page that renders it
  says what is wrong).

The bounds are :data:`BOUNDS` (whole numbers) and the ``MAX_*`` constants; the tests move each by
one.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable

from grpolens.errors import UserError
from grpolens.serve import urlstate

#: Whole-number inputs: name -> (smallest, largest) accepted. Steps and ranks follow the run
#: format's folder names (8 and 5 digits); ids and positions fit int64; a page of completions
#: is at most 200 rows and the top-K table 500.
BOUNDS: dict[str, tuple[int, int]] = {
    "step": (0, 10**8 - 1),
    "sample": (0, 2**63 - 1),
    "pos": (0, 2**31 - 1),
    "group": (0, 2**63 - 1),
    "rank": (1, 2**31 - 1),  # "reward rank <=": 1 is the best completion of a group
    "page": (0, 10**6),
    "page size": (1, 200),
    "top": (1, urlstate.MAX_TOP_K),
}
#: Runs one request may name (the header's selection, the Runs page's ticks): as the URL's.
MAX_RUNS = urlstate.MAX_RUNS
#: Characters of free text (the metric filter, a table's filter row): as the URL's.
MAX_TEXT = urlstate.MAX_TEXT
#: ``&&``-joined clauses of a table's filter row (each becomes a polars expression; 1,000 of them
#: cost half a minute of CPU).
MAX_CLAUSES = 8
#: Sort keys of a table (one stable sort each).
MAX_SORT = urlstate.MAX_SORT
#: Metrics chosen for the Compare page's delta curves.
MAX_DELTA = urlstate.MAX_DELTA
#: Entries of a list the server made and the browser sends back (the panels' log y boxes, the
#: points of a click, the selected rows of a table).
MAX_ITEMS = 256
#: Characters of any other string input (a page path, a row id, a choice).
MAX_SHORT = 300

_METRIC = urlstate.METRIC_NAME
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class BadInput(UserError):
    """A callback input out of its bounds; the page shows the message."""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _number(value: Any) -> float | None:
    """``value`` as a finite float, or None (not a number, or infinite/NaN, or a long string)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return float(value) if abs(value) < 2**64 else None
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str) and len(value) <= 32:
        try:
            f = float(value)
        except ValueError:
            return None
        return f if math.isfinite(f) else None
    return None


def whole(value: Any, what: str) -> int | None:
    """A whole-number input within ``BOUNDS[what]`` (``None``/``""`` -> None); :class:`BadInput`
    with the bounds for anything else (``1e300``, ``-1``, ``2.5``, ``"abc"``, a list)."""
    if value is None or value == "":
        return None
    lo, hi = BOUNDS[what]
    if isinstance(value, int) and not isinstance(value, bool):
        ok = lo <= value <= hi
        n = value
    else:
        f = _number(value)
        ok = f is not None and f == int(f) and lo <= int(f) <= hi
        n = int(f) if ok else 0
    if not ok:
        raise BadInput(f"{what} must be a whole number in {lo:,}..{hi:,}, got {_shown(value)}")
    return n


def whole_or_none(value: Any, what: str) -> int | None:
    """:func:`whole`, with ``None`` for a bad value (callbacks that only write the URL)."""
    try:
        return whole(value, what)
    except BadInput:
        return None


def index(value: Any, n: int) -> int | None:
    """A position in a list of ``n`` (a point's run index): None unless a whole number in 0..n-1."""
    f = _number(value)
    return int(f) if f is not None and f == int(f) and 0 <= f < n else None


def row_indices(value: Any, n: int) -> list[int]:
    """A table's selected rows: the valid indices among at most :data:`MAX_ITEMS`, sorted, once each."""
    try:
        given = items(value, "selected rows")
    except BadInput:
        return []
    return sorted({i for i in (index(v, n) for v in given) if i is not None})


def clamped(value: Any, what: str, default: int) -> int:
    """A whole number clamped into ``BOUNDS[what]`` (``default`` when missing or not a number):
    the controls that clamp rather than refuse (the top-K count, the page size)."""
    lo, hi = BOUNDS[what]
    f = _number(value)
    return default if f is None else int(min(max(f, lo), hi))


def smoothing(value: Any) -> float:
    """The smoothing slider: a number clamped into 0..0.99 (0 when missing)."""
    if value is None or value == "":
        return 0.0
    f = _number(value)
    if f is None:
        raise BadInput(f"smoothing must be a number in 0..{urlstate.SMOOTH_MAX}, got {_shown(value)}")
    return min(max(f, 0.0), urlstate.SMOOTH_MAX)


def step_range(value: Any) -> tuple[int | None, int | None]:
    """The step slider's ``[from, to]`` (None, or a list of two steps)."""
    if value is None or value == []:
        return None, None
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise BadInput(f"step range must be [from, to], got {_shown(value)}")
    return whole(value[0], "step"), whole(value[1], "step")


def text(value: Any, what: str, limit: int = MAX_TEXT) -> str | None:
    """Free text of at most ``limit`` characters, control characters removed (None when blank)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadInput(f"{what} must be text, got {_shown(value)}")
    if len(value) > limit:
        raise BadInput(f"{what} is {len(value):,} characters long; at most {limit} are accepted")
    value = _CONTROL.sub("", value).strip()
    return value or None


def filter_query(value: Any, what: str = "table filter") -> str | None:
    """A DataTable's filter row (``{col} op value`` clauses joined by ``&&``): bounded text of at
    most :data:`MAX_CLAUSES` clauses."""
    q = text(value, what)
    if q is not None:
        check_clauses(q, what)
    return q


def check_clauses(query: str, what: str = "table filter") -> None:
    n = query.count("&&") + 1
    if n > MAX_CLAUSES:
        raise BadInput(f"{what} has {n} clauses; at most {MAX_CLAUSES} are accepted")


def _list(value: Any, what: str, limit: int) -> list:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise BadInput(f"{what} must be a list, got {_shown(value)}")
    if len(value) > limit:
        raise BadInput(f"{what}: {len(value):,} entries; at most {limit} are accepted")
    return list(value)


def run_names(runs, value: Any, what: str = "runs") -> list[str]:
    """The header's run selection: a list of at most :data:`MAX_RUNS` served runs (one name is a
    list of one), duplicates dropped; an unknown name is refused by the run allow-list."""
    names = [value] if isinstance(value, str) else _list(value, what, MAX_RUNS)
    out: list[str] = []
    for n in names:
        runs.path(n)  # UnknownRun for anything but a served run
        if n not in out:
            out.append(n)
    return out


def run_names_or_none(runs, value: Any) -> list[str] | None:
    """The header's runs for a link; None (the link's default) when they are not valid."""
    try:
        return run_names(runs, value) or None
    except UserError:
        return None


def run_name(runs, value: Any) -> str:
    runs.path(value)
    return value


def choice(value: Any, allowed: Iterable[str], default: str) -> str:
    """One of ``allowed``; ``default`` for anything else (the radio buttons' values)."""
    return value if isinstance(value, str) and value in tuple(allowed) else default


def choices(value: Any, allowed: Iterable[str], what: str) -> list[str]:
    """The ticked values of a checklist, restricted to ``allowed``."""
    allowed = tuple(allowed)
    return [v for v in _list(value, what, len(allowed) * 2) if isinstance(v, str) and v in allowed]


def metric_names(value: Any, what: str, limit: int = MAX_DELTA) -> list[str]:
    """Metric names (the Compare page's delta curves): at most ``limit``, each a metric-like name."""
    out: list[str] = []
    for m in _list(value, what, limit):
        if not isinstance(m, str) or not _METRIC.match(m):
            raise BadInput(f"{what}: {_shown(m)} is not a metric name")
        if m not in out:
            out.append(m)
    return out


def sort_by(value: Any, what: str = "table sort") -> list[dict]:
    """A DataTable's ``sort_by``: at most :data:`MAX_SORT` ``{"column_id", "direction"}`` entries."""
    out: list[dict] = []
    for s in _list(value, what, MAX_SORT):
        col = s.get("column_id") if isinstance(s, dict) else None
        direction = s.get("direction") if isinstance(s, dict) else None
        if not isinstance(col, str) or not _METRIC.match(col) or direction not in ("asc", "desc"):
            raise BadInput(f"{what}: {_shown(s)} is not a column and a direction (asc or desc)")
        out.append({"column_id": col, "direction": direction})
    return out


def items(value: Any, what: str) -> list:
    """A list the server made and the browser sends back (bounded by :data:`MAX_ITEMS`)."""
    return _list(value, what, MAX_ITEMS)


def short(value: Any, what: str) -> str | None:
    """A short string input (a page path, a row id); None when missing or not a short string."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    return value if isinstance(value, str) and len(value) <= MAX_SHORT else None


def pathname(value: Any) -> str:
    """The page path of ``dcc.Location`` ("/" for anything that is not a short string)."""
    return short(value, "path") or "/"
