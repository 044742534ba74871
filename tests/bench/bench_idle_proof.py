#!/usr/bin/env python3
"""What an idle cell's hooks cost with and without the proof of the idle cell before (``IdleProof``),
side by side in one process.

Method: an IPython shell in this process (no kernel, no messages) with ``%load_ext gpucleanup`` and the
scenario's set-up (a framework with memory in use and nothing to free: ``torch_idle`` or ``cupy_idle`` of
profile_cell.py; ``fake_torch``: a stand-in torch from tests/python/stand_ins on the fake CUDA driver,
for machines without a GPU; ``fake_device``: a device in use on the fake driver and no framework, where the
driver's figures alone prove a cell idle). Then rounds: a block of ``--block`` cells (default 500) with the proof, and
one without (``IdleProof.made`` answering None and ``stands`` False, so every idle cell takes the long way
as before the proof), in alternating order, each after 20 untimed cells. A cell is the extension's two
hooks called as IPython calls them (``pre_run_cell(info)``, ``post_run_cell(result)``): what the cell
itself costs is left out, as it is the same in both. Per state: the median over the rounds of each
block's mean, and the fastest block. Each block checks that its cells were proven idle (the engine's
count of skipped cells grew by the block) and that the proof was (or was not) in use.

Usage: python tests/bench/bench_idle_proof.py [SCENARIO ...] [--rounds N] [--block N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent

SETUP = {
    "torch_idle": "import torch\nw = torch.ones(1 << 20, device='cuda')\ntorch.cuda.synchronize()",
    "cupy_idle": "import cupy as cp\nw = cp.ones(1 << 20)\ncp.cuda.Device(0).synchronize()",
    "fake_torch": None,  # made by _fake_device
    "fake_device": None,  # made by _fake_device: a device in use, no framework
}


def _fake_device(torch: bool) -> None:
    """A device in use on the fake CUDA driver and, with ``torch``, a stand-in torch with 1 GiB in use on it
    (tests/python/stand_ins)."""
    sys.path.insert(0, str(ROOT / "tests" / "python"))
    sys.path.insert(0, str(HERE))
    import fake_driver  # tests/bench/fake_driver.py

    gib = 1 << 30
    fake_driver.use({"devices": [{"total_bytes": 80 * gib, "free_bytes": 78 * gib, "primary_active": True}]})
    if not torch:
        return
    import pytest
    from stand_ins import World
    from stand_ins.torch import install_torch

    install_torch(pytest.MonkeyPatch(), World(n_devices=1, active=(0,), current=0), allocated={0: gib},
                  reserved={0: gib}, host_keys="2.5")


def _proof(engine) -> object:
    """The engine's idle proof (its quiet check's; ``_idle_proof`` before the engine kept it there, so that
    one script measures both)."""
    quiet = getattr(engine, "quiet", None)
    return quiet.proof if quiet is not None else getattr(engine, "_idle_proof")


def run(scenario: str, rounds: int, block: int) -> dict:
    from IPython.core.interactiveshell import ExecutionInfo, ExecutionResult, InteractiveShell

    if scenario in ("fake_torch", "fake_device"):
        _fake_device(torch=scenario == "fake_torch")
    shell = InteractiveShell.instance()
    for code in ("%load_ext gpucleanup", SETUP[scenario], "x = 1", "x = 1", "x = 1"):
        if code is not None:
            result = shell.run_cell(code, store_history=True)
            if not result.success:
                raise SystemExit(f"bench_idle_proof: {scenario}: {code!r} failed: {result.error_in_exec!r}")
    from gpucleanup.engine import after_cell
    from gpucleanup.in_kernel import extension

    ext = extension.get_extension(shell)
    engine = ext.engine
    info = ExecutionInfo("x = 1", True, False, True, None)
    result = ExecutionResult(info)
    result.execution_count = shell.execution_count
    made, stands = after_cell.IdleProof.__dict__["made"], after_cell.IdleProof.__dict__["stands"]

    def use_proof(on: bool) -> None:
        after_cell.IdleProof.made = made if on else classmethod(lambda cls, *parts: None)
        after_cell.IdleProof.stands = stands if on else (lambda self, *parts: False)

    def timed(on: bool) -> float:
        use_proof(on)
        for _ in range(20):
            ext.pre_run_cell(info)
            ext.post_run_cell(result)
        skipped = engine.since.skipped
        start = time.perf_counter()
        for _ in range(block):
            ext.pre_run_cell(info)
            ext.post_run_cell(result)
        took = (time.perf_counter() - start) / block
        if engine.since.skipped - skipped != block:
            raise SystemExit(f"bench_idle_proof: {scenario}: {block - engine.since.skipped + skipped} cells were not idle")
        if (_proof(engine) is not None) != on:
            raise SystemExit(f"bench_idle_proof: {scenario}: the proof was {'not ' if on else ''}in use")
        return took * 1e6

    with_proof: list = []
    without: list = []
    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            (with_proof if on else without).append(timed(on))
    use_proof(True)
    on_med, off_med = statistics.median(with_proof), statistics.median(without)
    return {"scenario": scenario, "rounds": rounds, "block": block, "with_proof_us": with_proof, "without_us": without,
            "with_proof_median_us": on_med, "without_median_us": off_med, "saved_us": off_med - on_med,
            "ratio": on_med / off_med, "fastest_with_us": min(with_proof), "fastest_without_us": min(without)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # no choices= here: argparse checks a list default of nargs="*" against them as one value, and refuses it
    parser.add_argument("scenario", nargs="*", help=f"of {sorted(SETUP)} (default: torch_idle)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--block", type=int, default=500)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    args.scenario = args.scenario or ["torch_idle"]
    unknown = [name for name in args.scenario if name not in SETUP]
    if unknown:
        parser.error(f"unknown scenario {unknown[0]!r}: choose from {', '.join(sorted(SETUP))}")
    if len(args.scenario) != 1:
        # one shell per process: each scenario in a process of its own
        import subprocess

        out = []
        for scenario in args.scenario:
            cmd = [sys.executable, __file__, scenario, "--rounds", str(args.rounds), "--block", str(args.block)]
            done = subprocess.run(cmd + ["--json", "/dev/stdout"], capture_output=True, text=True)
            if done.returncode != 0:
                sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
                print(f"bench_idle_proof: {scenario} failed (exit {done.returncode})")
                return 1
            out.append(json.loads(done.stdout.strip().splitlines()[-1]))
    else:
        out = [run(args.scenario[0], args.rounds, args.block)]
    for r in out:
        print(f"{r['scenario']:12s} hooks per idle cell: with the proof {r['with_proof_median_us']:.1f} µs, without "
              f"{r['without_median_us']:.1f} µs: {r['saved_us']:+.1f} µs saved, {r['ratio']:.2f}x "
              f"(fastest blocks {r['fastest_with_us']:.1f} and {r['fastest_without_us']:.1f} µs; {r['rounds']} rounds "
              f"of {r['block']} cells each)", file=sys.stderr if str(args.json) == "/dev/stdout" else sys.stdout)
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(out if len(out) > 1 else out[0]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
