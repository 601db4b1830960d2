"""The deviceless GPU compile tier, fast subset: jpa's kernels and the engine's jitted steps compile
for an H100 and an A100 that are not here (XLA's whole GPU pipeline, Triton and ptxas included).

Each test runs scripts/gpu_compile_check.py as its users do (a subprocess: the script sets XLA's
logging before JAX loads, to read ptxas's register report) and checks its JSON report. The full
covering grid is `python scripts/gpu_compile_check.py --target h100|a100` (BENCHMARKS.md).
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_compile_check.py"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("jax_plugins.xla_cuda12") is None,
    reason="the compile-only GPU packages are not installed (pip install -e '.[gpu]'; ./run test does)")


def run_check(tmp_path, *args, timeout=900):
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_CPP_VMODULE")}
    proc = subprocess.run([sys.executable, str(SCRIPT), *args, "--json", str(out)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)
    assert out.exists(), proc.stderr[-3000:]
    report = json.loads(out.read_text())
    return proc, report


def compiled(report):
    return [r for r in report["records"] if "refused" not in r]


@pytest.mark.parametrize("target,kernel_names", [("h100", ("triton", "mosaic")), ("a100", ("triton",))])
def test_kernel_grid_subset_compiles(tmp_path, target, kernel_names):
    proc, report = run_check(tmp_path, "--target", target, "--subset", "fast", "--only", "kernels")
    failed = [(r["name"], r.get("error") or r.get("problems")) for r in report["records"] if not r["ok"]]
    assert proc.returncode == 0 and not failed, failed
    recs = compiled(report)
    assert {r["name"].split()[0] for r in recs} == set(kernel_names)
    for r in recs:
        assert r["pool_copies"] == [], r["name"]
        assert r["pool_bytes"] < 2 ** 28 or r["temp_bytes"] < r["pool_bytes"] // 4, r["name"]
        if r["name"].startswith("triton"):
            # One Pallas Triton kernel, with the launch XLA recorded and ptxas's register count.
            assert r["triton_calls"] == 1 and len(r["kernels"]) == 1, r["name"]
            (k,) = r["kernels"].values()
            assert np.prod(k["grid"]) >= 1 and k["threads"][0] >= 32 and 0 < k["shared_memory"] <= 232448
            assert 0 < k["registers"] <= 255 and k["spill_stores"] == 0
        else:
            # The Mosaic kernel's ptxas report, read from MOSAIC_GPU_DUMP_TO: registers, no spills,
            # the SMEM scratch Mosaic planned and the threads of its one warpgroup.
            assert r["mosaic_calls"] == 1 and r["triton_calls"] == 0
            k = r["kernels"]["jpa_mosaic_decode"]
            assert k["ptxas_reports"] >= 1 and 0 < k["registers"] <= 255 and k["spill_stores"] == 0, r["name"]
            assert 0 < k["shared_memory"] <= 232448 and k["threads"][0] == 128
    assert report["summary"]["ptxas"], "ptxas did not run: registers cannot have been read"


@pytest.mark.parametrize("target,kernel_names", [("h100", ("triton", "mosaic")), ("a100", ("triton",))])
def test_stacked_pool_in_a_layer_loop_compiles(tmp_path, target, kernel_names):
    """The layer-scanned model's call: a loop over 40 layers, ONE [L, K, P, S_p, H] pool per K/V
    (5 GiB each: Pallas Triton's 64-bit offsets) carried, written each layer and donated, the
    ragged op (tile kernel + decode kernel) called on the whole pool with the loop index as its
    layer. Both kernels sit once in the loop body; the pools reach them uncopied and aliased."""
    proc, report = run_check(tmp_path, "--target", target, "--subset", "fast", "--only", "stacked")
    failed = [(r["name"], r.get("error") or r.get("problems")) for r in report["records"] if not r["ok"]]
    assert proc.returncode == 0 and not failed, failed
    recs = compiled(report)
    assert sorted(r["name"].split()[1] for r in recs) == sorted(kernel_names)
    for r in recs:
        assert r["kind"] == "stacked" and r["num_layers"] == 40, r["name"]
        assert r["pool_bytes"] > 2 * 2 ** 32 and r["alias_bytes"] >= r["pool_bytes"], r["name"]
        assert r["pool_copies"] == [] and r["temp_bytes"] < r["pool_bytes"] // 4, r["name"]
        calls = r["triton_calls" if r["name"].split()[1] == "triton" else "mosaic_calls"]
        assert calls == 2, r["name"]   # the tile kernel and the last rows' decode kernel
        assert len(r["kernels"]) == 2, r["kernels"]
        for k in r["kernels"].values():
            assert 0 < k["registers"] <= 255 and k["spill_stores"] == 0, r["name"]


def test_random_accepted_configs_compile(tmp_path):
    """Whatever unsupported_reason accepts for the target compiles (fresh random configurations)."""
    seed = int(np.random.default_rng().integers(1 << 30))
    for target in ("h100", "a100"):
        proc, report = run_check(tmp_path, "--target", target, "--only", "kernels", "--random", "3",
                                 "--seed", str(seed))
        failed = [(r["name"], r.get("error") or r.get("problems")) for r in report["records"] if not r["ok"]]
        assert proc.returncode == 0 and not failed, (f"seed {seed}", failed)


def test_oversized_kernel_is_reported_not_crashed(tmp_path):
    """A kernel asking for more shared memory than the target has fails in the tier, as on a GPU,
    and the tier reports it with a non-zero exit (the check that refuses to pass by accident)."""
    script = tmp_path / "oversized.py"
    script.write_text(f"""
import sys, functools
sys.path.insert(0, {str(ROOT / "scripts")!r})
import gpu_compile_check as g
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl

def kernel(x_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], x_ref[...], preferred_element_type=jnp.float32).astype(o_ref.dtype)

def big(x):  # a 512x512 bf16 dot in one program: its operands need ~1 MiB of shared memory
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(1,), in_specs=[pl.BlockSpec((512, 512), lambda i: (0, 0))],
                          out_specs=pl.BlockSpec((512, 512), lambda i: (0, 0)))(x)

rec = g.Compiler("h100").compile("oversized", big, (jax.ShapeDtypeStruct((512, 512), jnp.bfloat16),))
print("RESULT", rec["ok"], rec.get("error", ""))
""")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    assert line.startswith("RESULT False") and "RESOURCE_EXHAUSTED" in line, line


def test_engine_steps_compile_with_the_targets_kernel(tmp_path):
    """SmolLM2 bf16 with a >= 1 GiB pool: the engine's one program, the unified step, names the
    A100's Triton kernels three times in the program text: the layers are a scan, so its one
    layer body holds the ragged tiles' and last rows' calls and the decode loop's one (an unrolled
    model, or an XLA pass unrolling the scan, would show 90); with speculation (H100, Mosaic) five;
    donated pools aliased, no pool copy, small temporaries."""
    # One program per target (both: scripts/gpu_compile_check.py --only engine, recorded in
    # benchmarks/gpu_compile_spec_*.json): the A100 the plain step, the H100 the speculative one,
    # whose decode loop adds the verify pass (a ragged op over k + 1 rows per sequence) to the plain
    # step's ragged step and decode pass.
    for target, call, steps, calls in (("h100", "mosaic_calls", "spec", 5), ("a100", "triton_calls", "plain", 3)):
        proc, report = run_check(tmp_path, "--target", target, "--only", "engine", "--engine-steps", steps)
        recs = report["records"]
        assert proc.returncode == 0 and all(r["ok"] for r in recs), [r.get("problems") or r.get("error")
                                                                     for r in recs]
        (unified,) = recs
        assert "unified step" in unified["name"] and ("speculation" in unified["name"]) == (steps == "spec")
        assert unified["attention"] == ("mosaic" if target == "h100" else "triton")
        assert unified[call] == calls
        for r in recs:
            assert r["pool_bytes"] >= 2 ** 30
            assert r["alias_bytes"] >= r["pool_bytes"], r["name"]
            assert r["temp_bytes"] < r["pool_bytes"] // 4 and r["pool_copies"] == [], r["name"]


def test_a_spilling_kernel_fails_the_record(tmp_path):
    """ptxas spills are a failure of the tier (every accepted configuration must compile without
    them): a Triton kernel made to spill (two [64, 128] f32 tiles live across a loop in one warp:
    512 values per thread, 255 registers at most) is reported with its spill bytes and ok False."""
    script = tmp_path / "spill.py"
    script.write_text(f"""
import sys
sys.path.insert(0, {str(ROOT / "scripts")!r})
import gpu_compile_check as g
import jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

def kernel(x_ref, o_ref):
    x = x_ref[...]
    def body(i, acc):  # f32 [64, 128] accumulator + x over 1 warp: 512 live values per thread
        return acc * x + x
    o_ref[...] = lax.fori_loop(0, 8, body, x)

def jpa_spill(x):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(1,),
                          in_specs=[pl.BlockSpec((64, 128), lambda i: (0, 0))],
                          out_specs=pl.BlockSpec((64, 128), lambda i: (0, 0)), name="jpa_spill",
                          compiler_params=plgpu.CompilerParams(num_warps=1))(x)

rec = g.Compiler("h100").compile("spill", jpa_spill, (jax.ShapeDtypeStruct((64, 128), jnp.float32),))
print("RESULT", rec["ok"], rec.get("spills"), rec.get("problems"), rec.get("error", ""))
""")
    # (In the full suite pytest's process has TF_CPP_MIN_LOG_LEVEL=1 from JAX's CUDA plugin, which
    # hid ptxas's report until gpu_compile_check set the level itself: this must hold in that env.)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="1")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    assert line.startswith("RESULT False {'jpa_spill':") and "ptxas spills registers" in line, line


def test_tensor_parallel_engine_steps_compile_for_8_h100s(tmp_path):
    """A Llama-shaped model (2 of its 32 layers, for time) tensor-parallel over 8 compile-only H100s:
    the layers a scan, so the program text holds one layer body per model pass: the kernels three
    times on every device, exactly two f32[tokens, d_model] all-reduces per body in each of the
    step's two model passes (ragged pass, decode loop), nothing with a head axis or a pool
    dimension moved, the stacked pool shards donated in place."""
    proc, report = run_check(tmp_path, "--target", "h100", "--only", "tp", "--tp", "8", "--layers", "2")
    recs = report["records"]
    assert proc.returncode == 0 and all(r["ok"] for r in recs), [(r["name"], r.get("error") or r["problems"]) for r in recs]
    (step,) = recs
    assert step["mosaic_calls"] == 3 and step["row_parallel_all_reduces"] == 2 * 2
    types = step["collectives_per_step"]["all-reduce"]["types"]
    assert "f32[64,4096]" in types and "f32[512,4096]" in types, types   # decode loop, ragged pass
    for r in recs:
        assert r["pool_copies"] == [] and r["alias_bytes"] >= r["pool_bytes"] == r["pool_bytes_per_device"]
        assert r["pool_spec"] == "P(None, 'tp')" and r["param_specs"]["wo"] == "P(None, 'tp', None)"
        assert "all-to-all" not in r["other_collectives"] and "collective-permute" not in r["other_collectives"]
