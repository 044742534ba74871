"""Runs the demo notebooks in a real Jupyter kernel and prints every cell with its output.

With a GPU (a CUDA driver that reports a device, checked in a subprocess so
this process never initialises CUDA) it runs share/examples/*.ipynb for the
frameworks that are installed. Without one it runs share/demo/tour.ipynb
against the fake CUDA driver from the test suite, with a scripted device whose
driver pool holds memory, and says so; the tour ends with a park and a resume.

After the tour, the same scripted device can be explored by hand:
  --shell   an IPython shell with gpucleanup loaded (%gpumem, --vars, --plot, --park, --release)
  --server  Jupyter Server with gpucleanup's page (/gpucleanup) and its REST API, and one kernel
            with gpucleanup loaded; runs until Ctrl-C, then stops the server and its kernel
  --lab     the same, with JupyterLab (the test set-up installs it): the notebook of that kernel at /lab,
            gpucleanup's item in the status bar and its section in the Running panel

Every mode on the fake driver gets a checkpoint directory of its own (the fake's
checkpoint calls keep their state there, so parking works), removed at the end.

Usage: python scripts/demo.py [NOTEBOOK ...] [--fake-driver PATH]
       python scripts/demo.py --shell [--fake-driver PATH]
       python scripts/demo.py --server|--lab [--port N] [--fake-driver PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Iterator, Optional

import nbformat
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOUR = ROOT / "share" / "demo" / "tour.ipynb"

# A device whose primary context is active (the kernel "uses" it) and whose
# default memory pool keeps 6 GiB reserved with 512 MiB in use: the drain
# after the first cell trims the 5.5 GiB nobody uses.
FAKE_SCENARIO = {
    "devices": [
        {
            "name": "Fake H100 (scripted)",
            "total_bytes": 85520809984,
            "free_bytes": 70000000000,
            "primary_active": True,
            "default_pool": {"reserved_bytes": 6 << 30, "used_bytes": 512 << 20},
        }
    ]
}

# The tour's last cells on the fake driver: parking needs the fake's checkpoint directory, which only a
# run of this script provides, so they are not in the notebook (which also runs without one).
PARK_CELLS = ["x = 41\n%gpumem --park", "x + 1  # the next cell brings the GPU memory back first"]

# notebook -> the frameworks it needs
GPU_NOTEBOOKS = {
    "cupy_images.ipynb": ("cupy",),
    "torch_training.ipynb": ("torch",),
    "mixed_frameworks.ipynb": ("cupy", "torch", "numba"),
}

SHELL_HINTS = """\
An IPython shell with gpucleanup loaded, on the fake CUDA driver of the test suite: one scripted device
({name}) whose driver pool keeps 6.0 GiB reserved, 512 MiB of it in use. Try:
  %gpumem              the device, its pools and the last cells
  %gpumem --vars       the GPU arrays and tensors this shell keeps (none: no framework runs on the fake)
  %gpumem --plot       the device's memory over the last cells, as sparklines
  %gpumem --park       park this process's GPU memory in host memory; the next line you run brings it back
  %gpumem --release out   let go of the output cache's GPU arrays and say what came back
  %gpumem?             every option
exit (or Ctrl-D) leaves.
"""

STOP_TIMEOUT_S = 30  # the server's shutdown, its kernel's included
READY_TIMEOUT_S = 60  # the server listening, the kernel started, gpucleanup loaded in it


def gpu_present() -> bool:
    code = (
        "import ctypes,sys\n"
        "try: lib = ctypes.CDLL('libcuda.so.1')\n"
        "except OSError: sys.exit(1)\n"
        "n = ctypes.c_int(0)\n"
        "sys.exit(0 if lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(n)) == 0 and n.value > 0 else 1)\n"
    )
    return subprocess.run([sys.executable, "-c", code]).returncode == 0


@contextlib.contextmanager
def fake_device(fake_driver: pathlib.Path) -> Iterator[dict]:
    """The environment of a process on the scripted device, with a checkpoint directory of its own (removed
    on leaving) so that parking works there."""
    if not fake_driver.exists():
        sys.exit(f"demo: the fake CUDA driver is not built ({fake_driver}): bash scripts/demo.sh builds it")
    with tempfile.TemporaryDirectory(prefix="gpucleanup-demo-checkpoints-") as checkpoints:
        yield {
            "GPUCLEANUP_LIBCUDA": str(fake_driver),
            "GPUCLEANUP_FAKE_CUDA_SCENARIO": json.dumps(FAKE_SCENARIO),
            "GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR": checkpoints,
        }


def show(nb_path: pathlib.Path, env: dict, extra_cells: tuple = ()) -> int:
    nb = nbformat.read(nb_path, as_version=4)
    nb.cells.extend(nbformat.v4.new_code_cell(source) for source in extra_cells)
    print(f"=== {nb_path.relative_to(ROOT)} (real Jupyter kernel: {sys.executable} -m ipykernel)")
    old_env = dict(os.environ)
    os.environ.update(env)
    try:
        # The kernel talks to this process over ipc sockets in a private directory: over TCP, ipykernel warns
        # on its stderr (which is this terminal) that the channel is not encrypted.
        # Its own stderr (other packages' warnings) is kept apart and shown after the cells, named as such.
        with tempfile.TemporaryDirectory(prefix="gpucleanup-demo-") as sockets, \
                tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as kernel_stderr:
            km = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(sockets, "kernel"),
                               connection_file=os.path.join(sockets, "kernel.json"))
            NotebookClient(nb, km=km, timeout=600, allow_errors=True).execute(stderr=kernel_stderr)
            kernel_stderr.seek(0)
            stray = kernel_stderr.read()
    finally:
        os.environ.clear()
        os.environ.update(old_env)
    failed = 0
    for n, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        prompt = f"In [{n + 1}]: "
        print("\n" + prompt + cell.source.replace("\n", "\n" + " " * len(prompt)))
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                sys.stdout.write(out.text)
            elif out.output_type in ("execute_result", "display_data"):
                print(out.data.get("text/plain", ""))
            elif out.output_type == "error":
                print(f"{out.ename}: {out.evalue}")
                failed += out.ename not in ("UsageError",)
    if stray.strip():
        print("\n--- the kernel process's own stderr (not a cell's output):")
        sys.stdout.write(stray if stray.endswith("\n") else stray + "\n")
    print()
    return failed


def tour(notebooks: list, fake_driver: pathlib.Path) -> int:
    if not notebooks and gpu_present():
        notebooks = [ROOT / "share" / "examples" / nb for nb, needs in GPU_NOTEBOOKS.items()
                     if all(importlib.util.find_spec(mod) is not None for mod in needs)]
    if notebooks:
        return 1 if sum(show(nb, {}) for nb in notebooks) else 0
    print("No GPU here: running the tour against the fake CUDA driver of the test suite "
          f"({fake_driver}), with one scripted device. On a GPU machine the same command "
          "runs share/examples/ on the real device.\n")
    with fake_device(fake_driver) as env:
        failed = show(TOUR, env, extra_cells=tuple(PARK_CELLS))
    print("Explore the same scripted device by hand: bash scripts/demo.sh --shell (IPython) "
          "or bash scripts/demo.sh --server (Jupyter Server with gpucleanup's page).")
    return 1 if failed else 0


@contextlib.contextmanager
def sigint_to_child_only() -> Iterator[None]:
    """Ctrl-C reaches the whole foreground process group: the child (IPython) handles it, this process must
    not die of it. A Python handler, not SIG_IGN: an ignored SIGINT would be inherited, a handler is not."""
    previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def shell(fake_driver: pathlib.Path) -> int:
    print(SHELL_HINTS.format(name=FAKE_SCENARIO["devices"][0]["name"]), flush=True)
    with fake_device(fake_driver) as env, sigint_to_child_only():
        return subprocess.run([sys.executable, "-m", "IPython", "--ext=gpucleanup", "--no-banner"],
                              env=dict(os.environ, **env)).returncode


class Server:
    """``python -m jupyter_server`` with gpucleanup's server extension, in a session of its own (Ctrl-C in the
    terminal reaches this process only, which then shuts the server down: no "Shutdown this server?")."""

    def __init__(self, env: dict, root: pathlib.Path, sockets: str, port: Optional[int]):
        from jupyter_core.paths import jupyter_runtime_dir

        self.token = secrets.token_hex(24)
        # the token in the environment (JUPYTER_TOKEN: /proc/<pid>/environ is readable by this user alone), never
        # in the arguments, which every local user reads in /proc/<pid>/cmdline
        env = dict(env, JUPYTER_TOKEN=self.token)
        self.env = env
        argv = [sys.executable, "-m", "jupyter_server", "--no-browser", "--ServerApp.ip=127.0.0.1",
                f"--ServerApp.root_dir={root}",
                "--ServerApp.jpserver_extensions=gpucleanup.server=True", "--ServerApp.log_level=WARN",
                # ipc sockets: over TCP, ipykernel warns on its stderr (this terminal); in a directory with a
                # short name, as a socket's path is at most 107 bytes (the runtime directory's can be longer)
                "--KernelManager.transport=ipc", f"--KernelManager.ip={sockets}/kernel"]
        if port is not None:
            argv += [f"--port={port}", "--ServerApp.port_retries=0"]
        if os.geteuid() == 0:
            argv.append("--allow-root")
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        # where the server writes jpserver-<pid>.json (its URL: the port it found) and its kernels' connection files
        with _environ(env):
            self.runtime = pathlib.Path(jupyter_runtime_dir())
        self.url = ""
        self.kernel_pids: list = []

    def wait_ready(self) -> None:
        info = self.runtime / f"jpserver-{self.proc.pid}.json"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"Jupyter Server exited with status {self.proc.returncode} (its messages are above)")
            if info.exists() and not self.url:
                with contextlib.suppress(ValueError, OSError):
                    self.url = json.loads(info.read_text())["url"].rstrip("/")
            if self.url:
                with contextlib.suppress(OSError):
                    if self.request("GET", "/api/status")[0] == 200:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"Jupyter Server did not answer within {READY_TIMEOUT_S} s")
            time.sleep(0.1)

    def request(self, method: str, path: str, body: Optional[dict] = None) -> tuple:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=READY_TIMEOUT_S) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode(errors="replace")

    def start_kernel(self, path: str) -> dict:
        status, session = self.request("POST", "/api/sessions",
                                       {"path": path, "type": "notebook", "kernel": {"name": "python3"}})
        if status != 201:
            raise RuntimeError(f"the server did not start a kernel: {status} {session}")
        return session["kernel"]

    def entry(self, kernel_id: str) -> Optional[dict]:
        status, entry = self.request("GET", f"/api/gpucleanup/kernels/{kernel_id}")
        return entry if status == 200 else None

    def stop(self) -> None:
        """The server's own shutdown (it stops its kernels), bounded; then SIGTERM, then SIGKILL."""
        if self.proc.poll() is None and self.url:
            with contextlib.suppress(OSError):
                self.request("POST", "/api/shutdown")
        for stop in (None, self.proc.terminate, self.proc.kill):
            if self.proc.poll() is not None:
                break
            if stop is not None:
                stop()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=STOP_TIMEOUT_S)
        for pid in self.kernel_pids:  # a server killed above left its kernel running
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running, and not a zombie waiting for its (new) parent to reap it."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@contextlib.contextmanager
def _environ(env: dict) -> Iterator[None]:
    old = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(old)


def run_first_cell(runtime: pathlib.Path, kernel_id: str, code: str) -> str:
    """``code`` run in the kernel through its connection file; its stream output and errors."""
    from jupyter_client import BlockingKernelClient

    kc = BlockingKernelClient(connection_file=str(runtime / f"kernel-{kernel_id}.json"))
    kc.load_connection_file()
    kc.start_channels(hb=False)  # the server watches the kernel's heartbeat
    try:
        kc.wait_for_ready(timeout=READY_TIMEOUT_S)
        out: list = []

        def collect(msg: dict) -> None:
            content = msg["content"]
            if msg["msg_type"] == "stream":
                out.append(content["text"])
            elif msg["msg_type"] in ("display_data", "execute_result"):
                out.append(content["data"].get("text/plain", "") + "\n")
            elif msg["msg_type"] == "error":
                out.append(f"{content['ename']}: {content['evalue']}\n")

        kc.execute_interactive(code, timeout=READY_TIMEOUT_S, output_hook=collect)
        return "".join(out)
    finally:
        kc.stop_channels()


def wait_for_gpucleanup(server: Server, kernel_id: str) -> dict:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        entry = server.entry(kernel_id)
        if entry and entry.get("gpucleanup") and entry.get("state"):
            return entry
        if time.monotonic() > deadline:
            raise RuntimeError(f"gpucleanup's page does not list the kernel {kernel_id} within {READY_TIMEOUT_S} s")
        time.sleep(0.1)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def server(fake_driver: pathlib.Path, port: Optional[int], lab: bool = False) -> int:
    if lab and importlib.util.find_spec("jupyterlab") is None:
        print("demo: --lab needs JupyterLab in this environment (bash scripts/setup.sh installs it with the tests' "
              "packages), or use --server", file=sys.stderr)
        return 2
    print("Starting Jupyter Server with gpucleanup's page, on the fake CUDA driver of the test suite "
          f"(one scripted device, {FAKE_SCENARIO['devices'][0]['name']}) ...", flush=True)
    with fake_device(fake_driver) as fake, \
            tempfile.TemporaryDirectory(prefix="gpucleanup-demo-notebooks-") as root, \
            tempfile.TemporaryDirectory(prefix="gpucleanup-ipc-") as sockets:
        shutil.copy(TOUR, pathlib.Path(root) / "tour.ipynb")
        env = dict(os.environ, **fake)
        # Ctrl-C, and a plain kill too, stop the server and its kernel (also where a shell started this
        # process with SIGINT ignored, as it does for a job started with &)
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _interrupt)
        srv = None
        try:
            srv = Server(env, pathlib.Path(root), sockets, port)
            srv.wait_ready()
            kernel = srv.start_kernel("tour.ipynb")
            code = "%load_ext gpucleanup"
            print(f"\nIn [1]: {code}  (run in the server's kernel {kernel['id']})")
            sys.stdout.write(run_first_cell(srv.runtime, kernel["id"], code))
            entry = wait_for_gpucleanup(srv, kernel["id"])
            if entry.get("pid"):
                srv.kernel_pids.append(entry["pid"])
            cli = (f"GPUCLEANUP_LIBCUDA={fake['GPUCLEANUP_LIBCUDA']} "
                   f"GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR={fake['GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR']} "
                   f"{pathlib.Path(sys.executable).parent / 'gpucleanup'}")
            print(f"\nJupyter Server is running (pid {srv.proc.pid}), with one kernel (pid {entry.get('pid')}) "
                  "that has gpucleanup loaded and can be parked:")
            if lab or importlib.util.find_spec("jupyterlab") is not None:  # --lab: checked above, said first
                print(f"  lab:    {srv.url}/lab/tree/tour.ipynb?token={srv.token}   (the notebook of that kernel; "
                      "gpucleanup's item in the status bar, its section in the Running panel)")
            print(f"  page:   {srv.url}/gpucleanup?token={srv.token}   (Park, Resume, Drain buttons)")
            print(f"  API:    {srv.url}/api/gpucleanup/kernels?token={srv.token}")
            print(f"  CLI:    {cli} ps   (or park / resume {kernel['id']}; in another terminal)")
            print("The notebook directory and the checkpoint directory are temporary and go with the server.")
            print("Ctrl-C stops the server and its kernel.", flush=True)
            srv.proc.wait()
            print(f"demo: Jupyter Server exited on its own, with status {srv.proc.returncode}")
            return 1
        except KeyboardInterrupt:
            print("\ndemo: stopping Jupyter Server and its kernel ...", flush=True)
            return 0
        except RuntimeError as error:
            print(f"demo: {error}", file=sys.stderr)
            return 1
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, signal.SIG_IGN)  # the stop below is bounded: let it finish
            if srv is not None:
                srv.stop()
                print(f"demo: Jupyter Server stopped (status {srv.proc.returncode})", flush=True)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     usage="%(prog)s [NOTEBOOK ...] | --shell | --server|--lab [--port N]  "
                                           "[--fake-driver PATH]")
    parser.add_argument("notebooks", nargs="*", type=pathlib.Path, help="notebooks to run instead of the tour")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--shell", action="store_true",
                      help="an IPython shell with gpucleanup loaded on the fake driver's scripted device")
    mode.add_argument("--server", action="store_true",
                      help="Jupyter Server with gpucleanup's page and a kernel on the scripted device, until Ctrl-C")
    mode.add_argument("--lab", action="store_true",
                      help="the same, the kernel's notebook in JupyterLab with gpucleanup's status item")
    parser.add_argument("--port", type=int, default=None,
                        help="the server's port (default: 8888, or the next free one)")
    parser.add_argument("--fake-driver", type=pathlib.Path, default=ROOT / "build" / "tests" / "fake_cuda" / "libcuda.so.1")
    args = parser.parse_args(argv)
    if (args.shell or args.server or args.lab) and args.notebooks:
        parser.error("--shell, --server and --lab run no notebook: give one or the other")
    if args.port is not None and not (args.server or args.lab):
        parser.error("--port goes with --server or --lab")
    missing = [str(nb) for nb in args.notebooks if not nb.is_file()]
    if missing:
        parser.error(f"no such notebook: {', '.join(missing)}")
    if args.shell:
        return shell(args.fake_driver)
    if args.server or args.lab:
        return server(args.fake_driver, args.port, lab=args.lab)
    return tour(list(args.notebooks), args.fake_driver)


if __name__ == "__main__":
    sys.exit(main())
