"""Writes the demo notebooks of this folder (nbformat v4). Run: python share/examples/make_notebooks.py

Each notebook loads gpucleanup in its first cell and then does ordinary GPU work with no
cleanup code at all: the summary line under each cell shows what gpucleanup freed. They
run in seconds on one H100. tests/gpu/test_kernel_gpu.py runs their cells in a real kernel
and checks, after each cell, that the pools hold nothing freeable; a cell's metadata
``gpucleanup.expect_summary`` says whether its summary line must appear: ``"same-or-next"``
for a cell that only frees pinned host memory, whose release (on a background thread) may be
reported by the next cell's line ("freed in background"); ``gpucleanup.expect_text``, text the
line must contain (a cell that leaves work queued: "waited ... for queued work");
``gpucleanup.keeps_outside_bytes``, raw memory a cell keeps (or, negative, frees) on purpose.
A notebook's own ``metadata.gpucleanup.requires`` lists modules without which the test skips it.
pycuda_threads_and_pool.ipynb and tensorflow_allocators.ipynb are written by hand, not by this script.
"""

from __future__ import annotations

import pathlib

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = pathlib.Path(__file__).resolve().parent


def code(source: str, summary: bool | str = True, says: str | None = None) -> nbformat.NotebookNode:
    """A cell; ``says``: text its summary line must contain (checked by tests/gpu/test_kernel_gpu.py)."""
    meta = {"expect_summary": summary}
    if says:
        meta["expect_text"] = says
    return new_code_cell(source.strip("\n"), metadata={"gpucleanup": meta})


def notebook(title: str, text: str, cells: list) -> nbformat.NotebookNode:
    nb = new_notebook(cells=[new_markdown_cell(f"# {title}\n\n{text}")] + cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


CUPY_IMAGES = notebook(
    "CuPy: a stack of large images",
    "An image-processing loop leaves CuPy's memory pool full of freed blocks, the FFT plan cache "
    "holds work areas, and the pinned pool keeps the staging buffer. No cell frees anything by hand; "
    "the line under each cell says what gpucleanup gave back.",
    [
        # The first matrix product and FFT create cuBLAS's and cuFFT's state (cuBLAS: about 66 MiB on an H100,
        # outside every pool, kept for the life of the process); made here, it does not read as a
        # change in the cells below.
        code("%load_ext gpucleanup\nimport cupy as cp\nimport numpy as np\n"
             "_ = cp.ones((64, 64), dtype=cp.float32) @ cp.ones((64, 64), dtype=cp.float32)  # cuBLAS set-up\n"
             "_ = cp.fft.rfft2(cp.ones((64, 64), dtype=cp.float32))  # cuFFT set-up",
             summary=False),
        code('''
# 48 images of 2048 x 2048 (768 MiB), low-pass filtered one by one in Fourier space
stack = cp.random.random((48, 2048, 2048), dtype=cp.float32)
fy = cp.fft.fftfreq(2048)[:, None]
fx = cp.fft.rfftfreq(2048)[None, :]
lowpass = cp.exp(-(fx**2 + fy**2) / (2 * 0.05**2)).astype(cp.float32)
filtered = cp.empty_like(stack)
for i in range(len(stack)):
    filtered[i] = cp.fft.irfft2(cp.fft.rfft2(stack[i]) * lowpass, s=(2048, 2048))
means = filtered.mean(axis=(1, 2)).get()
del stack, filtered
print("mean brightness of the first images:", np.round(means[:4], 4))
'''),
        code('''
# copy a result to the host through pinned memory (fast transfers), then drop it
result = cp.random.random((4096, 4096), dtype=cp.float32)
staging = cp.cuda.alloc_pinned_memory(result.nbytes)
host = np.frombuffer(staging, np.float32, result.size).reshape(result.shape)
result.get(out=host)
print("checksum:", float(host[:64, :64].sum()))
del result, staging, host
'''),
        code('''
# work still queued on the GPU when the cell ends: gpucleanup waits for it (bounded) before freeing
a = cp.random.random((8192, 8192), dtype=cp.float32)
for _ in range(20):
    a = a @ a
    a /= cp.linalg.norm(a)
''', says="for queued work"),
        code("del a"),
    ],
)

TORCH_TRAINING = notebook(
    "PyTorch: a training step, then nothing left behind",
    "A model is trained for a few steps on pinned batches, then deleted. PyTorch's caching allocator "
    "keeps the memory reserved and its pinned host cache keeps the batches' buffers until "
    "gpucleanup empties them after the cell.",
    [
        code("%load_ext gpucleanup\nimport torch\nfrom torch import nn", summary=False),
        code('''
model = nn.Sequential(*[nn.Sequential(nn.Linear(4096, 4096), nn.GELU()) for _ in range(6)], nn.Linear(4096, 10)).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(10):
    x = torch.randn(1024, 4096).pin_memory().cuda(non_blocking=True)
    y = torch.randint(0, 10, (1024,)).pin_memory().cuda(non_blocking=True)
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
print("last loss:", round(loss.item(), 4))
del model, optimizer, x, y, loss
'''),
        code('''
# a pinned staging area for host-side post-processing
buffers = [torch.empty(64 << 20, dtype=torch.uint8).pin_memory() for _ in range(8)]
print("pinned:", sum(b.numel() for b in buffers) >> 20, "MiB")
del buffers
''', summary="same-or-next"),
        code('''
# work still queued when the cell ends
a = torch.randn(8192, 8192, device="cuda")
for _ in range(20):
    a = a @ a
    a = a / a.norm()
''', says="for queued work"),
        code("del a"),
    ],
)

MIXED = notebook(
    "CuPy, PyTorch and Numba in one kernel",
    "Three frameworks, three pools: CuPy's memory pool, PyTorch's caching allocator and Numba's "
    "queue of deferred frees, plus the pinned pools of CuPy and PyTorch. gpucleanup empties each one "
    "after every cell.",
    [
        code("%load_ext gpucleanup\nimport cupy as cp\nimport numpy as np\nimport torch\nfrom numba import cuda",
             summary=False),
        code('''
# CuPy makes data, PyTorch consumes it without a copy (DLPack)
x = cp.random.random((8192, 8192), dtype=cp.float32)
t = torch.from_dlpack(x)
print("sum:", float((t @ t).sum()))
del x, t
'''),
        code('''
# Numba device arrays, worked on in place by CuPy (__cuda_array_interface__: no copy)
arrays = [cuda.to_device(np.ones(32 << 20)) for _ in range(4)]   # 4 x 256 MiB
for d in arrays:
    cp.asarray(d)[:] *= 2.0
print("first:", arrays[0][:3].copy_to_host())
del arrays, d   # Numba queues these frees; gpucleanup flushes the queue
'''),
        code('''
staging = cp.cuda.alloc_pinned_memory(256 << 20)
batch = torch.empty(128 << 20, dtype=torch.uint8).pin_memory()
del staging, batch
''', summary="same-or-next"),
        code('''
b = cp.random.random((8192, 8192), dtype=cp.float32)
for _ in range(20):
    b = b @ b
    b /= cp.linalg.norm(b)
'''),
        code("%gpumem", summary=False),
        code("%gpumem --vars", summary=False),
        code("del b"),
    ],
)


def main() -> None:
    for name, nb in (("cupy_images", CUPY_IMAGES), ("torch_training", TORCH_TRAINING),
                     ("mixed_frameworks", MIXED)):
        nbformat.validate(nb)
        nbformat.write(nb, HERE / f"{name}.ipynb")
        print("wrote", HERE / f"{name}.ipynb")


if __name__ == "__main__":
    main()
