"""The page /gpucleanup in headless Chromium (Selenium), against a real ``jupyter server`` and its kernels.

Debian's ``/usr/bin/chromium`` and ``/usr/bin/chromedriver`` are used as they are (Selenium Manager never
runs). The browser logs in as a user does, by opening the page with ``?token=``: from then on the page
talks to the server with its login cookie, so its Drain button goes through the server's XSRF check.
Every wait is on a condition of the DOM.

``GPUCLEANUP_PAGE_SCREENSHOT=<path.png>`` also saves the screenshot there (share/images/ holds one).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from test_server import TIMEOUT, Notebook, Server, fill

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")

if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
    pytest.skip(f"needs Debian's {CHROMIUM} and {CHROMEDRIVER} (apt-get install chromium chromium-driver)",
                allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver")

from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

WIDTH = 1280


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("jupyter-server-page"), "--GPUCleanupServer.refresh_s=0.5")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def kernels(server):
    """Three notebooks: one with gpucleanup and GPU work, one stuck in a cell, one without gpucleanup."""
    working = Notebook(server, "analysis/fit <b>&amp;</b>.ipynb")
    fill(working)
    stuck = Notebook(server, "analysis/sweep.ipynb")
    stuck.load_gpucleanup()
    stuck.run("x = 1")
    cell = stuck.count + 1
    msg_id = stuck.start("import time\ntime.sleep(600)")
    plain = Notebook(server, "plain.ipynb")
    server.wait_for(stuck.kernel_id, lambda e: e["state"]["state"] == "running", "running")
    yield {"working": working, "stuck": stuck, "stuck_cell": cell, "plain": plain}
    stuck.interrupt(msg_id)
    for nb in (working, stuck, plain):
        nb.close()


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     f"--window-size={WIDTH},1000", "--force-device-scale-factor=1"):
        options.add_argument(argument)
    # The browser is not what is under test: under scripts/sanitizers.sh this process runs with the ASan runtime
    # preloaded, which chromedriver and Chromium must not inherit (ASan aborts them at start).
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS")}
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER), env=env))
    yield driver
    driver.quit()


def wait(browser, condition, what: str):
    return WebDriverWait(browser, TIMEOUT, poll_frequency=0.05).until(condition, message=what)


#: the page as data, read in one script run: the page rebuilds a kernel's figures at every refresh, so
#: elements found one by one may belong to different refreshes (or be gone)
READ_PAGE = """
const text = (root, selector) => { const e = root.querySelector(selector); return e ? e.textContent.trim() : null; };
return Array.from(document.querySelectorAll("section.kernel")).map((s) => ({
  id: s.dataset.id,
  notebook: text(s, "h2.notebook"),
  notebook_elements: s.querySelector("h2.notebook").children.length,
  state: text(s, ".state"),
  hint: text(s, ".hint"),
  error: text(s, ".error"),
  drain_enabled: !s.querySelector("button.drain").disabled,
  drain_result: text(s, ".drain-result"),
  drain_class: s.querySelector(".drain-result").className,
  devices: Array.from(s.querySelectorAll("tr.device")).map((r) => ({
    index: r.dataset.index, gpu: text(r, ".gpu"), used: text(r, ".used"), live: text(r, ".live"),
    cached: text(r, ".cached"), outside: text(r, ".outside"), pool: text(r, ".pool")})),
  cells: Array.from(s.querySelectorAll("table.cells tr.cell")).map((r) => ({
    cell: text(r, ".cell-number"), freed: text(r, ".freed")})),
  timelines: Array.from(s.querySelectorAll("svg.timeline")).map((t) => ({
    index: t.dataset.index,
    lines: Array.from(t.querySelectorAll("polyline")).map((l) => l.getAttribute("class")),
    freed_markers: t.querySelectorAll("path.freed").length})),
}));
"""


def read_page(browser) -> dict:
    return {kernel["id"]: kernel for kernel in browser.execute_script(READ_PAGE)}


def until(browser, condition, what: str) -> dict:
    """The page (read_page) once ``condition`` holds for it."""
    return wait(browser, lambda b: (page := read_page(b)) and condition(page) and page, what)


def button(browser, kernel_id: str):
    # the Drain button and its result stay in place across refreshes
    return browser.find_element(By.CSS_SELECTOR, f'section.kernel[data-id="{kernel_id}"] button.drain')


def test_the_page_shows_every_kernel_and_drains(server, kernels, browser, tmp_path):
    working, stuck, plain = kernels["working"], kernels["stuck"], kernels["plain"]
    browser.get(f"{server.url}/gpucleanup?token={server.token}")
    page = until(browser, lambda p: len(p) == 3 and p[working.kernel_id]["timelines"], "three kernels and a timeline")

    # one section per kernel, this server's kernels by notebook path; names shown as text, never as markup
    assert [k["notebook"] for k in page.values()] == ["analysis/fit <b>&amp;</b>.ipynb", "analysis/sweep.ipynb",
                                                      "plain.ipynb"]
    assert [k["notebook_elements"] for k in page.values()] == [0, 0, 0]

    shown = page[working.kernel_id]
    assert shown["state"].startswith("idle for ")
    assert shown["error"] is None and shown["hint"] is None
    assert shown["devices"] == [{"index": "0", "gpu": "GPU0 Fake H100", "used": "7.0/80.0 GiB", "live": "5.0 GiB",
                                 "cached": "0 B", "outside": "2.0 GiB", "pool": "0 B"}]
    # newest first: the pool grown again, CuPy's cache, the pool grown, %load_ext (the scenario's pool and
    # CuPy's cache); the last cell, x = 1, changed nothing since the cleanup before it: an idle cell, no record
    n = working.count
    assert shown["cells"] == [{"cell": f"[{n - 1 - i}]", "freed": freed}
                              for i, freed in enumerate(["2.0 GiB", "1.0 GiB", "2.0 GiB", "2.0 GiB"])]
    (timeline,) = shown["timelines"]
    assert timeline["index"] == "0"
    assert {"line line-used", "line line-live", "line line-cached", "line line-outside"} <= set(timeline["lines"])
    assert timeline["freed_markers"] == 4  # every cell that freed memory

    # the kernel stuck in a cell: running, its age growing from one refresh to the next
    first = page[stuck.kernel_id]["state"]
    prefix = f"running cell {kernels['stuck_cell']} for "
    assert first.startswith(prefix)
    until(browser, lambda p: p[stuck.kernel_id]["state"] != first and p[stuck.kernel_id]["state"].startswith(prefix),
          "the stuck cell's age to grow")

    # the kernel without gpucleanup says how to load it, and cannot be drained
    off = page[plain.kernel_id]
    assert "gpucleanup not loaded" in off["state"]
    assert off["hint"] == "gpucleanup is not loaded in this kernel: run %load_ext gpucleanup in a cell"
    assert off["drain_enabled"] is False and shown["drain_enabled"] is True

    # Drain: the result for the idle kernel, the refusal for the running one (through the XSRF check:
    # the page is logged in by cookie)
    button(browser, working.kernel_id).click()
    page = until(browser, lambda p: "ok" in p[working.kernel_id]["drain_class"].split(), "the drain's result")
    result = page[working.kernel_id]["drain_result"]
    assert result.startswith("Drained at ")
    assert result.endswith(": GPU0: drained, released 0 B")
    button(browser, stuck.kernel_id).click()
    page = until(browser, lambda p: "refused" in p[stuck.kernel_id]["drain_class"].split(), "the drain's refusal")
    assert page[stuck.kernel_id]["drain_result"] == (
        f"Refused: kernel {stuck.kernel_id}: [gpucleanup.server.411] drain refused: the kernel is running; "
        "a drain runs only between cells (state idle)")
    # the results stay through the page's refreshes
    state = page[stuck.kernel_id]["state"]
    page = until(browser, lambda p: p[stuck.kernel_id]["state"] != state, "a refresh")
    assert page[working.kernel_id]["drain_result"] == result

    # no script error, no Content-Security-Policy violation (the 409 of the refused drain is logged as "network")
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE" and e["source"] != "network"]
    assert errors == []

    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(WIDTH, height + 140)  # the window's own frame
    shot = tmp_path / "server-page.png"
    assert browser.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    wanted = os.environ.get("GPUCLEANUP_PAGE_SCREENSHOT")
    if wanted:
        shutil.copyfile(shot, wanted)
