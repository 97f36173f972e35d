"""The dashboard in headless Chromium (Selenium), on two synthetic runs: one server and one browser
serve the whole package (starting Chromium costs seconds). Chromium's network log is read after
every test: no request may leave 127.0.0.1 (the dashboard shows prompt-derived data)."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from urllib.parse import urlparse

import pytest

from tests.serve.browser.helpers import ARTIFACTS

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="package")
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


@pytest.fixture(scope="package")
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
