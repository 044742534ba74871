"""Shared fixtures: the fake CUDA driver and the library under test.

The fake driver (tests/fake_cuda, built by CMake with GPUCLEANUP_BUILD_TESTS=ON)
is what libgpucleanup loads in these tests, through GPUCLEANUP_LIBCUDA. The
fixture loads the same shared object with ctypes, so the test scripts the very
instance the library talks to.

GPUCLEANUP_BUILD_DIR selects the CMake build directory (default: build/).
"""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import signal

import pytest

# A suite started in the background by a script (`bash scripts/test.sh &`, nohup) inherits SIGINT ignored, and so would
# every process it starts: the tests that send Ctrl-C to a kernel, a parker or an exporter would see nothing. The
# default handler here makes the children start with SIGINT at its default again (an exec keeps only an ignore).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("GPUCLEANUP_BUILD_DIR", ROOT / "build")).resolve()
FAKE_CUDA = BUILD / "tests" / "fake_cuda" / "libcuda.so.1"
SCHEMA_DIR = ROOT / "share" / "schema"

# Nothing a test starts may write into the user's own Jupyter runtime directory:
# a status endpoint started by a test without a directory of its own lands here.
if "JUPYTER_RUNTIME_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _RUNTIME = tempfile.mkdtemp(prefix="gpucleanup-test-runtime-")
    os.environ["JUPYTER_RUNTIME_DIR"] = _RUNTIME
    atexit.register(shutil.rmtree, _RUNTIME, True)

# Before anything loads libgpucleanup: point it at the fake driver, and name the
# library explicitly (the installed package's own, else the build tree's when the
# package comes from PYTHONPATH=ipython_ext), so that subprocesses and kernels the
# tests start load the same one whichever gpucleanup they import.
os.environ.setdefault("GPUCLEANUP_LIBCUDA", str(FAKE_CUDA))
if "GPUCLEANUP_LIBRARY" not in os.environ:
    import importlib.util

    spec = importlib.util.find_spec("gpucleanup")
    packaged = None
    if spec is not None and spec.submodule_search_locations:
        packaged = pathlib.Path(list(spec.submodule_search_locations)[0]) / "libgpucleanup.so"
    os.environ["GPUCLEANUP_LIBRARY"] = str(
        packaged if packaged is not None and packaged.exists() else BUILD / "native" / "libgpucleanup.so"
    )


class FakeCuda:
    """ctypes front of tests/fake_cuda/fake_cuda_control.h."""

    def __init__(self, path: pathlib.Path):
        if not path.exists():
            pytest.fail(f"fake CUDA driver not built at {path}: run CMake with -DGPUCLEANUP_BUILD_TESTS=ON")
        self.lib = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL)
        self.lib.fake_cuda_reset.argtypes = [ctypes.c_char_p]
        self.lib.fake_cuda_reset.restype = ctypes.c_int
        self.lib.fake_cuda_update.argtypes = [ctypes.c_char_p]
        self.lib.fake_cuda_update.restype = ctypes.c_int
        self.lib.fake_cuda_counter.argtypes = [ctypes.c_char_p]
        self.lib.fake_cuda_counter.restype = ctypes.c_longlong
        self.lib.fake_cuda_release_sync.argtypes = []
        self.lib.fake_cuda_release_sync.restype = None
        self.lib.fake_cuda_state_json.argtypes = []
        self.lib.fake_cuda_state_json.restype = ctypes.c_char_p
        self.lib.fake_cuda_last_error.argtypes = []
        self.lib.fake_cuda_last_error.restype = ctypes.c_char_p

    def reset(self, scenario: dict | None = None) -> None:
        if self.lib.fake_cuda_reset(json.dumps(scenario or {}).encode()) != 0:
            raise ValueError(self.lib.fake_cuda_last_error().decode())

    def update(self, patch: dict) -> None:
        if self.lib.fake_cuda_update(json.dumps(patch).encode()) != 0:
            raise ValueError(self.lib.fake_cuda_last_error().decode())

    def counter(self, name: str) -> int:
        return self.lib.fake_cuda_counter(name.encode())

    def release_sync(self) -> None:
        self.lib.fake_cuda_release_sync()

    def state(self) -> dict:
        return json.loads(self.lib.fake_cuda_state_json().decode())


_FAKE: FakeCuda | None = None


@pytest.fixture
def fake_cuda():
    """The fake driver, reset to one idle default device; hanging syncs released afterwards."""
    global _FAKE
    if _FAKE is None:
        _FAKE = FakeCuda(FAKE_CUDA)
    _FAKE.reset({})
    yield _FAKE
    _FAKE.release_sync()


@pytest.fixture(scope="session")
def schema_registry():
    """(registry, documents) of share/schema: every schema by its $id and by its file name."""
    from referencing import Registry, Resource

    registry = Registry()
    docs = {}
    for path in SCHEMA_DIR.glob("*.schema.json"):
        doc = json.loads(path.read_text())
        docs[path.name] = doc
        resource = Resource.from_contents(doc)
        registry = registry.with_resource(doc["$id"], resource).with_resource(path.name, resource)
    return registry, docs


@pytest.fixture(scope="session")
def schemas(schema_registry):
    """The JSON schemas of share/schema, with a validator per file name."""
    import jsonschema

    registry, docs = schema_registry
    return {name: jsonschema.Draft202012Validator(doc, registry=registry) for name, doc in docs.items()}


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    """A private Jupyter runtime directory (0700) for this test, with no notebook name in the environment:
    where the kernels and status endpoints a test starts write their discovery files."""
    directory = tmp_path / "runtime"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(directory))
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    return directory
