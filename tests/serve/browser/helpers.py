"""What the browser tests do to a page: wait for it, find elements, go to a path, screenshot it
(to ``test-artifacts/serve/``, for people to look at), read its severe console lines and its
curves' state."""

from __future__ import annotations

import time
from pathlib import Path


ARTIFACTS = Path(__file__).resolve().parents[3] / "test-artifacts" / "serve"


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


def modebar_titles(driver) -> list[str]:
    return [b.get_attribute("data-title") or "" for b in css(driver, ".modebar-btn")]


def checked(driver, selector) -> list[str]:
    return [i.get_attribute("value") for i in css(driver, selector) if i.is_selected()]


def curve_view(driver, page):
    """What the curve panels show: y axis type, x range and the runs drawn, per panel."""
    return driver.execute_script(f"""
        return Array.from(document.querySelectorAll('#page-{page} .js-plotly-plot')).filter(g => g._fullLayout)
            .map(g => [g._fullLayout.yaxis.type, g._fullLayout.xaxis.range.map(Math.round),
                       Array.from(new Set(g.data.map(t => t.name).filter(n => n))).sort().join(',')])""")
