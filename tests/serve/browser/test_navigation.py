"""End-to-end in a browser: every page loads, clicks lead where they say (a curve point to its
tokens, a table row to its completion, the Why panel, the Findings), runs are compared and
overlaid, and a completion's markup is shown as text."""

from __future__ import annotations

from urllib.parse import parse_qs, urlparse

import pytest
from tests.serve.browser.helpers import css, curve_view, go, severe_logs, shot, visible_graphs, wait

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(300)]


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
