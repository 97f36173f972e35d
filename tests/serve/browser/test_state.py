"""End-to-end in a browser: what the URL keeps (a page's view, panel log boxes, ticked rows, the
header's runs) survives a reload and the back button; dark mode follows the system, down to the
dropdowns and sliders."""

from __future__ import annotations

from urllib.parse import parse_qs, urlparse

import pytest

from tests.serve.browser.helpers import checked, css, curve_view, go, severe_logs, shot, visible_graphs, wait

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(300)]


def test_url_state_survives_reload_and_back(server, browser):
    """Every page's view lives in its URL: a link opens it, a reload keeps it, back/forward step through."""
    go(browser, server, "/policy?runs=beta&smooth=0.6&y=log&filter=kl&from=3&to=10")
    wait(browser, lambda d: len(visible_graphs(d, "policy")) >= 2, what="policy curves")
    # (a panel with no positive value stays linear on log y)
    view = wait(browser, lambda d: (v := curve_view(d, "policy")) and sum(p[0] == "log" for p in v) >= 2 and v,
                what="log axes from the URL")
    assert all(p[1] == [3, 10] and p[2] == "beta" for p in view), view
    assert checked(browser, "#y-scale input") == ["log"]
    assert css(browser, "#metric-filter")[0].get_attribute("value") == "kl"
    # A control changes the URL (a new history entry) ...
    css(browser, "#y-scale input[value='robust']")[0].click()
    wait(browser, lambda d: "robust" in d.current_url, what="the toggle in the URL")
    url = browser.current_url
    # ... which a reload (or a colleague) opens as it was.
    browser.refresh()
    wait(browser, lambda d: checked(d, "#y-scale input") == ["log", "robust"], what="the toggles after reload")
    wait(browser, lambda d: curve_view(d, "policy") == view, what="the same curves after reload")
    assert browser.current_url == url
    browser.back()
    wait(browser, lambda d: checked(d, "#y-scale input") == ["log"], what="back: robust off again")
    browser.forward()
    wait(browser, lambda d: checked(d, "#y-scale input") == ["log", "robust"], what="forward: robust on")
    # The navigation keeps the curve controls in the URL.
    css(browser, "#nav-overview")[0].click()
    wait(browser, lambda d: urlparse(d.current_url).path == "/", what="the Overview")
    q = parse_qs(urlparse(browser.current_url).query)
    assert q["runs"] == ["beta"] and q["smooth"] == ["0.6"] and q["from"] == ["3"] and q["y"] == ["log,robust"], q

    # Tokens: run, step, sample, ranking, K and colouring.
    go(browser, server, "/tokens?run=beta&step=5&sample=163&by=entropy&k=7&color=mismatch")
    wait(browser, lambda d: len(css(d, "#tok-table tbody tr td")) > 0 and len(css(d, "#completion-tokens .tok")),
         what="tokens")
    wait(browser, lambda d: "beta, step 5" in css(d, "#tok-summary")[0].text and "by entropy" in
         css(d, "#tok-summary")[0].text, what="the top-K of beta step 5 by entropy")
    assert checked(browser, "#tok-by input") == ["entropy"] and checked(browser, "#tok-color input") == ["mismatch"]
    assert css(browser, "#tok-k")[0].get_attribute("value") == "7"
    assert "sample 163" in css(browser, "#tok-completion .summary")[0].text
    css(browser, "#tok-color input[value='kl']")[0].click()
    wait(browser, lambda d: "color=" not in d.current_url, what="colour back to the default, left out of the URL")
    browser.refresh()
    wait(browser, lambda d: checked(d, "#tok-by input") == ["entropy"] and checked(d, "#tok-color input") == ["kl"],
         what="tokens view after reload")

    # Completions: the page of the table.
    go(browser, server, "/completions?run=beta&step=5&page=1")
    wait(browser, lambda d: "page 2 of 2" in css(d, "#comp-summary")[0].text, what="page 2 from the URL")
    css(browser, "#comp-table .previous-page")[0].click()
    wait(browser, lambda d: "page=" not in d.current_url, what="page 1 (the default) in the URL")
    browser.back()
    wait(browser, lambda d: "page 2 of 2" in css(d, "#comp-summary")[0].text, what="back to page 2")

    # Compare: runs A and B and the delta curves.
    go(browser, server, "/compare?a=beta&b=alpha&delta=entropy")
    wait(browser, lambda d: len(css(d, "#cmp-graphs .js-plotly-plot")) == 1, what="one delta curve")
    assert "delta=entropy" in browser.current_url
    shot(browser, "compare-from-url")

    # A hostile link opens the defaults, shows nothing of itself, runs nothing.
    go(browser, server, "/tokens?run=../../etc/passwd&step=nan&k=1e9&by=%3Cscript%3Ealert(1)%3C/script%3E")
    wait(browser, lambda d: len(css(d, "#tok-table tbody tr td")) > 0, what="the default tokens view")
    assert checked(browser, "#tok-by input") == ["kl"]
    assert "passwd" not in browser.find_element("css selector", "body").text
    assert severe_logs(browser) == []


def test_dark_mode_follows_the_system(server, browser):
    """prefers-color-scheme: dark darkens the page and the charts (plotly's inline colours too)."""
    colours = """
        const bg = document.querySelector('#page-overview .js-plotly-plot .bg');
        const txt = document.querySelector('#page-overview .js-plotly-plot .gtitle');
        return [getComputedStyle(document.body).backgroundColor, getComputedStyle(bg).fill,
                getComputedStyle(txt).fill]"""

    def luminance(rgb: str) -> float:
        r, g, b = [int(x) for x in rgb[rgb.index("(") + 1:rgb.index(")")].split(",")[:3]]
        return 0.2126 * r + 0.7152 * g + 0.0722 * b

    try:
        browser.execute_cdp_cmd("Emulation.setEmulatedMedia",
                                {"features": [{"name": "prefers-color-scheme", "value": "dark"}]})
        go(browser, server, "/")
        wait(browser, lambda d: len(visible_graphs(d, "overview")) >= 3, what="overview curves")
        body, plot, text = browser.execute_script(colours)
        assert luminance(body) < 40 and luminance(plot) < 40 and luminance(text) > 150, (body, plot, text)
        shot(browser, "overview-dark")
        go(browser, server, "/compare")
        wait(browser, lambda d: len(css(d, "#cmp-table tbody tr")) > 3, what="comparison table")
        shot(browser, "compare-dark")
    finally:
        browser.execute_cdp_cmd("Emulation.setEmulatedMedia",
                                {"features": [{"name": "prefers-color-scheme", "value": "light"}]})
    go(browser, server, "/")
    wait(browser, lambda d: len(visible_graphs(d, "overview")) >= 3, what="overview curves")
    body, plot, text = browser.execute_script(colours)
    assert luminance(body) > 200 and luminance(plot) > 200 and luminance(text) < 120, (body, plot, text)


def test_panel_log_boxes_ticked_rows_and_header_runs_survive_a_reload(server, browser):
    """The views not kept by the other URL tests: a panel's own log y box, the Runs page's ticked
    rows, and the header's runs while on the Tokens and Completions pages."""
    axis_types = ("return Array.from(document.querySelectorAll('#page-overview .js-plotly-plot'))"
                  ".filter(g => g._fullLayout).map(g => g._fullLayout.yaxis.type)")
    go(browser, server, "/")
    wait(browser, lambda d: len(visible_graphs(d, "overview")) >= 3, what="overview curves")
    wait(browser, lambda d: css(d, "#page-overview .panel-log input")[1].click() or True, what="the second panel's box")
    wait(browser, lambda d: "log=" in d.current_url, what="the panel's log y in the URL")
    browser.refresh()
    after = wait(browser, lambda d: (t := d.execute_script(axis_types)) and "log" in t and t, what="the log panel again")
    assert after[1] == "log" and after.count("log") == 1, after
    assert [i.is_selected() for i in css(browser, "#page-overview .panel-log input")][:2] == [False, True]
    # unticked again: the key leaves the URL
    wait(browser, lambda d: css(d, "#page-overview .panel-log input")[1].click() or True, what="untick it")
    wait(browser, lambda d: "log=" not in d.current_url, what="the key gone")

    # the Runs page: the ticked rows
    go(browser, server, "/runs")
    wait(browser, lambda d: [b.is_selected() for b in css(d, "#runs-table input[type=checkbox]")] == [True, True],
         what="the header's runs ticked")
    wait(browser, lambda d: css(d, "#runs-table input[type=checkbox]")[0].click() or True, what="untick alpha")
    wait(browser, lambda d: "tick=beta" in d.current_url, what="the ticked rows in the URL")
    browser.refresh()
    wait(browser, lambda d: [b.is_selected() for b in css(d, "#runs-table input[type=checkbox]")] == [False, True],
         what="beta alone ticked after a reload")

    # Tokens and Completions: the header's runs
    for page, ready in (("tokens", "#tok-table tbody tr td"), ("completions", "#comp-table tbody tr td")):
        go(browser, server, f"/{page}?run=alpha&step=3&runs=beta")
        wait(browser, lambda d: css(d, ready), what=f"the {page} page")
        header = lambda d: [s.text for s in css(d, "#runs .dash-dropdown-value-item")]  # noqa: E731
        wait(browser, lambda d: header(d) == ["beta"], what="the header's runs from the URL")
        browser.refresh()
        wait(browser, lambda d: header(d) == ["beta"] and css(d, ready), what="the header's runs after a reload")
        assert "runs=beta" in browser.current_url
    # and a change of the header's runs there goes into the URL
    css(browser, "#runs")[0].click()
    option = wait(browser, lambda d: [o for o in css(d, "[role=option]") if o.text.strip() == "alpha"],
                  what="alpha in the header's list")[0]
    option.click()
    wait(browser, lambda d: parse_qs(urlparse(d.current_url).query).get("runs") in (None, ["alpha", "beta"],
                                                                                   ["beta", "alpha"]),
         what="the header's new runs in the Completions URL")
    assert urlparse(browser.current_url).path == "/completions"
    assert severe_logs(browser) == []


def test_dark_mode_reaches_dropdowns_and_sliders(server, browser):
    """Dash's own dropdowns (the box, its open list) and sliders (track, marks) turn dark too."""
    def luminance(rgb: str) -> float:
        r, g, b = [int(float(x)) for x in rgb[rgb.index("(") + 1:rgb.index(")")].split(",")[:3]]
        return 0.2126 * r + 0.7152 * g + 0.0722 * b

    parts = """
        const st = (sel, prop) => { const e = document.querySelector(sel); return e ? getComputedStyle(e)[prop] : null; };
        return {box: st('#runs', 'backgroundColor'), boxText: st('#runs .dash-dropdown-value-item', 'color'),
                list: st('.dash-dropdown-content', 'backgroundColor'), option: st('.dash-dropdown-option', 'color'),
                mark: st('#range .dash-slider-mark, .dash-slider-mark', 'color')}"""
    def open_run_list() -> dict:
        go(browser, server, "/")
        wait(browser, lambda d: len(visible_graphs(d, "overview")) >= 3, what="overview curves")
        css(browser, "#runs")[0].click()
        return wait(browser, lambda d: (p := d.execute_script(parts)) and p["list"] and p, what="the open run list")

    try:
        browser.execute_cdp_cmd("Emulation.setEmulatedMedia",
                                {"features": [{"name": "prefers-color-scheme", "value": "dark"}]})
        got = open_run_list()
        shot(browser, "dropdown-dark")
        assert luminance(got["box"]) < 40 and luminance(got["list"]) < 40, got
        assert luminance(got["boxText"]) > 150 and luminance(got["option"]) > 150 and luminance(got["mark"]) > 150, got
    finally:
        browser.execute_cdp_cmd("Emulation.setEmulatedMedia",
                                {"features": [{"name": "prefers-color-scheme", "value": "light"}]})

    got = open_run_list()
    assert luminance(got["box"]) > 200 and luminance(got["list"]) > 200 and luminance(got["option"]) < 120, got
