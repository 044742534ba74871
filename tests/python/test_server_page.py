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

from gpucleanup.units import format_bytes
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


#: the page as data, read in one script run: the page rebuilds its rows at every refresh, so elements found one
#: by one may belong to different refreshes (or be gone)
READ_PAGE = """
const text = (root, selector) => { const e = root.querySelector(selector); return e ? e.textContent.trim() : null; };
const rows = Array.from(document.querySelectorAll("tr.kernel-row")).map((r) => {
  const card = document.querySelector(`tr.card-row[data-id="${CSS.escape(r.dataset.id)}"] section.kernel`);
  return {
    id: r.dataset.id,
    notebook: text(r, "td.name .notebook"),
    notebook_elements: r.querySelector("td.name .notebook").children.length,
    owner: text(r, "td.owner"),
    state: text(r, ".state"),
    idle: text(r, "td.idle"),
    held: text(r, "td.held"),
    parked: text(r, "td.parked"),
    check: text(r, "td.check"),
    hint: text(r, ".hint"),
    error: text(r, ".error"),
    drain_enabled: !r.querySelector("button.drain").disabled,
    park_label: text(r, "button.park"),
    drain_result: text(r, ".drain-result"),
    drain_class: r.querySelector(".drain-result").className,
    card: card ? {
      devices: Array.from(card.querySelectorAll("tr.device")).map((d) => ({
        index: d.dataset.index, gpu: text(d, ".gpu"), used: text(d, ".used"), live: text(d, ".live"),
        cached: text(d, ".cached"), outside: text(d, ".outside"), pool: text(d, ".pool")})),
      cells: Array.from(card.querySelectorAll("table.cells tr.cell")).map((c) => ({
        cell: text(c, ".cell-number"), freed: text(c, ".freed")})),
      timelines: Array.from(card.querySelectorAll("svg.timeline")).map((t) => ({
        index: t.dataset.index,
        lines: Array.from(t.querySelectorAll("polyline")).map((l) => l.getAttribute("class")),
        freed_markers: t.querySelectorAll("path.freed").length})),
    } : null,
  };
});
const gpus = Array.from(document.querySelectorAll("section.gpu")).map((g) => ({
  gpu: g.dataset.gpu, name: text(g, ".gpu-name"), used: text(g, ".gpu-used"),
  figures: Object.fromEntries(Array.from(g.querySelectorAll(".gpu-figure")).map((f) => [f.className.split(" ")[1],
    text(f, ".value")])),
}));
const sorted = document.querySelector("th.sorted");
return {rows, gpus, sort: sorted ? sorted.dataset.sort : null,
        bulk: {shown: !document.getElementById("bulk-result").hidden,
               summary: text(document, ".bulk-summary"),
               items: Array.from(document.querySelectorAll("li.bulk-item")).map((i) => ({
                 id: i.dataset.id, text: i.textContent, outcome: text(i, "output"),
                 outcome_class: i.querySelector("output").className})),
               left: Array.from(document.querySelectorAll(".bulk-left li")).map((i) => i.textContent),
               progress: text(document, ".bulk-progress"),
               go_shown: !document.getElementById("park-them").hidden}};
"""


def read_page(browser) -> dict:
    page = browser.execute_script(READ_PAGE)
    page["by_id"] = {row["id"]: row for row in page["rows"]}
    return page


def until(browser, condition, what: str) -> dict:
    """The page (read_page) once ``condition`` holds for it."""
    return wait(browser, lambda b: (page := read_page(b)) and condition(page) and page, what)


def row_button(browser, kernel_id: str, which: str):
    # the row's buttons and their result stay in place across refreshes
    return browser.find_element(By.CSS_SELECTOR, f'tr.kernel-row[data-id="{kernel_id}"] button.{which}')


def no_script_errors(browser) -> None:
    # no script error, no Content-Security-Policy violation (refusals' 409s are logged as "network")
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE" and e["source"] != "network"]
    assert errors == []


def screenshot(browser, tmp_path, variable: str) -> None:
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(WIDTH, height + 140)  # the window's own frame
    shot = tmp_path / "server-page.png"
    assert browser.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    wanted = os.environ.get(variable)
    if wanted:
        shutil.copyfile(shot, wanted)
    browser.set_window_size(WIDTH, 1000)


def test_the_page_shows_every_kernel_and_drains(server, kernels, browser, tmp_path):
    working, stuck, plain = kernels["working"], kernels["stuck"], kernels["plain"]
    browser.get(f"{server.url}/gpucleanup?token={server.token}")
    page = until(browser, lambda p: len(p["rows"]) == 3, "three kernels")

    # one row per kernel, by the memory each holds (the two without any by name: ties keep the idle-time and
    # name order); names shown as text, never as markup
    assert page["sort"] == "held"
    assert page["rows"][0]["notebook"] == "analysis/fit <b>&amp;</b>.ipynb"
    assert {r["notebook"] for r in page["rows"]} == {"analysis/fit <b>&amp;</b>.ipynb", "analysis/sweep.ipynb",
                                                     "plain.ipynb"}
    assert [r["notebook_elements"] for r in page["rows"]] == [0, 0, 0]

    shown = page["by_id"][working.kernel_id]
    assert shown["state"] == "idle" and shown["idle"].startswith(("0 ms", "1", "2", "3", "4", "5", "6", "7", "8", "9"))
    assert " s" in shown["idle"] and "since " in shown["idle"]
    assert shown["error"] is None and shown["hint"] is None and shown["card"] is None
    assert shown["owner"] and shown["check"].startswith("can park")
    # no nvidia-smi here: what it holds is its own pools, 5 GiB live (outside every pool unknown)
    assert shown["held"] == "GPU0 5.0 GiB"

    # its card opens from the row: devices, last cells, timeline, as before
    row_button(browser, working.kernel_id, "open").click()
    # drawn at once from the row's data (the last cell), then with its last cells at the next refresh, which
    # asks this kernel alone for them
    page = until(browser, lambda p: len((p["by_id"][working.kernel_id]["card"] or {}).get("cells") or ()) == 4,
                 "the card with its last cells")
    card = page["by_id"][working.kernel_id]["card"]
    assert card["devices"] == [{"index": "0", "gpu": "GPU0 Fake H100", "used": "7.0/80.0 GiB", "live": "5.0 GiB",
                                "cached": "0 B", "outside": "2.0 GiB", "pool": "0 B"}]
    # newest first: the pool grown again, CuPy's cache, the pool grown, %load_ext (the scenario's pool and
    # CuPy's cache); the last cell, x = 1, changed nothing since the cleanup before it: an idle cell, no record
    n = working.count
    assert card["cells"] == [{"cell": f"[{n - 1 - i}]", "freed": freed}
                             for i, freed in enumerate(["2.0 GiB", "1.0 GiB", "2.0 GiB", "2.0 GiB"])]
    (timeline,) = card["timelines"]
    assert timeline["index"] == "0"
    assert {"line line-used", "line line-live", "line line-cached", "line line-outside"} <= set(timeline["lines"])
    assert timeline["freed_markers"] == 4  # every cell that freed memory

    # the kernel stuck in a cell: running, its age growing from one refresh to the next; the park check says why
    stuck_row = page["by_id"][stuck.kernel_id]
    first = stuck_row["state"]
    prefix = f"running cell {kernels['stuck_cell']} for "
    assert first.startswith(prefix)
    assert stuck_row["check"].startswith("cannot park")
    assert stuck_row["idle"] == "-"
    until(browser, lambda p: p["by_id"][stuck.kernel_id]["state"] != first
          and p["by_id"][stuck.kernel_id]["state"].startswith(prefix), "the stuck cell's age to grow")

    # the kernel without gpucleanup says how to load it, and cannot be drained
    off = page["by_id"][plain.kernel_id]
    assert "gpucleanup not loaded" in off["state"]
    assert off["hint"] == "gpucleanup is not loaded in this kernel: run %load_ext gpucleanup in a cell"
    assert off["drain_enabled"] is False and shown["drain_enabled"] is True

    # Drain, per row: the result for the idle kernel, the refusal for the running one (through the XSRF check:
    # the page is logged in by cookie)
    row_button(browser, working.kernel_id, "drain").click()
    page = until(browser, lambda p: "ok" in p["by_id"][working.kernel_id]["drain_class"].split(), "the drain's result")
    result = page["by_id"][working.kernel_id]["drain_result"]
    assert result.startswith("Drained at ")
    assert result.endswith(": GPU0: drained, released 0 B")
    row_button(browser, stuck.kernel_id, "drain").click()
    page = until(browser, lambda p: "refused" in p["by_id"][stuck.kernel_id]["drain_class"].split(),
                 "the drain's refusal")
    assert page["by_id"][stuck.kernel_id]["drain_result"] == (
        f"Refused: kernel {stuck.kernel_id}: [gpucleanup.server.411] drain refused: the kernel is running; "
        "a drain runs only between cells (state idle)")
    # the results and the open card stay through the page's refreshes
    state = page["by_id"][stuck.kernel_id]["state"]
    page = until(browser, lambda p: p["by_id"][stuck.kernel_id]["state"] != state, "a refresh")
    assert page["by_id"][working.kernel_id]["drain_result"] == result
    assert page["by_id"][working.kernel_id]["card"]["timelines"]

    no_script_errors(browser)
    screenshot(browser, tmp_path, "GPUCLEANUP_PAGE_SCREENSHOT")


def test_the_admins_view_of_many_kernels_sorts_totals_and_parks_the_idle_ones(browser, tmp_path_factory, tmp_path):
    """24 light kernels (test_server_admin's), the stand-in nvidia-smi: the header per GPU is the API's, the
    table sorts on a click, and "park the kernels idle for more than N min" previews, then parks one after
    the other and reports each result, a refused park included.

    ``GPUCLEANUP_ADMIN_SCREENSHOT=<path.png>`` saves the page after the parks (share/images/ holds one)."""
    import test_server_admin as admin

    with admin.admin_world(tmp_path_factory.mktemp("admin-page"), 24, "--GPUCleanupServer.refresh_s=0.5") as world:
        server, pids = world["server"], world["pids"]
        browser.get(f"{server.url}/gpucleanup?token={server.token}")
        page = until(browser, lambda p: len(p["rows"]) == 24 and p["gpus"], "24 kernels")
        data = admin.listing(server, sort="held", cards="")
        # the header: each GPU's figures as the API gives them, held being the sum of the rows
        assert [g["gpu"] for g in page["gpus"]] == [g["gpu"] for g in data["gpus"]] == [admin.UUID0, admin.UUID1]
        g0, api0 = page["gpus"][0], data["gpus"][0]
        assert g0["name"] == "GPU0 Fake H100"
        assert g0["used"].startswith(f"{api0['used_bytes'] / (1 << 30):.1f}/80.0 GiB used")
        assert g0["figures"]["held"] == format_bytes(api0["held_bytes"])
        assert g0["figures"]["rest"] == format_bytes(api0["rest_bytes"]) == format_bytes(admin.OTHER_MIB << 20)
        assert g0["figures"]["live"] == format_bytes(api0["live_bytes"])
        assert g0["figures"]["parked"] == "0 B"
        # rows by memory held, most first; a click on a header sorts by it
        assert [r["id"] for r in page["rows"]] == [e["id"] for e in data["kernels"]]
        browser.find_element(By.CSS_SELECTOR, 'th[data-sort="name"]').click()
        page = until(browser, lambda p: p["sort"] == "name", "sorted by name")
        names = [r["notebook"] for r in page["rows"]]
        assert names[:-1] == sorted(names[:-1]) and names[-1] == f"process {pids[admin.UNNAMED]}"
        browser.find_element(By.CSS_SELECTOR, 'th[data-sort="idle"]').click()
        page = until(browser, lambda p: p["sort"] == "idle", "sorted by idle time")
        order = [pids.index(int(r["id"].removeprefix("pid-"))) for r in page["rows"]]
        assert order[:22] == sorted((i for i in range(24) if i not in admin.RUNNING), key=lambda i: -admin.idle_s(i))

        # the preview: which kernels, how much they would give back, which are left and why
        field = browser.find_element(By.ID, "idle-minutes")
        field.clear()
        field.send_keys("20")
        browser.find_element(By.ID, "preview").click()
        page = until(browser, lambda p: p["bulk"]["summary"] and p["bulk"]["go_shown"], "the preview")
        preview = server.api("GET", "/api/gpucleanup/park-idle?min_idle_s=1200")
        assert [i["id"] for i in page["bulk"]["items"]] == [k["id"] for k in preview["kernels"]]
        count = len(preview["kernels"])
        assert page["bulk"]["summary"] == (f"Parking {count} kernels idle for more than 20 min would give back "
                                           f"{format_bytes(preview['bytes'])} of GPU memory:")
        assert any(k["id"] == f"pid-{pids[admin.FAILED]}" for k in preview["kernels"])
        assert len(page["bulk"]["left"]) == 1 and "[gpucleanup.park.627]" in page["bulk"]["left"][0]
        # then one park after the other, each result said; the refused one with its reason
        browser.find_element(By.ID, "park-them").click()
        page = until(browser, lambda p: (p["bulk"]["progress"] or "").startswith("Done at "), "the parks")
        outcomes = {i["id"]: i for i in page["bulk"]["items"]}
        failed = outcomes[f"pid-{pids[admin.FAILED]}"]
        assert "refused" in failed["outcome_class"].split()
        assert failed["outcome"] == (f"· Refused: kernel pid-{pids[admin.FAILED]} not parked: [gpucleanup.park.615] "
                                     f"the driver reports process {pids[admin.FAILED]} as failed: it cannot be parked; "
                                     "save what you can and restart it")
        parked = [i for i in page["bulk"]["items"] if "ok" in i["outcome_class"].split()]
        assert len(parked) == count - 1
        given = sum(k["bytes"] for k in preview["kernels"] if k["id"] != failed["id"])
        assert page["bulk"]["progress"].endswith(f": {count - 1} parked, {format_bytes(given)} given back; "
                                                 "1 not parked (said above)")
        # the rows say parked, with Resume; nvidia-smi stops listing them, and the header shows them parked
        world["world"].set(pids, parked={int(i["id"].removeprefix("pid-")) for i in parked})
        page = until(browser, lambda p: all(p["by_id"][i["id"]]["park_label"] == "Resume" for i in parked)
                     and p["gpus"][0]["figures"]["parked"] == format_bytes(given), "the parked rows and header")
        for item in parked:
            assert page["by_id"][item["id"]]["state"] == "parked"
            assert page["by_id"][item["id"]]["parked"].startswith(format_bytes(next(
                k["bytes"] for k in preview["kernels"] if k["id"] == item["id"])) + "since ")
            assert page["by_id"][item["id"]]["held"] == "GPU0 0 B"  # nothing on the GPU while parked
        browser.find_element(By.CSS_SELECTOR, 'th[data-sort="held"]').click()
        page = until(browser, lambda p: p["sort"] == "held", "sorted by memory held")
        # open the card of the kernel holding the most
        row_button(browser, page["rows"][0]["id"], "open").click()
        until(browser, lambda p: p["rows"][0]["card"] and p["rows"][0]["card"]["devices"], "a card")
        no_script_errors(browser)
        screenshot(browser, tmp_path, "GPUCLEANUP_ADMIN_SCREENSHOT")
