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

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_validate.py"
SECTIONS = ("kernels", "auto", "engine", "bandwidth", "peers", "throughput", "kernels_rest", "invariant")


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


def test_plan_orders_the_sections_by_what_they_prove():
    proc = run("--plan")
    order = [line.split()[0] for line in proc.stdout.splitlines() if line.split() and line.split()[0] in SECTIONS]
    assert order == list(SECTIONS)


@pytest.mark.bench  # ~30 s: a process per section importing JAX and building the cases (CI runs it)
def test_dry_run_plans_every_section_within_the_budget_on_a_cpu(tmp_path):
    """--dry-run builds each section's cases, shapes and (abstract) models on the CPU and reports each one's
    estimate and how many of its items the budget reaches, in the run's order; nothing runs on a device."""
    out = tmp_path / "out"
    proc = run("--dry-run", "--quick", "--budget-s", "240", "--sections", "kernels,engine,bandwidth",
               "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["dry_run"] and report["budget_s"] == 240
    secs = report["sections"]
    assert list(secs) == ["kernels", "engine", "bandwidth"]
    for name, r in secs.items():
        assert r["dry_run"] and r["items"] == len(r["plan"]) > 0, (name, r)
        assert r["items_within_budget"] + r["not_run_for_budget"] == r["items"]
    # the kernels section holds only the cases auto picks a kernel for on the planned H100, each marked so
    assert all("(auto picks)" in line for line in secs["kernels"]["plan"])
    # in order, the budget reaches every kernel case and engine run, then part of the bandwidth rows
    assert secs["kernels"]["not_run_for_budget"] == 0 and secs["engine"]["not_run_for_budget"] == 0
    assert 0 < secs["bandwidth"]["not_run_for_budget"] < secs["bandwidth"]["items"]
    assert report["estimate_s"] <= 240
    assert "DRY RUN" in (out / "report.md").read_text()


def test_sections_past_the_budget_are_skipped_and_reported(tmp_path):
    out = tmp_path / "out"
    proc = run("--debug-cpu-interpret", "--budget-s", "5", "--sections", "kernels,auto", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    for name in ("kernels", "auto"):
        assert report["sections"][name]["skipped"] and "of the budget left" in report["sections"][name]["cut"]
    assert "| kernels | skipped |" in (out / "report.md").read_text()


@pytest.mark.soak
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
