"""A real Jupyter kernel for every test, benchmark and soak that drives one: ipykernel started through
jupyter_client (``KernelManager``, ``BlockingKernelClient``), cells sent to it, each cell's outputs collected
from iopub until the kernel says idle for it and then its execute_reply (what a frontend waits for), and a
stop that never hangs.

Imported by path, as tests/server_harness.py is: ``sys.path.insert(0, <repository>/tests)``, then
``import kernel_harness``. jupyter_client is imported when a kernel starts, not here.

Every wait is bounded: a cell's collection raises :class:`NoReply` (a ``queue.Empty``) when the kernel says
nothing for ``timeout`` seconds, or when the whole cell outlasts ``within`` seconds; with ``watch=True`` a
kernel that dies raises :class:`KernelDied` within a second instead.
"""

from __future__ import annotations

import contextlib
import queue
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

#: seconds a kernel may stay silent (ready, a cell's next message) unless told otherwise
TIMEOUT = 60.0

#: the metadata key that names a display output as gpucleanup's own (gpucleanup.records.report.OUTPUT_TAG; not
#: imported: a benchmark's kernels may load another gpucleanup than this process)
GPUCLEANUP = "gpucleanup"


class NoReply(queue.Empty):
    """Nothing came from the kernel within the bound."""


class KernelDied(AssertionError):
    """The kernel process ended while a cell waited on it."""


@dataclass(frozen=True)
class Output:
    """One output of a cell, in the order it came.

    ``kind``: ``stdout`` or ``stderr`` (a stream), ``display`` (display_data, update_display_data), ``result``
    (execute_result), ``gpucleanup`` (a display output gpucleanup names as its own: its summary lines), ``error``,
    ``clear`` (a clear_output: no text, ``metadata["wait"]`` its wait flag).
    ``text``: what it reads as: a stream's text; the ``text/plain`` of a display output or result, then a
    newline; an error's ``ename: evalue`` and a newline.
    """

    kind: str
    text: str
    data: dict = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)


class Cell(str):
    """One cell's outputs. The string itself is every output's text in the order it came, as a notebook shows
    the cell (a ``str`` with views, as IPython's ``LSString`` is): ``"42\\n"``, ``"ZeroDivisionError: ...\\n"``.

    ``outputs``: each :class:`Output`; ``error``: the error's content (``ename``, ``evalue``, ``traceback``) or
    None; ``reply``: the execute_reply's content.
    """

    msg_id: str
    outputs: tuple
    error: Optional[dict]
    reply: dict

    def __new__(cls, msg_id: str, outputs: Sequence[Output], error: Optional[dict], reply: dict) -> "Cell":
        cell = super().__new__(cls, "".join(o.text for o in outputs))
        cell.msg_id, cell.outputs, cell.error, cell.reply = msg_id, tuple(outputs), error, reply
        return cell

    def joined(self, *kinds: str) -> str:
        """The text of the outputs of these kinds, in the order they came."""
        return "".join(o.text for o in self.outputs if o.kind in kinds)

    @property
    def stdout(self) -> str:
        return self.joined("stdout")

    @property
    def stderr(self) -> str:
        return self.joined("stderr")

    @property
    def printed(self) -> str:
        """The cell's stdout and gpucleanup's lines, in the order they came (stderr and rich outputs apart)."""
        return self.joined("stdout", GPUCLEANUP)

    @property
    def gpucleanup(self) -> str:
        """gpucleanup's own lines (each display output's text, a newline after each)."""
        return self.joined(GPUCLEANUP)

    @property
    def display(self) -> list:
        """The ``text/plain`` of every other display output and result, in order."""
        return [o.data.get("text/plain", "") for o in self.outputs if o.kind in ("display", "result")]

    @property
    def result(self) -> Optional[str]:
        """The ``text/plain`` of the cell's execute_result, or None."""
        return next((o.data.get("text/plain") for o in reversed(self.outputs) if o.kind == "result"), None)

    @property
    def error_line(self) -> Optional[str]:
        """``ename: evalue`` of the cell's error, or None."""
        return None if self.error is None else f"{self.error['ename']}: {self.error['evalue']}"

    @property
    def traceback(self) -> Optional[str]:
        return None if self.error is None else "\n".join(self.error.get("traceback") or [])


def output(kind: str, content: dict) -> Optional[Output]:
    """The output an iopub message of this kind carries, or None (status, execute_input...)."""
    if kind == "stream":
        return Output(content["name"], content["text"])
    if kind in ("display_data", "update_display_data", "execute_result"):
        data, metadata = content.get("data", {}), content.get("metadata", {})
        named = GPUCLEANUP if GPUCLEANUP in metadata else "result" if kind == "execute_result" else "display"
        return Output(named, data.get("text/plain", "") + "\n", data, metadata)
    if kind == "error":
        return Output("error", f"{content['ename']}: {content['evalue']}\n")
    if kind == "clear_output":  # no text: the cell reads the same; its place in the order is what counts
        return Output("clear", "", metadata={"wait": bool(content.get("wait"))})
    return None


class Kernel:
    """A real ipykernel, started with ``env`` as its whole environment.

    ``python``: run ipykernel with this interpreter (else the ``python3`` kernel spec as found); ``cwd``: its
    working directory; ``kernel_id``: name its connection file ``kernel-<id>.json`` in ``env``'s
    JUPYTER_RUNTIME_DIR, as Jupyter Server does (``gpucleanup ps`` shows the id); ``stdout``, ``stderr``: the
    kernel process's own output; ``ports``: its five ports (shell, iopub, stdin, hb, control) instead of ports
    jupyter_client picks; ``shutdown_wait_s``: jupyter_client's ``shutdown_wait_time``; ``ready``: wait this
    long for the kernel to answer (None: the caller calls :meth:`wait_ready`); ``timeout``: the default bound
    of a cell's waits. A kernel that fails to start or to answer is stopped before the error is raised.
    """

    def __init__(self, env: dict, *, python: Optional[str] = None, cwd=None, kernel_id: Optional[str] = None,
                 stdout=None, stderr=None, ports: Optional[Sequence[int]] = None,
                 shutdown_wait_s: Optional[float] = None, ready: Optional[float] = TIMEOUT,
                 timeout: float = TIMEOUT):
        from jupyter_client.manager import KernelManager

        self.env = env
        self.runtime = Path(env["JUPYTER_RUNTIME_DIR"]) if env.get("JUPYTER_RUNTIME_DIR") else None
        self.id = kernel_id
        self.timeout = timeout
        manager: dict = {}
        if kernel_id is not None:
            manager["connection_file"] = str(self.runtime / f"kernel-{kernel_id}.json")
        if ports is not None:
            manager["cache_ports"] = False  # the provisioner's port cache would replace the ports given
        self.km = KernelManager(**manager)
        if ports is not None:
            (self.km.shell_port, self.km.iopub_port, self.km.stdin_port, self.km.hb_port,
             self.km.control_port) = ports
        if shutdown_wait_s is not None:
            self.km.shutdown_wait_time = shutdown_wait_s
        if python is not None:
            self._run_with(python)
        launch = {name: value for name, value in (("cwd", None if cwd is None else str(cwd)), ("stdout", stdout),
                                                  ("stderr", stderr)) if value is not None}
        self.km.start_kernel(env=env, **launch)
        self.process = self.km.provisioner.process  # kept: jupyter_client lets go of it once it has ended
        self.pid = self.km.provisioner.pid
        self.kc = self.km.client()
        self.kc.start_channels()
        if ready is not None:
            self.wait_ready(ready)

    def _run_with(self, python: str) -> None:
        try:
            spec = self.km.kernel_spec
        except Exception:
            spec = None
        if spec is None:  # no kernel spec installed: one of our own
            from jupyter_client.kernelspec import KernelSpec

            self.km._kernel_spec = KernelSpec(argv=[], display_name="python3", language="python")  # noqa: SLF001
        self.km.kernel_spec.argv = [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"]

    def wait_ready(self, timeout: float = TIMEOUT) -> None:
        """Until the kernel answers (RuntimeError past ``timeout`` s, the kernel then stopped)."""
        try:
            self.kc.wait_for_ready(timeout=timeout)
        except BaseException:
            self.stop()
            raise

    # ------------------------------------------------------------ cells

    def send(self, code: str, *, silent: bool = False, store_history: Optional[bool] = None,
             user_expressions: Optional[dict] = None) -> str:
        """Sends a cell; its msg_id. Nothing here answers ``input()``: a cell that asks fails at once."""
        history = not silent if store_history is None else store_history
        return self.kc.execute(code, silent=silent, store_history=history, user_expressions=user_expressions or {},
                               allow_stdin=False)

    def collect(self, msg_id: str, timeout: Optional[float] = None, *, within: Optional[float] = None,
                watch: bool = False) -> Cell:
        """The outputs of cell ``msg_id`` until the kernel says idle for it, then its reply (replies to earlier
        requests still queued, such as ``wait_for_ready``'s extra kernel_info requests, are dropped).

        :class:`NoReply` when the kernel says nothing for ``timeout`` s (default: the kernel's), or past
        ``within`` s in all; ``watch``: a kernel that dies raises :class:`KernelDied` within a second.
        """
        timeout = self.timeout if timeout is None else timeout
        end = None if within is None else time.monotonic() + within
        outputs, error = [], None
        while True:
            msg = self._next(self.kc.iopub_channel, self.kc.get_iopub_msg, timeout, end, watch, msg_id, "idle")
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content.get("execution_state") == "idle":
                break
            if kind == "error":
                error = content
            out = output(kind, content)
            if out is not None:
                outputs.append(out)
        while True:
            reply = self._next(self.kc.shell_channel, self.kc.get_shell_msg, timeout, end, watch, msg_id, "its reply")
            if reply["parent_header"].get("msg_id") == msg_id:
                return Cell(msg_id, outputs, error, reply["content"])

    def execute(self, code: str, timeout: Optional[float] = None, *, within: Optional[float] = None,
                watch: bool = False, silent: bool = False, store_history: Optional[bool] = None,
                user_expressions: Optional[dict] = None) -> Cell:
        """Runs a cell to its end: :meth:`send`, then :meth:`collect`."""
        msg_id = self.send(code, silent=silent, store_history=store_history, user_expressions=user_expressions)
        return self.collect(msg_id, timeout, within=within, watch=watch)

    def _next(self, channel, get, timeout: float, end: Optional[float], watch: bool, msg_id: str, what: str) -> dict:
        wait = timeout if end is None else min(timeout, end - time.monotonic())
        deadline = time.monotonic() + wait
        try:
            if watch:  # a kernel that dies says nothing more: asked every second, not waited for
                while not channel.msg_ready():
                    if not self.km.is_alive():
                        raise KernelDied(f"the kernel died (exit status {self.exit_status()}) in a cell\n"
                                         f"{self.diagnose()}")
                    if time.monotonic() > deadline:
                        raise queue.Empty
                    channel.socket.poll(1000)
            if wait <= 0:
                raise queue.Empty
            return get(timeout=wait)
        except queue.Empty:
            raise NoReply(f"kernel {self.pid}: nothing within {wait:g} s while cell {msg_id} waited for "
                          f"{what}") from None

    # ------------------------------------------------------------ the process

    def exit_status(self) -> Optional[int]:
        """The kernel process's exit status (a negative number: the signal that ended it), None while it runs."""
        return self.process.poll()

    def diagnose(self) -> str:
        """What is known of the kernel when a wait fails: said in :class:`KernelDied`'s message."""
        return f"kernel {self.pid}: exit status {self.exit_status()}"

    def target(self):
        """The kernel's gpucleanup status endpoint, from its discovery file in the runtime directory."""
        import json

        from gpucleanup.protocol import discovery, status_client

        info = json.loads(discovery.path_for_pid(self.pid, self.runtime).read_text())
        return status_client.Target(info["endpoint"], Path(info["key_file"]).read_bytes())

    def status(self, timeout: float = 5) -> dict:
        """The kernel's reply to ``gpucleanup status``."""
        from gpucleanup.protocol import status_client

        return status_client.request(self.target(), "status", timeout=timeout)

    def stop(self, now: bool = True) -> None:
        """Ends the kernel and never hangs: ``now`` kills it; otherwise it is asked to shut down, as Jupyter
        does, and killed past ``shutdown_wait_time`` (5 s unless set). Again, or after a shutdown made through
        ``km``, it does nothing more."""
        with contextlib.suppress(Exception):
            self.kc.stop_channels()
        if self.km.is_alive():
            self.km.shutdown_kernel(now=now)
        elif self.km.has_kernel:  # ended by itself or by a signal: its files and sockets still go
            with contextlib.suppress(Exception):
                self.km.cleanup_resources()
