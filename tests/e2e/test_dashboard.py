"""The live dashboard in headless Chromium: the KV grid fills while requests run, then empties."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import API_KEY, MODEL, Server, start_server, stop_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER),
                                reason="Debian's chromium and chromium-driver are not installed (make browser)")


@pytest.fixture()
def browser() -> Iterator[Any]:
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="fitserve-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _grid(driver: Any) -> tuple[int, frozenset[str]]:
    """(used-block count the page reports, ids of the blocks it paints as used)."""
    used = int(driver.execute_script("return document.getElementById('grid').dataset.used") or 0)
    painted = driver.execute_script(
        "return Array.from(document.querySelectorAll('#grid .blk.used')).map(e => e.dataset.block)")
    return used, frozenset(painted)


def _wait(pred: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_grid_changes_while_requests_run_and_empties(server: Server, browser: Any) -> None:
    server.wait_idle()
    # The server has an API key: the page and its /dashboard/state polls need it too.
    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Bearer {API_KEY}"}})
    browser.get(f"{server.url}/dashboard")
    _wait(lambda: browser.execute_script("return document.querySelectorAll('#grid .blk').length") == 256,
          30, "the grid of 256 blocks")
    assert _grid(browser)[0] == 0

    def load() -> None:  # 4 requests whose prompts grow past several blocks while we watch
        body = {"model": MODEL, "prompt": "word " * 40, "max_tokens": 200, "ignore_eos": True, "n": 2}
        with httpx.Client(timeout=300, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
            threads = [threading.Thread(target=c.post, args=(f"{server.url}/v1/completions",),
                                        kwargs={"json": body}) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

    worker = threading.Thread(target=load)
    worker.start()
    first = _wait(lambda: (g := _grid(browser))[0] > 0 and g, 60, "blocks to appear")
    assert first[0] == len(first[1])
    # n=2 computes each prompt once and forks its blocks: they show as shared
    _wait(lambda: int(browser.execute_script("return document.getElementById('grid').dataset.shared") or 0) > 0
          and browser.execute_script("return document.querySelectorAll('#grid .blk.shared').length") > 0,
          60, "blocks shared by the n=2 children")
    _wait(lambda: _grid(browser)[1] != first[1], 60, "the grid to change as requests grow")
    assert browser.execute_script("return document.querySelectorAll('#requests tr').length") > 0
    worker.join(300)
    _wait(lambda: _grid(browser) == (0, frozenset()), 30, "the grid to empty")
    assert browser.find_element("id", "kv-used").text == "0"
    assert not browser.find_element("id", "groups-box").is_displayed()  # one full group
    # freed, but the prompts' full blocks stay cached (evictable) and are painted so
    cached = browser.execute_script("return document.querySelectorAll('#grid .blk.cached').length")
    assert cached > 0 and cached == int(browser.execute_script(
        "return document.getElementById('grid').dataset.cached"))


def test_layer_groups_show_the_blocks_the_window_frees(tiny_hf_model_dir: Any, tmp_path: Any,
                                                        browser: Any) -> None:
    """A hybrid model (tiny Gemma 2: a layer on a 6-token window, a full layer): the page lists
    both KV groups, and the windowed group's freed count grows while a request runs."""
    srv = start_server(tmp_path, "--model", str(tiny_hf_model_dir("gemma2")), "--block-size", "4",
                       "--max-model-len", "256")  # the tiny model's trained context
    try:
        browser.get(f"{srv.url}/dashboard")
        rows = "return Array.from(document.querySelectorAll('#groups tr')).map(r => [" \
               "r.children[0].textContent, Number(r.dataset.used), Number(r.dataset.freed)])"
        _wait(lambda: len(browser.execute_script(rows)) == 2, 30, "two layer groups")
        assert browser.find_element("id", "groups-box").is_displayed()
        assert [r[0] for r in browser.execute_script(rows)] == ["full", "sliding (window 6)"]
        model = httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": [5 + i % 300 for i in range(40)], "max_tokens": 200,
                "ignore_eos": True}
        worker = threading.Thread(target=httpx.post, args=(f"{srv.url}/v1/completions",),
                                  kwargs={"json": body, "timeout": 120})
        worker.start()
        running = _wait(lambda: (r := browser.execute_script(rows))[1][2] > 0 and r, 60,
                        "the window to free blocks")
        worker.join(120)
        done = _wait(lambda: (r := browser.execute_script(rows))[0][1] == r[1][1] == 0 and r, 30,
                     "the groups to empty")
        assert done[1][2] >= running[1][2] > 0  # freed so far: a count since start
    finally:
        assert stop_server(srv) == 0
