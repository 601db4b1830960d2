"""scripts/gpu_validate.py on a CPU: what can be checked without a GPU (its sections' results
need one). It refuses on a CPU (exit 2); --plan lists every section with what it needs; each
section runs in its own process, so a crash in one is recorded and the next still runs, and the
report (JSON + markdown) is written after each section. The last uses the script's debug switches
(--debug-cpu-interpret runs a section's kernels in interpret mode on the CPU; --debug-crash aborts
a section's process)."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_validate.py"
SECTIONS = ("kernels", "auto", "bandwidth", "peers", "engine", "invariant")


def run(*args, timeout=900):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)})


def test_refuses_without_a_gpu(tmp_path):
    proc = run("--quick", "--out", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "needs an NVIDIA GPU" in proc.stderr
    assert not (tmp_path / "out" / "report.json").exists()


def test_plan_lists_every_section_and_what_it_needs():
    proc = run("--plan")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    for name in SECTIONS:
        assert name in lines and "GPU" in lines[name], (name, proc.stdout)


def test_sections_are_isolated_and_the_report_is_written(tmp_path):
    out = tmp_path / "out"
    proc = run("--debug-cpu-interpret", "--quick", "--sections", "kernels,engine", "--debug-crash", "engine",
               "--out", str(out))
    assert proc.returncode == 1, proc.stderr[-3000:]  # one section failed
    report = json.loads((out / "report.json").read_text())
    kernels, engine = report["sections"]["kernels"], report["sections"]["engine"]
    # The kernels section ran (interpret mode) and compared against the float64 oracle.
    assert kernels["ok"] and kernels["ran"] == 2, kernels
    assert all(c["max_abs_err"] <= c["tolerance"] for c in kernels["cases"])
    # The engine section's process aborted: recorded with its exit status, not lost.
    assert not engine["ok"] and "exited with" in engine["error"], engine
    md = (out / "report.md").read_text()
    assert "| kernels | ok |" in md and "| engine | FAILED |" in md
