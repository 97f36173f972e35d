"""The dashboard's pages, one module each, and their catalogue.

A page module declares its pages with ``pages(runs=None) -> list[Page]``: each :class:`Page` names
its path and label, the URL keys its view is made of, its layout, its callbacks and the CSV
downloads it offers. Everything else reads this list: the navigation bar and the page containers
(:mod:`grpolens.serve.layout`), which page is shown (:mod:`grpolens.serve.callbacks`), the URL keys
(:mod:`grpolens.serve.urlstate`) and the ``/csv/<what>`` routes (:mod:`grpolens.serve.downloads`).

The curve pages come from the metric families: :mod:`~grpolens.serve.pages.curves` makes one per
page the registry declares (``Family.page``), so a family's curves are drawn as soon as it
registers. Adding any other page is one module here and its name in :data:`PAGE_MODULES`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

#: The page modules, in the navigation bar's order.
PAGE_MODULES = ("runs", "curves", "tokens", "completions", "compare", "findings")


@dataclass(frozen=True)
class Page:
    """One page of the dashboard.

    ``group``: the name of its URL keys (pages with the same view share one, e.g. every curve
    page's is "curves"); ``keys``: those keys, in the order a URL writes them; ``layout(runs)``: its
    container (``id="page-<id>"``); ``register(app, runs)``: its callbacks; ``csv``: download name
    -> ``build(runs, search) -> (file stem, frame)``; ``curve_controls``: whether the header's curve
    controls (smoothing, step range, ...) apply to it.

    A page whose URL holds some of the header's values (the runs, the step range) besides its own
    keys says how, for :func:`grpolens.serve.url_callbacks.sync_header`, which owns the header's
    controls: ``header_search(runs, search, header) -> query``, the page's URL once the header's
    controls changed (``header``: :class:`grpolens.serve.urlsync.Header`); ``header_runs(runs,
    search) -> names or None``, the header's runs as the page's URL sets them (None: as they are).
    Without them the page's URL is its own (the curve pages' keys are the header's).
    """

    path: str
    label: str
    group: str
    keys: tuple[str, ...]
    layout: Callable
    register: Callable | None = None
    csv: dict[str, Callable] = field(default_factory=dict)
    curve_controls: bool = False
    #: the curve page's name ("overview", or the registry's page); None for other pages
    curves: str | None = None
    #: ``lead(runs) -> bool``: the page goes first in the navigation bar for these runs (the
    #: Findings page when a run has a warning or critical finding)
    lead: Callable | None = None
    header_search: Callable | None = None
    header_runs: Callable | None = None

    @property
    def id(self) -> str:
        return "overview" if self.path == "/" else self.path.strip("/")


@lru_cache(maxsize=1)
def all_pages() -> tuple[Page, ...]:
    """Every page, in the navigation bar's order (each module's, in :data:`PAGE_MODULES` order)."""
    out: list[Page] = []
    for name in PAGE_MODULES:
        out += importlib.import_module(f"grpolens.serve.pages.{name}").pages()
    paths = [p.path for p in out]
    dupes = sorted({p for p in paths if paths.count(p) > 1})
    if dupes:
        raise ValueError(f"dashboard pages declared twice: {', '.join(dupes)}")
    return tuple(out)


def nav_order(runs) -> list[Page]:
    """The pages in the navigation bar's order for ``runs``: those that lead for them first."""
    every = all_pages()
    first = [p for p in every if p.lead is not None and p.lead(runs)]
    return first + [p for p in every if p not in first]


def by_path(path: str) -> Page | None:
    return next((p for p in all_pages() if p.path == path), None)


def curve_pages() -> dict[str, str]:
    """Path -> curve page name ("overview", "policy", ...) of every curve page."""
    return {p.path: p.curves for p in all_pages() if p.curves}


def url_keys() -> dict[str, tuple[str, ...]]:
    """URL keys group -> its keys (pages sharing a group declare the same keys)."""
    out: dict[str, tuple[str, ...]] = {}
    for p in all_pages():
        if out.setdefault(p.group, p.keys) != p.keys:
            raise ValueError(f"page {p.path}: URL keys group {p.group!r} declared with other keys elsewhere")
    return out


def group_of_path() -> dict[str, str]:
    return {p.path: p.group for p in all_pages()}


def csv_builders() -> dict[str, Callable]:
    """Download name -> its builder, from every page."""
    out: dict[str, Callable] = {}
    for p in all_pages():
        for what, build in p.csv.items():
            if out.setdefault(what, build) is not build:
                raise ValueError(f"CSV download {what!r} declared by two pages")
    return out
