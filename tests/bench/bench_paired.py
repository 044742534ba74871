#!/usr/bin/env python3
"""gpucleanup's added time per cell, measured on and off inside the same kernel (paired).

Two bare kernels differ by 0.08-0.25 ms per cell, as much as the +0.3 ms goal, so
comparing one kernel with gpucleanup against another without it mostly measures the
kernels. Here every kernel runs both states and the difference is taken within it.

Method, per scenario (those of bench_kernels.py; default cupy-idle, torch-idle,
rerun-cupy-pinned; with --fake-driver: cuda-unused, names-10):
  * --kernels K plain ipykernel kernels (default 3), started all at once, each with its
    own IPYTHONDIR. Each runs, untimed: %load_ext gpucleanup plus the --config lines as
    %config, the framework's set-up (bench_kernels.FW_SETUP), the scenario's set-up.
  * Each switch is an untimed cell: %unload_ext gpucleanup (off) or %load_ext gpucleanup
    plus the %config lines (on). After it, a silent user_expressions request (no cell
    hooks) checks that post_run_cell holds a gpucleanup callback (on) or none (off), then
    --settle untimed cells of the scenario (default 3) absorb the first cells after a switch.
  * Warm-up: --warmup untimed cells off, then on (default 10).
  * Rounds: per round one block of --block cells (default 20) on and one off; on first
    in even rounds, off first in odd ones (ABBA: a switch once per round). Round r runs
    on kernel 0, then kernel 1, ... so drift hits all kernels alike. --cells timed cells
    per state and kernel (default 400).
  * Time of a cell: execute to idle (bench_kernels.Kernel.run): execute_request sent until
    idle on iopub and execute_reply on shell have both arrived.
  * Per kernel: median and p95 on and off, added = median(on) - median(off),
    ratio = median(on) / median(off); across kernels: mean, min and max of those; pooled:
    median of all kernels' on cells minus median of all their off cells. Also the cells
    that printed gpucleanup output (idle scenarios should print nothing), with a sample.
  * At the end: the scenario's teardown, then the kernels shut down (also on error).

--stages: before gpucleanup is first loaded, each kernel installs tests/bench/kernel_probe.py's
timers (the steps of profile_cell.py --stages, and ipykernel's do_execute on and off);
the table then also splits the added time into the execution inside the kernel (of which
the hooks) and what lies outside it (ipykernel's messages, other threads).

--quick: 40 cells, blocks of 10, 3 warm-up cells, 2 kernels. --json PATH: everything,
every cell's time in ms included. Exit code 1 when a scenario failed.

Usage: python tests/bench/bench_paired.py [--scenario NAME ...] [--kernels K] [--cells N]
       [--block N] [--config LINE ...] [--fake-driver PATH] [--stages] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402
from bench_kernels import (FW_SETUP, CellFailed, Kernel, framework_check, host_figures, kernel_env,  # noqa: E402
                           make_scenario, nvidia_smi_machine, percentile)

DEFAULT = ["cupy-idle", "torch-idle", "rerun-cupy-pinned"]
DEFAULT_FAKE = ["cuda-unused", "names-10"]
UNSUPPORTED = ("long-session", "pinned-8g")  # cells before the timed ones / a silent re-pin per cell
# silent: how many post_run_cell callbacks come from gpucleanup
HOOKS_EXPR = ("sum(1 for f in get_ipython().events.callbacks['post_run_cell'] "
              "if (getattr(f, '__module__', None) or '').startswith('gpucleanup'))")
UNLOAD = "%unload_ext gpucleanup"
# --stages: kernel_probe's timers, installed before gpucleanup is first loaded
PROBE_INSTALL = (f"import sys as _s; _s.path.insert(0, {str(Path(__file__).resolve().parent)!r}); "
                 "import kernel_probe as _kp; _kp.install(get_ipython()); del _s, _kp")


class SwitchFailed(CellFailed):
    pass


def r4(x):
    return None if x is None else round(x, 4)


class Paired:
    """One kernel of a scenario: its gpucleanup state, switched by untimed cells, and its timed cells."""

    def __init__(self, kernel: Kernel, sc: dict, load: str, settle: int):
        self.k, self.sc, self.load, self.settle = kernel, sc, load, settle
        self.state = "on"  # the kernel's first cell loads gpucleanup
        self.switches = 0
        self.times: Dict[str, List[float]] = {"on": [], "off": []}
        self.outputs: Dict[str, List[str]] = {"on": [], "off": []}
        self.hooks: List[int] = []

    def verify(self) -> None:
        n = self.k.expressions({"n": HOOKS_EXPR})["n"]
        self.hooks.append(n)
        if not isinstance(n, int) or (n > 0) != (self.state == "on"):
            raise SwitchFailed(f"{self.k.variant}: gpucleanup should be {self.state}, but post_run_cell holds "
                               f"{n!r} gpucleanup callbacks")

    def switch(self, state: str) -> None:
        if state == self.state:
            return
        self.k.run(self.load if state == "on" else UNLOAD)
        self.state = state
        self.switches += 1
        self.verify()
        for _ in range(self.settle):
            self.k.run(self.sc["cell"])

    def cells(self, state: str, n: int, timed: bool = True) -> None:
        self.switch(state)
        for _ in range(n):
            res = self.k.run(self.sc["cell"])
            if timed:
                self.times[state].append(res["elapsed_s"] * 1e3)
                if res["stdout"].strip():
                    self.outputs[state].append(res["stdout"])


def everywhere(kernels: List[Kernel], code: str) -> None:
    """One untimed cell on every kernel at once."""
    if code.strip():
        ids = [(k, k.send(code)) for k in kernels]
        for k, msg_id in ids:
            k.wait([msg_id])


def rounds(ps: List[Paired], cells: int, block: int, warmup: int) -> int:
    for p in ps:  # warm-up off, then on: round 0 starts on
        p.cells("off", warmup, timed=False)
        p.cells("on", warmup, timed=False)
    done = rnd = 0
    while done < cells:
        n = min(block, cells - done)
        order = ("on", "off") if rnd % 2 == 0 else ("off", "on")
        for p in ps:
            for state in order:
                p.cells(state, n)
        done += n
        rnd += 1
    return rnd


def stats(times: List[float]) -> dict:
    return {"n": len(times), "median_ms": r4(statistics.median(times)), "p95_ms": r4(percentile(times, 0.95)),
            "times_ms": [round(t, 4) for t in times]}


def kernel_result(p: Paired) -> dict:
    on, off = stats(p.times["on"]), stats(p.times["off"])
    out = p.outputs["on"]
    return {"on": on, "off": off, "added_ms": r4(on["median_ms"] - off["median_ms"]),
            "ratio": r4(on["median_ms"] / off["median_ms"]), "switches": p.switches, "hook_counts": p.hooks,
            "on_cells_with_output": len(out), "off_cells_with_output": len(p.outputs["off"]),
            "output_sample": out[-1][-600:] if out else ""}


def spread(values: List[float]) -> dict:
    return {"mean": r4(statistics.fmean(values)), "min": r4(min(values)), "max": r4(max(values))}


def start(sc: dict, args, workdir: Path, kernels: List[Kernel]) -> None:
    for i in range(args.kernels):
        env = kernel_env(args, sc, workdir, f"k{i}")
        kernels.append(Kernel(f"k{i}", args.python, env, args.timeout, log=workdir / f"k{i}" / "kernel.log"))
    for k in kernels:
        k.wait_ready()


def run_scenario(sc: dict, args, load: str, workroot: Path) -> dict:
    """One scenario on its own kernels; {"error": ...} with the kernels' log tails when a cell failed."""
    t0 = time.perf_counter()
    res: dict = {k: sc[k] for k in ("framework", "setup", "cell", "teardown")}
    res.update(kernels=args.kernels, cells=sc["cells"], block=args.block, warmup=sc["warmup"], settle=args.settle)
    kernels: List[Kernel] = []
    try:
        start(sc, args, workroot / sc["name"], kernels)
        ps = [Paired(k, sc, load, args.settle) for k in kernels]
        if args.stages:
            everywhere(kernels, PROBE_INSTALL)
        everywhere(kernels, load)
        for p in ps:
            p.verify()
        res["gpucleanup_version"] = kernels[0].expressions({"v": "__import__('gpucleanup').__version__"})["v"]
        everywhere(kernels, FW_SETUP[sc["framework"]])
        everywhere(kernels, sc["setup"])
        host_before = [host_figures(k.pid) for k in kernels]
        res["rounds"] = rounds(ps, sc["cells"], args.block, sc["warmup"])
        host_after = [host_figures(k.pid) for k in kernels]
        everywhere(kernels, sc["teardown"])
        per = res["per_kernel"] = {p.k.variant: kernel_result(p) for p in ps}
        if args.stages:  # the untimed cells before the rounds: load, set-up, warm-up, settle
            skip = 3 + 2 * sc["warmup"] + 2 * args.settle
            for p in ps:
                per[p.k.variant]["probe"] = p.k.expressions({"r": f"__import__('json').dumps("
                                                                  f"__import__('kernel_probe').report({skip}))"})["r"]
        for i, e in enumerate(per.values()):
            e["host"] = {"before": host_before[i], "after": host_after[i]}
        res["across"] = {"added_ms": spread([e["added_ms"] for e in per.values()]),
                         "ratio": spread([e["ratio"] for e in per.values()])}
        on = statistics.median([t for p in ps for t in p.times["on"]])
        off = statistics.median([t for p in ps for t in p.times["off"]])
        res["pooled"] = {"on_median_ms": r4(on), "off_median_ms": r4(off), "added_ms": r4(on - off), "ratio": r4(on / off)}
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
        res["kernel_logs"] = {k.variant: k.log_tail() for k in kernels if k.log_tail().strip()}
    finally:
        for k in kernels:
            k.shutdown()
    res["elapsed_s"] = round(time.perf_counter() - t0, 2)
    return res


def print_table(name: str, res: dict) -> None:
    if "skipped" in res:
        print(f"== {name}: skipped ({res['skipped']})")
        return
    if "error" in res:
        print(f"== {name}: FAILED: {res['error'].splitlines()[0]}")
        for k, tail in res.get("kernel_logs", {}).items():
            print(f"  -- {k} log tail:\n" + "\n".join("     " + line for line in tail.splitlines()[-15:]))
        return
    print(f"== {name}: framework {res['framework']}, gpucleanup {res['gpucleanup_version']}, {res['kernels']} kernels, "
          f"{res['cells']} timed cells per state each ({res['rounds']} rounds, blocks of {res['block']}, "
          f"warm-up {res['warmup']}, settle {res['settle']}), {res['elapsed_s']} s")
    print(f"  {'kernel':<8}{'off med':>9}{'on med':>9}{'added':>9}{'ratio':>7}{'off p95':>9}{'on p95':>9}"
          f"{'switches':>10}  on cells w/ output")
    for k, e in res["per_kernel"].items():
        print(f"  {k:<8}{e['off']['median_ms']:>9.3f}{e['on']['median_ms']:>9.3f}{e['added_ms']:>+9.3f}{e['ratio']:>7.2f}"
              f"{e['off']['p95_ms']:>9.3f}{e['on']['p95_ms']:>9.3f}{e['switches']:>10}  {e['on_cells_with_output']}")
    a, r, pooled = res["across"]["added_ms"], res["across"]["ratio"], res["pooled"]
    print(f"  across kernels: added {a['mean']:+.3f} ms (min {a['min']:+.3f}, max {a['max']:+.3f}); "
          f"ratio {r['mean']:.2f} (min {r['min']:.2f}, max {r['max']:.2f})")
    print(f"  pooled: on {pooled['on_median_ms']:.3f} - off {pooled['off_median_ms']:.3f} = {pooled['added_ms']:+.3f} ms "
          f"(ratio {pooled['ratio']:.2f})")
    print_probe(res)
    for k, e in res["per_kernel"].items():
        if e["output_sample"]:
            print(f"  gpucleanup said ({k}, last): {e['output_sample'].strip().splitlines()[-1][:160]}")


def print_probe(res: dict) -> None:
    """--stages: per kernel, the added time split by where it goes, then the steps (median µs per on cell)."""
    probes = {k: e["probe"] for k, e in res["per_kernel"].items() if isinstance(e.get("probe"), dict)}
    for k, pr in probes.items():
        rc, added = pr["run_cell_us"], res["per_kernel"][k]["added_ms"] * 1e3
        hooks = sum(us for label, us, _ in pr["stages"] if label.endswith(("GPUCleanup.pre_run_cell",
                                                                          "GPUCleanup.post_run_cell")))
        inside = (rc["on"] or 0) - (rc["off"] or 0)
        print(f"  {k}: added {added:.0f} µs = execution in the kernel {inside:+.0f} µs (on {rc['on']}, off {rc['off']}; "
              f"hooks {hooks:.0f} µs) + outside it {added - inside:+.0f} µs")
    if probes:
        k, pr = next(iter(probes.items()))
        print(f"  steps in {k} (median µs per on cell, inclusive, calls per cell):")
        for label, us, calls in pr["stages"][:30]:
            print(f"    {us:9.1f} µs  {calls:5.2f}  {label}")


def print_summary(results: Dict[str, dict]) -> None:
    print("\n== summary (ms per cell, execute to idle; added = median(on) - median(off) within each kernel)")
    print(f"  {'scenario':<20}{'off med':>9}{'added mean':>12}{'min':>9}{'max':>9}{'pooled':>9}{'ratio':>7}")
    for name, res in results.items():
        if "pooled" not in res:
            print(f"  {name:<20}{res.get('skipped') or 'FAILED: ' + res.get('error', '').splitlines()[0][:80]}")
            continue
        a, p = res["across"]["added_ms"], res["pooled"]
        print(f"  {name:<20}{p['off_median_ms']:>9.3f}{a['mean']:>+12.3f}{a['min']:>+9.3f}{a['max']:>+9.3f}"
              f"{p['added_ms']:>+9.3f}{res['across']['ratio']['mean']:>7.2f}")


def scenario_for(name: str, args, fw: dict) -> dict:
    """bench_kernels' scenario; make_scenario reads options of bench_kernels that this script does not have."""
    if name in UNSUPPORTED:
        return {"skip": "not measured by the paired method (use bench_kernels.py)"}
    extra = dict(long_cells=0, long_variants=["bare"], torch_step_cells=args.cells, pinned_cells=args.cells, pinned_gib=8)
    return make_scenario(name, argparse.Namespace(**{**vars(args), **extra}), fw)


def main() -> int:
    """Parse the options, run each scenario on its own kernels, print the tables, write --json."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
    parser.add_argument("--scenario", action="append", default=[], help="scenario(s), comma separated or repeated "
                        f"(default {','.join(DEFAULT)}; with --fake-driver {','.join(DEFAULT_FAKE)})")
    parser.add_argument("--kernels", type=int, default=3, help="kernels per scenario (default 3)")
    parser.add_argument("--cells", type=int, default=400, help="timed cells per state and kernel (default 400)")
    parser.add_argument("--block", type=int, default=20, help="cells in a row in one state (default 20)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed cells in each state first (default 10)")
    parser.add_argument("--settle", type=int, default=3, help="untimed cells after each switch (default 3)")
    parser.add_argument("--config", action="append", default=[],
                        help="a %%config line run after each %%load_ext gpucleanup, e.g. \"GPUCleanup.release = 'auto'\"")
    parser.add_argument("--stages", action="store_true",
                        help="time the steps inside each kernel (tests/bench/kernel_probe.py) and split the added time")
    parser.add_argument("--quick", action="store_true", help="40 cells, blocks of 10, 3 warm-up, 2 kernels")
    parser.add_argument("--fake-driver", help="the fake libcuda.so.1 (no GPU): GPUCLEANUP_LIBCUDA and a fake scenario for the kernels")
    parser.add_argument("--python", default=sys.executable, help="interpreter of the kernels (default: this one)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a cell may take (default 60)")
    parser.add_argument("--json", help="write every figure here (rewritten after each scenario)")
    args = parser.parse_args()
    if args.quick:
        args.cells, args.warmup, args.kernels = 40, 3, 2
        args.block = min(args.block, 10)
    if min(args.kernels, args.cells, args.block) < 1 or min(args.warmup, args.settle) < 0:
        parser.error("--kernels, --cells and --block must be >= 1, --warmup and --settle >= 0")
    if args.fake_driver and not Path(args.fake_driver).exists():
        parser.error(f"--fake-driver {args.fake_driver}: no such file")
    if not bk._has("jupyter_client"):
        print("bench_paired: jupyter_client is not importable: nothing to run")
        return 1
    bk.GPUCLEANUP_CONFIG.extend(args.config)
    load = bk.tool_cell("gpucleanup", "")  # %load_ext gpucleanup + the %config lines
    names = bk.expand_names(args.scenario) or (DEFAULT_FAKE if args.fake_driver else DEFAULT)
    probe_env = {k: v for k, v in os.environ.items() if not k.startswith(("JPY_", "GPUCLEANUP_FAKE_CUDA"))}
    fw = {} if args.fake_driver else framework_check(args.python, probe_env)
    meta = {"time": time.strftime("%Y-%m-%d %H:%M:%S %z"), "platform": platform.platform(), "python": sys.version.split()[0],
            "cpus": os.cpu_count(), "gpu": nvidia_smi_machine(), "frameworks": fw,
            "fake_driver": os.path.abspath(args.fake_driver) if args.fake_driver else None,
            "versions": {m: bk._version(m) for m in ("IPython", "ipykernel", "jupyter_client")},
            "options": {k: v for k, v in vars(args).items() if k != "json"}, "method": __doc__.split("\n\n")[2]}
    print(f"bench_paired: Python {meta['python']}, {meta['cpus']} CPUs, GPU {meta['gpu'] or 'none (nvidia-smi absent)'}"
          + (f", fake driver {meta['fake_driver']}" if args.fake_driver else ""), flush=True)
    results: Dict[str, dict] = {}
    out = {"meta": meta, "scenarios": results}
    t_all = time.perf_counter()
    workroot = Path(tempfile.mkdtemp(prefix="gpucleanup-bench-paired-"))
    try:
        for name in names:
            sc = scenario_for(name, args, fw)
            if "skip" in sc:
                results[name] = {"skipped": sc["skip"]}
            else:
                print(f"-- {name}: {args.kernels} kernels ...", flush=True)
                results[name] = run_scenario(sc, args, load, workroot)
            meta["gpucleanup"] = meta.get("gpucleanup") or results[name].get("gpucleanup_version")
            print_table(name, results[name])
            sys.stdout.flush()
            if args.json:
                bk._write(args.json, out)
    finally:
        shutil.rmtree(workroot, ignore_errors=True)
    out["elapsed_s"] = round(time.perf_counter() - t_all, 1)
    print_summary(results)
    print(f"\nbench_paired: {len(names)} scenarios in {out['elapsed_s']} s")
    if args.json:
        bk._write(args.json, out)
        print(f"bench_paired: figures in {args.json}")
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
