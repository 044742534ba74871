"""gpucleanup in Jupyter Server: the page ``/gpucleanup``, its REST API and every kernel's figures in ``/metrics``.

The handlers and their routes are :mod:`.handlers`'s (each says its request and answers), the entries they list
:mod:`.model`'s and :mod:`.admin`'s, the automatic park :mod:`.auto_park`'s; README "In the browser" tells the page,
the API and the ``GPUCleanupServer`` settings. The kernel side of gpucleanup never imports this package:
jupyter_server is needed only here.
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
