"""The dashboard's view as a URL query, and back: what a copied link carries.

Every page keeps its view in the query string of its URL (the page itself is the path), so a
reload, a bookmark or a link sent to a colleague reopens the same view, and the browser's back and
forward buttons step through the views. Only values that differ from the page's defaults are
written, so a key that is absent means "the default".

The query comes from whoever typed or sent the link: :func:`decode` treats it as hostile. A run
must be one the server was started with, numbers must be finite and in range, choices must be
among the page's own, free text is cut to a bounded length with control characters removed, and
anything else is dropped (the default applies). :func:`encode` escapes every value
(``urllib.parse.urlencode``), so ``&``, ``=``, ``#`` or ``<`` in a run name or a filter cannot
change the query's structure.

The checks are pure functions (no Dash); which keys each page has is declared by the page modules
(:mod:`grpolens.serve.pages`), and :mod:`grpolens.serve.url_callbacks` wires both to the pages.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Mapping
from urllib.parse import parse_qs, urlencode

class _FromPages(Mapping):
    """A table the page modules declare (:mod:`grpolens.serve.pages`), built on first use (the
    pages import this module, so it cannot import them first)."""

    def __init__(self, build):
        self._build, self._table = build, None

    def _get(self) -> dict:
        if self._table is None:
            self._table = self._build()
        return self._table

    def __getitem__(self, key):
        return self._get()[key]

    def __iter__(self):
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


def _pages():
    from grpolens.serve import pages

    return pages


#: The page groups and, for each, the query keys its view is made of (in the order written), as
#: each page declares them: Overview and the other curve pages share the header's curve controls
#: (``log``/``lin``: the panels whose own "log y" box differs from the header's); ``runs`` on the
#: Tokens and Completions pages: the header's selection, kept while one looks at them; ``tick``
#: on the Runs page: the rows ticked for an overlay.
KEYS: Mapping[str, tuple[str, ...]] = _FromPages(lambda: _pages().url_keys())
#: URL path -> page group.
GROUP_OF_PATH: Mapping[str, str] = _FromPages(lambda: _pages().group_of_path())

#: Bounds of what a query may ask for.
MAX_TEXT = 200  # metric filter words, completions filter query
MAX_RUNS = 64
MAX_DELTA = 12  # the Compare page draws at most 12 delta curves
MAX_PANELS = 64  # panels with their own log y box set
MAX_SORT = 8
MAX_INT = 10**12
MAX_TOP_K = 500
SMOOTH_MAX = 0.99
Y_OPTIONS = ("log", "robust")
YES_NO = ("any", "yes", "no")
#: Metric and column names: no spaces, quotes or markup.
METRIC_NAME = re.compile(r"^[\w/.:@+\-]{1,160}$")
_METRIC = METRIC_NAME
#: Characters of a query read at all (a longer one is ignored whole: no view needs 16 kB).
MAX_QUERY = 16384
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def parse_query(search: str | None) -> dict[str, list[str]]:
    """``?a=1&a=2&b=`` -> ``{"a": ["1", "2"]}`` (blank values dropped); a query of more fields
    than any view has (200), or longer than :data:`MAX_QUERY`, or not text, is ignored whole: the
    page opens on its defaults."""
    if search is not None and (not isinstance(search, str) or len(search) > MAX_QUERY):
        return {}
    try:
        return parse_qs((search or "").lstrip("?"), keep_blank_values=False, max_num_fields=200)
    except ValueError:
        return {}


def _last(q: dict[str, list[str]], key: str) -> str | None:
    v = q.get(key)
    return v[-1] if v else None


def as_int(value: Any) -> int | None:
    """A control's value as a whole number (None when empty or not finite; fractions cut)."""
    try:
        if value is None or value == "":
            return None
        f = float(value)
        return int(f) if math.isfinite(f) else None
    except (TypeError, ValueError):
        return None


def _int(text: str | None, lo: int = 0, hi: int = MAX_INT) -> int | None:
    """A whole number in ``[lo, hi]``, or None ("12", "12.0" pass; "nan", "1e400", "3.5" do not)."""
    if text is None or len(text) > 24:
        return None
    try:
        f = float(text)
    except ValueError:
        return None
    if not math.isfinite(f) or f != int(f) or not lo <= f <= hi:
        return None
    return int(f)


def _float(text: str | None, lo: float, hi: float) -> float | None:
    if text is None or len(text) > 24:
        return None
    try:
        f = float(text)
    except ValueError:
        return None
    return min(max(f, lo), hi) if math.isfinite(f) else None


def _text(text: str | None) -> str | None:
    if text is None:
        return None
    text = _CONTROL.sub("", text)[:MAX_TEXT].strip()
    return text or None


def _choice(text: str | None, allowed: Iterable[str]) -> str | None:
    return text if text in tuple(allowed) else None


def _sort(values: list[str]) -> list[dict] | None:
    """``["kl_max:asc", "reward:desc"]`` -> the DataTable's ``sort_by``."""
    out = []
    for v in values[:MAX_SORT]:
        col, _, direction = v.rpartition(":")
        if direction in ("asc", "desc") and _METRIC.match(col) and col not in [s["column_id"] for s in out]:
            out.append({"column_id": col, "direction": direction})
    return out or None


def decode(group: str, search: str | None, run_names: Iterable[str], choices: dict[str, Iterable[str]] | None = None
           ) -> dict[str, Any]:
    """The valid values of ``group``'s keys in the query ``search``; a key absent from the result
    was absent or refused (the default applies). ``choices``: allowed values of the ``by`` and
    ``color`` keys (the Tokens page's scores)."""
    q = parse_query(search)
    names = list(run_names)
    choices = choices or {}
    out: dict[str, Any] = {}
    for key in KEYS[group]:
        if key not in q:
            continue
        raw = _last(q, key)
        value: Any = None
        if key in ("runs", "tick"):
            picked = []
            for v in q[key][:MAX_RUNS]:
                if v in names and v not in picked:
                    picked.append(v)
            value = picked or None
        elif key in ("run", "a", "b"):
            value = raw if raw in names else None
        elif key in ("step", "sample", "pos", "group", "from", "to"):
            value = _int(raw)
        elif key == "rank":
            value = _int(raw, lo=1)
        elif key == "page":
            value = _int(raw, hi=10**6)
        elif key == "k":
            value = _int(raw, lo=1, hi=MAX_TOP_K)
        elif key == "smooth":
            value = _float(raw, 0.0, SMOOTH_MAX)
            value = None if value is None else round(value, 2)
        elif key in ("filter", "where"):
            value = _text(raw)
        elif key == "y":
            value = [o for o in Y_OPTIONS if o in {p for v in q[key] for p in v.split(",")}]
        elif key == "baseline":
            value = _choice(raw, ("on", "off"))
        elif key in ("truncated", "vetoed"):
            value = _choice(raw, YES_NO)
        elif key in ("by", "color"):
            value = _choice(raw, choices.get(key, ()))
        elif key == "why":  # the metric the Tokens page's Why panel explains
            value = raw if raw is not None and _METRIC.match(raw) else None
        elif key in ("delta", "log", "lin"):
            picked = []
            for v in q[key][:MAX_DELTA if key == "delta" else MAX_PANELS]:
                if _METRIC.match(v) and v not in picked:
                    picked.append(v)
            value = picked or None
        elif key == "sort":
            value = _sort(q[key])
        if value is not None:
            out[key] = value
    if "from" in out and "to" in out and out["from"] > out["to"]:
        del out["from"], out["to"]
    both = set(out.get("log", ())) & set(out.get("lin", ()))
    for key in ("log", "lin"):  # a panel named in both says nothing: the header's choice applies
        if both and key in out:
            out[key] = [m for m in out[key] if m not in both] or None
            if out[key] is None:
                del out[key]
    return out


def _as_query_values(key: str, value: Any) -> list[str]:
    if isinstance(value, bool):
        return ["on" if value else "off"]
    if key == "sort":
        return [f"{s['column_id']}:{s['direction']}" for s in value]
    if key == "y":
        return [",".join(o for o in Y_OPTIONS if o in value)] if value else []
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    if isinstance(value, float):
        return [f"{value:.2f}".rstrip("0").rstrip(".") or "0"]
    return [str(value)]


def encode(group: str, state: dict[str, Any], defaults: dict[str, Any] | None = None) -> str:
    """The query for ``state`` (``"?k=v&..."``, or ``""``): ``group``'s keys in a fixed order,
    those equal to their default (or None, or empty) left out, every value escaped."""
    defaults = defaults or {}
    pairs: list[tuple[str, str]] = []
    for key in KEYS[group]:
        value = state.get(key)
        if value is None or value == "" or value == [] or value == defaults.get(key, _MISSING):
            continue
        pairs += [(key, v) for v in _as_query_values(key, value)]
    return "?" + urlencode(pairs) if pairs else ""


_MISSING = object()
