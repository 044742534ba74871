"""gpucleanup in Jupyter Server: the page ``/gpucleanup`` and its REST API.

Installed with the package (``pip install gpucleanup[server]``), the extension is enabled by the file
``etc/jupyter/jupyter_server_config.d/gpucleanup.json`` the wheel puts in the environment; from a
source tree, start the server with ``--ServerApp.jpserver_extensions='{"gpucleanup.server": true}'``.
Under the server's base URL, for a logged-in user (token, password or login cookie):

``GET gpucleanup``
    The page, the admin's view (``admin.py``): a block per GPU (used of total; held by kernels with
    gpucleanup, split into live, cached and outside every pool; parked in host memory; the rest), the
    kernels as rows of a table (by memory held, idle time or name), each row's card (devices, last cells,
    timeline), Drain, Park/Resume and Can park? per row, and "park the kernels idle for more than N min";
    refreshed every ``refresh_s``.
``GET api/gpucleanup/kernels`` (``?sort=held|idle|name``, ``?cards=ID,ID``)
    ``{"time_ns", "runtime_dir", "kernels": [...], "gpus": [...], "skipped": [...]}``: one entry per kernel
    the server runs, joined with every kernel that has a gpucleanup discovery file (see ``model.py``,
    ``admin.py``). With ``cards``, only those kernels' last cells are asked for: one request per kernel.
``GET api/gpucleanup/park-idle?min_idle_s=N`` and ``POST`` (``{"min_idle_s", "ids"}``)
    Which kernels idle that long a park would take and what it would give back; then those parks, one
    after the other, each result.
``GET api/gpucleanup/kernels/<id>``
    One entry (``id``: the kernel id, or ``pid-<pid>`` for a kernel without one); 404 if unknown.
``POST api/gpucleanup/kernels/<id>/park`` and ``.../resume``
    The kernel's whole GPU memory, its context included, to host memory and back (``gpucleanup.park.kernel_side``).
    200: ``ok``, the driver's ``state`` and one sentence; 409: refused (a cell or a drain is running,
    already parked, a restore known to fail, host memory too small); 504: no answer.
``POST api/gpucleanup/kernels/<id>/drain``
    A signed drain through the kernel's status endpoint, body ``{"timeout_s": 0 to 60}`` (optional).
    200: the result; 409: the kernel refused (a cell is running, a drain is running) or has no
    gpucleanup; 504: no answer. Subject to the server's XSRF check, as every POST.

Settings (``jupyter_server_config.py``)::

    c.GPUCleanupServer.timeout = 1.0        # seconds per kernel's status reply
    c.GPUCleanupServer.history = 50         # cells per kernel for the timeline
    c.GPUCleanupServer.refresh_s = 2.0      # the page's refresh period
    c.GPUCleanupServer.drain_timeout = 10.0 # a drain's wait for queued GPU work, by default
    c.GPUCleanupServer.park_idle_after_s = 0 # park kernels idle this long (0: never)

With ``prometheus_client`` installed, the server's own ``/metrics`` also carries every kernel's
figures (``gpucleanup.outside.metrics``).

The kernel side of gpucleanup never imports this package: jupyter_server is needed only here.
"""

from __future__ import annotations

from .auto_park import AutoPark
from .handlers import GPUCleanupServer, KernelWatch, handlers

__all__ = ["GPUCleanupServer", "_jupyter_server_extension_points", "_load_jupyter_server_extension"]


def _jupyter_server_extension_points():
    return [{"module": "gpucleanup.server"}]


#: where the loaded extension keeps its KernelWatch, in the server's tornado settings: one per server
_SETTING = "gpucleanup_watch"


def _load_jupyter_server_extension(serverapp) -> None:
    settings_ = serverapp.web_app.settings
    if settings_.get(_SETTING) is not None:
        # loaded twice on one server (listed twice, or loaded again by hand): the first load's handlers,
        # pools and parking loop serve; a second set would double every one of them
        serverapp.log.info("gpucleanup: the extension is loaded on this server already; nothing added")
        return
    settings = GPUCleanupServer(parent=serverapp, log=serverapp.log)
    watch = KernelWatch(serverapp, settings)
    settings_[_SETTING] = watch
    serverapp.web_app.add_handlers(".*$", handlers(serverapp.base_url, watch))
    _stop_with_the_server(serverapp, watch)
    _register_metrics(serverapp)
    if settings.park_idle_after_s > 0:
        watch.auto_park = AutoPark(watch, settings.park_idle_after_s, serverapp.log)
        watch.auto_park.start()
    serverapp.log.info("gpucleanup: the page of the kernels' GPU memory is at %sgpucleanup", serverapp.base_url)


def _stop_with_the_server(serverapp, watch: KernelWatch) -> None:
    """Stop the parking loop and shut the thread pools down when the server stops.

    A module extension (not an ExtensionApp) gets no ``stop_extension`` call from Jupyter Server: the
    server's stop (``ServerApp._cleanup``, from ``stop()``, Ctrl-C or ``POST /api/shutdown``, and the test
    fixtures' own cleanup) calls ``cleanup_extensions()`` first, so the watch is closed there, before the
    server's own extensions' hooks."""
    original = getattr(serverapp, "cleanup_extensions", None)
    if original is None:
        serverapp.log.warning("gpucleanup: this Jupyter Server has no cleanup_extensions(): the page's threads "
                              "end only with the process")
        return

    async def cleanup_extensions(*args, **kwargs):
        try:
            watch.close()
        except Exception as exc:  # the server's own cleanup goes on whatever happens here
            serverapp.log.warning("gpucleanup: stopping the page's threads failed: %s", exc)
        finally:
            settings_ = getattr(getattr(serverapp, "web_app", None), "settings", {})
            if settings_.get(_SETTING) is watch:
                del settings_[_SETTING]
        from jupyter_server.utils import ensure_async

        return await ensure_async(original(*args, **kwargs))

    serverapp.cleanup_extensions = cleanup_extensions


def _register_metrics(serverapp) -> None:
    """Every kernel's figures in the server's own /metrics, when prometheus_client is installed."""
    try:
        from ..outside import metrics

        register = getattr(metrics, "register_server_collector", None)
        if register is None:
            serverapp.log.info("gpucleanup: this version of gpucleanup.outside.metrics adds nothing to /metrics")
            return
        register(serverapp)
        serverapp.log.info("gpucleanup: the kernels' figures are on %smetrics", serverapp.base_url)
    except ImportError as exc:
        serverapp.log.info("gpucleanup: /metrics shows no kernel figures (%s): pip install prometheus_client", exc)
    except Exception as exc:  # the page and the API work without it
        serverapp.log.warning("gpucleanup: kernel figures could not be added to /metrics: %s", exc)
