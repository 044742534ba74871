"""gpucleanup on Dask workers: ``gpucleanup.dask.register(client)`` installs :class:`GPUCleanupPlugin` on every worker.

The names below come from :mod:`.plugin` at first use: every kernel imports :mod:`.workers`, which must not import
``distributed`` (and Tornado with it) where nothing uses Dask.
"""

__all__ = ["GPUCleanupPlugin", "register", "unregister", "cluster_memory", "drain_cluster", "PLUGIN_NAME"]


def __getattr__(name: str):
    if name in __all__:
        from . import plugin

        return getattr(plugin, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
