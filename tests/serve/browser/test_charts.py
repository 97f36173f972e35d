"""End-to-end in a browser: the charts' controls (log axes, the mode bar, the CSV link) and that no
chart can be sent to a cloud service."""

from __future__ import annotations

from urllib.parse import urlparse

import pytest

from tests.serve.browser.helpers import css, go, modebar_titles, severe_logs, shot, visible_graphs, wait

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(300)]


UPLOAD_TITLES = ("share", "cloud", "chart studio")


def test_no_chart_can_be_sent_to_the_cloud(server, browser, serve_runs, tmp_path):
    """No mode bar on any page offers "Share chart" (plotly.js's sendChartToCloud, on by default)."""
    pages = (("/", "Overview", ".js-plotly-plot"), ("/policy", "Policy", ".js-plotly-plot"),
             ("/mismatch", "Mismatch", ".js-plotly-plot"), ("/rewards", "Rewards", ".js-plotly-plot"),
             ("/tokens?run=alpha&step=9", "Tokens", ".js-plotly-plot"),
             ("/completions?run=beta&step=5", "Completions", "#comp-table tbody tr"),
             ("/compare", "Compare", ".js-plotly-plot"))
    for path, label, ready in pages:
        go(browser, server, path)
        wait(browser, lambda d: css(d, ready) and (ready != ".js-plotly-plot" or css(d, ".modebar-btn")),
             what=f"the {label} page")
        titles = modebar_titles(browser)
        if ready == ".js-plotly-plot":
            assert any("download" in t.lower() for t in titles), (label, titles)  # the mode bar is there
        assert not [t for t in titles if any(w in t.lower() for w in UPLOAD_TITLES)], (label, titles)
    # The sweep's HTML report is a plotly chart too.
    from grpolens.analysis.sweep import parse_params, sweep, write_html

    _, alpha, _ = serve_runs
    params = parse_params(["rollout_is.upper=1.5,2"])
    report = tmp_path / "sweep.html"
    write_html(sweep(alpha, params), params, report, "sweep")
    browser.get(report.as_uri())
    wait(browser, lambda d: css(d, ".modebar-btn"), what="the sweep chart")
    titles = modebar_titles(browser)
    assert not [t for t in titles if any(w in t.lower() for w in UPLOAD_TITLES)], titles


def test_log_y_toggle_switches_the_rendered_axes(server, browser):
    go(browser, server, "/")
    wait(browser, lambda d: len(visible_graphs(d, "overview")) >= 3, what="overview curves")
    axis_types = ("return Array.from(document.querySelectorAll('#page-overview .js-plotly-plot'))"
                  ".filter(g => g._fullLayout).map(g => g._fullLayout.yaxis.type)")
    assert "log" not in browser.execute_script(axis_types)
    css(browser, "#y-scale input[value='log']")[0].click()
    # every curve with a positive value is drawn on a log axis by plotly itself
    types = wait(browser, lambda d: (t := d.execute_script(axis_types)) and "log" in t and t, what="log y axes")
    assert types.count("log") >= 3, types
    shot(browser, "overview-log-y")
    css(browser, "#y-scale input[value='log']")[0].click()
    wait(browser, lambda d: (t := d.execute_script(axis_types)) and "log" not in t, what="linear y axes again")
    assert severe_logs(browser) == []


def test_mode_bar_does_not_cover_the_legend(server, browser):
    go(browser, server, "/")
    wait(browser, lambda d: len(visible_graphs(d, "overview")) >= 3, what="overview curves")
    boxes = browser.execute_script("""
        return Array.from(document.querySelectorAll('#page-overview .js-plotly-plot')).map(g => {
            const l = g.querySelector('.legend'), m = g.querySelector('.modebar');
            return l && m ? [l.getBoundingClientRect().toJSON(), m.getBoundingClientRect().toJSON()] : null;
        }).filter(b => b)""")
    assert boxes
    for legend, bar in boxes:
        assert legend["right"] <= bar["left"] or bar["bottom"] <= legend["top"] or legend["bottom"] <= bar["top"], \
            (legend, bar)


def test_csv_link_downloads_the_data_behind_a_chart(server, browser, serve_runs, tmp_path):
    """A chart's CSV link saves the run's metric, step by step, as metrics.parquet holds it."""
    import polars as pl

    from grpolens.run import format as fmt

    _, alpha, _ = serve_runs
    browser.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(tmp_path)})
    go(browser, server, "/?runs=alpha&from=2")
    wait(browser, lambda d: len(visible_graphs(d, "overview")) >= 3, what="overview curves")
    wait(browser, lambda d: [a for a in css(d, "#page-overview .graph-box a.csv-link")
                             if "metric=kl%2Fk3&" in a.get_attribute("href")][0].click() or True,
         what="a click on the KL chart's CSV link")
    done = wait(browser, lambda d: [p for p in tmp_path.iterdir() if p.suffix == ".csv"], what="the download")[0]
    assert done.name == "grpolens-kl_k3.csv"
    got = pl.read_csv(done)
    want = pl.read_parquet(fmt.derived_dir(alpha) / "metrics.parquet").filter(pl.col("step") >= 2).sort("step")
    assert got["run"].unique().to_list() == ["alpha"]
    assert got["step"].to_list() == want["step"].to_list()
    assert got["value"].to_list() == want["kl/k3"].to_list()


def test_one_panel_has_its_own_log_toggle(server, browser):
    go(browser, server, "/")
    wait(browser, lambda d: len(visible_graphs(d, "overview")) >= 3, what="overview curves")
    axis_types = ("return Array.from(document.querySelectorAll('#page-overview .js-plotly-plot'))"
                  ".filter(g => g._fullLayout).map(g => g._fullLayout.yaxis.type)")
    before = browser.execute_script(axis_types)
    assert "log" not in before
    wait(browser, lambda d: css(d, "#page-overview .panel-log input")[1].click() or True,
         what="a click on the second panel's log box")

    after = wait(browser, lambda d: (t := d.execute_script(axis_types)) and "log" in t and t, what="one log panel")
    assert after[1] == "log" and after.count("log") == 1, after
    assert severe_logs(browser) == []


def test_health_page_is_drawn(server, browser):
    """The page the ``health`` family declares is in the navigation bar and draws its curves (it
    was declared and never shown before the page catalogue, issue #29)."""
    go(browser, server, "/")
    wait(browser, lambda d: len(visible_graphs(d, "overview")) >= 3, what="overview curves")
    css(browser, "#nav-health")[0].click()
    wait(browser, lambda d: urlparse(d.current_url).path == "/health", what="the Health page")
    wait(browser, lambda d: len(visible_graphs(d, "health")) >= 3, what="health curves")
    titles = " ".join(e.text for e in css(browser, "#page-health .gtitle"))
    assert "health/masked_tokens" in titles and "health/nonfinite/logp" in titles
    assert "active" in css(browser, "#nav-health")[0].get_attribute("class")
    assert css(browser, "#curve-controls")[0].is_displayed()
    shot(browser, "health")
    assert not [e.text for e in css(browser, ".error") if e.is_displayed()]
    assert severe_logs(browser) == []
