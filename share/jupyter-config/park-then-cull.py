# Parking as the culling policy: an example jupyter_server_config.py (copy it into your own; it is not installed).
# A kernel left idle gives its GPU memory back after minutes and keeps its variables; one left for a day is ended.
# tests/python/test_park_culling.py starts a real jupyter server with this file and checks that it is taken as meant.
c = get_config()  # noqa: F821 (given by Jupyter when it loads this file)

# gpucleanup: park every kernel with gpucleanup that has been idle 30 minutes (its whole GPU memory, the CUDA context
# included, to host memory; its next cell brings it back). Idle: no cell, and no resume, since (its status endpoint).
c.GPUCleanupServer.park_idle_after_s = 30 * 60

# Jupyter Server: shut down a kernel idle for a day. Idle: nothing the kernel published for a cell, a completion, an
# inspection or a comm message (any request but kernel_info, comm_info, interrupt, shutdown and debug); a park and a
# resume from outside go through gpucleanup's own endpoint, not Jupyter's channels, and do not count.
c.MappingKernelManager.cull_idle_timeout = 24 * 3600
c.MappingKernelManager.cull_interval = 300
# A notebook left open in a browser tab keeps a connection: without this, such a kernel is parked but never culled.
c.MappingKernelManager.cull_connected = True

# A parked kernel that is shut down is resumed first (its frameworks' frees at exit would wait for a restore; a
# 32 GiB resume took 6.1 s on an H200). Jupyter waits this long for a kernel to end by itself, sending SIGTERM at half
# of it (5 s by default: SIGTERM after 2.5 s) and SIGKILL at its end. A kernel that exits at once is not held up.
c.KernelManager.shutdown_wait_time = 60.0
