"""How a kernel is found and asked from outside it: discovery records, signed status requests, notebook paths."""
