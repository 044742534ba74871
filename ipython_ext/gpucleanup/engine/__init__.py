"""The after-cell engine: what one cell's pass finds and frees, device by device, with no IPython in it."""
