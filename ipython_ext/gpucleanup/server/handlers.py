"""The REST API, the page and its static files, as tornado handlers of Jupyter Server.

Every handler is authenticated (the server's token, password or login cookie) and authorised on the
resource ``kernels``: reading it for the lists and the page, writing it for a drain, a park or a resume. POST requests go
through Jupyter Server's XSRF check (a token-authenticated request is exempt, as everywhere in the
server). Status requests block for up to their timeout, so they run on a small thread pool of
their own, never on the server's event loop; drains, which wait for a kernel's GPU, on another, so
that drains to kernels that do not answer never hold up the list.
"""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Dict, List, Optional

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler, AuthenticatedFileHandler, JupyterHandler
from jupyter_server.utils import ensure_async, url_path_join
from tornado import template, web
from traitlets import Float, Int
from traitlets.config import LoggingConfigurable

from ..protocol import discovery
from ..outside import kernels
from ..park import steps as park_steps, kernel_side as parking, from_outside as remote_park
from ..protocol import status_client
from ..say import printable
from ..version import __version__
from . import admin, model

STATIC = Path(__file__).resolve().parent / "static"

#: the authorisation resource of every handler here: the page and the API are about kernels
AUTH_RESOURCE = "kernels"

#: status_client's refusals that mean "not now" (409): not idle, another drain running, drain disabled; a park
#: step the kernel's state does not allow, parking disabled
_CONFLICTS = {"gpucleanup.server.411", "gpucleanup.server.412", "gpucleanup.server.413", "gpucleanup.server.418",
              "gpucleanup.server.420"}


class GPUCleanupServer(LoggingConfigurable):
    """Settings of the page and the REST API (``c.GPUCleanupServer.<name>`` in jupyter_server_config.py,
    or ``--GPUCleanupServer.<name>=<value>`` on the command line)."""

    timeout = Float(
        1.0, min=0.01, max=60.0,
        help="Seconds to wait at most for each kernel's status reply (kernels are asked at once).",
    ).tag(config=True)

    history = Int(
        50, min=0, max=10000,
        help=("Cells per kernel to read for the timeline (each kernel keeps its last GPUCleanup.history_size, "
              "100 by default); 0: the last cell only."),
    ).tag(config=True)

    refresh_s = Float(
        2.0, min=0.5, max=3600.0,
        help="Seconds between two refreshes of the page /gpucleanup while it is open.",
    ).tag(config=True)

    drain_timeout = Float(
        10.0, min=0.0, max=60.0,
        help="Seconds a drain waits at most for the kernel's queued GPU work, when the request names none.",
    ).tag(config=True)


    park_idle_after_s = Float(
        0.0, min=0.0, max=30 * 24 * 3600.0,
        help=("Park every kernel with gpucleanup that has been idle this many seconds (its whole GPU memory, the "
              "CUDA context included, to host memory; its next cell brings it back). 0, the default, never parks "
              "a kernel by itself. Only kernels this server may ask (the same user, this PID namespace)."),
    ).tag(config=True)


class KernelWatch:
    """Collects the API's data: the server's kernels and every kernel's status reply.

    Requests that arrive while a collection runs share it: many open pages cost one round of status
    requests, not one each.
    """

    def __init__(self, serverapp, settings: GPUCleanupServer):
        self.serverapp = serverapp
        self.settings = settings
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="gpucleanup-server")
        # Drains wait for a kernel's GPU (up to a minute each): a pool of their own, so that drains to kernels
        # that do not answer never hold the threads the list and the page need.
        self._drains = ThreadPoolExecutor(max_workers=4, thread_name_prefix="gpucleanup-drain")
        # one collection per set of cards whose history is wanted (None: every kernel's), shared by the
        # requests that arrive while it runs
        self._pending: Dict[object, asyncio.Future] = {}
        #: park checks per kernel pid: (when asked, its future), shared by requests within CHECK_SHARED_S seconds
        #: (each costs a helper process and nvidia-smi: viewers asking again must not slow an admin's park); a
        #: park or a resume of that kernel forgets its entry
        self.park_checks: Dict[int, tuple] = {}
        self._stopped = False
        #: the automatic park (GPUCleanupServer.park_idle_after_s > 0), stopped with the watch
        self.auto_park = None

    def close(self) -> None:
        """The server stops: no new work, the automatic parking's timer stopped, both pools shut down (work
        queued and not started is cancelled; a status request under way ends within its timeout, a park under
        way runs to its end, as a park must). Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self.auto_park is not None:
            self.auto_park.stop()
        for pool in (self._executor, self._drains):
            pool.shutdown(wait=False, cancel_futures=True)

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def runtime_dir(self) -> Path:
        # Where the kernels write their discovery files: their JUPYTER_RUNTIME_DIR, which they
        # inherit from this server's environment.
        return discovery.runtime_dir()

    def run(self, function, *args, **kwargs):
        return asyncio.get_running_loop().run_in_executor(self._executor, partial(function, *args, **kwargs))

    def drain(self, target: status_client.Target, wait: float, drain_timeout: float):
        """A drain request to ``target``, on the drains' own pool (never the list's)."""
        return asyncio.get_running_loop().run_in_executor(
            self._drains, partial(status_client.request, target, "drain", wait, timeout_s=drain_timeout))

    def park(self, kernel: discovery.Kernel, target: status_client.Target, action: str, automatic: bool = False):
        """Park or resume ``kernel`` (gpucleanup.park.from_outside, each step in a helper process), on the drains'
        pool: a park moves the kernel's whole device memory and may take minutes. ``automatic``: the
        policy's park (``park_idle_after_s``), which a kernel refuses while a thread a cell started runs on."""
        lock = parking.lock_path(kernel.key_file, kernel.pid)
        self.park_checks.pop(kernel.pid, None)
        if action == "park":
            call = partial(remote_park.park_from_outside, kernel.pid, target, self.settings.timeout, lock, automatic)
        else:
            call = partial(remote_park.resume_from_outside, kernel.pid, target, self.settings.timeout, lock, 0.0)
        future = asyncio.get_running_loop().run_in_executor(self._drains, call)
        future.add_done_callback(lambda _: self.park_checks.pop(kernel.pid, None))
        return future

    CHECK_SHARED_S = 2.0

    def park_check(self, kernel: discovery.Kernel, target: status_client.Target):
        """``remote_park.check_kernel`` for ``kernel``, one at a time per kernel, its answer shared for
        :data:`CHECK_SHARED_S` seconds; on the drains' pool (a helper's look at the driver, nvidia-smi)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        for pid in [p for p, (when, _) in self.park_checks.items() if now - when > self.CHECK_SHARED_S]:
            del self.park_checks[pid]
        shared = self.park_checks.get(kernel.pid)
        if shared is None:
            lock = parking.lock_path(kernel.key_file, kernel.pid)
            check = partial(remote_park.check_kernel, kernel.pid, target, self.settings.timeout, lock)
            shared = self.park_checks[kernel.pid] = (now, loop.run_in_executor(self._drains, check))
        return shared[1]

    async def server_kernels(self) -> List[dict]:
        """This server's kernels: id, notebook path (its session's), pid, execution state."""
        app = self.serverapp
        notebooks: Dict[str, str] = {}
        session_manager = getattr(app, "session_manager", None)
        if session_manager is not None:
            for session in await ensure_async(session_manager.list_sessions()):
                kernel = session.get("kernel") or {}
                if kernel.get("id") and session.get("path") and kernel["id"] not in notebooks:
                    notebooks[kernel["id"]] = session["path"]
        found = []
        manager = app.kernel_manager
        for model_ in await ensure_async(manager.list_kernels()):
            kernel_id = model_.get("id")
            pid = None
            try:
                provisioner = getattr(manager.get_kernel(kernel_id), "provisioner", None)
                pid = getattr(provisioner, "pid", None)
            except KeyError:
                pass  # shut down meanwhile
            found.append({
                "kernel_id": kernel_id,
                "notebook": notebooks.get(kernel_id),
                "pid": pid if isinstance(pid, int) else None,
                "execution_state": model_.get("execution_state"),
            })
        return found

    async def _collect(self, cards: Optional[frozenset]) -> dict:
        ours = await self.server_kernels()
        # A read removes nothing: whoever may read the list (a read-only user included) must not delete
        # files; stale files are swept by the next kernel that loads gpucleanup, and by gpucleanup ps.
        # Every kernel is asked once (its status, and its last cells too when every card is wanted); nvidia-smi
        # looks at the GPUs and at their processes meanwhile, on two other threads of the pool.
        history = self.settings.history if cards is None else 0
        smi_timeout = max(1.0, self.settings.timeout)
        gathered, gpus, apps = await asyncio.gather(
            self.run(kernels.gather, self.runtime_dir, self.settings.timeout, history, clean=False),
            self.run(park_steps.gpus, smi_timeout), self.run(park_steps.compute_apps, smi_timeout))
        view = admin.GpuView(gpus, apps if gpus is not None else None)
        if cards and self.settings.history > 0:
            # the last cells of the open cards only: a second request to those kernels alone
            await self.run(_histories, gathered, cards, self.settings.timeout, self.settings.history)
        root = getattr(self.serverapp, "root_dir", None)
        # reading /proc and the kernels' files, and building the answer: on the pool too, off the event loop
        return await self.run(_answer, ours, gathered, view, root)

    async def collect(self, cards: Optional[frozenset] = None) -> dict:
        """The API's answer; ``cards``: the ids whose last cells and timeline are wanted (None: every
        kernel's, as ``GET api/gpucleanup/kernels`` without ``cards`` answers)."""
        if self._stopped:
            raise web.HTTPError(503, "%s", "the server is stopping")
        pending = self._pending.get(cards)
        if pending is None:
            pending = self._pending[cards] = asyncio.ensure_future(self._collect(cards))

            def done(_future):
                if self._pending.get(cards) is pending:
                    del self._pending[cards]

            pending.add_done_callback(done)
        # shielded: a client that goes away does not cancel the round the others wait for
        return await asyncio.shield(pending)

    async def park_one(self, key: str, action: str) -> tuple:
        """Park or resume the kernel ``key``: ``(HTTP status, body)``, the body as ``POST .../park`` answers
        it (a refusal's too: ``{"id", "ok": false, "refused": true, "message"}``)."""
        try:
            kernel = await self.find(key)
            if not kernel.key_file:
                raise web.HTTPError(409, "%s", f"kernel {key} has no key file: it cannot be parked from outside")
            target = _target_of(kernel, key)
            try:
                done = await self.park(kernel, target, action)
            except status_client.StatusRejected as exc:
                status = 409 if exc.error_id in _CONFLICTS else 502
                raise web.HTTPError(status, "%s", f"kernel {key}: {exc}") from None
            except (status_client.StatusTimeout, status_client.StatusUnreachable) as exc:
                _, sentence = kernels.short_error(exc, self.settings.timeout)
                raise web.HTTPError(504, "%s", f"kernel {key} {sentence}") from None
            except status_client.StatusError as exc:
                raise web.HTTPError(502, "%s", f"kernel {key}: {exc}") from None
            except (park_steps.ParkRefused, parking.LockBusy) as exc:
                raise web.HTTPError(409, "%s", f"kernel {key} not {'parked' if action == 'park' else 'resumed'}: "
                                    f"{exc}") from None
        except web.HTTPError as exc:
            message = exc.log_message % exc.args if exc.args else (exc.log_message or exc.reason or "")
            return exc.status_code, {"id": key, "action": action, "ok": False, "refused": exc.status_code == 409,
                                     "message": message}
        outcome, before = done if action == "resume" else (done, None)
        return (200 if outcome.ok else 500), {
            "id": key,
            "kernel_id": kernel.kernel_id,
            "pid": kernel.pid,
            "action": action,
            "ok": outcome.ok,
            "refused": False,
            "state": outcome.state,
            "message": remote_park.outcome_text(outcome, before),
            "outcome": outcome.as_dict(),
        }

    async def find(self, key: str) -> discovery.Kernel:
        """The discovery record of the kernel ``key`` names (kernel id or ``pid-<pid>``); HTTPError 404 when
        no kernel has that name, 409 when it has no gpucleanup or cannot be asked from here."""
        found = await self.run(discovery.scan, self.runtime_dir, clean=False)
        ours = {k["kernel_id"]: k for k in await self.server_kernels()}
        pid = ours[key]["pid"] if key in ours else None
        for kernel in found.live:
            if model.entry_id(kernel.kernel_id, kernel.pid) == key or (pid is not None and kernel.pid == pid):
                return kernel
        # A kernel elsewhere (another machine, PID or network namespace) is named by its kernel id only: its pid
        # means nothing here, and may be the pid of one of this server's kernels that has no gpucleanup.
        for kernel in found.elsewhere:
            if kernel.kernel_id and kernel.kernel_id == key:
                raise web.HTTPError(409, "%s", f"kernel {key} runs elsewhere ({kernel.elsewhere}): "
                                    f"{kernels.where_to_ask(kernel)}")
        if key in ours:
            raise web.HTTPError(409, "%s", f"kernel {key}: {model.NOT_LOADED}")
        raise web.HTTPError(404, "%s", f"no kernel {key}: GET api/gpucleanup/kernels lists the kernels")


class _API(APIHandler):
    auth_resource = AUTH_RESOURCE

    def initialize(self, watch: KernelWatch):
        self.watch = watch

    def write_error(self, status_code: int, **kwargs) -> None:
        # APIHandler writes log_message unformatted; ours carry the message as an argument
        # (a notebook name may hold a '%').
        exc = (kwargs.get("exc_info") or (None, None, None))[1]
        if isinstance(exc, web.HTTPError) and exc.log_message and exc.args:
            self.set_header("Content-Type", "application/json")
            self.finish({"message": exc.log_message % exc.args, "reason": exc.reason})
            return
        super().write_error(status_code, **kwargs)

    def log_exception(self, typ, value, tb) -> None:
        # A kernel's refusal, a key file's path or a thread's name is in the message: one line in the server's
        # log, with no control character (tornado writes it as it is). The page gets it whole, as JSON.
        if isinstance(value, web.HTTPError) and value.log_message:
            message = value.log_message % value.args if value.args else value.log_message
            self.log.warning("%d %s: %s", value.status_code, printable(self._request_summary()), printable(message))
            return
        super().log_exception(typ, value, tb)


class KernelsHandler(_API):
    """``GET api/gpucleanup/kernels``: every kernel, with its state, devices, last cells and timeline."""

    # Reading the list is not activity: a page left open (it refreshes every 2 s) must not keep an idle server
    # alive for jupyterhub-idle-culler, which culls on the server's last_activity (jupyter_server's own
    # /api/status does the same). Drain, park and resume still count.
    _track_activity = False

    @web.authenticated
    @authorized
    async def get(self):
        # ?sort=held|idle|name: the table's orders (none: this server's kernels by notebook, then the others by
        # pid); ?cards=ID,ID: only these kernels' last cells and timeline (each other kernel asked once)
        order = self.get_query_argument("sort", None)
        if order is not None and order not in admin.SORTS:
            raise web.HTTPError(400, "%s", f"sort must be one of {', '.join(admin.SORTS)}, got {order!r}")
        cards = self.get_query_argument("cards", None)
        wanted = None if cards is None else frozenset(filter(None, cards.split(",")))
        if wanted is not None and (len(wanted) > 256 or any(len(key) > 128 for key in wanted)):
            raise web.HTTPError(400, "%s", "cards must list at most 256 kernel ids, as the list names them")
        data = await self.watch.collect(wanted)
        if order is not None:
            data = dict(data, kernels=admin.sort_entries(data["kernels"], order), sort=order)
        self.finish(data)


class KernelHandler(_API):
    """``GET api/gpucleanup/kernels/<id>``: one kernel; 404 for a kernel neither this server nor a discovery
    file knows."""

    _track_activity = False  # a read, as KernelsHandler

    @web.authenticated
    @authorized
    async def get(self, key: str):
        data = await self.watch.collect(frozenset({key}))  # this kernel's last cells only
        for entry in data["kernels"]:
            if entry["id"] == key or entry["kernel_id"] == key:
                self.finish(dict(entry, time_ns=data["time_ns"]))
                return
        raise web.HTTPError(404, "%s", f"no kernel {key}: GET api/gpucleanup/kernels lists the kernels")


class DrainHandler(_API):
    """``POST api/gpucleanup/kernels/<id>/drain``, body ``{"timeout_s": 0 to 60}`` (optional): a signed drain
    request to the kernel's status endpoint. 200 with the result when the kernel answered; 409 when it
    refused (a cell is running, a drain is running); 504 when it did not answer."""

    @web.authenticated
    @authorized
    async def post(self, key: str):
        settings = self.watch.settings
        body = self.get_json_body() or {}
        if not isinstance(body, dict):
            raise web.HTTPError(400, "%s", "the body must be a JSON object, e.g. {\"timeout_s\": 10}")
        drain_timeout = body.get("timeout_s", settings.drain_timeout)
        if (not isinstance(drain_timeout, (int, float)) or isinstance(drain_timeout, bool)
                or not math.isfinite(drain_timeout) or not 0 <= drain_timeout <= 60):
            raise web.HTTPError(400, "%s", f"timeout_s must be a number of seconds from 0 to 60, got {drain_timeout!r}")
        kernel = await self.watch.find(key)
        target = _target_of(kernel, key)
        # The reply comes when the drain ends: wait for as long as the drain may take.
        wait = settings.timeout + float(drain_timeout)
        try:
            reply = await self.watch.drain(target, wait, drain_timeout)
        except status_client.StatusRejected as exc:
            status = 409 if exc.error_id in _CONFLICTS else 502
            raise web.HTTPError(status, "%s", f"kernel {key}: {exc}") from None
        except (status_client.StatusTimeout, status_client.StatusUnreachable) as exc:
            _, sentence = kernels.short_error(exc, wait)
            raise web.HTTPError(504, "%s", f"kernel {key} {sentence}") from None
        except status_client.StatusError as exc:
            raise web.HTTPError(502, "%s", f"kernel {key}: {exc}") from None
        result = reply.get("result") if isinstance(reply.get("result"), dict) else {}
        devices = [d for d in result.get("devices") or () if isinstance(d, dict)]
        driver = result.get("driver") if isinstance(result.get("driver"), dict) else {}
        broken_driver = not devices and driver.get("state") in ("unusable", "exiting")
        self.finish({
            "id": key,
            "kernel_id": kernel.kernel_id,
            "pid": kernel.pid,
            "notebook": kernel.notebook,
            # every device in use drained (none in use: nothing to drain, unless the driver is broken)
            "drained": not broken_driver and all(d.get("state") == "drained" for d in devices),
            "lines": model.drain_lines(result, float(drain_timeout)),
            "result": result,
        })


def _answer(ours: List[dict], gathered: kernels.Gathered, view: "admin.GpuView", root: Optional[str]) -> dict:
    return admin.annotate(model.assemble(ours, gathered), view, admin.local_facts(gathered, view), root)


def _histories(gathered: kernels.Gathered, cards: frozenset, timeout: float, history: int) -> None:
    """The last ``history`` cells of the kernels whose entry id is in ``cards``, into their views."""
    wanted = [v for v in gathered.kernels
              if v.status is not None and (model.entry_id(v.kernel_id, v.pid) in cards or f"pid-{v.pid}" in cards)]
    targets = []
    for view in list(wanted):
        try:
            targets.append(kernels.target_of(view.kernel))
        except OSError:
            wanted.remove(view)
    if not targets:
        return
    for view, result in zip(wanted, status_client.request_many(targets, "history", timeout, limit=int(history))):
        if isinstance(result, dict) and isinstance(result.get("records"), list):
            view.history = result["records"]


def _target_of(kernel: discovery.Kernel, key: str) -> status_client.Target:
    """The kernel's endpoint and key; HTTPError 502 for a key file that cannot be used."""
    try:
        return kernels.target_of(kernel)
    except discovery.UnsafeFile as exc:
        raise web.HTTPError(502, "%s", f"kernel {key}: its key file {kernel.key_file} is {exc.strerror}: "
                            "restart the kernel") from None
    except OSError as exc:
        raise web.HTTPError(502, "%s", f"kernel {key}: cannot read its key file {kernel.key_file} "
                            f"({exc.strerror}): run the server as the user who started the kernel") from None


class ParkHandler(_API):
    """``POST api/gpucleanup/kernels/<id>/park`` and ``.../resume``: the kernel's whole GPU memory, its
    context included, to host memory and back (gpucleanup.park.from_outside; the same as ``gpucleanup park|resume``).
    200 with ``ok`` true, the driver's ``state`` and one sentence when it was done; 500 with the same body,
    ``ok`` false, when a driver step failed (the sentence says where the process is: ``gpucleanup park|resume``
    exit 6); 409 when refused and nothing was done (a cell or a drain is running, already parked, not parked,
    a restore known to fail, not enough host memory or no room to resume, another park of it under way:
    exit 4); 504 when the kernel did not answer; 404 for an unknown kernel."""

    @web.authenticated
    @authorized
    async def post(self, key: str, action: str):
        status, body = await self.watch.park_one(key, action)
        if status not in (200, 500):
            raise web.HTTPError(status, "%s", body["message"])
        self.set_status(status)
        self.finish(body)


def _min_idle_s(value) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not math.isfinite(seconds) or not 0 <= seconds <= 30 * 24 * 3600:
        raise web.HTTPError(400, "%s", f"min_idle_s must be a number of seconds from 0 to 2592000 (30 days), got "
                            f"{value!r}")
    return seconds


class ParkIdleHandler(_API):
    """``GET api/gpucleanup/park-idle?min_idle_s=N``: which kernels "park the kernels idle for more than N s"
    would park (every kernel with gpucleanup idle that long that the cheap check finds parkable, most memory
    first), what each holds and the total it would give back, and those it would leave with their reasons;
    touches nothing. ``POST`` with ``{"min_idle_s": N, "ids": [...]}`` (``ids`` optional: the preview's, so that
    what is parked is what was shown) parks them one after the other and answers every result:
    ``{"results": [{"id", "ok", "refused", "message", "bytes"}], "parked_bytes", "parked_unknown"}`` (``bytes``:
    what the park moved, as nvidia-smi saw it before; None where it cannot say). A kernel that stopped
    being idle meanwhile is left alone and said so."""

    @web.authenticated
    @authorized
    async def get(self):
        seconds = _min_idle_s(self.get_query_argument("min_idle_s", None))
        data = await self.watch.collect(frozenset())
        self.finish(dict(admin.park_preview(data["kernels"], seconds), time_ns=data["time_ns"]))

    @web.authenticated
    @authorized
    async def post(self):
        body = self.get_json_body() or {}
        if not isinstance(body, dict):
            raise web.HTTPError(400, "%s", "the body must be a JSON object, e.g. {\"min_idle_s\": 1800}")
        seconds = _min_idle_s(body.get("min_idle_s"))
        ids = body.get("ids")
        if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, str) for i in ids)):
            raise web.HTTPError(400, "%s", "ids must be a list of kernel ids, as the preview lists them")
        preview = admin.park_preview((await self.watch.collect(frozenset()))["kernels"], seconds)
        chosen = {item["id"]: item for item in preview["kernels"]}
        results = []
        for key in (ids if ids is not None else list(chosen)):
            item = chosen.get(key)
            if item is None:
                refused = next((r for r in preview["refused"] if r["id"] == key), None)
                why = ("; ".join(refused["reasons"]) if refused else
                       f"it is no longer idle for {seconds:g} s (or no longer listed): nothing was done")
                results.append({"id": key, "ok": False, "refused": True, "message": f"kernel {key} not parked: {why}",
                                "bytes": 0})
                continue
            status, result = await self.watch.park_one(key, "park")
            parked = (result.get("outcome") or {}).get("parked_bytes") if result.get("ok") else None
            results.append({"id": key, "ok": result["ok"], "refused": result.get("refused", False),
                            "status": status, "message": result["message"],
                            # what the park moved (nvidia-smi's figure before it); None where nvidia-smi cannot say
                            "bytes": parked if isinstance(parked, int) else (None if result["ok"] else 0)})
        self.finish({"min_idle_s": seconds, "results": results,
                     "parked_bytes": sum(r["bytes"] or 0 for r in results if r["ok"]),
                     "parked_unknown": sum(1 for r in results if r["ok"] and r["bytes"] is None)})


class ParkCheckHandler(_API):
    """``GET api/gpucleanup/kernels/<id>/park-check``: whether the kernel can be parked now and, if not, every
    reason (gpucleanup.park.from_outside.check_kernel, the same as ``gpucleanup park --check``); touches nothing. 200 with
    ``parkable``, ``reasons``, ``usage`` (bytes per GPU UUID), the kernel's and the driver's state, and one
    sentence in ``message``."""

    _track_activity = False  # touches nothing: a read, as KernelsHandler

    @web.authenticated
    @authorized
    async def get(self, key: str):
        kernel = await self.watch.find(key)
        if not kernel.key_file:
            raise web.HTTPError(409, "%s", f"kernel {key} has no key file: it cannot be parked from outside")
        found = dict(await asyncio.shield(self.watch.park_check(kernel, _target_of(kernel, key))))
        found["id"] = key
        found["message"] = ("can be parked now" if found["parkable"] else
                            "cannot be parked now: " + "; ".join(found["reasons"]))
        self.finish(found)


class PageHandler(JupyterHandler):
    """``GET gpucleanup``: the page (static/index.html with the server's base URL and the refresh period)."""

    auth_resource = AUTH_RESOURCE
    _templates = template.Loader(str(STATIC))  # autoescapes every {{ }}

    def initialize(self, watch: KernelWatch):
        self.watch = watch

    @property
    def content_security_policy(self) -> str:
        # The page loads its own script and style and talks to this server only.
        return "; ".join([
            super().content_security_policy,
            "default-src 'none'", "script-src 'self'", "style-src 'self'", "connect-src 'self'",
            "img-src 'self' data:", "base-uri 'none'", "form-action 'none'",
        ])

    @web.authenticated
    @authorized
    def get(self):
        # Reading xsrf_token sets the _xsrf cookie, which the page sends back as X-XSRFToken on a drain.
        self.xsrf_token
        page = self._templates.load("index.html").generate(
            base_url=self.base_url,
            refresh_s=f"{self.watch.settings.refresh_s:g}",
            version=__version__,
        )
        self.set_header("Content-Type", "text/html; charset=UTF-8")
        self.set_header("Cache-Control", "no-store")
        self.finish(page)


class StaticHandler(AuthenticatedFileHandler):
    """``GET gpucleanup/static/<file>``: the page's script and style, for logged-in users only."""

    auth_resource = AUTH_RESOURCE


def handlers(base_url: str, watch: KernelWatch) -> list:
    kernel = r"(?P<key>[^/]+)"
    args = {"watch": watch}
    return [
        (url_path_join(base_url, "api/gpucleanup/kernels"), KernelsHandler, args),
        (url_path_join(base_url, "api/gpucleanup/kernels", kernel), KernelHandler, args),
        (url_path_join(base_url, "api/gpucleanup/kernels", kernel, "drain"), DrainHandler, args),
        (url_path_join(base_url, "api/gpucleanup/kernels", kernel, r"(?P<action>park|resume)"), ParkHandler, args),
        (url_path_join(base_url, "api/gpucleanup/kernels", kernel, "park-check"), ParkCheckHandler, args),
        (url_path_join(base_url, "api/gpucleanup/park-idle"), ParkIdleHandler, args),
        (url_path_join(base_url, "gpucleanup/?"), PageHandler, args),
        (url_path_join(base_url, "gpucleanup/static/(.*)"), StaticHandler, {"path": str(STATIC)}),
    ]
