"""Two GPUs in one kernel (skipped on a machine with fewer): GPU1 alone, both GPUs, and GPU0
alone while GPU1 stays idle. Each device in use is cleaned and named on a line of its own;
an idle device gets no context from gpucleanup (its primary context stays inactive, as the
driver reports it to the process itself; nvidia-smi's view is printed as a figure)."""

from __future__ import annotations

import pytest

from conftest import gpu_count, require, run_script

SHELL = '''
    import io, contextlib, subprocess, os
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    def run(code):
        sink = io.StringIO()
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            res = shell.run_cell(code, store_history=True)
        assert res.error_in_exec is None and res.error_before_exec is None, sink.getvalue()
        lines = [l for l in sink.getvalue().splitlines() if l.startswith("gpucleanup")]
        for l in lines:
            figure(l)
        return lines
    def contexts():
        import gpucleanup
        return {d["index"]: bool(d.get("in_use")) for d in gpucleanup.snapshot()["devices"]}
    def smi():
        try:
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id,used_memory",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout
        except Exception as exc:
            out = f"nvidia-smi: {exc}"
        figure(f"nvidia-smi compute apps (pid {os.getpid()}): {out.strip() or '(none listed)'}")
'''


@pytest.fixture(autouse=True)
def two_gpus():
    count, why = gpu_count()
    if count < 2:
        pytest.skip(f"needs two GPUs ({why})")
    require("torch")


def test_gpu1_alone_is_cleaned_and_gpu0_gets_no_context():
    r = run_script(SHELL, '''
        run("%load_ext gpucleanup")
        run("%config GPUCleanup.release = 'cell'")  # given back as each cell ends (the default waits for idle)
        run("import torch\\nw = torch.ones(1, device='cuda:1')")
        lines = run("x = torch.empty(1 << 30, dtype=torch.uint8, device='cuda:1')\\ndel x")
        smi()
        result(lines=lines, contexts=contexts())
    ''')
    devices = [l for l in r["lines"] if " · GPU" in l]
    assert len(devices) == 1 and devices[0].startswith("gpucleanup · GPU1 "), r["lines"]
    assert "freed 1.0 GiB (torch 1.0)" in devices[0], r["lines"]
    assert {str(k): v for k, v in r["contexts"].items()} == {"0": False, "1": True}, r


def test_both_gpus_are_cleaned_each_on_its_own_line():
    r = run_script(SHELL, '''
        run("%load_ext gpucleanup")
        run("%config GPUCleanup.release = 'cell'")  # given back as each cell ends (the default waits for idle)
        run("import torch\\nw0 = torch.ones(1, device='cuda:0')\\nw1 = torch.ones(1, device='cuda:1')")
        lines = run("a = torch.empty(1 << 30, dtype=torch.uint8, device='cuda:0')\\n"
                    "b = torch.empty(1 << 29, dtype=torch.uint8, device='cuda:1')\\ndel a, b")
        smi()
        result(lines=lines, contexts=contexts())
    ''')
    gpu0 = [l for l in r["lines"] if l.startswith("gpucleanup · GPU0 ")]
    gpu1 = [l for l in r["lines"] if l.startswith("gpucleanup · GPU1 ")]
    assert len(gpu0) == 1 and "freed 1.0 GiB (torch 1.0)" in gpu0[0], r["lines"]
    assert len(gpu1) == 1 and "freed 512 MiB (torch 512)" in gpu1[0], r["lines"]
    assert set(r["contexts"].values()) == {True}, r


def test_gpu0_alone_leaves_idle_gpu1_without_a_context():
    r = run_script(SHELL, '''
        run("%load_ext gpucleanup")
        run("%config GPUCleanup.release = 'cell'")  # given back as each cell ends (the default waits for idle)
        run("import torch\\nw = torch.ones(1, device='cuda:0')")
        lines = []
        for _ in range(3):
            lines += run("x = torch.empty(1 << 28, dtype=torch.uint8, device='cuda:0')\\ndel x")
        run("%gpumem --drain")
        smi()
        result(lines=lines, contexts=contexts())
    ''')
    assert all(l.startswith("gpucleanup · GPU0 ") for l in r["lines"] if " · GPU" in l), r["lines"]
    assert any("freed 256 MiB (torch 256)" in l for l in r["lines"]), r["lines"]
    assert {str(k): v for k, v in r["contexts"].items()} == {"0": True, "1": False}, r


def test_idle_cells_on_two_gpus_read_pytorchs_token_alone_and_a_tensor_deleted_on_gpu1_is_given_back():
    # PyTorch's quiet token covers every device in use: idle cells build no figures, and a tensor deleted on GPU1
    # (its bytes stay in torch's cache there, unseen by the driver) changes it; that cell frees GPU1 alone
    r = run_script(SHELL, '''
        from gpucleanup.in_kernel import extension
        from gpucleanup.frameworks import ADAPTERS
        adapter = next(a for a in ADAPTERS if a.name == "torch")
        reads, read_figures = [], type(adapter)._stats
        type(adapter)._stats = lambda self, *a: reads.append(1) or read_figures(self, *a)
        run("%load_ext gpucleanup")
        run("%config GPUCleanup.release = 'cell'")
        ext = extension.get_extension(shell)
        run("import torch\\nx0 = torch.ones(1 << 28, device='cuda:0')\\nx1 = torch.ones(1 << 27, device='cuda:1')")
        run("z = 1")
        read, skipped = len(reads), ext.engine.since.skipped
        idle = [run("z = 1") for _ in range(10)]
        idle_reads, idle_skipped = len(reads) - read, ext.engine.since.skipped - skipped
        freed = run("del x1")
        result(idle=idle, idle_reads=idle_reads, idle_skipped=idle_skipped, freed=freed)
    ''')
    assert r["idle"] == [[]] * 10 and r["idle_skipped"] == 10 and r["idle_reads"] == 0, r
    gpu1 = [l for l in r["freed"] if l.startswith("gpucleanup · GPU1 ")]
    assert len(gpu1) == 1 and "freed 512 MiB (torch 512)" in gpu1[0], r["freed"]
    assert not any(l.startswith("gpucleanup · GPU0 ") and "freed 0 B" not in l for l in r["freed"]), r["freed"]
