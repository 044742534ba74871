"""gpucleanup's JupyterLab extension: built from its sources, installed with the package, and shown by a real
JupyterLab (from PyPI) in headless Chromium against kernels on the fake CUDA driver."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpucleanup.units import format_bytes
from support import ROOT

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
    meta = json.loads((BUILT / "package.json").read_text())
    assert meta["jupyterlab"]["_build"]["load"] == "static/" + next(n for n in _files(out) if n.startswith("remoteEntry"))


def test_jupyterlab_lists_the_installed_extension_enabled():
    pytest.importorskip("jupyterlab")
    done = subprocess.run([sys.executable, "-m", "jupyter", "labextension", "list"], capture_output=True, text=True,
                          timeout=120)
    listed = [line for line in (done.stdout + done.stderr).splitlines() if line.strip().startswith("gpucleanup ")]
    assert len(listed) == 1 and "enabled" in listed[0] and "OK" in listed[0], done.stdout + done.stderr


def _expected(entry: dict) -> str:
    """The item's text for an entry of the server's API, by the rule the extension follows (src/index.js)."""
    parts = []
    for held in entry["held"]:
        if held["bytes"] > 0:
            cached = f" ({format_bytes(held['cached_bytes']).split()[0]} cached)" if held["cached_bytes"] > 0 else ""
            parts.append(f"GPU{held['index']} {format_bytes(held['bytes'])}{cached}")
    return " · ".join(parts)


@pytest.mark.skipif(not (CHROMIUM.exists() and CHROMEDRIVER.exists()), reason="needs chromium and chromium-driver")
def test_the_status_item_shows_the_figures_of_the_kernel_in_focus(tmp_path):
    pytest.importorskip("jupyterlab")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    from test_server import TIMEOUT, Server

    srv = Server(tmp_path / "srv")
    browser = None
    try:
        # every kernel the server starts loads gpucleanup, as the README's set-up does
        profile = tmp_path / "srv" / "ipython" / "profile_default"
        profile.mkdir(parents=True)
        (profile / "ipython_kernel_config.py").write_text("c.InteractiveShellApp.extensions = ['gpucleanup']\n")
        kernelspec = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
        (srv.root / "fit.ipynb").write_text(json.dumps({"cells": [], "metadata": {"kernelspec": kernelspec},
                                                         "nbformat": 4, "nbformat_minor": 5}))
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--window-size=1400,900"):
            options.add_argument(argument)
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS")}
        browser = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER), env=env))
        browser.get(f"{srv.url}/lab/tree/fit.ipynb?token={srv.token}")

        def shown(driver):
            items = driver.find_elements("css selector", ".gpucleanup-status")
            return items[0] if items and items[0].text and items[0].get_attribute("data-kernel") else False

        item = WebDriverWait(browser, TIMEOUT, poll_frequency=0.1).until(shown, message="no gpucleanup status item")
        kernel_id = item.get_attribute("data-kernel")
        entry = srv.entry(kernel_id)
        assert entry["gpucleanup"] and entry["held_bytes"] > 0, entry
        assert item.text == _expected(entry)
    finally:
        if browser is not None:
            if os.environ.get("GPUCLEANUP_LAB_SCREENSHOT"):
                browser.save_screenshot(os.environ["GPUCLEANUP_LAB_SCREENSHOT"])
            browser.quit()
        srv.stop()
