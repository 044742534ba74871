"""Tools that work from outside every kernel: the ``gpucleanup`` command, the kernel list, metrics, the exporter."""
