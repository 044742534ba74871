"""gpucleanup's JupyterLab extension: built from its sources, installed with the package, and shown by a real
JupyterLab (from PyPI) in headless Chromium against kernels on the fake CUDA driver."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from gpucleanup.units import format_bytes
from support import ROOT
from test_server import STAND_IN_CUPY, GiB, MiB

sys.path.insert(0, str(ROOT / "tests"))
from lab_item import item_text  # noqa: E402  (tests/lab_item.py)

BUILT = ROOT / "share" / "jupyter" / "labextensions" / "gpucleanup"
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")


def _files(directory: Path) -> dict:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_the_committed_build_is_what_the_sources_build(tmp_path):
    # scripts/build_labextension.sh installs Debian's webpack; scripts/setup.sh runs it where it is missing
    if shutil.which("webpack") is None:
        pytest.skip("needs Debian's webpack (bash scripts/build_labextension.sh installs it)")
    out = tmp_path / "static"
    done = subprocess.run(["webpack", "--config", str(ROOT / "labextension" / "webpack.config.js")],
                          env=dict(os.environ, NODE_PATH="/usr/share/nodejs", GPUCLEANUP_LAB_OUT=str(out)),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _files(out) == _files(BUILT / "static"), "stale: run bash scripts/build_labextension.sh and commit"
    assert _files(ROOT / "labextension" / "schema") == _files(BUILT / "schemas" / "gpucleanup"), "stale schema"
    meta = json.loads((BUILT / "package.json").read_text())
    assert meta["jupyterlab"]["_build"]["load"] == "static/" + next(n for n in _files(out) if n.startswith("remoteEntry"))


def test_jupyterlab_lists_the_installed_extension_enabled():
    pytest.importorskip("jupyterlab")
    done = subprocess.run([sys.executable, "-m", "jupyter", "labextension", "list"], capture_output=True, text=True,
                          timeout=120)
    listed = [line for line in (done.stdout + done.stderr).splitlines() if line.strip().startswith("gpucleanup ")]
    assert len(listed) == 1 and "enabled" in listed[0] and "OK" in listed[0], done.stdout + done.stderr


def _expected(entry: dict, show_cached: bool = True) -> str:
    """The item's text for an entry of the server's API, by the rule the extension follows (src/index.js)."""
    return item_text(entry, show_cached)


def _held_by_gpumem(report: dict) -> dict:
    """``%gpumem --json``'s devices as the server's ``held`` rows, without nvidia-smi: what the kernel's frameworks
    hold live (at least what its driver pools have in use) plus what they and the driver pools keep cached."""
    rows = []
    for dev in report["devices"]:
        frameworks = dev["frameworks"].values()
        pool_used = sum(pool["used_bytes"] for pool in dev["pools"])
        live = max(sum(fw.get("live_bytes") or 0 for fw in frameworks), pool_used)
        cached = sum(fw.get("cached_bytes") or 0 for fw in frameworks) + sum(
            pool["reserved_bytes"] - pool["used_bytes"] for pool in dev["pools"])
        rows.append({"index": dev["index"], "bytes": live + cached, "cached_bytes": cached})
    return {"held": rows}


REPLAY = """
(() => {
  const recorded = %s;
  const real = window.fetch.bind(window);
  window.fetch = async (input, init) => {
    const url = typeof input === 'string' ? input : input.url;
    if (!url.includes('/api/gpucleanup/kernels?')) return real(input, init);
    const answer = await (await real(input, init)).json();
    const own = (answer.kernels || []).find((e) => e.notebook === 'fit.ipynb');
    answer.kernels = own ? [Object.assign({}, recorded, {id: own.id, kernel_id: own.kernel_id, notebook: own.notebook})] : [];
    return new Response(JSON.stringify(answer), {status: 200, headers: {'Content-Type': 'application/json'}});
  };
})();
"""


class Lab:
    """A real Jupyter server with JupyterLab, every kernel loading gpucleanup at start (the README's set-up), on the
    fake driver with a checkpoint directory, and headless Chromium logged in on ``fit.ipynb`` (``page``: ``lab``,
    or ``notebooks`` for Notebook 7). ``plain.ipynb``'s kernel, of the kernelspec ``plain``, has no gpucleanup."""

    def __init__(self, tmp_path: Path, settings: Optional[dict] = None, page: str = "lab",
                 replay: Optional[dict] = None):
        webdriver = pytest.importorskip("selenium.webdriver")
        from selenium.webdriver.chrome.service import Service

        from test_server import Server

        checkpoints = tmp_path / "checkpoints"
        checkpoints.mkdir()
        # the user's settings for the extension (JupyterLab's user-settings folder, one per test)
        user_settings = tmp_path / "lab-user-settings"
        (user_settings / "gpucleanup").mkdir(parents=True)
        if settings is not None:
            (user_settings / "gpucleanup" / "status-item.jupyterlab-settings").write_text(json.dumps(settings))
        self.srv = Server(tmp_path / "srv", extra_env={"GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR": str(checkpoints),
                                                       "JUPYTERLAB_SETTINGS_DIR": str(user_settings)})
        self.browser = None
        profile = tmp_path / "srv" / "ipython" / "profile_default"
        profile.mkdir(parents=True)
        (profile / "ipython_kernel_config.py").write_text("c.InteractiveShellApp.extensions = ['gpucleanup']\n")
        kernelspec = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
        # a kernelspec whose kernels read another IPython directory: no config file loads gpucleanup there
        plain = {"name": "plain", "display_name": "Python 3 (no gpucleanup)", "language": "python"}
        (tmp_path / "srv" / "data" / "kernels" / "plain").mkdir(parents=True)
        (tmp_path / "srv" / "ipython-plain").mkdir()
        (tmp_path / "srv" / "data" / "kernels" / "plain" / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": plain["display_name"], "language": "python",
            "env": {"IPYTHONDIR": str(tmp_path / "srv" / "ipython-plain")}}))
        for name, spec in (("fit.ipynb", kernelspec), ("eval.ipynb", kernelspec), ("plain.ipynb", plain)):
            (self.srv.root / name).write_text(json.dumps({"cells": [], "metadata": {"kernelspec": spec},
                                                          "nbformat": 4, "nbformat_minor": 5}))
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--window-size=1400,900"):
            options.add_argument(argument)
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS")}
        self.browser = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER), env=env))
        if replay is not None:
            # every answer to the extension's list request carries ``replay`` (an entry the GPU machine's server
            # gave) in place of the kernels, under the id of fit.ipynb's kernel here; set before the page loads
            self.browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": REPLAY % json.dumps(replay)})
        self.page = "lab/tree" if page == "lab" else page
        self.browser.get(f"{self.srv.url}/{self.page}/fit.ipynb?token={self.srv.token}")

    def open(self, notebook: str) -> None:
        """``notebook`` in the browser's window, in focus (JupyterLab: a tab of its own beside the others)."""
        self.browser.get(f"{self.srv.url}/{self.page}/{notebook}")

    def open_beside(self, notebook: str) -> None:
        """``notebook`` opened from JupyterLab's file browser (a double click), in a tab beside the open ones."""
        from selenium.webdriver.common.action_chains import ActionChains

        def entry(driver):
            found = [e for e in driver.find_elements("css selector", ".jp-DirListing-item")
                     if e.find_element("css selector", ".jp-DirListing-itemText").text.strip() == notebook]
            return found[0] if found else False

        ActionChains(self.browser).double_click(self.wait(entry, f"{notebook} is not in the file browser")).perform()

    def start_cell(self, code: str):
        """Types ``code`` into the notebook's active cell and runs it with Shift+Enter; returns the cell."""
        from selenium.webdriver.common.keys import Keys

        def active(driver):
            cells = driver.find_elements("css selector", ".jp-Notebook .jp-Cell.jp-mod-active")
            return cells[-1] if cells and cells[-1].find_elements("css selector", ".cm-content") else False

        self.click(lambda d: (found := active(d)) and found.find_element("css selector", ".cm-content"),
                   "no active cell with an editor")
        cell = self.wait(active, "no active cell with an editor")
        editor = cell.find_element("css selector", ".cm-content")
        editor.send_keys(code)
        editor.send_keys(Keys.SHIFT, Keys.ENTER)
        return cell

    def run_cell(self, code: str) -> str:
        """:meth:`start_cell`, then waits for the cell's prompt number; returns the text of its execute result
        ('' where none)."""
        cell = self.start_cell(code)

        def ran(driver):
            prompt = cell.find_element("css selector", ".jp-InputArea-prompt").get_attribute("textContent")
            return re.fullmatch(r"\s*\[\d+\]:\s*", prompt) is not None

        self.wait(ran, f"the cell {code!r} did not finish")
        return "".join(out.get_attribute("textContent") for out in cell.find_elements(
            "css selector", ".jp-OutputArea-executeResult .jp-OutputArea-output"))

    def ps(self) -> dict:
        """``gpucleanup ps --json`` beside the server, by kernel id."""
        done = subprocess.run([sys.executable, "-m", "gpucleanup", "ps", "--json"], env=self.srv.env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return {entry["kernel_id"]: entry for entry in json.loads(done.stdout)}

    def wait(self, condition, what: str):
        from selenium.webdriver.support.ui import WebDriverWait

        from test_server import TIMEOUT

        from selenium.common.exceptions import (ElementClickInterceptedException, ElementNotInteractableException,
                                                NoSuchElementException, StaleElementReferenceException)

        # an element JupyterLab drew again between the look and the use, or a click that another element would
        # take, or that the element cannot take yet, while the page is still being laid out (the browser then
        # clicks nothing): tried again on the next poll
        return WebDriverWait(self.browser, TIMEOUT, poll_frequency=0.1, ignored_exceptions=(
            NoSuchElementException, StaleElementReferenceException, ElementClickInterceptedException,
            ElementNotInteractableException)).until(condition, message=what)

    def click(self, find, what: str) -> None:
        """Clicks the element ``find(driver)`` returns once it is there and the click reaches it."""
        def clicked(driver):
            target = find(driver)
            if target:
                target.click()
            return bool(target)

        self.wait(clicked, what)

    def click_item(self) -> None:
        """Clicks the status item once it names a kernel."""
        self.item()
        self.click(lambda d: (d.find_elements("css selector", ".gpucleanup-status") or [False])[0], "the status item")

    def item(self, text_starts: str = ""):
        """The status item once it shows figures (starting with ``text_starts``) of a kernel it names."""
        def shown(driver):
            items = driver.find_elements("css selector", ".gpucleanup-status")
            ok = items and items[0].text.startswith(text_starts) and items[0].text and items[0].get_attribute(
                "data-kernel")
            return items[0] if ok else False

        return self.wait(shown, f"no gpucleanup status item saying {text_starts!r}...")

    def press(self, label: str) -> None:
        """The button ``label`` of the dialog on top."""
        def button(driver):
            found = [b for b in driver.find_elements("css selector", ".jp-Dialog .jp-Dialog-button")
                     if b.text.strip() == label]
            return found[-1] if found else False

        self.click(button, f"no dialog button {label!r}")

    def close(self) -> None:
        if self.browser is not None:
            if os.environ.get("GPUCLEANUP_LAB_SCREENSHOT"):
                self.browser.save_screenshot(os.environ["GPUCLEANUP_LAB_SCREENSHOT"])
            self.browser.quit()
        self.srv.stop()


needs_browser = pytest.mark.skipif(not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
                                   reason="needs chromium and chromium-driver")


@pytest.fixture
def lab(tmp_path):
    pytest.importorskip("jupyterlab")
    lab = Lab(tmp_path)
    yield lab
    lab.close()


@needs_browser
def test_the_status_item_shows_the_figures_of_the_kernel_in_focus(lab):
    item = lab.item()
    entry = lab.srv.entry(item.get_attribute("data-kernel"))
    assert entry["gpucleanup"] and entry["held_bytes"] > 0, entry
    assert item.text == _expected(entry)
    # the same figures as the kernel's own %gpumem --json, run as a cell of the notebook in the browser
    report = json.loads(lab.run_cell("%gpumem --json"))
    assert [dev["index"] for dev in report["devices"]] == [0], report
    assert _held_by_gpumem(report)["held"][0]["bytes"] == report["devices"][0]["known_bytes"] > 0
    assert lab.item("GPU0 ").text == _expected(_held_by_gpumem(report)), json.dumps(report["devices"])


@needs_browser
def test_the_item_looks_apart_while_its_kernel_runs_a_cell(lab):
    kernel_id = lab.item("GPU0 ").get_attribute("data-kernel")
    # a stand-in CuPy keeps 4 GiB after every cell (what the fake driver's pool held is drained after a cell)
    (lab.srv.root / "stand_in_cupy.py").write_text(STAND_IN_CUPY)
    lab.run_cell("%run stand_in_cupy.py")
    idle_color = lab.item("GPU0 4.0 GiB").value_of_css_property("color")
    go = lab.srv.root / "go"
    lab.start_cell(f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)")
    busy = lab.wait(lambda d: (lambda i: i if i.text.endswith(" · running") else False)(lab.item("GPU0 ")),
                    "the item does not say running while the cell runs")
    assert busy.get_attribute("data-kind") == "busy" and busy.get_attribute("data-kernel") == kernel_id
    assert busy.value_of_css_property("color") != idle_color
    go.write_text("")
    idle = lab.wait(lambda d: (lambda i: i if not i.text.endswith(" · running") else False)(lab.item("GPU0 ")),
                    "the item still says running after the cell")
    assert idle.get_attribute("data-kind") == "idle" and idle.value_of_css_property("color") == idle_color


@needs_browser
def test_no_item_for_a_kernel_without_gpucleanup(lab):
    lab.item("GPU0 ")
    lab.open("plain.ipynb")  # its kernel has no gpucleanup: the server lists it, with nothing to say

    def plain_listed_and_item_hidden(driver):
        entries = [e for e in lab.srv.kernels() if e.get("notebook") == "plain.ipynb"]
        items = driver.find_elements("css selector", ".gpucleanup-status")
        # data-listed: how many kernels the extension's last refresh listed (fit, eval is not open, plain)
        return (entries and items and items[0].get_attribute("data-listed") == "2"
                and not items[0].is_displayed() and items[0].text == "" and entries[0])

    entry = lab.wait(plain_listed_and_item_hidden, "the item still shows, or the plain kernel is not listed")
    assert entry["gpucleanup"] is False and entry.get("held", []) == []
    assert lab.run_cell("'gpucleanup' in get_ipython().extension_manager.loaded") == "False"


@needs_browser
def test_notebook_7_shows_the_item_at_the_top_of_the_notebooks_page_and_the_kernel_under_running(tmp_path):
    pytest.importorskip("notebook")
    lab = Lab(tmp_path, page="notebooks")
    try:
        item = lab.item("GPU0 ")
        top = lab.browser.find_elements("css selector", "#top-panel .gpucleanup-status")
        assert top and top[0].get_attribute("data-kernel") == item.get_attribute("data-kernel")
        kernel_id = item.get_attribute("data-kernel")
        assert item.text == _expected(lab.srv.entry(kernel_id))
        # the tree page's Running tab lists the kernel in gpucleanup's section
        lab.browser.get(f"{lab.srv.url}/tree")

        def running_tab(driver):
            tabs = [t for t in driver.find_elements("css selector", ".lm-TabBar-tab") if t.text.strip() == "Running"]
            return tabs[0] if tabs else False

        lab.click(running_tab, "no Running tab on the tree page")
        row = lab.wait(lambda d: d.find_elements("css selector", ".gpucleanup-running-item"), "no gpucleanup row")[0]
        assert row.get_attribute("data-context") == kernel_id
        assert row.find_element("css selector", ".jp-RunningSessions-itemDetail").text == _expected(
            lab.srv.entry(kernel_id))
    finally:
        lab.close()


@needs_browser
def test_the_item_follows_the_notebook_in_focus(lab):
    first = lab.item("GPU0 ").get_attribute("data-kernel")
    lab.open_beside("eval.ipynb")  # a second notebook, its own kernel, in focus

    def shows(other_than=None, equal_to=None):
        def check(driver):
            items = driver.find_elements("css selector", ".gpucleanup-status")
            kernel = items[0].get_attribute("data-kernel") if items and items[0].text.startswith("GPU0 ") else ""
            ok = kernel and (kernel != other_than if other_than else kernel == equal_to)
            return kernel if ok else False
        return check

    second = lab.wait(shows(other_than=first), "the item did not switch to the second notebook's kernel")
    assert lab.srv.entry(second)["notebook"] == "eval.ipynb"

    def tab(driver):
        tabs = [t for t in driver.find_elements("css selector", ".lm-DockPanel-tabBar .lm-TabBar-tab")
                if t.text.strip() == "fit.ipynb"]
        return tabs[0] if tabs else False

    lab.click(tab, "no tab of fit.ipynb")
    assert lab.wait(shows(equal_to=first), "the item did not switch back to the first notebook's kernel") == first


@needs_browser
def test_the_items_panel_parks_and_resumes_the_kernel_and_the_item_follows(lab):
    kernel_id = lab.item("GPU0 ").get_attribute("data-kernel")
    lab.click_item()
    lab.press("Park")
    lab.press("OK")  # the server's sentence: parked ... in host memory
    # the fake driver has no nvidia-smi beside it: the park measures no bytes, and the item says none
    assert lab.item("GPU parked").get_attribute("data-kernel") == kernel_id
    assert lab.srv.entry(kernel_id)["state"]["state"] == "parked"
    own = lab.srv.entry(kernel_id)["kernel_id"]
    assert lab.ps()[own]["status"]["state"]["state"] == "parked"
    lab.click_item()
    lab.press("Resume")
    lab.press("OK")
    lab.item("GPU0 ")
    assert lab.srv.entry(kernel_id)["state"]["state"] == "idle"
    # parked again through the item, then a cell of the notebook resumes it and takes 3 GiB with a stand-in CuPy,
    # live, 1 GiB cached (what the fake driver's pool held is drained after each cell): the item follows
    lab.click_item()
    lab.press("Park")
    lab.press("OK")
    lab.item("GPU parked")
    (lab.srv.root / "stand_in_cupy.py").write_text(STAND_IN_CUPY)
    lab.run_cell("%run stand_in_cupy.py")
    entry = lab.srv.wait_for(kernel_id, lambda e: e["state"]["state"] == "idle" and e["held_bytes"] == 4 * GiB,
                             "the kernel is not idle with the stand-in CuPy's 3 GiB live, 1 GiB cached")
    assert lab.item("GPU0 4.0 GiB").get_attribute("data-kernel") == kernel_id
    assert lab.item().text == _expected(entry) == "GPU0 4.0 GiB (1.0 cached)"
    assert lab.ps()[own]["status"]["state"]["state"] == "idle"


@needs_browser
def test_the_items_panel_says_idle_time_and_park_check_and_opens_the_page_in_a_tab(lab):
    kernel_id = lab.item("GPU0 ").get_attribute("data-kernel")
    lab.click_item()
    idle = lab.wait(lambda d: d.find_elements("css selector", ".jp-Dialog .gpucleanup-idle"), "no idle line")[0]
    assert idle.text.startswith("idle for ") and "(since " in idle.text
    check = lab.wait(lambda d: d.find_elements("css selector", ".jp-Dialog .gpucleanup-check"), "no check line")[0]
    said = lab.srv.api("GET", f"/api/gpucleanup/kernels/{kernel_id}/park-check")
    assert check.text == f"park check: {said['message']}"
    lab.press("Open page")
    frame = lab.wait(lambda d: d.find_elements("css selector", ".gpucleanup-page"), "no page tab")[0]
    assert frame.tag_name == "iframe" and frame.get_attribute("src").endswith("/gpucleanup")
    lab.browser.switch_to.frame(frame)
    try:  # the page itself, logged in through JupyterLab's cookie, lists the kernel
        lab.wait(lambda d: kernel_id in d.page_source, "the page in the tab does not list the kernel")
    finally:
        lab.browser.switch_to.default_content()


@needs_browser
def test_the_running_panel_lists_the_kernel_with_its_figures_and_parks_it(lab):
    kernel_id = lab.item("GPU0 ").get_attribute("data-kernel")
    lab.click(lambda d: (d.find_elements("css selector", "[data-id='jp-running-sessions']") or [False])[0],
              "no Running tab")

    def row(driver):
        rows = driver.find_elements("css selector", ".gpucleanup-running-item")
        return rows[0] if len(rows) == 1 and rows[0].get_attribute("data-context") == kernel_id else False

    listed = lab.wait(row, "no gpucleanup row for the kernel in the Running panel")
    entry = lab.srv.entry(kernel_id)
    label = listed.find_element("css selector", ".jp-RunningSessions-itemLabel")
    assert label.text == "fit.ipynb"
    lab.click(lambda d: (found := row(d)) and found.find_element("css selector", ".jp-RunningSessions-itemLabel"),
              "the row's notebook")  # this server's kernel: its notebook opens (it is open already: its tab stays the one)
    assert [t.text for t in lab.browser.find_elements("css selector", ".lm-DockPanel-tabBar .lm-TabBar-tabLabel")
            ] == ["fit.ipynb"]
    assert listed.find_element("css selector", ".jp-RunningSessions-itemDetail").text == _expected(entry)
    # the item's button shows while the pointer is over the item (JupyterLab 4.0 acts on its mouse-down)
    from selenium.webdriver.common.action_chains import ActionChains

    button = listed.find_element("css selector", ".jp-RunningSessions-itemShutdown")
    ActionChains(lab.browser).move_to_element(listed).move_to_element(button).click().perform()
    lab.press("OK")  # the server's sentence: parked ...
    assert lab.srv.entry(kernel_id)["state"]["state"] == "parked"
    lab.wait(lambda d: (lambda r: r and r.find_element("css selector", ".jp-RunningSessions-itemDetail").text
                        == "GPU parked")(row(d)), "the Running panel's row does not say parked")


@needs_browser
def test_the_users_settings_leave_out_the_cached_figure(tmp_path):
    pytest.importorskip("jupyterlab")
    lab = Lab(tmp_path, settings={"showCached": False, "refreshSeconds": 1})
    try:
        item = lab.item("GPU0 ")
        entry = lab.srv.entry(item.get_attribute("data-kernel"))
        assert "cached" not in item.text and item.text == _expected(entry, show_cached=False)
    finally:
        lab.close()


RESULTS = ROOT / "tests" / "bench" / "results"


@needs_browser
@pytest.mark.parametrize("state", ["idle", "parked"])
def test_the_item_draws_what_the_gpu_machines_server_answered(tmp_path, state):
    """The answers of a real server on the GPU machine (tests/gpu/test_lab_item_gpu.py, kept in
    tests/bench/results/), drawn by the extension here: the GPU machine has no browser."""
    pytest.importorskip("jupyterlab")
    recorded = sorted(RESULTS.glob(f"*-lab-item-{state}-*.json"))
    if not recorded:
        pytest.skip("no answer from the GPU machine is kept (scripts/gpu_run.sh lab, then tests/bench/results/)")
    saved = json.loads(recorded[-1].read_text())
    (entry,) = [e for e in saved["answer"]["kernels"] if e["notebook"] == "fit.ipynb"]
    lab = Lab(tmp_path, replay=entry)
    try:
        if state == "idle":
            (held,) = entry["held"]
            smi = saved["nvidia_smi"][held["uuid"]]
            # what nvidia-smi said of the kernel's process gives the same text as the server's figure
            assert item_text({"held": [dict(held, bytes=smi)]}) == item_text(entry)
            item = lab.item("GPU0 ")
            assert item.text == item_text(entry)
        else:
            assert entry["held_bytes"] == 0 and sum(saved["nvidia_smi"].values()) == 0
            item = lab.item("GPU parked")
            assert item.text == f"GPU parked {format_bytes(entry['parked']['bytes'])}"
            assert item.value_of_css_property("font-style") == "italic"
        if os.environ.get("GPUCLEANUP_LAB_RESULTS"):  # =1: the screenshot kept beside the answer, to commit
            lab.browser.save_screenshot(str(recorded[-1].with_suffix(".png")))
    finally:
        lab.close()


@needs_browser
def test_the_item_keeps_the_cached_figures_unit_where_it_is_not_the_held_ones(tmp_path):
    pytest.importorskip("jupyterlab")
    uuid = "GPU-00000000-0000-4000-8000-000000000001"
    held = {"gpu": uuid, "index": 0, "uuid": uuid, "bytes": 3 * GiB + 512 * MiB, "live_bytes": 3 * GiB,
            "cached_bytes": 512 * MiB, "outside_bytes": 0, "source": "nvidia-smi"}
    entry = {"id": "k", "kernel_id": "k", "notebook": "fit.ipynb", "gpucleanup": True, "parked": None,
             "state": {"state": "idle"}, "held": [held], "held_bytes": held["bytes"]}
    lab = Lab(tmp_path, replay=entry)  # an answer as a server on a GPU machine gives it
    try:
        assert lab.item("GPU0 ").text == item_text(entry) == "GPU0 3.5 GiB (512 MiB cached)"
    finally:
        lab.close()
