"""Bad input and hostile neighbours, swept.

1. Every ``%gpumem`` option (``magics.OPTIONS``, with its parser's own actions) given wrong
   values: a ``UsageError`` that says what to do, and nothing of the extension changes.
2. Every config trait of ``GPUCleanup`` (``class_traits(config=True)``) given values of the wrong
   type or out of range, at run time (``%config``) and at load (the shell's config, a profile's
   ``ipython_config.py``): refused or ignored with one sentence, every value as before.
3. Every environment variable the package reads (found in its sources), with garbage: the
   extension loads or says in one line why not, cells run and return their values.
4. A hostile runtime directory: open to every user, unwritable, full, a planted link, file, FIFO or
   directory at every name the kernel uses: cells work, one line at most, nothing written through.
5. A second local user (uid 65534) against a kernel of this user, on ipc and on tcp: it cannot
   connect, read the key or the discovery file; ``gpucleanup`` shows it nothing; on tcp every
   request without the key is refused with the documented error and discloses nothing; the
   kernel answers its owner as before and did nothing.

The tests that drop privileges run only as root (as here and in CI); they skip otherwise. The
unprivileged child imports what it needs before it drops them: this user's interpreter may live
in a directory the other user cannot enter, and imports are not what is under test.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import types
import urllib.request
from pathlib import Path

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output
from traitlets.config import Config

from conftest import BUILD, FAKE_CUDA
import gpucleanup
import gpucleanup._native  # noqa: F401  (the package attribute a stand-in replaces)
import gpucleanup.frameworks
import gpucleanup.in_kernel.status_endpoint
from gpucleanup.in_kernel import config, extension, magics
from gpucleanup.protocol import status_client
from gpucleanup.in_kernel.status_endpoint import StatusEndpoint
from shell_stand_ins import StandInEndpoint, shell  # noqa: F401  (fixture)
from support import GiB  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ipython_ext" / "gpucleanup"
LIBRARY = Path(os.environ.get("GPUCLEANUP_LIBRARY") or BUILD / "native" / "libgpucleanup.so")
FAKE_CUPTI = BUILD / "tests" / "fake_cupti" / "libcupti.so"
NOBODY = 65534
SCENARIO = {"devices": [{"name": "Fake H100", "primary_active": True}]}
# A bound that only a hang reaches: never a measure of speed.
HANG_S = 60

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a second local user needs root to switch to (uid 65534)")


def _child_env(**extra: str) -> dict:
    env = dict(os.environ)
    for name in list(env):
        if name.startswith(("GPUCLEANUP_FAKE_CUDA", "JPY_")):
            env.pop(name)
    env.update(
        PYTHONPATH=str(ROOT / "ipython_ext") + os.pathsep + str(Path(__file__).parent),
        GPUCLEANUP_LIBRARY=str(LIBRARY),
        GPUCLEANUP_LIBCUDA=str(FAKE_CUDA),
        GPUCLEANUP_FAKE_CUDA_SCENARIO=json.dumps(SCENARIO),
    )
    env.update(extra)
    return env


def _python(code: str, env: dict, *args: str, cwd: str | None = None, timeout: float = HANG_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def _tree(path: Path) -> dict:
    """Every entry under ``path`` (not following links): type, mode, size, content of small files."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in sorted(dirs + files):
            full = os.path.join(root, name)
            info = os.lstat(full)
            content = None
            if stat.S_ISREG(info.st_mode) and info.st_size < 4096:
                with open(full, "rb") as f:
                    content = f.read()
            elif stat.S_ISLNK(info.st_mode):
                content = os.readlink(full)
            out[os.path.relpath(full, path)] = (stat.S_IFMT(info.st_mode), stat.S_IMODE(info.st_mode), info.st_uid,
                                                info.st_mtime_ns, content)
    return out


# ====================================================================== 1. %gpumem options with wrong values


@pytest.fixture
def loaded(shell, fake_cuda, monkeypatch):  # noqa: F811
    """gpucleanup loaded against the fake driver (GPU0 in use), one cell's record kept, a few variables."""
    fake_cuda.reset(SCENARIO)
    monkeypatch.setattr(gpucleanup.frameworks, "active", lambda: [])
    monkeypatch.setattr(gpucleanup.in_kernel.status_endpoint, "StatusEndpoint", lambda: StandInEndpoint())
    shell.run_line_magic("load_ext", "gpucleanup")
    with capture_output():
        shell.run_cell("weights = [1.0, 2.0]\nzero = 0\nnothing = None\nname = 'model'", store_history=True)
    ext = extension.get_extension(shell)
    assert len(ext.history) >= 1 and ext.enabled and ext.hooks_registered
    yield shell
    for name in ("weights", "zero", "other_zero", "nothing", "name"):
        shell.user_ns.pop(name, None)


def _snapshot(ip) -> dict:
    """What a refused %gpumem must leave as it was."""
    ext = extension.get_extension(ip)
    return {
        "enabled": ext.enabled,
        "history": [(r.get("cell"), r.get("forced")) for r in ext.history.last()],
        "trace": (ext.trace.tracer.active, ext.trace.tracer.library, ext.trace.tracer.refused),
        "config": {name: getattr(ext, name) for name in ext.trait_names(config=True)},
        "hooks": ext.hooks_registered,
        "user_ns": {k: id(v) for k, v in ip.user_ns.items() if not k.startswith("_")},
        "magic": getattr(ip.find_line_magic("gpumem"), "__self__", None) is ext,
    }


def _actions() -> dict:
    parser = extension.GPUCleanup.gpumem.parser
    return {option: action for action in parser._actions for option in action.option_strings}


# Values that are wrong for every option that takes one, shell metacharacters and unicode among them.
_WRONG = ["''", "'$(id)'", "'`id`; rm -rf ~'", "'a b'", "✓", "'--'"]


def _wrong_lines():
    actions = _actions()
    assert set(magics.OPTIONS) <= set(actions), "every option of magics.OPTIONS is an argument of %gpumem"
    for option in magics.OPTIONS:
        action = actions[option]
        yield f"{option} {option}"  # repeated
        yield f"{option} extra-word"
        if action.nargs == 0:  # a flag
            yield f"{option}=yes"
        elif action.type is int:
            for value in _WRONG + ["-1", "0", "abc", "1.5", "1e3", "9" * 5000, "三", "0x10", "--1"]:
                yield f"{option} {value}"
            yield f"{option} 3 {option} 4"
        elif action.const == "show":  # on|off, or nothing
            for value in _WRONG + ["maybe", "ON", "1", "true", "on;off"]:
                yield f"{option} {value}"
            yield f"{option} on {option} off"
        else:  # --release WHAT
            yield option  # no value
            for value in _WRONG + ["no_such_variable", "__builtins__", "__name__", "In", "Out", "zero", "nothing", "name",
                                   "'weights[0]'"]:
                yield f"{option} {value}"
            yield f"{option} out {option} traceback"


WRONG_LINES = list(_wrong_lines())


def _zero_names(ip) -> set:
    return {k for k, v in ip.user_ns.items() if type(v) is int and v == 0 and not k.startswith("_")}


def _says_what_to_do(message: str) -> bool:
    return "Usage:" in message or "pass out, traceback or the name of a variable" in message


@pytest.mark.parametrize("line", WRONG_LINES, ids=[line[:60] for line in WRONG_LINES])
def test_every_wrong_gpumem_line_is_a_usage_error_that_changes_nothing(loaded, line):
    ip = loaded
    before = _snapshot(ip)
    zero_names = _zero_names(ip)
    with pytest.raises(UsageError) as raised:
        with capture_output() as shown:
            ip.run_line_magic("gpumem", line)
    message = str(raised.value)
    assert message.startswith("%gpumem"), message
    assert _says_what_to_do(message), message
    assert shown.stdout == "" and shown.outputs == []  # refused before anything was done or said
    assert _snapshot(ip) == before
    assert _zero_names(ip) == zero_names
    # In a cell: one line, "UsageError: ...", no traceback; the next cell runs as usual
    with capture_output() as cell:
        result = ip.run_cell(f"%gpumem {line}", store_history=True)
    assert isinstance(result.error_in_exec, UsageError)
    assert "Traceback" not in cell.stdout + cell.stderr
    assert cell.stderr.startswith("UsageError: %gpumem"), cell.stderr[:300]
    assert _snapshot(ip)["config"] == before["config"]
    assert ip.run_cell("6 * 7", store_history=True).result == 42


def test_release_of_a_small_int_does_not_delete_the_other_names_bound_to_it(loaded):
    # del_var by identity deletes every name bound to the object: with a shared small int or None,
    # unrelated variables would go with it.
    ip = loaded
    ip.user_ns["other_zero"] = 0
    with pytest.raises(UsageError) as raised:
        ip.run_line_magic("gpumem", "--release zero")
    assert str(raised.value) == (
        "%gpumem --release: zero is int 0, which holds no GPU memory (deleting it by identity would delete every "
        "other name bound to the same object): pass out, traceback or the name of a variable that holds GPU memory "
        "(see %gpumem --vars)")
    assert ip.user_ns["zero"] == 0 and ip.user_ns["other_zero"] == 0
    with pytest.raises(UsageError, match="__builtins__ is Python's own"):
        ip.run_line_magic("gpumem", "--release __builtins__")
    with pytest.raises(UsageError, match=r"Out is IPython's own \(for GPU arrays in the output cache pass out\)"):
        ip.run_line_magic("gpumem", "--release Out")
    # a variable of the user's is still released as before
    with capture_output() as shown:
        ip.run_line_magic("gpumem", "--release weights")
    assert "weights" not in ip.user_ns
    assert shown.stdout.splitlines()[0] == "gpucleanup · deleted weights and every reference IPython kept to it (as %xdel)"


@pytest.mark.parametrize("first", magics.OPTIONS)
def test_every_pair_of_options_runs_or_is_refused_with_the_fix(loaded, first):
    # Each option with each other one: either it runs, or a UsageError says how to fix it and
    # nothing changed. No other exception reaches the cell.
    ip = loaded
    for second in magics.OPTIONS:
        if second == first:
            continue
        line = f"{first} {second}"
        before = _snapshot(ip)
        try:
            with capture_output():
                ip.run_line_magic("gpumem", line)
        except UsageError as exc:
            assert "Usage:" in str(exc) or "create one first" in str(exc) or "is not imported" in str(exc), (line, exc)
            assert _snapshot(ip) == before, line
        finally:
            with capture_output():
                ip.run_line_magic("gpumem", "--on")
                if extension.get_extension(ip).trace.tracer.active:
                    ip.run_line_magic("gpumem", "--trace off")


# ====================================================================== 2. config traits with wrong values

TRAITS = extension.GPUCleanup.class_traits(config=True)

_UNCOPYABLE = "(i for i in ())"  # a generator: no deepcopy, no pickle


def _wrong_values(name, trait) -> list:
    """(source, value) pairs: the wrong type and out of range, for this trait's kind."""
    from traitlets import Bool, Dict, Enum, Float, Int

    wrong = [("None", None), ("'✓'", "✓"), ("'$(id)'", "$(id)"), ("[]", []), (_UNCOPYABLE, None)]
    if isinstance(trait, Bool):
        wrong += [("'yes'", "yes"), ("2", 2), ("0.5", 0.5), ("'True'", "True")]
    elif isinstance(trait, Enum):
        first = trait.values[0]
        wrong += [("'sometimes'", "sometimes"), ("3", 3), (repr(first.upper()), first.upper()),
                  (repr(f" {first}"), f" {first}"), ("''", ""), ("True", True)]
    elif isinstance(trait, (Int, Float)):
        low, high = trait.min, trait.max
        wrong += [(repr(low - 1), low - 1), (repr(high * 2), high * 2), ("True", True), ("False", False),
                  (repr(str(trait.default_value)), str(trait.default_value)), ("10**5000", 10**5000), ("1j", 1j)]
        if isinstance(trait, Int):
            wrong += [("1.5", 1.5)]
        else:
            wrong += [("float('nan')", float("nan")), ("float('inf')", float("inf")), ("float('-inf')", float("-inf"))]
    elif isinstance(trait, Dict):
        wrong += [("{'cupy': 'on'}", {"cupy": "on"}), ("{1: True}", {1: True}), ("['cupy']", ["cupy"]),
                  ("'cupy'", "cupy"), ("{'tensorflw': False}", {"tensorflw": False}), ("{'cupy': None}", {"cupy": None})]
    else:  # a new kind of trait: add its wrong values here
        raise AssertionError(f"no wrong values for {name} ({type(trait).__name__})")
    return wrong


CONFIG_CASES = [(name, source, value) for name, trait in sorted(TRAITS.items()) for source, value in
                _wrong_values(name, trait)]
CONFIG_IDS = [f"{name}={source[:30]}" for name, source, _ in CONFIG_CASES]


def test_the_sweep_covers_every_config_trait():
    assert {name for name, _, _ in CONFIG_CASES} == set(TRAITS) and len(TRAITS) >= 15


@pytest.fixture
def stand_in_loaded(shell, monkeypatch):  # noqa: F811
    from shell_stand_ins import StandInNative

    monkeypatch.setattr(gpucleanup, "_native", StandInNative())
    monkeypatch.setattr(gpucleanup.frameworks, "active", lambda: [])
    monkeypatch.setattr(gpucleanup.in_kernel.status_endpoint, "StatusEndpoint", lambda: StandInEndpoint())
    return shell


def _values(ext) -> dict:
    return {name: getattr(ext, name) for name in TRAITS}


@pytest.mark.parametrize("name, source, value", CONFIG_CASES, ids=CONFIG_IDS)
def test_percent_config_refuses_a_wrong_value_in_one_paragraph_and_changes_nothing(stand_in_loaded, caplog, capsys,
                                                                                   name, source, value):
    ip = stand_in_loaded
    ip.run_line_magic("load_ext", "gpucleanup")
    ext = extension.get_extension(ip)
    before = _values(ext)
    caplog.clear()
    capsys.readouterr()
    ip.run_line_magic("config", f"GPUCleanup.{name} = {source}")
    allowed = config.allowed_values(name, TRAITS[name])
    out, err = capsys.readouterr()
    assert caplog.messages == [] and out == "", (caplog.messages, out)
    assert err.endswith("\n") and err.count("\n") == 1, err
    said = err[:-1]
    assert said.startswith(f"GPUCleanup.{name} = "), said
    assert f" refused: {name} must be {allowed}. Nothing changed; %config GPUCleanup lists every option." in said, said
    assert "\n" not in said and len(said) < 400
    assert _values(ext) == before
    assert ext.history.size == before["history_size"]
    assert name not in ip.config.GPUCleanup  # the shell kept nothing a reload would meet
    ip.run_line_magic("gpumem", "--json")  # the extension still answers


@pytest.mark.parametrize("name, source, value", CONFIG_CASES, ids=CONFIG_IDS)
def test_a_wrong_value_in_the_config_loads_with_the_default_and_says_which(stand_in_loaded, capsys, name, source,
                                                                            value):
    ip = stand_in_loaded
    cfg = Config()
    setattr(cfg.GPUCleanup, name, eval(source) if source == _UNCOPYABLE else value)
    ip.config.merge(cfg)
    capsys.readouterr()
    ip.run_line_magic("load_ext", "gpucleanup")
    ext = extension.get_extension(ip)
    lines = capsys.readouterr().out.splitlines()
    allowed = config.allowed_values(name, TRAITS[name])
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"gpucleanup · ignored GPUCleanup.{name} = "), lines
    assert lines[0].endswith(f" from the configuration: {name} must be {allowed}; using the default"), lines
    assert _values(ext) == _values(config.GPUCleanupOptions())  # every trait at its default
    ip.run_line_magic("gpumem", "--json")


def test_a_profile_config_file_full_of_wrong_values_loads_with_the_defaults(tmp_path):
    # A real ipython_config.py, read by IPython at start-up: the first wrong value of every trait.
    profile = tmp_path / "ipython" / "profile_default"
    profile.mkdir(parents=True)
    wrong = {}
    for name, trait in sorted(TRAITS.items()):
        source = next(s for s, _ in _wrong_values(name, trait) if s not in ("None", _UNCOPYABLE))
        wrong[name] = source
    (profile / "ipython_config.py").write_text(
        "c = get_config()\nc.InteractiveShellApp.extensions = ['gpucleanup']\nc.HistoryManager.hist_file = ':memory:'\n"
        + "".join(f"c.GPUCleanup.{name} = {source}\n" for name, source in wrong.items()))
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    done = subprocess.run(
        [sys.executable, "-m", "IPython", "--no-banner", "--colors=nocolor", "-c",
         "from gpucleanup.in_kernel import extension\next = extension.get_extension(get_ipython())\n"
         "print(sorted(n for n in ext.trait_names(config=True) if getattr(ext, n) != ext.trait_defaults(n)))\n"
         "print(6 * 7)"],
        env=_child_env(IPYTHONDIR=str(tmp_path / "ipython"), JUPYTER_RUNTIME_DIR=str(runtime), HOME=str(tmp_path)),
        capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    lines = done.stdout.splitlines()
    ignored = [line for line in lines if line.startswith("gpucleanup · ignored GPUCleanup.")]
    assert len(ignored) == len(TRAITS), lines
    for name, source in wrong.items():
        allowed = config.allowed_values(name, TRAITS[name])
        assert sum(line.startswith(f"gpucleanup · ignored GPUCleanup.{name} = ") and
                   line.endswith(f"{name} must be {allowed}; using the default") for line in ignored) == 1, (name, lines)
    assert lines[-2:] == ["[]", "42"]  # every trait at its default; the cell ran


# ====================================================================== 3. environment variables with garbage

# Variables named in the package's sources (Python and native); each must be swept below.
_READS = re.compile(r"""(?:environ|env|getenv)(?:\.get)?[\[(]\s*["']([A-Z][A-Z0-9_]+)["']""")
# Read from a WSGI request's environ, not the process's.
_NOT_PROCESS_ENV = {"PATH_INFO", "HTTP_AUTHORIZATION"}  # the WSGI request's environ, not the process's

# How far each variable is reached: paths get the path garbage too.
PATH_VARIABLES = ("GPUCLEANUP_LIBRARY", "GPUCLEANUP_LIBCUDA", "GPUCLEANUP_CUPTI", "JUPYTER_RUNTIME_DIR",
                  "JUPYTER_DATA_DIR", "XDG_DATA_HOME", "CUDA_HOME", "CUDA_PATH")
WORD_VARIABLES = ("GPUCLEANUP_NATIVE_GIL", "GPUCLEANUP_PARK_HELD_BY", "GPUCLEANUP_PARK_HOLD", "GPUCLEANUP_PARK_HOLD_MS",
                  "GPUCLEANUP_PARK_RESTORE_MAP",
                  "GPUCLEANUP_PARK_UNPROVEN",
                  "GPUCLEANUP_STATUS_TRANSPORT",
                  "GPUCLEANUP_TRACE_CALLER", "JPY_SESSION_NAME",
                  "NO_COLOR", "TERM", "TF_GPU_ALLOCATOR", "XLA_PYTHON_CLIENT_ALLOCATOR")
WORD_GARBAGE = ("empty", "nan", "long", "junk")
PATH_GARBAGE = WORD_GARBAGE + ("fifo", "directory", "missing")


def _read_variables() -> set:
    found = set()
    for root in (PACKAGE, ROOT / "native" / "src", ROOT / "native" / "include"):
        for path in root.rglob("*"):
            if path.suffix in (".py", ".cpp", ".hpp", ".h", ".inc"):
                found.update(_READS.findall(path.read_text(errors="replace")))
    return found - _NOT_PROCESS_ENV


def test_every_variable_the_package_reads_is_swept():
    assert _read_variables() == set(PATH_VARIABLES) | set(WORD_VARIABLES)


# One process imports IPython and makes a shell, then forks a child per case (two at a time): the
# child sets the variable, loads gpucleanup (library, driver, endpoint: all first loaded in the
# child), runs cells and writes what it saw. A child still there after HANG_S is killed by its alarm.
_SWEEP = r"""
import json, os, sys, traceback
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config
import gpucleanup, gpucleanup.in_kernel.extension, gpucleanup.in_kernel.status_endpoint, gpucleanup.outside.cli, jupyter_core.paths

work, cases = sys.argv[1], json.loads(sys.argv[2])
config = Config()
config.HistoryManager.hist_file = ":memory:"
ip = InteractiveShell.instance(config=config)
values = {"empty": b"", "nan": b"nan", "long": b"x" * 5000, "junk": bytes(b for b in range(1, 256)),
          "fifo": os.path.join(work, "fifo").encode(), "directory": os.path.join(work, "dir").encode(),
          "missing": None}
os.mkfifo(os.path.join(work, "fifo"))
os.mkdir(os.path.join(work, "dir"))
CELLS = ["%load_ext gpucleanup", "x = 6 * 7\nx", "d = %gpumem --json\ntype(d).__name__", "%gpumem --trace on",
         "%gpumem --trace off", "from gpucleanup.outside import cli\ncli.colour_wanted()",
         "from gpucleanup.frameworks import jax as j, tensorflow as t\n(j._platform_allocator(), t._async_allocator())",
         "x + 1", "%unload_ext gpucleanup", "x + 2"]
running = {}


def reap():
    pid, status = os.wait()
    print(json.dumps([running.pop(pid), os.waitstatus_to_exitcode(status)]), flush=True)


for case in cases:
    name, variable, garbage = case
    out = os.path.join(work, name + ".out")
    if len(running) >= 2:
        reap()
    pid = os.fork()
    if pid == 0:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        import signal
        signal.alarm(int(sys.argv[3]))
        try:
            os.chdir(work)
            if variable in ("JUPYTER_DATA_DIR", "XDG_DATA_HOME"):
                os.environb.pop(b"JUPYTER_RUNTIME_DIR", None)  # else these are never read
            if variable == "XDG_DATA_HOME":
                os.environb.pop(b"JUPYTER_DATA_DIR", None)
            missing = os.path.join(work, "missing-" + name, "deeper").encode()  # nothing there yet
            os.environb[variable.encode()] = values[garbage] if garbage != "missing" else missing
            results = []
            for cell in CELLS:
                start = os.fstat(1).st_size
                r = ip.run_cell(cell, store_history=True)
                sys.stdout.flush()
                sys.stderr.flush()
                results.append({"cell": cell, "result": repr(r.result), "output": [start, os.fstat(1).st_size],
                                "error": None if r.success else repr(r.error_before_exec or r.error_in_exec)})
            with open(os.path.join(work, name + ".json"), "w") as f:
                json.dump(results, f)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        except BaseException:
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(3)
    running[pid] = name
while running:
    reap()
"""


def _env_cases():
    for variable in PATH_VARIABLES + WORD_VARIABLES:
        for garbage in (PATH_GARBAGE if variable in PATH_VARIABLES else WORD_GARBAGE):
            yield f"{variable}-{garbage}", variable, garbage


ENV_CASES = list(_env_cases())


@pytest.fixture(scope="module")
def env_sweep(tmp_path_factory):
    """{case: (exit code, output, cell results)} for every (variable, garbage) case."""
    work = tmp_path_factory.mktemp("env-sweep")
    runtime = work / "runtime"
    runtime.mkdir(mode=0o700)
    env = _child_env(HOME=str(work / "home"), JUPYTER_RUNTIME_DIR=str(runtime), GPUCLEANUP_CUPTI=str(FAKE_CUPTI))
    for name in ("NO_COLOR", "TERM", "TF_GPU_ALLOCATOR", "XLA_PYTHON_CLIENT_ALLOCATOR", "CUDA_HOME", "CUDA_PATH",
                 "JUPYTER_DATA_DIR", "XDG_DATA_HOME", "GPUCLEANUP_STATUS_TRANSPORT", "GPUCLEANUP_NATIVE_GIL",
                 "GPUCLEANUP_TRACE_CALLER"):
        env.pop(name, None)
    done = _python(_SWEEP, env, str(work), json.dumps(ENV_CASES), str(HANG_S), cwd=str(work),
                   timeout=HANG_S * len(ENV_CASES))
    assert done.returncode == 0, done.stderr
    codes = dict(json.loads(line) for line in done.stdout.splitlines() if line.startswith("["))
    found = {}
    for name, _, _ in ENV_CASES:
        cells = work / f"{name}.json"
        found[name] = (codes.get(name), (work / f"{name}.out").read_text(errors="replace"),
                       json.loads(cells.read_text()) if cells.exists() else None)
    return found


# What the one line of the cell that loads gpucleanup says, where the garbage stops something.
LOAD_LINES = {
    "GPUCLEANUP_LIBRARY-fifo": "is not a regular file: point GPUCLEANUP_LIBRARY at libgpucleanup.so, or unset it",
    "GPUCLEANUP_LIBRARY-directory": "is not a regular file: point GPUCLEANUP_LIBRARY at libgpucleanup.so, or unset it",
    "GPUCLEANUP_LIBRARY-missing": "cannot be opened (No such file or directory): point GPUCLEANUP_LIBRARY at",
    "GPUCLEANUP_LIBRARY-junk": "cannot be opened (No such file or directory): point GPUCLEANUP_LIBRARY at",
    "GPUCLEANUP_LIBRARY-long": "cannot open shared object file: File name too long",  # a name: dlopen's lookup
    "GPUCLEANUP_LIBCUDA-fifo": "gpucleanup · no CUDA driver found (",
    "GPUCLEANUP_LIBCUDA-directory": "gpucleanup · no CUDA driver found (",
    "GPUCLEANUP_LIBCUDA-junk": "gpucleanup · no CUDA driver found (\\x01\\x02\\x03",
    "JUPYTER_RUNTIME_DIR-nan": "runtime directory 'nan' is not an absolute path: gpucleanup writes no discovery file, key "
                               "or socket there; set JUPYTER_RUNTIME_DIR to the absolute path of a private directory",
    "JUPYTER_RUNTIME_DIR-fifo": "gpucleanup status endpoint did not start: FileExistsError",
}
# A word variable with a value it does not take: the load says so (before: nothing, and the default was used;
# the transport's stopped the status endpoint), and the cells run as with the default.
_WORDS_TAKEN = {"GPUCLEANUP_STATUS_TRANSPORT": "ipc, tcp: it is read as ipc", "GPUCLEANUP_NATIVE_GIL":
                "hold, release: it is read as hold", "GPUCLEANUP_TRACE_CALLER": "1, 0: it is read as 1",
                "GPUCLEANUP_PARK_RESTORE_MAP": "identity, none: it is read as identity",
                "GPUCLEANUP_PARK_HOLD": "on, off: it is read as on"}
for _variable, _taken in _WORDS_TAKEN.items():
    LOAD_LINES[f"{_variable}-nan"] = f"gpucleanup · {_variable}='nan' is not one of {_taken} (set one of those, or unset it)"
    for _garbage in ("long", "junk"):
        LOAD_LINES[f"{_variable}-{_garbage}"] = f"is not one of {_taken} (set one of those, or unset it)"
for _garbage in ("nan", "long", "junk"):
    LOAD_LINES[f"GPUCLEANUP_PARK_UNPROVEN-{_garbage}"] = (
        "which is not among the frameworks whose parks wait for proof (jax): ignored there")
    LOAD_LINES[f"GPUCLEANUP_PARK_HOLD_MS-{_garbage}"] = (
        "is not a whole number of milliseconds from 1 to 60000: it is read as 5000 (set one, or unset it)")
# Where the garbage changes nothing that the cells see: the load says nothing.
QUIET_LOADS = {f"{v}-{g}" for v in ("JPY_SESSION_NAME", "NO_COLOR", "TERM", "TF_GPU_ALLOCATOR",
                                    "XLA_PYTHON_CLIENT_ALLOCATOR", "CUDA_HOME", "CUDA_PATH", "GPUCLEANUP_CUPTI")
               for g in PATH_GARBAGE} | {f"{v}-empty" for v in (*_WORDS_TAKEN, "GPUCLEANUP_PARK_HOLD_MS",
                                                                "GPUCLEANUP_PARK_UNPROVEN")}


@pytest.mark.parametrize("name, variable, garbage", ENV_CASES, ids=[c[0] for c in ENV_CASES])
def test_garbage_in_an_environment_variable_never_breaks_a_cell(env_sweep, name, variable, garbage):
    code, output, cells = env_sweep[name]
    assert code == 0, f"{name}: exit {code} (-14: hung until the alarm)\n{output}"
    assert "Traceback" not in output, output
    assert [c["error"] for c in cells] == [None] * len(cells), cells
    results = {c["cell"]: c["result"] for c in cells}
    assert results["x = 6 * 7\nx"] == "42" and results["x + 1"] == "43" and results["x + 2"] == "44"
    assert results["d = %gpumem --json\ntype(d).__name__"] == "'JSONReport'"
    data = output.encode()
    said = {}
    for cell in cells:
        start, end = cell["output"]
        lines = [line for line in data[start:end].decode(errors="replace").splitlines() if not line.startswith("Out[")]
        # at most one line per cell, on one line (no control character of the garbage is printed raw)
        assert len(lines) <= 1, (cell["cell"], lines)
        assert all(line.isprintable() for line in lines), lines
        said[cell["cell"]] = lines[0] if lines else None
    load = said["%load_ext gpucleanup"]
    if name in LOAD_LINES:
        assert load is not None and LOAD_LINES[name] in load, load
    if name in QUIET_LOADS:
        assert load is None, load
    if load is not None:
        assert load.startswith(("gpucleanup · ", "gpucleanup status endpoint did not start: ")), load
    if variable == "GPUCLEANUP_CUPTI":
        # one line says whether the trace started (a libcupti installed elsewhere is tried after the garbage)
        assert said["%gpumem --trace on"].startswith("gpucleanup · "), said


# ====================================================================== 4. a hostile runtime directory

# Something planted before the kernel starts, at a name it uses (relative to the runtime directory;
# {pid} is this process's instance, <pid>-<random>, its random part fixed here so that it can be known
# beforehand), and what the kernel then does: starts its endpoint (the name is
# replaced, never written through), or says in one line why not. "victim" is a file and "elsewhere"
# a directory outside the runtime directory: nothing may be written there.
PLANTS = {
    "socket-is-a-link": ("gpucleanup/{pid}.sock", "link-to-victim", None),
    "socket-is-a-file": ("gpucleanup/{pid}.sock", "hard-linked-file", None),
    "socket-is-a-fifo": ("gpucleanup/{pid}.sock", "fifo", None),
    "socket-is-a-directory": ("gpucleanup/{pid}.sock", "directory",
                              "gpucleanup status endpoint did not start: NativeError: [gpucleanup.server.505] cannot bind"),
    "publisher-socket-is-a-link": ("gpucleanup/{pid}.sock.pub", "link-to-victim", None),
    "key-is-a-link": ("gpucleanup/{pid}.key", "link-to-victim", None),
    "key-is-a-fifo": ("gpucleanup/{pid}.key", "fifo", None),
    "key-is-a-directory": ("gpucleanup/{pid}.key", "directory",
                           "gpucleanup status endpoint did not start: IsADirectoryError: [Errno 21] Is a directory"),
    "discovery-file-is-a-link": ("gpucleanup-{pid}.json", "link-to-victim", None),
    "discovery-file-is-a-fifo": ("gpucleanup-{pid}.json", "fifo", None),
    "discovery-file-is-a-directory": ("gpucleanup-{pid}.json", "directory",
                                      "gpucleanup status endpoint did not start: IsADirectoryError: [Errno 21] Is a "
                                      "directory"),
    "private-dir-is-a-link": ("gpucleanup", "link-to-elsewhere",
                              "gpucleanup status endpoint did not start: PermissionError: {runtime}/gpucleanup is a "
                              "symbolic link: gpucleanup keeps its keys and sockets only in a directory of its own; "
                              "remove the link"),
    "private-dir-is-a-file": ("gpucleanup", "hard-linked-file",
                              "gpucleanup status endpoint did not start: PermissionError: {runtime}/gpucleanup is not a "
                              "directory: remove it, gpucleanup keeps its keys and sockets there"),
    "private-dir-is-someone-elses": ("gpucleanup", "directory-of-uid-65534",
                                     "gpucleanup status endpoint did not start: PermissionError: {runtime}/gpucleanup "
                                     "belongs to uid 65534, not to you: use a directory of your own"),
    "runtime-dir-mode-0777": ("", "mode-0777",
                              "gpucleanup status endpoint did not start: InsecureRuntimeDir: runtime directory {runtime} "
                              "is writable by every user (mode 777): gpucleanup writes no discovery file, key or socket "
                              "there; set JUPYTER_RUNTIME_DIR to a private directory (yours, mode 0700)"),
    "runtime-dir-mode-1777": ("", "mode-1777",
                              "gpucleanup status endpoint did not start: InsecureRuntimeDir: runtime directory {runtime} "
                              "is writable by every user (mode 1777): gpucleanup writes no discovery file, key or "
                              "socket there; set JUPYTER_RUNTIME_DIR to a private directory (yours, mode 0700)"),
}


#: the random part of this process's instance in these tests (gpucleanup.protocol.discovery.new_instance)
PLANTED_ID = "5eed5eed"


def _plant(runtime: Path, outside: Path, where: str, what: str) -> None:
    path = runtime / where.format(pid=f"{os.getpid()}-{PLANTED_ID}")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if what == "link-to-victim":
        os.symlink(outside / "victim.txt", path)
    elif what == "link-to-elsewhere":
        os.symlink(outside / "elsewhere", path)
    elif what == "hard-linked-file":
        os.link(outside / "planted.txt", path)  # its content stays reachable through the other name
    elif what == "fifo":
        os.mkfifo(path, 0o600)
    elif what == "directory":
        path.mkdir(mode=0o700)
    elif what == "directory-of-uid-65534":
        path.mkdir(mode=0o700)
        os.chown(path, NOBODY, NOBODY)
    elif what.startswith("mode-"):
        runtime.chmod(int(what[len("mode-"):], 8))
    else:
        raise AssertionError(what)


@pytest.mark.parametrize("case", sorted(PLANTS))
def test_a_planted_name_is_never_written_through_and_the_cells_work(shell, fake_cuda, tmp_path, monkeypatch, caplog,
                                                                    case):  # noqa: F811
    if case == "private-dir-is-someone-elses" and os.geteuid() != 0:
        pytest.skip("making a directory of another user needs root")
    where, what, line = PLANTS[case]
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    outside = tmp_path / "outside"
    (outside / "elsewhere").mkdir(parents=True, mode=0o755)
    (outside / "elsewhere" / "theirs.txt").write_text("theirs\n")
    (outside / "victim.txt").write_text("precious\n")
    (outside / "planted.txt").write_text("planted\n")
    _plant(runtime, outside, where, what)
    monkeypatch.setattr(gpucleanup.protocol.discovery, "new_instance", lambda pid=None: f"{os.getpid()}-{PLANTED_ID}")
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.setattr(gpucleanup.frameworks, "active", lambda: [])
    fake_cuda.reset(SCENARIO)
    before = _tree(outside)
    with caplog.at_level(logging.WARNING, logger="gpucleanup"), capture_output() as shown:
        shell.run_line_magic("load_ext", "gpucleanup")
        results = [shell.run_cell(code, store_history=True) for code in ("x = 6 * 7\nx", "%gpumem --json", "x + 1")]
    assert [r.error_in_exec for r in results] == [None, None, None]
    assert results[0].result == 42 and results[2].result == 43
    assert "Traceback" not in shown.stdout + shown.stderr
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "gpucleanup"]
    ext = extension.get_extension(shell)
    endpoint = ext._endpoint
    if line is None:
        # started: the planted name was replaced by the kernel's own file or socket
        assert warnings == [] and endpoint.running, warnings
        info = json.loads((runtime / f"gpucleanup-{os.getpid()}-{PLANTED_ID}.json").read_text())
        reply = status_client.request(status_client.Target(info["endpoint"], Path(info["key_file"]).read_bytes()),
                                      "status", timeout=10)
        assert reply["state"]["state"] == "idle"
        planted = runtime / where.format(pid=f"{os.getpid()}-{PLANTED_ID}")
        assert not planted.is_symlink()
        kind = stat.S_IFMT(planted.lstat().st_mode)
        assert kind == (stat.S_IFSOCK if ".sock" in where else stat.S_IFREG)
        assert stat.S_IMODE(planted.lstat().st_mode) == 0o600
    else:
        assert len(warnings) == 1 and warnings[0].startswith(line.format(runtime=runtime)), warnings
        assert not endpoint.running
    assert _tree(outside) == before  # nothing written, chmod-ed or removed through a link
    if what.startswith("mode-"):
        assert os.listdir(runtime) == []  # nothing made in a directory every user may write to
    if where == "gpucleanup":
        assert sorted(os.listdir(runtime)) == ["gpucleanup"]  # no discovery file either
    shell.run_line_magic("unload_ext", "gpucleanup")
    assert _tree(outside) == before
    if line is None:  # the kernel's own files are gone with it; nothing else of the runtime dir was touched
        assert sorted(os.listdir(runtime)) == ["gpucleanup"] and os.listdir(runtime / "gpucleanup") == []


# A kernel of its own in a subprocess: a tmpfs cannot be mounted here, so a full disk is the kernel
# refusing to let the process write: RLIMIT_FSIZE 0 with SIGXFSZ ignored makes every write(2) to a
# file fail with EFBIG (the discovery writer treats every OSError alike; ENOSPC itself is
# simulated in test_discovery.py). Unwritable: a runtime directory 0500 of the user the kernel runs
# as, which only an unprivileged user feels (root writes anyway).
_KERNEL = r"""
import json, os, resource, signal, sys, secrets, tempfile, shutil, logging
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config
import gpucleanup, gpucleanup.in_kernel.extension, gpucleanup.in_kernel.status_endpoint, gpucleanup.protocol.discovery, gpucleanup._native
import gpucleanup.frameworks, gpucleanup.engine.after_cell, gpucleanup.in_kernel.tracing, gpucleanup.records.history, gpucleanup.in_kernel.holders
import jupyter_core.paths
config = Config()
config.HistoryManager.hist_file = ":memory:"
ip = InteractiveShell.instance(config=config)
gpucleanup._native.probe()  # library and driver loaded
from IPython.utils.capture import capture_output
with capture_output():  # what IPython imports to run a cell and to show an error, before privileges go
    ip.run_cell("1", store_history=True)
    ip.run_cell("1 / 0", store_history=True)
mode = sys.argv[1]
runtime = os.environ["JUPYTER_RUNTIME_DIR"]
if mode == "full":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))
if mode == "unwritable":
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
out = []
for code in ("%load_ext gpucleanup", "x = 6 * 7\nx", "x + 1"):
    r = ip.run_cell(code, store_history=True)
    out.append([repr(r.result), None if r.success else repr(r.error_in_exec)])
if mode == "fills-later":
    ext = gpucleanup.in_kernel.extension.get_extension(ip)
    path = ext._endpoint.discovery_path
    first = open(path, "rb").read()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))
    ip.user_ns["__session__"] = "named-later.ipynb"  # the endpoint rewrites its discovery file as the next cell starts
    for code in ("x + 2", "x + 3"):
        r = ip.run_cell(code, store_history=True)
        out.append([repr(r.result), None if r.success else repr(r.error_in_exec)])
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    out.append(open(path, "rb").read() == first)
    out.append(sorted(os.listdir(os.path.dirname(path))) + sorted(os.listdir(os.path.join(runtime, "gpucleanup"))))
sys.stdout.flush()
print("@@" + json.dumps(out))
"""


@pytest.mark.parametrize("mode", ["full", "unwritable", "fills-later"])
def test_a_full_or_unwritable_runtime_directory_leaves_the_cells_alone(tmp_path, mode):
    if mode == "unwritable" and os.geteuid() != 0:
        pytest.skip("the kernel runs as uid 65534 here, which needs root to switch to")
    base = Path(tempfile.mkdtemp(prefix="gpucleanup-hostile-"))
    try:
        base.chmod(0o755)
        runtime = base / "runtime"
        runtime.mkdir(mode=0o700)
        if mode == "unwritable":
            runtime.chmod(0o500)
            os.chown(runtime, NOBODY, NOBODY)
        done = _python(_KERNEL, _child_env(JUPYTER_RUNTIME_DIR=str(runtime), HOME=str(base)), mode, cwd=str(base))
        assert done.returncode == 0, done.stderr
        head, _, tail = done.stdout.rpartition("@@")
        found = json.loads(tail)
        assert found[:3] == [["None", None], ["42", None], ["43", None]], found
        assert "Traceback" not in done.stdout + done.stderr, done.stderr
        said = [line for line in (head + done.stderr).splitlines() if line and not line.startswith("Out[")]
        if mode == "full":
            assert said == ["gpucleanup status endpoint did not start: OSError: [Errno 27] File too large"], said
            assert os.listdir(runtime / "gpucleanup") == []  # no key, no temporary file
            assert [p.name for p in runtime.iterdir()] == ["gpucleanup"]
        elif mode == "unwritable":
            assert said == [f"gpucleanup status endpoint did not start: PermissionError: [Errno 13] Permission denied: "
                            f"'{runtime}/gpucleanup'"], said
            assert os.listdir(runtime) == []
        else:
            assert found[3:5] == [["44", None], ["45", None]], found
            assert found[5] is True  # the discovery file is whole and as it was
            names = found[6]
            assert len(names) == 6 and not any(name.endswith(".tmp") for name in names), names  # the dir, the discovery file, key, park lock, 2 sockets; no temporary file
            assert said == [], said  # the failed rewrite is not the user's concern: the file stays valid
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)


def test_a_relative_runtime_directory_is_refused_before_anything_is_made(tmp_path, monkeypatch, fake_cuda, caplog):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", "nan")
    with caplog.at_level(logging.WARNING, logger="gpucleanup"):
        ep = StatusEndpoint()
        ep.start(types.SimpleNamespace(user_ns={}))
    assert not ep.running
    assert caplog.messages == [
        "gpucleanup status endpoint did not start: ValueError: runtime directory 'nan' is not an absolute path: "
        "gpucleanup writes no discovery file, key or socket there; set JUPYTER_RUNTIME_DIR to the absolute path of a "
        "private directory (yours, mode 0700)"]
    assert os.listdir(tmp_path) == []
    ep.close()


# ====================================================================== 5. a second local user

# Run as uid/gid 65534 (no supplementary groups): the modules are imported first, then the
# privileges go, then the code runs. Its stdout is one JSON object.
_AS_NOBODY = """
import errno, hashlib, hmac, io, json, os, socket, sys, time, uuid, contextlib
import zmq
import gpucleanup, gpucleanup.outside.cli, gpucleanup.outside.kernels, gpucleanup.protocol.discovery, gpucleanup.protocol.status_client, gpucleanup.records.report
import jupyter_core.paths
import argparse, concurrent.futures, shutil, textwrap, locale, encodings.idna, urllib.request, urllib.error
os.setgroups([]); os.setgid(65534); os.setuid(65534)
assert os.getuid() == os.geteuid() == 65534 and os.getgid() == 65534 and os.getgroups() == []

def why(call):
    try:
        call()
        return "done"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))

def connect(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    finally:
        s.close()

def cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = gpucleanup.outside.cli.main(list(argv))
        except SystemExit as exc:
            code = exc.code
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
"""


def _as_nobody(code: str, env: dict) -> dict:
    done = _python(_AS_NOBODY + textwrap.dedent(code), env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture
def shared_tmp():
    """A directory under the system's temporary directory that every user can enter (0755), with a
    public file as a control: what the other user cannot read there is kept from it by gpucleanup's
    modes, not by a private parent (pytest's own tmp_path is 0700)."""
    base = Path(tempfile.mkdtemp(prefix="gpucleanup-hostile-"))
    base.chmod(0o755)
    (base / "public.txt").write_text("anyone may read this\n")
    (base / "public.txt").chmod(0o644)
    home = base / "home-of-other"
    home.mkdir()
    os.chown(home, NOBODY, NOBODY) if os.geteuid() == 0 else None
    try:
        yield base
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def victim_kernel(shared_tmp, fake_cuda, monkeypatch, request):
    """This process as a kernel of this user (transport by ``request.param``), idle, with a notebook
    name and a last cell that freed 6 GiB; its runtime directory is listable by every user (0755),
    as a shared machine may have it. Drains would act on the fake driver's active GPU0."""
    transport = request.param
    runtime = shared_tmp / "runtime"
    runtime.mkdir(mode=0o755)
    runtime.chmod(0o755)
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    fake_cuda.reset(SCENARIO)
    ep = StatusEndpoint(transport=transport)
    ep.start(types.SimpleNamespace(user_ns={"__session__": "/home/me/secret-plans.ipynb"}))
    assert ep.error is None, ep.error
    ep.set_state({"state": "idle", "since_ns": time.time_ns()})
    ep.publish({"cell": 11, "devices": [{"index": 0, "freed_bytes": {"cupy": 6 * GiB}, "live_bytes": {"cupy": 3 * GiB}}]})
    owner = status_client.Target(ep.info["endpoint"], Path(ep.info["key_file"]).read_bytes())
    before = status_client.request(owner, "status", timeout=10)
    yield types.SimpleNamespace(ep=ep, runtime=runtime, base=shared_tmp, owner=owner, before=before, fake=fake_cuda,
                                transport=transport)
    ep.close()


def _owner_sees_the_same_kernel(kernel) -> None:
    """The kernel still answers its owner, in the same state, with the same last cell, and did nothing."""
    after = status_client.request(kernel.owner, "status", timeout=10)
    assert after["state"]["state"] == "idle"
    assert after["state"]["since_ns"] == kernel.before["state"]["since_ns"]
    assert after["last_record"] == kernel.before["last_record"]
    assert after["kernel"] == kernel.before["kernel"]
    assert after["server"]["history_size"] == kernel.before["server"]["history_size"] == 1
    assert after["server"]["drain_running"] is False
    assert kernel.fake.counter("calls.cuCtxSynchronize") == 0  # no drain reached the device
    assert kernel.fake.counter("calls.cuMemPoolTrimTo") == 0
    # the owner's own drain still works, and reaches the device: the counters above would have seen one
    drained = status_client.request(kernel.owner, "drain", timeout=30, timeout_s=5)
    assert drained["ok"] is True and drained["kind"] == "drain"
    assert kernel.fake.counter("calls.cuCtxSynchronize") >= 1


@needs_root
@pytest.mark.parametrize("victim_kernel", ["ipc"], indirect=True)
def test_another_user_cannot_reach_an_ipc_kernel_nor_read_its_files(victim_kernel):
    k = victim_kernel
    info = k.ep.info
    private = Path(info["key_file"]).parent
    found = _as_nobody(
        f"""
        base, runtime, private = {str(k.base)!r}, {str(k.runtime)!r}, {str(private)!r}
        discovery_file, key_file = {str(k.ep.discovery_path)!r}, {info["key_file"]!r}
        socks = [{info["endpoint"][6:]!r}, {info["pub_endpoint"][6:]!r}]

        def read(path):
            with open(path, "rb") as f:
                f.read()

        out = {{"public": open(base + "/public.txt").read(), "listing": sorted(os.listdir(runtime)),
               "discovery": why(lambda: read(discovery_file)), "key": why(lambda: read(key_file)),
               "private_dir": why(lambda: os.listdir(private)),
               "connect": [why(lambda p=p: connect(p)) for p in socks]}}
        os.environ["JUPYTER_RUNTIME_DIR"] = runtime
        out["ps"] = cli("ps")
        out["ps_json"] = cli("ps", "--json")
        out["status"] = cli("status", {str(os.getpid())!r}, "--json")
        out["drain"] = cli("drain", {str(os.getpid())!r})
        print(json.dumps(out))
        """,
        _child_env(HOME=str(k.base / "home-of-other"), JUPYTER_RUNTIME_DIR=str(k.runtime)),
    )
    pid = os.getpid()
    # the path is open to the other user (the control), the names are listable: only the modes stop it
    assert found["public"] == "anyone may read this\n"
    assert found["listing"] == ["gpucleanup", k.ep.discovery_path.name]
    assert found["discovery"] == "EACCES"  # 0600
    assert found["key"] == "EACCES"  # in the 0700 directory
    assert found["private_dir"] == "EACCES"
    assert found["connect"] == ["EACCES", "EACCES"]
    # gpucleanup as the other user: this user's kernel is not listed; one line says why the file was skipped
    ps = found["ps"]
    assert ps["code"] == 1, ps
    assert ps["stdout"] == ""
    assert ps["stderr"].splitlines() == [
        f"gpucleanup: skipped {k.ep.discovery_path}: cannot be read (Permission denied)",
        f"gpucleanup: no kernel with gpucleanup is running (no usable discovery file in {k.runtime}): "
        "run %load_ext gpucleanup in a kernel first",
    ], ps["stderr"]
    assert json.loads(found["ps_json"]["stdout"]) == []
    for command in ("status", "drain"):
        result = found[command]
        assert result["code"] == 1, result
        assert result["stdout"] == ""
    for result in found.values():
        text = json.dumps(result)
        assert "secret-plans" not in text and "6.0 GiB" not in text and str(6 * GiB) not in _whole_numbers(text)
    _owner_sees_the_same_kernel(k)


@needs_root
@pytest.mark.parametrize("victim_kernel", ["ipc"], indirect=True)
def test_a_0600_socket_and_key_keep_another_user_out_even_in_a_directory_opened_later(victim_kernel):
    # Someone (the owner, by mistake) opens the private directory for others to enter: the socket
    # and the key are 0600 on their own, so the other user still cannot connect or read.
    k = victim_kernel
    private = Path(k.ep.info["key_file"]).parent
    private.chmod(0o711)
    try:
        found = _as_nobody(
            f"""
            print(json.dumps({{"connect": [why(lambda p=p: connect(p)) for p in
                                           ({k.ep.info["endpoint"][6:]!r}, {k.ep.info["pub_endpoint"][6:]!r})],
                              "key": why(lambda: open({k.ep.info["key_file"]!r}, "rb").read())}}))
            """,
            _child_env(HOME=str(k.base / "home-of-other")),
        )
    finally:
        private.chmod(0o700)
    assert found == {"connect": ["EACCES", "EACCES"], "key": "EACCES"}
    _owner_sees_the_same_kernel(k)


_TCP_ATTACK = """
endpoint, notebook = {endpoint!r}, "secret-plans"
ctx = zmq.Context()
out = {{"key": why(lambda: open({key_file!r}, "rb").read()), "discovery": why(lambda: open({discovery!r}, "rb").read()),
       "replies": {{}}}}

def body(kind, **fields):
    fields.update(protocol=1, kind=kind, id=str(uuid.uuid4()), time_ns=time.time_ns())
    return json.dumps(fields).encode()

def ask(name, frames):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    s.send_multipart(frames)
    reply = s.recv_multipart() if s.poll({hang_ms}) else None
    s.close()
    out["replies"][name] = None if reply is None else [f.decode("utf-8", "replace") for f in reply]

forged = "0" * 64
guessed = hmac.new(b"", body("status"), hashlib.sha256).hexdigest()
for kind in ("status", "history", "ping", "drain"):
    ask("unsigned " + kind, [b"", b"", body(kind)])
    ask("unsigned one-frame " + kind, [b"", body(kind)])
    ask("forged " + kind, [b"", forged.encode(), body(kind)])
for kind in ("status", "drain"):
    data = body(kind)
    ask("empty-key " + kind, [b"", hmac.new(b"", data, hashlib.sha256).hexdigest().encode(), data])
    ask("guessed-key " + kind, [b"", hmac.new(b"0" * 64, data, hashlib.sha256).hexdigest().encode(), data])
ask("unsigned garbage", [b"", b"", b"\\xff{{not json"])
ask("uppercase forged", [b"", forged.upper().encode(), body("status")])
ctx.term()
print(json.dumps(out))
"""


def _whole_numbers(text: str) -> set[str]:
    """Every run of digits in `text`: a figure leaks only as a whole number, never as digits inside another."""
    return set(re.findall(r"\d+", text))


@needs_root
@pytest.mark.parametrize("victim_kernel", ["tcp"], indirect=True)
def test_another_user_on_tcp_is_refused_every_request_and_learns_nothing(victim_kernel):
    k = victim_kernel
    info = k.ep.info
    assert info["transport"] == "tcp" and info["endpoint"].startswith("tcp://127.0.0.1:")
    found = _as_nobody(
        _TCP_ATTACK.format(endpoint=info["endpoint"], key_file=info["key_file"], discovery=str(k.ep.discovery_path),
                           hang_ms=HANG_S * 1000),
        _child_env(HOME=str(k.base / "home-of-other")),
    )
    assert found["key"] == "EACCES" and found["discovery"] == "EACCES"
    replies = found["replies"]
    expected = {name: ("gpucleanup.server.403" if name.startswith(("forged", "empty-key", "guessed-key", "uppercase"))
                       else "gpucleanup.server.401") for name in replies}
    assert len(replies) == 18
    for name, frames in replies.items():
        assert frames is not None, f"{name}: no reply"
        assert len(frames) == 3 and frames[0] == "", (name, frames)
        reply = json.loads(frames[2])
        # an error reply and nothing else: no kernel, no state, no snapshot, no record, no counters
        assert set(reply) == {"protocol", "ok", "kind", "id", "time_ns", "error"}, (name, reply)
        assert (reply["ok"], reply["kind"], reply["id"]) == (False, "error", None), (name, reply)
        assert set(reply["error"]) == {"id", "message"}
        assert reply["error"]["id"] == expected[name], (name, reply)
        assert reply["error"]["message"].startswith(f"[{expected[name]}] "), reply
        assert "secret-plans" not in frames[2] and "GiB" not in frames[2]
        # as whole numbers: the reply's time_ns may hold the pid's digits by chance
        assert str(6 * GiB) not in _whole_numbers(frames[2]) and str(os.getpid()) not in _whole_numbers(frames[2])
    assert replies["unsigned drain"] and json.loads(replies["forged drain"][2])["error"]["message"] == (
        "[gpucleanup.server.403] bad signature: sign the body with HMAC-SHA256 (hex digest) under the key from the "
        "kernel's key file")
    _owner_sees_the_same_kernel(k)


@needs_root
@pytest.mark.parametrize("victim_kernel", ["ipc"], indirect=True)
def test_another_user_scraping_the_exporter_gets_no_figure_and_no_notebook(victim_kernel):
    from gpucleanup.outside import exporter as exporter_mod

    k = victim_kernel
    exporter = exporter_mod.start_exporter(0, runtime_dir=k.runtime, timeout=5.0)
    try:
        found = _as_nobody(
            f"""
            import urllib.request, urllib.error
            out = {{"token": why(lambda: open({str(exporter.token_file)!r}).read())}}
            try:
                urllib.request.urlopen({exporter.url!r}, timeout=30)
                out["status"] = 200
            except urllib.error.HTTPError as exc:
                out["status"], out["body"] = exc.code, exc.read().decode()
            print(json.dumps(out))
            """,
            _child_env(HOME=str(k.base / "home-of-other")),
        )
        token = exporter.token_file.read_text().strip()
        request = urllib.request.Request(exporter.url, headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            owners = response.read().decode()
    finally:
        exporter.shutdown()
    assert found["token"] == "EACCES"
    assert found["status"] == 401
    assert "secret-plans" not in found["body"] and "gpucleanup_" not in found["body"]
    assert 'notebook="/home/me/secret-plans.ipynb"' in owners  # the owner, with the token, sees it


_FOREIGN_SUBSCRIBERS = """
n = int(sys.argv[1])
context = zmq.Context()
subs = []
for _ in range(n):
    s = context.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(sys.argv[2])
    subs.append(s)
print("ready", flush=True)
sys.stdin.read()
"""


@needs_root
@pytest.mark.parametrize("victim_kernel", ["tcp"], indirect=True)
def test_foreign_subscribers_cannot_lock_the_owner_out_of_its_records(victim_kernel):
    k = victim_kernel
    pub = k.ep.info["pub_endpoint"]
    lib = k.ep._lib()
    foreign = subprocess.Popen([sys.executable, "-c", _AS_NOBODY + _FOREIGN_SUBSCRIBERS, "70", pub],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               env=_child_env(HOME=str(k.base / "home-of-other")))
    subscriber = status_client.Subscriber()
    try:
        assert foreign.stdout.readline().strip() == "ready"
        # the records socket is full of the other user's subscribers (and refuses more of them)
        deadline = time.monotonic() + HANG_S
        while not (lib.server_connections()["pub_peers"] >= lib.server_connections()["max_peers"]
                   and lib.server_connections()["refused_connections"] > 0):
            assert time.monotonic() < deadline, lib.server_connections()
            time.sleep(0.05)
        subscriber.add("owner", status_client.Target(pub, k.owner.key, "owner"))
        got = []
        deadline = time.monotonic() + HANG_S
        cell = 100
        while not got:
            assert time.monotonic() < deadline, "the owner's subscription got no record"
            cell += 1
            k.ep.publish({"cell": cell, "devices": []})
            got = subscriber.poll(0.2)
        assert got[0][1]["record"]["cell"] > 100
    finally:
        subscriber.close()
        foreign.stdin.close()
        foreign.wait(HANG_S)


_IDLE_CONNECTIONS = """
held = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.connect(("127.0.0.1", int(sys.argv[2])))
    held.append(s)
print("ready", flush=True)
sys.stdin.read()
"""


@needs_root
@pytest.mark.parametrize("victim_kernel", ["ipc"], indirect=True)
def test_idle_connections_of_another_user_cannot_lock_the_owner_out_of_the_exporter(victim_kernel, monkeypatch):
    from gpucleanup.outside import exporter as exporters

    k = victim_kernel
    monkeypatch.setattr(exporters, "REQUEST_DEADLINE_S", 600.0)  # the other user's connections stay as long as it likes
    exporter = exporters.start_exporter(0, runtime_dir=k.runtime, timeout=5.0)
    foreign = subprocess.Popen([sys.executable, "-c", _AS_NOBODY + _IDLE_CONNECTIONS, "100", str(exporter.port)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               env=_child_env(HOME=str(k.base / "home-of-other")))
    try:
        assert foreign.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + HANG_S
        while exporter.server.waiting < 100:  # all held by the gate, none with a thread
            assert time.monotonic() < deadline, exporter.server.waiting
            time.sleep(0.05)
        token = exporter.token_file.read_text().strip()
        for _ in range(3):
            request = urllib.request.Request(exporter.url, headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(request, timeout=HANG_S) as response:
                assert 'notebook="/home/me/secret-plans.ipynb"' in response.read().decode()
        assert exporter.server.serving <= exporters.MAX_CONNECTIONS
    finally:
        foreign.stdin.close()
        foreign.wait(HANG_S)
        exporter.shutdown()


def test_the_exporter_closes_a_connection_that_sends_nothing(tmp_path, monkeypatch):
    import socket

    from gpucleanup.outside import exporter as exporters

    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setattr(exporters, "REQUEST_DEADLINE_S", 0.5)
    exporter = exporters.start_exporter(0, runtime_dir=runtime, timeout=1.0)
    try:
        with socket.create_connection(("127.0.0.1", exporter.port), timeout=HANG_S) as idle:
            assert idle.recv(1) == b""  # closed by the exporter, well within the guard
    finally:
        exporter.shutdown()
