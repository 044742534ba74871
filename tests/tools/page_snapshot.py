"""The page /gpucleanup drawn from a recorded answer of its API, in headless Chromium, as a PNG.

The GPU machine has no browser; its GPU test (tests/gpu/test_server_gpu.py with GPUCLEANUP_ARTIFACTS) records
what ``GET /api/gpucleanup/kernels`` answered there. This serves the package's own page (static/index.html,
page.js, page.css, rendered as gpucleanup.server renders them) with that recorded answer as the API, and
takes a screenshot with Debian's Chromium through Selenium. The page cannot tell the difference: it draws
the recorded kernels, devices, last cells and timelines exactly as it drew the live ones.

Usage: python tests/tools/page_snapshot.py RECORDED.json OUT.png [--width 1280]
(scripts/page_snapshot.sh installs what it needs first.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
from pathlib import Path

import tornado.httpserver
import tornado.ioloop
import tornado.web
from tornado import template

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "ipython_ext"))
from gpucleanup import __version__  # noqa: E402
from gpucleanup.server.handlers import STATIC  # noqa: E402


class Page(tornado.web.RequestHandler):
    def get(self):
        page = template.Loader(str(STATIC)).load("index.html").generate(base_url="/", refresh_s="2",
                                                                         version=__version__)
        self.set_header("Content-Type", "text/html; charset=UTF-8")
        self.finish(page)


class Recorded(tornado.web.RequestHandler):
    def initialize(self, answer: dict):
        self.answer = answer

    def get(self):
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(self.answer))


def serve(answer: dict) -> tuple:
    """The page and the recorded API on a free loopback port, on a thread of its own: (port, stop)."""
    ready = threading.Event()
    state = {}

    def run():
        asyncio.set_event_loop(asyncio.new_event_loop())
        loop = tornado.ioloop.IOLoop.current()
        app = tornado.web.Application([
            (r"/gpucleanup/?", Page),
            (r"/gpucleanup/static/(.*)", tornado.web.StaticFileHandler, {"path": str(STATIC)}),
            (r"/api/gpucleanup/kernels", Recorded, {"answer": answer}),
        ])
        server = tornado.httpserver.HTTPServer(app)
        sockets = tornado.netutil.bind_sockets(0, "127.0.0.1")
        server.add_sockets(sockets)
        state.update(port=sockets[0].getsockname()[1], loop=loop, server=server)
        ready.set()
        loop.start()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    if not ready.wait(30):
        raise RuntimeError("the page server did not start within 30 s")

    def stop():
        state["loop"].add_callback(state["server"].stop)
        state["loop"].add_callback(state["loop"].stop)
        thread.join(30)

    return state["port"], stop


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recorded", type=Path, help="a recorded answer of GET /api/gpucleanup/kernels")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--width", type=int, default=1280)
    args = parser.parse_args(argv)
    answer = json.loads(args.recorded.read_text())

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", f"--window-size={args.width},900"):
        options.add_argument(flag)
    port, stop = serve(answer)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    try:
        driver.get(f"http://127.0.0.1:{port}/gpucleanup")
        expected = len(answer.get("kernels") or [])
        WebDriverWait(driver, 30).until(
            lambda d: d.execute_script("return document.querySelectorAll('#rows > tr.kernel-row').length") == expected)
        # every row's card open: the figures, last cells and timeline of each kernel
        driver.execute_script("document.querySelectorAll('#rows button.open').forEach((b) => b.click())")
        WebDriverWait(driver, 30).until(
            lambda d: d.execute_script("return document.querySelectorAll('#rows section.kernel').length") == expected)
        height = driver.execute_script("return document.documentElement.scrollHeight")
        # the whole page, not the window's part of it
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                               {"width": args.width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        driver.save_screenshot(str(args.out))
    finally:
        driver.quit()
        stop()
    print(f"page_snapshot: {expected} kernels drawn from {args.recorded} into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
