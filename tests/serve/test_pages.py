"""The page catalogue (issue #29): a dashboard page is one module, and the navigation, the page
containers, page switching, the URL keys and the CSV routes all follow the list of pages; every
page a metric family declares is drawn."""

from __future__ import annotations

import sys
import types

import pytest
from dash import dcc, html

from grpolens.serve import pages, urlstate
from grpolens.serve.app import create_app
from tests.serve.test_callbacks import graphs, walk


def test_every_family_page_has_a_route():
    """A family declares the page its curves go on; a page no route shows would hide them (the
    ``health`` page was declared and never drawn)."""
    from grpolens.metrics.registry import FAMILIES, PAGES
    from grpolens.plugins import load_plugins

    load_plugins()
    routes = pages.curve_pages()
    shown = set(routes.values())
    missing = sorted({f.page for f in FAMILIES.values()} - shown)
    assert not missing, f"families' pages with no dashboard route: {missing}"
    assert set(PAGES) <= shown and routes["/"] == "overview"
    for page in PAGES:
        assert routes[f"/{page}"] == page


def test_health_page_draws_the_health_family(runset):
    keys = [g.id["key"] for g in graphs(pages.curves.curve_page_children(runset, "health", ["alpha"]))]
    assert "health:health/masked_tokens" in keys and "health:health/nonfinite/logp" in keys
    assert all(k.startswith("health:health/") for k in keys)


def test_catalogue_is_consistent():
    every = pages.all_pages()
    assert [p.path for p in every][:2] == ["/runs", "/"]
    assert len({p.path for p in every}) == len(every) and len({p.id for p in every}) == len(every)
    assert dict(urlstate.GROUP_OF_PATH) == {p.path: p.group for p in every}
    assert set(urlstate.KEYS) == {p.group for p in every}
    assert set(pages.csv_builders()) == {"runs", "curve", "band", "is_hist", "is_step", "sweep", "tokens",
                                         "completion", "completions", "compare", "delta", "findings"}


def test_layout_has_a_container_and_a_link_per_page(runset):
    app = create_app(runset)
    ids = {getattr(c, "id", None) for c in walk(app.layout) if isinstance(getattr(c, "id", None), str)}
    for p in pages.all_pages():
        assert f"page-{p.id}" in ids and f"nav-{p.id}" in ids, p.path
    nav = next(c for c in walk(app.layout) if isinstance(c, html.Nav))
    assert all(isinstance(c, dcc.Link) for c in nav.children)
    assert [(c.href, c.children) for c in nav.children] == [(p.path, p.label) for p in pages.nav_order(runset)]
    assert sorted(c.href for c in nav.children) == sorted(p.path for p in pages.all_pages())


@pytest.fixture
def extra_page(monkeypatch):
    """A page module added to the catalogue the way a contributor would: one module, one name."""
    mod = types.ModuleType("grpolens.serve.pages.hello")

    def layout(runs):
        return html.Div([html.Div(id="hello-text")], id="page-hello", className="page")

    def register(app, runs):
        from dash import Input, Output, no_update

        @app.callback(Output("hello-text", "children"), Input("url", "pathname"))
        def hello(pathname):
            return f"{len(runs.names)} runs" if pathname == "/hello" else no_update

    def csv(runs, search):
        import polars as pl

        return "hello", pl.DataFrame({"run": runs.names})

    mod.pages = lambda: [pages.Page("/hello", "Hello", "hello", ("run",), layout, register, csv={"hello": csv})]
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(pages, "PAGE_MODULES", (*pages.PAGE_MODULES, "hello"))
    pages.all_pages.cache_clear()
    urlstate.KEYS._table = urlstate.GROUP_OF_PATH._table = None
    yield mod
    pages.all_pages.cache_clear()
    urlstate.KEYS._table = urlstate.GROUP_OF_PATH._table = None


def test_a_page_is_one_module(runset, extra_page):
    app = create_app(runset)
    client = app.server.test_client()
    ids = {getattr(c, "id", None) for c in walk(app.layout)}
    assert {"page-hello", "nav-hello", "hello-text"} <= ids
    assert urlstate.GROUP_OF_PATH["/hello"] == "hello" and urlstate.KEYS["hello"] == ("run",)
    r = client.get("/csv/hello")
    assert r.status_code == 200 and r.data.decode().splitlines() == ["run", "alpha", "beta"]
    show = next(cb for cb in app._callback_list if "page-hello.style" in cb["output"])
    outs = [{"id": o.rsplit(".", 1)[0], "property": o.rsplit(".", 1)[1]} for o in show["output"][2:-2].split("...")]
    body = {"output": show["output"], "outputs": outs, "inputs": [{"id": "url", "property": "pathname",
                                                                   "value": "/hello"}], "state": [],
            "changedPropIds": ["url.pathname"]}
    resp = client.post("/_dash-update-component", json=body).get_json()["response"]
    assert resp["page-hello"]["style"] == {} and resp["page-runs"]["style"] == {"display": "none"}
    assert resp["nav-hello"]["className"] == "nav-link active"
    assert resp["curve-controls"]["style"] == {"display": "none"}


def test_a_page_keeps_the_headers_values_in_its_url_through_its_own_hooks(runset, extra_page, monkeypatch):
    """The header's callback knows no page but the curve pages: a page whose URL holds the header's
    values says how (``Page.header_search``, ``Page.header_runs``), and one added in a test is kept
    in step with no other edit; a page without them keeps its URL as it is."""
    import dataclasses

    from tests.serve.test_callback_inputs import initial_values, post

    calls = []

    def header_search(runs, search, header):
        calls.append((search, header.runs, header.smoothing))
        return "?run=" + "+".join(header.runs)

    def header_runs(runs, search):
        return ["beta"] if search == "?run=beta" else None

    plain = extra_page.pages()[0]
    app = create_app(runset)
    sync = next(cb for cb in app._callback_list if "runs.value" in cb["output"] and "url.search" in cb["output"])
    values = {**initial_values(app), ("url", "pathname"): "/hello", ("url", "search"): "?run=alpha",
              ("runs", "value"): ["alpha"], ("smoothing", "value"): 0.5}
    got = post(app.server.test_client(), sync, values, ["smoothing.value"]).get_json()["response"]
    assert "url" not in got  # no hooks: the page's URL is its own

    hooked = dataclasses.replace(plain, header_search=header_search, header_runs=header_runs)
    monkeypatch.setattr(extra_page, "pages", lambda: [hooked])
    pages.all_pages.cache_clear()
    app = create_app(runset)
    client = app.server.test_client()
    got = post(client, sync, {**values, ("runs", "value"): ["alpha", "beta"]}, ["runs.value"]).get_json()["response"]
    assert got["url"]["search"] == "?run=alpha+beta" and calls == [("?run=alpha", ["alpha", "beta"], 0.5)]
    got = post(client, sync, values, ["smoothing.value"]).get_json()["response"]
    assert "url" not in got  # the hook's URL is the one on screen: nothing to write
    got = post(client, sync, {**values, ("url", "search"): "?run=beta"}, ["url.search"]).get_json()["response"]
    assert got["runs"]["value"] == ["beta"]  # the URL sets the header's runs
    got = post(client, sync, values, ["url.search"]).get_json()["response"]
    assert "runs" not in got  # a URL without them leaves the header as it is
