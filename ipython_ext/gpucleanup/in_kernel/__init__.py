"""gpucleanup inside the user's kernel: the IPython extension, its magics, its configuration and its status endpoint."""
