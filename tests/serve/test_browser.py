"""End-to-end: the dashboard in headless Chromium (Selenium), on two synthetic runs.

One server and one browser serve the whole module (starting Chromium costs seconds). Each page
is screenshotted to ``test-artifacts/serve/`` for people to look at. Chromium's network log is read
after every test: no request may leave 127.0.0.1 (the dashboard shows prompt-derived data).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(300)]

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "serve"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def server(runset):
    import logging

    from werkzeug.serving import make_server

    from grpolens.serve.app import create_app

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

    app = create_app(runset)
    srv = make_server("127.0.0.1", 0, app.server, threaded=True)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.port}"
    srv.shutdown()


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("needs chromium and chromedriver (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="grpolens-chrome-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--no-first-run", "--window-size=1400,1000", f"--user-data-dir={profile}"):
        opts.add_argument(arg)
    # "performance" carries the DevTools Network events: every request the pages make.
    opts.set_capability("goog:loggingPrefs", {"browser": "SEVERE", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.implicitly_wait(0)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


LOCAL_SCHEMES = ("data", "blob", "about", "file", "chrome")  # chrome://: the browser's own resources
LOCAL_HOSTS = ("127.0.0.1", "localhost")


def requested_urls(driver) -> list[str]:
    """Every URL the browser requested since the last call (the performance log is drained)."""
    urls = []
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg.get("method") in ("Network.requestWillBeSent", "Network.webSocketCreated"):
            urls.append(msg["params"].get("request", msg["params"]).get("url", ""))
    return urls


def off_machine(urls: list[str]) -> list[str]:
    return [u for u in urls if urlparse(u).scheme not in LOCAL_SCHEMES and urlparse(u).hostname not in LOCAL_HOSTS]


@pytest.fixture(autouse=True)
def nothing_leaves_loopback(browser):
    """After each test, every request the browser made went to the dashboard on 127.0.0.1."""
    requested_urls(browser)  # drop what an earlier test's teardown left
    yield
    urls = requested_urls(browser)
    assert off_machine(urls) == [], off_machine(urls)


def wait(driver, cond, timeout=30, what="condition"):
    end = time.time() + timeout
    last = None
    while time.time() < end:
        try:
            got = cond(driver)
            if got:
                return got
        except Exception as e:  # noqa: BLE001 - stale elements while Dash re-renders
            last = e
        time.sleep(0.15)
    raise AssertionError(f"timed out waiting for {what}" + (f" ({last})" if last else ""))


def css(driver, selector):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def visible_graphs(driver, page):
    return [g for g in css(driver, f"#page-{page} .js-plotly-plot .main-svg") if g.is_displayed()]


def shot(driver, name):
    time.sleep(0.4)  # let plotly finish drawing
    driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def go(driver, base, path):
    driver.get(base + path)
    wait(driver, lambda d: css(d, ".header .brand"), what="the app to load")


def severe_logs(driver):
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE" and "favicon" not in e.get("message", "")]


def test_pages_load(server, browser):
    go(browser, server, "/")
    wait(browser, lambda d: len(visible_graphs(d, "overview")) >= 3, what="overview curves")
    shot(browser, "overview")
    for page, label in (("policy", "Policy"), ("mismatch", "Mismatch"), ("rewards", "Rewards")):
        css(browser, f"#nav-{page}")[0].click()  # client-side navigation, like a user
        wait(browser, lambda d: visible_graphs(d, page), what=f"{page} curves")
        if page == "mismatch":
            wait(browser, lambda d: any(g.is_displayed() for g in css(d, "#mismatch-step .js-plotly-plot")),
                 what="IS weights of one step")
            assert "δ = log π_train − log π_rollout" in css(browser, "#mismatch-step")[0].text
        shot(browser, page)
    assert not [e.text for e in css(browser, ".error") if e.is_displayed()]
    logs = severe_logs(browser)
    assert logs == [], logs


def test_click_curve_point_opens_tokens(server, browser):
    from selenium.webdriver.common.action_chains import ActionChains

    go(browser, server, "/")
    wait(browser, lambda d: len(visible_graphs(d, "overview")) >= 3, what="overview curves")
    graph = next(g for g in css(browser, "#page-overview .js-plotly-plot") if g.is_displayed())
    drag = graph.find_elements("css selector", ".nsewdrag")[0]
    ActionChains(browser).move_to_element_with_offset(drag, 0, 0).pause(0.3).click().perform()
    wait(browser, lambda d: urlparse(d.current_url).path == "/tokens", what="the Tokens page")
    q = parse_qs(urlparse(browser.current_url).query)
    assert q["run"][0] in ("alpha", "beta") and 0 <= int(q["step"][0]) < 14
    wait(browser, lambda d: len(css(d, "#tok-table tbody tr")) > 5, what="top-K rows")
    wait(browser, lambda d: len(css(d, "#completion-tokens .tok")) > 0, what="completion tokens")
    assert f"step {q['step'][0]}" in css(browser, "#tok-summary")[0].text
    shot(browser, "tokens")
    # A row of the top-K table opens that token's completion, with the token outlined.
    cells = css(browser, "#tok-table tbody tr td")
    cells[3].click()
    wait(browser, lambda d: "sample=" in d.current_url, what="the clicked completion")
    wait(browser, lambda d: css(d, "#completion-tokens .tok.focus"), what="the focused token")


def test_script_in_completion_is_text(server, browser, serve_runs, runset):
    import polars as pl

    from grpolens.serve import data

    _, alpha, _ = serve_runs
    hit = None
    for step in range(14):
        s = data.step_samples(alpha, step).filter(pl.col("completion").str.contains("<script>", literal=True))
        if s.height:
            hit = (step, int(s["sample_id"][0]), s["completion"][0])
            break
    assert hit, "the synthetic run should contain a completion with <script>"
    step, sid, text = hit
    go(browser, server, f"/tokens?run=alpha&step={step}&sample={sid}")
    el = wait(browser, lambda d: css(d, "#completion-text"), what="completion text")[0]
    assert el.text == text.strip() or el.text == text  # shown character for character
    assert "<script>alert(1)</script>" in el.text
    assert css(browser, "#page-tokens script") == []  # nothing became an element
    assert css(browser, "#page-tokens img") == []  # the prompts' <img onerror=alert(1)> neither
    from selenium.common.exceptions import NoAlertPresentException

    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert  # alert(1) never ran
    shot(browser, "completion-script-as-text")


def test_completions_table_paging_and_row_link(server, browser):
    go(browser, server, "/completions?run=beta&step=5")
    wait(browser, lambda d: len(css(d, "#comp-table tbody tr")) >= 20, what="completion rows")
    summary = css(browser, "#comp-summary")[0].text
    assert "page 1 of 2" in summary, summary
    first = [td.text for td in css(browser, "#comp-table tbody tr")[2].find_elements("css selector", "td")][:2]
    shot(browser, "completions")
    css(browser, "#comp-table .next-page")[0].click()
    wait(browser, lambda d: "page 2 of 2" in css(d, "#comp-summary")[0].text, what="page 2")
    rows = css(browser, "#comp-table tbody tr")
    second = [td.text for td in rows[2].find_elements("css selector", "td")][:2]
    assert second != first
    # Filtering and sorting happen on the server, from the table's own filter row and sort arrows.
    from selenium.webdriver.common.keys import Keys

    box = css(browser, '#comp-table th.dash-filter[data-dash-column="tokens"] input')[0]
    box.click()
    box.send_keys("> 20" + Keys.ENTER)
    wait(browser, lambda d: "page 1 of 1" in css(d, "#comp-summary")[0].text, what="filtered rows")
    n = int(css(browser, "#comp-summary")[0].text.split(": ")[1].split()[0])
    assert 0 < n < 32

    def column(name):
        idx = [th.get_attribute("data-dash-column") for th in css(browser, "#comp-table th.dash-header")].index(name)
        return [float(tr.find_elements("css selector", "td")[idx].text)
                for tr in css(browser, "#comp-table tbody tr") if tr.find_elements("css selector", "td")]

    assert all(v > 20 for v in column("tokens"))
    css(browser, '#comp-table th.dash-header[data-dash-column="kl_max"] .column-header--sort')[0].click()
    wait(browser, lambda d: column("kl_max") == sorted(column("kl_max")), what="rows sorted by kl_max")
    shot(browser, "completions-filtered-sorted")
    rows = css(browser, "#comp-table tbody tr")
    rows[2].find_elements("css selector", "td")[0].click()
    wait(browser, lambda d: urlparse(d.current_url).path == "/tokens", what="the completion view")
    q = parse_qs(urlparse(browser.current_url).query)
    assert q["run"] == ["beta"] and q["step"] == ["5"] and int(q["sample"][0]) >= 0
    wait(browser, lambda d: css(d, "#completion-tokens .tok"), what="completion tokens")


def test_compare_two_runs(server, browser, runset):
    from grpolens.serve import data

    go(browser, server, "/compare")
    wait(browser, lambda d: len(css(d, "#cmp-table tbody tr")) > 3, what="comparison table")
    wait(browser, lambda d: [g for g in css(d, "#cmp-graphs .js-plotly-plot .main-svg") if g.is_displayed()],
         what="delta curves")
    first = [tr for tr in css(browser, "#cmp-table tbody tr") if tr.find_elements("css selector", "td")][0]
    want = data.compare(data.series(runset.path("alpha")), data.series(runset.path("beta")))["metric"][0]
    assert first.find_elements("css selector", "td")[0].text == want  # the most different metric first
    assert want.startswith(("mismatch/", "rollout_is/"))  # beta's injected rollout drift
    shot(browser, "compare")
    logs = severe_logs(browser)
    assert logs == [], logs


UPLOAD_TITLES = ("share", "cloud", "chart studio")


def modebar_titles(driver) -> list[str]:
    return [b.get_attribute("data-title") or "" for b in css(driver, ".modebar-btn")]


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


def checked(driver, selector) -> list[str]:
    return [i.get_attribute("value") for i in css(driver, selector) if i.is_selected()]


def curve_view(driver, page):
    """What the curve panels show: y axis type, x range and the runs drawn, per panel."""
    return driver.execute_script(f"""
        return Array.from(document.querySelectorAll('#page-{page} .js-plotly-plot')).filter(g => g._fullLayout)
            .map(g => [g._fullLayout.yaxis.type, g._fullLayout.xaxis.range.map(Math.round),
                       Array.from(new Set(g.data.map(t => t.name).filter(n => n))).sort().join(',')])""")


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


def test_runs_table_overlays_the_ticked_runs(server, browser):
    go(browser, server, "/runs")
    wait(browser, lambda d: len(css(d, "#runs-table input[type=checkbox]")) == 2, what="one row per run")
    headers = [th.get_attribute("data-dash-column") for th in css(browser, "#runs-table th.dash-header")]
    assert {"run", "steps", "config.loss_type", "config.beta", "config.rollout_is.mode"} <= set(headers), headers
    wait(browser, lambda d: [b.is_selected() for b in css(d, "#runs-table input[type=checkbox]")] == [True, True],
         what="the header's selection ticked")
    # (clicks retried: the table may re-render under the pointer)
    wait(browser, lambda d: css(d, "#runs-table input[type=checkbox]")[0].click() or True, what="untick alpha")
    wait(browser, lambda d: "1 run(s) ticked" in css(d, "#runs-summary")[0].text, what="the overlay links")
    shot(browser, "runs")
    wait(browser, lambda d: css(d, "#runs-overlay-overview")[0].click() or True, what="click the overlay link")
    wait(browser, lambda d: urlparse(d.current_url).path == "/" and "runs=beta" in d.current_url, what="the overlay")
    wait(browser, lambda d: (v := curve_view(d, "overview")) and all(p[2] == "beta" for p in v), what="beta only")
    # The table's filter and sort live in its URL too.
    go(browser, server, "/runs?sort=steps:desc&where=%7Brun%7D%20%3D%20beta")
    wait(browser, lambda d: len(css(d, "#runs-table input[type=checkbox]")) == 1, what="the filtered table")
    browser.refresh()
    wait(browser, lambda d: len(css(d, "#runs-table input[type=checkbox]")) == 1, what="the filter after reload")
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


def test_why_panel(server, browser):
    """Clicking a curve point opens the Tokens page with the Why panel of that curve's metric
    (issue #30); its charts, concentration curve and links work."""
    from selenium.webdriver.common.action_chains import ActionChains

    go(browser, server, "/policy?runs=alpha&filter=kl/k3")
    wait(browser, lambda d: visible_graphs(d, "policy"), what="the kl/k3 curve")
    graph = next(g for g in css(browser, "#page-policy .js-plotly-plot") if g.is_displayed())
    drag = graph.find_elements("css selector", ".nsewdrag")[0]
    ActionChains(browser).move_to_element_with_offset(drag, 0, 0).pause(0.3).click().perform()
    wait(browser, lambda d: urlparse(d.current_url).path == "/tokens", what="the Tokens page")
    q = parse_qs(urlparse(browser.current_url).query)
    assert q["why"] == ["kl/k3"] and q["run"] == ["alpha"]
    wait(browser, lambda d: f"step {q['step'][0]}" in css(d, "#why-headline")[0].text, what="the Why headline")

    go(browser, server, "/tokens?run=alpha&step=9&why=kl/k3")
    wait(browser, lambda d: css(d, "#why-headline") and "kl/k3" in css(d, "#why-headline")[0].text,
         what="the Why panel")
    wait(browser, lambda d: any(g.is_displayed() for g in css(d, "#why-token_id .js-plotly-plot")), what="token bars")
    wait(browser, lambda d: any(g.is_displayed() for g in css(d, "#why-lorenz .main-svg")), what="the Lorenz curve")
    wait(browser, lambda d: len(css(d, "#tok-table tbody tr")) > 5, what="top-K rows beside it")
    table, panel = css(browser, ".tok-table-box")[0], css(browser, "#tok-why")[0]
    assert panel.location["x"] > table.location["x"] and abs(panel.location["y"] - table.location["y"]) < 40
    shot(browser, "why")
    wait(browser, lambda d: css(d, "#why-completion .why-link")[0].click() or True, what="a completion's link")
    wait(browser, lambda d: "sample=" in d.current_url, what="the completion of the top key")
    wait(browser, lambda d: len(css(d, "#completion-tokens .tok")) > 0, what="its tokens")
    assert parse_qs(urlparse(browser.current_url).query)["why"] == ["kl/k3"]  # the panel stays open
    assert not [e.text for e in css(browser, ".error") if e.is_displayed()]
    assert severe_logs(browser) == []


def test_findings_page(server, browser):
    """The runs have planted pathologies: the Findings page leads the navigation bar (issue #31);
    a finding's links open its curve and the Why panel of its worst step."""
    go(browser, server, "/")
    nav = css(browser, ".nav .nav-link")
    assert nav[0].text == "Findings"
    nav[0].click()
    wait(browser, lambda d: urlparse(d.current_url).path == "/findings", what="the Findings page")
    wait(browser, lambda d: css(d, "#find-list .finding"), what="finding cards")
    wait(browser, lambda d: len(css(d, "#find-detectors tbody tr")) > 3, what="the detectors")
    card = css(browser, "#find-list .finding")[0]
    assert "kl-spike" in card.text and "critical" in card.text.lower()
    shot(browser, "findings")
    # Dash may redraw the cards between finding and clicking: wait() retries a stale element
    wait(browser, lambda d: css(d, "#find-list .finding .find-why")[0].click() or True, what="the why link")
    wait(browser, lambda d: urlparse(d.current_url).path == "/tokens", what="the Tokens page")
    q = parse_qs(urlparse(browser.current_url).query)
    assert q["why"] == ["kl/k3"] and q["step"] == ["9"] and q["run"] == ["alpha"]
    wait(browser, lambda d: css(d, "#why-headline") and "kl/k3" in css(d, "#why-headline")[0].text,
         what="the Why panel")
    browser.back()
    wait(browser, lambda d: css(d, "#find-list .finding"), what="finding cards again")
    wait(browser, lambda d: css(d, "#find-list .finding .find-link")[0].click() or True, what="the curve link")
    wait(browser, lambda d: urlparse(d.current_url).path == "/policy", what="the kl/k3 curve")
    wait(browser, lambda d: visible_graphs(d, "policy"), what="its curves")
    assert parse_qs(urlparse(browser.current_url).query)["filter"] == ["kl/k3"]
    assert not [e.text for e in css(browser, ".error") if e.is_displayed()]
    assert severe_logs(browser) == []
