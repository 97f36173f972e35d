"""End-to-end: a run's what-if variant (``recompute --set``) in the dashboard, in headless Chromium:
listed as a run of its own, overlaid on the curves, on the Runs page with its overrides, and in
Compare. Its own server (one run and its variant); the package's browser."""

from __future__ import annotations

import threading

import pytest

from tests.serve.browser.helpers import css, curve_view, go, severe_logs, shot, visible_graphs, wait

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(300)]

VARIANT = "gamma @ epsilon=0.05"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import logging

    from werkzeug.serving import make_server

    import grpolens
    from grpolens.adapters.synth import synth_run
    from grpolens.serve.app import create_app

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    root = tmp_path_factory.mktemp("variant-serve")
    run = synth_run(root / "gamma", seed=2, steps=6, ranks=1, groups=2, generations=4, max_len=24, texts=True)
    grpolens.recompute(run)
    grpolens.recompute(run, overrides={"epsilon": 0.05})
    app = create_app([root])
    srv = make_server("127.0.0.1", 0, app.server, threaded=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.port}"
    srv.shutdown()


def test_variant_is_selectable_and_overlays_its_run(server, browser):
    from grpolens.serve import urlstate

    go(browser, server, "/")
    wait(browser, lambda d: visible_graphs(d, "overview"), what="overview curves")
    # the run alone by default; its variant is one of the header's options
    view = curve_view(browser, "overview")
    assert view and all(p[2] == "gamma" for p in view), view
    css(browser, "#runs")[0].click()  # the header's run list, as a user adds a run to the view
    option = wait(browser, lambda d: [o for o in css(d, "[role=option]") if VARIANT in o.text],
                  what="the variant among the header's runs")[0]
    option.click()
    view = wait(browser, lambda d: (v := curve_view(d, "overview")) and any(p[2] == f"gamma,{VARIANT}" for p in v) and v,
                what="the variant's curves overlaid on its run's")
    wait(browser, lambda d: "epsilon" in d.current_url, what="the selection in the URL")
    # a link overlays both too (the Runs page makes such links)
    go(browser, server, "/policy" + urlstate.encode("curves", {"runs": ["gamma", VARIANT]}))
    wait(browser, lambda d: (v := curve_view(d, "policy")) and any(p[2] == f"gamma,{VARIANT}" for p in v),
         what="the overlay from a link")
    shot(browser, "variant-overlay")
    browser.refresh()  # the overlay survives a reload
    wait(browser, lambda d: (v := curve_view(d, "policy")) and any(p[2] == f"gamma,{VARIANT}" for p in v),
         what="the overlay after a reload")
    assert severe_logs(browser) == []


def test_variant_on_the_runs_page_and_in_compare(server, browser):
    go(browser, server, "/runs")
    wait(browser, lambda d: len(css(d, "#runs-table input[type=checkbox]")) == 2, what="the run and its variant")
    cells = wait(browser, lambda d: [td.text for td in css(d, "#runs-table td[data-dash-column=variant]")],
                 what="the variant column")
    assert "epsilon=0.05" in cells
    eps = [td.text for td in css(browser, "#runs-table td[data-dash-column='config.epsilon']")]
    assert sorted(float(x) for x in eps) == [0.05, 0.2], eps
    go(browser, server, "/compare")  # its default: the first run against the next, here the variant
    wait(browser, lambda d: len(css(d, "#cmp-table tbody tr")) > 1, what="the comparison table")
    first = [td.text for td in css(browser, "#cmp-table tbody tr td")][:1]
    assert first and first[0].startswith(("clip/", "loss", "policy/", "ratio")), first  # the clip range differs
    shot(browser, "variant-compare")
    assert severe_logs(browser) == []
