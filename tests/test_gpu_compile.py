"""The deviceless GPU compile tier, fast subset: jpa's kernels and the engine's jitted steps compile
for an H100 and an A100 that are not here (XLA's whole GPU pipeline, Triton and ptxas included).

Each compiling test runs in a fresh process (XLA's logging must be set before XLA starts, to read
ptxas's register report: `jpa.tools.deviceless.configure_environment`): `jpa tools compile`
as its users run it, checking its JSON report, or a few lines over `jpa.tools`. The HLO readers of
`jpa.tools.hlo` are tested here on a hand-written module. The full covering grid is
`jpa tools compile --target h100|a100` (BENCHMARKS.md).
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from jpa.tools import deviceless, hlo

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOOL = [sys.executable, "-m", "jpa.tools", "compile"]   # `jpa tools compile`

# The compiling tests need the `gpu` extra; the HLO readers' tests on hand-written modules run anywhere.
needs_gpu_packages = pytest.mark.skipif(deviceless.missing_packages() is not None,
                                        reason=str(deviceless.missing_packages()))


def fresh_env(**extra):
    """The environment of a compiling subprocess: this checkout's jpa first on the path (a script's
    own folder, not the working directory, is where Python looks first)."""
    path = os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    return dict(os.environ, PYTHONPATH=path, **extra)


def run_check(tmp_path, *args, timeout=900):
    out = tmp_path / "report.json"
    env = {k: v for k, v in fresh_env().items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_CPP_VMODULE")}
    proc = subprocess.run([*TOOL, *args, "--json", str(out)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)
    assert out.exists(), proc.stderr[-3000:]
    report = json.loads(out.read_text())
    return proc, report


def compiled(report):
    return [r for r in report["records"] if "refused" not in r]


@pytest.mark.soak
@needs_gpu_packages
@pytest.mark.parametrize("target,kernel_names", [("h100", ("triton", "mosaic")), ("a100", ("triton", "mosaic"))])
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
            # (the A100's is the cp.async + mma.sync kernel, its PTX for sm_80, not Mosaic's default sm_90a).
            assert r["mosaic_calls"] == 1 and r["triton_calls"] == 0
            # (on an H100 a configuration the WGMMA kernel refuses runs the mma.sync kernel with TMA copies).
            (name,) = r["kernels"]
            assert name in (("jpa_mosaic_decode_ampere",) if target == "a100"
                            else ("jpa_mosaic_decode", "jpa_mosaic_decode_ampere")), (r["name"], name)
            k = r["kernels"][name]
            assert k["ptx_targets"] == ["sm_80" if target == "a100" else "sm_90a"], r["name"]
            assert k["ptxas_reports"] >= 1 and 0 < k["registers"] <= 255 and k["spill_stores"] == 0, r["name"]
            assert 0 < k["shared_memory"] <= 232448 and k["threads"][0] == 128
    assert report["summary"]["ptxas"], "ptxas did not run: registers cannot have been read"


@pytest.mark.soak
@needs_gpu_packages
@pytest.mark.parametrize("target,kernel_names", [("h100", ("triton", "mosaic")), ("a100", ("triton", "mosaic"))])
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


@pytest.mark.soak
@needs_gpu_packages
def test_random_accepted_configs_compile(tmp_path):
    """Whatever unsupported_reason accepts for the target compiles (fresh random configurations)."""
    seed = int(np.random.default_rng().integers(1 << 30))
    for target in ("h100", "a100"):
        proc, report = run_check(tmp_path, "--target", target, "--only", "kernels", "--random", "3",
                                 "--seed", str(seed))
        failed = [(r["name"], r.get("error") or r.get("problems")) for r in report["records"] if not r["ok"]]
        assert proc.returncode == 0 and not failed, (f"seed {seed}", failed)


@pytest.mark.bench
@needs_gpu_packages
def test_oversized_kernel_is_reported_not_crashed(tmp_path):
    """A kernel asking for more shared memory than the target has fails in the tier, as on a GPU,
    and the tier reports it with a non-zero exit (the check that refuses to pass by accident)."""
    script = tmp_path / "oversized.py"
    script.write_text(f"""
from jpa.tools import deviceless as g
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
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=fresh_env())
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), proc.stderr[-3000:])
    assert line.startswith("RESULT False") and "RESOURCE_EXHAUSTED" in line, line


# The H100's speculative step in the main tier; the A100's and the B200's plain ones (another ~25 s
# deviceless SmolLM2 compile each; their mma.sync kernels are compiled above and in
# tests/test_bench_mosaic_ampere.py, alone and in a layer loop) in CI's bench tier.
@pytest.mark.soak
@needs_gpu_packages
@pytest.mark.parametrize("target,call,steps,calls", [
    ("h100", "mosaic_calls", "spec", 4),
    pytest.param("a100", "mosaic_calls", "plain", 3, marks=pytest.mark.bench),
    pytest.param("b200", "mosaic_calls", "plain", 3, marks=pytest.mark.bench)])
def test_engine_steps_compile_with_the_targets_kernel(tmp_path, target, call, steps, calls):
    """SmolLM2 bf16 with a >= 1 GiB pool: the engine's one program, the unified step, names the
    target's Mosaic kernels (WGMMA on the H100, mma.sync on the A100 / B200) three times in the
    program text and no Triton kernel: the layers are a scan, so its one
    layer body holds the ragged tiles' and last rows' calls and the decode loop's one (an unrolled
    model, or an XLA pass unrolling the scan, would show 90); with speculation (H100, Mosaic) four:
    the verify pass's k + 1 rows a sequence are ONE multi-row decode kernel call that reads the live
    KV once (`jpa.ops.ragged.query_rows_at_most`; two calls, the KV read twice, would make five);
    donated pools aliased, no pool copy, small temporaries."""
    # One program per target (both: `jpa tools compile` --only engine, recorded in
    # benchmarks/gpu_compile_spec_*.json): the A100 the plain step, the H100 the speculative one,
    # whose decode loop adds the verify pass (a ragged op over k + 1 rows per sequence) to the plain
    # step's ragged step and decode pass.
    proc, report = run_check(tmp_path, "--target", target, "--only", "engine", "--engine-steps", steps)
    recs = report["records"]
    assert proc.returncode == 0 and all(r["ok"] for r in recs), [r.get("problems") or r.get("error") for r in recs]
    (unified,) = recs
    assert "unified step" in unified["name"] and ("speculation" in unified["name"]) == (steps == "spec")
    assert unified["attention"] == "mosaic" and unified[call] == calls
    assert unified["triton_calls"] == 0
    for r in recs:
        assert r["pool_bytes"] >= 2 ** 30
        assert r["alias_bytes"] >= r["pool_bytes"], r["name"]
        assert r["temp_bytes"] < r["pool_bytes"] // 4 and r["pool_copies"] == [], r["name"]


@pytest.mark.soak
@needs_gpu_packages
@pytest.mark.bench
def test_step_shape_ladder_compiles_for_h100(tmp_path):
    """Every rung of the step-shape ladder (`--only ladder`; here max_seqs 2, budget 32: the 1 x 16 rung and
    the 2 x 32 full shape) is the engine's step with the H100's Mosaic kernels three times in the layer body,
    the pools aliased uncopied, no spill (benchmarks/gpu_compile_ladder_h100.json: the 32-slot ladder)."""
    proc, report = run_check(tmp_path, "--target", "h100", "--only", "ladder", "--max-seqs", "2", "--budget", "32")
    recs = report["records"]
    assert proc.returncode == 0 and all(r["ok"] for r in recs), [r.get("problems") or r.get("error") for r in recs]
    assert [r["name"].split(" (")[0] for r in recs] == ["engine unified step", "engine step-shape rung 1 rows x 16 tokens"]
    for r in recs:
        assert r["attention"] == "mosaic" and r["mosaic_calls"] == 3 and r["triton_calls"] == 0, r["name"]
        assert r["alias_bytes"] >= r["pool_bytes"] and r["pool_copies"] == [], r["name"]


@needs_gpu_packages
def test_a_spilling_kernel_fails_the_record(tmp_path):
    """ptxas spills are a failure of the tier (every accepted configuration must compile without
    them): a Triton kernel made to spill (two [64, 128] f32 tiles live across a loop in one warp:
    512 values per thread, 255 registers at most) is reported with its spill bytes and ok False."""
    script = tmp_path / "spill.py"
    script.write_text(f"""
from jpa.tools import deviceless as g
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
    # hid ptxas's report until the tools set the level themselves: this must hold in that env.)
    env = fresh_env(TF_CPP_MIN_LOG_LEVEL="1")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), proc.stderr[-3000:])
    assert line.startswith("RESULT False {'jpa_spill':") and "ptxas spills registers" in line, line


@pytest.mark.bench
@needs_gpu_packages
def test_a_compiler_made_after_xla_started_warns(tmp_path):
    """ptxas's report reaches XLA's log only if `configure_environment` ran before XLA started: a
    Compiler made later (here after `jax.devices()`, with a parent's TF_CPP_MIN_LOG_LEVEL=1) says
    its records will lack registers, rather than leaving them silently empty."""
    script = tmp_path / "late.py"
    script.write_text("""
import warnings
import jax
from jpa.tools import deviceless
jax.devices()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    deviceless.Compiler("a100")
print("WARNED", [str(w.message)[:40] for w in caught if w.category is RuntimeWarning])
""")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=fresh_env(TF_CPP_MIN_LOG_LEVEL="1"))
    line = next((x for x in proc.stdout.splitlines() if x.startswith("WARNED")), proc.stderr[-3000:])
    assert "XLA started before" in line, line


# A hand-written optimized-HLO module of a 2-host x 8-GPU program: a layer scan (the while whose
# body calls the attention kernel) holding a row-parallel all-reduce over all 16 devices and an
# all-gather of attention heads; one all-gather per host outside the layers; a sampling all-reduce.
TWO_HOST_HLO = """
HloModule two_hosts

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%layer_body (p: (s32[], f32[64,4096])) -> (s32[], f32[64,4096]) {
  %k = bf16[64,1,128]{2,1,0} custom-call(%x), custom_call_target="mosaic_gpu_v2"
  %all-reduce-start.1 = ((f32[64,4096]{1,0}), f32[64,4096]{1,0}) all-reduce-start(%y), channel_id=1, replica_groups=mesh['tp'=16] {'tp'}, use_global_device_ids=true, to_apply=%add
  %all-gather.2 = bf16[64,16,128]{2,1,0} all-gather(%k), channel_id=2, replica_groups=[1,16]<=[16], dimensions={1}, use_global_device_ids=true
  ROOT %t = (s32[], f32[64,4096]) tuple(%i, %z)
}

%layer_cond (p: (s32[], f32[64,4096])) -> pred[] {
  ROOT %c = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[64,4096]) -> f32[64,4096] {
  %while.1 = (s32[], f32[64,4096]) while(%init), condition=%layer_cond, body=%layer_body, backend_config={"known_trip_count":{"n":"80"}}
  %all-gather.3 = s32[64,8]{1,0} all-gather(%ids), channel_id=3, replica_groups=[2,8]<=[16], dimensions={1}, use_global_device_ids=true
  %all-reduce.4 = f32[64]{0} all-reduce(%m), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15}}, use_global_device_ids=true, to_apply=%add
  ROOT %r = f32[64,4096] get-tuple-element(%while.1), index=1
}
"""


def test_replica_groups_spellings_map_to_hosts():
    """XLA's three spellings of replica groups (lists, iota with a transpose, mesh axes with a
    sub-axis and an explicit device order) read as the groups XLA means, worked out by hand."""
    rg = hlo.replica_groups
    assert rg("replica_groups={{0,1},{2,3}}", 4) == [[0, 1], [2, 3]]
    assert rg("replica_groups={}", 4) == [[0, 1, 2, 3]]
    assert rg("replica_groups=[2,8]<=[16]", 16) == [list(range(8)), list(range(8, 16))]
    assert rg("replica_groups=[8,2]<=[2,8]T(1,0)", 16) == [[i, i + 8] for i in range(8)]
    assert rg("replica_groups=mesh['tp'=16] {'tp'}", 16) == [list(range(16))]
    assert rg("replica_groups=mesh['dp'=2,'tp'=8] {'tp'}", 16) == [list(range(8)), list(range(8, 16))]
    assert rg("replica_groups=mesh['dp'=2,'tp'=8] {'dp'}", 16) == [[i, i + 8] for i in range(8)]
    # A sub-axis 'tp':(pre)size splits the axis of 8 as [pre, size, 8 // (pre * size)], row-major;
    # groups vary along the size factor: (1)2 is the major factor of 2, (2)4 the minor factor of 4.
    assert rg("replica_groups=mesh['tp'=8] {'tp':(1)2}", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert rg("replica_groups=mesh['tp'=8] {'tp':(2)4}", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rg("replica_groups=mesh['x'=2,'y'=2], device_ids=(3,2,1,0) {'y'}", 4) == [[3, 2], [1, 0]]
    assert rg("source_target_pairs={{0,8},{8,0}}", 16) == [[0, 8], [8, 0]]


def test_cross_host_classifier_flags_heads_moving_between_hosts():
    """On 2 hosts x 8 GPUs (partitions 0-7 on host 0): the row-parallel all-reduce crosses hosts
    and is allowed, per layer; a per-host all-gather stays within a host; the sampling all-reduce
    crosses hosts outside the layers and is allowed; the all-gather of attention heads crosses
    hosts inside a layer and is flagged, so a compile whose K/V or heads moved between hosts fails."""
    hosts = [0] * 8 + [1] * 8
    items = hlo.host_collectives(TWO_HOST_HLO, hosts)
    by = {(c["op"], c["type"]): c for c in items}
    row, heads = by[("all-reduce", "f32[64,4096]")], by[("all-gather", "bf16[64,16,128]")]
    per_host, sampling = by[("all-gather", "s32[64,8]")], by[("all-reduce", "f32[64]")]
    assert row["cross_host"] and row["layer_body"] and row["loops"] == [80] and row["executions"] == 80
    assert heads["cross_host"] and heads["layer_body"] and heads["hosts_per_group"] == 2
    assert not per_host["cross_host"] and per_host["group_size"] == 8 and not per_host["layer_body"]
    assert sampling["cross_host"] and not sampling["layer_body"] and sampling["loops"] == []
    sizes = dict(d_model=4096, head_dim=128, num_pages=32768, page_size=16, max_tokens=512)
    problems = hlo.cross_host_problems(items, **sizes)
    assert len(problems) == 1 and "bf16[64,16,128]" in problems[0] and "heads" in problems[0], problems
    # Without the heads' all-gather the rule holds.
    assert hlo.cross_host_problems([c for c in items if c is not heads], **sizes) == []
    # The same all-gather within one host's 8 GPUs does not cross hosts: not flagged by this rule.
    assert hlo.cross_host_problems([dict(heads, cross_host=False, hosts_per_group=1)], **sizes) == []


POOL_OR_NOT_HLO = """
HloModule pool_or_not

ENTRY %main (x: f32[4096,20]) -> f32[4096,20] {
  %all-gather.1 = f32[4096,20]{1,0} all-gather(%x), channel_id=1, replica_groups=[1,16]<=[16], dimensions={0}, use_global_device_ids=true
  %all-gather.2 = f32[1,8,4096,16]{3,2,1,0} all-gather(%s), channel_id=2, replica_groups=[1,16]<=[16], dimensions={1}, use_global_device_ids=true
  %all-gather.3 = bf16[1,8,4096,16,128]{4,3,2,1,0} all-gather(%k), channel_id=3, replica_groups=[1,16]<=[16], dimensions={1}, use_global_device_ids=true
  ROOT %r = f32[4096,20] copy(%all-gather.1)
}
"""


def test_cross_host_classifier_matches_the_pool_by_its_axes():
    """With 4096 pages of 16 tokens, a sampling all-gather f32[4096, 20] holds the page count but
    is not the pool (the old rule flagged any type containing "4096,"); the pool's scales
    [layers, kv heads, pages, page_size] and its K/V pages are, axis by axis."""
    items = hlo.host_collectives(POOL_OR_NOT_HLO, [0] * 8 + [1] * 8)
    sampling, scales, kv = items
    assert [c["type"] for c in items] == ["f32[4096,20]", "f32[1,8,4096,16]", "bf16[1,8,4096,16,128]"]
    assert all(c["cross_host"] for c in items)
    moves = lambda c, **kw: hlo.moves_heads_or_pool(c, **{**dict(head_dim=128, num_pages=4096, page_size=16), **kw})
    assert not moves(sampling) and moves(scales) and moves(kv)
    assert moves(kv, num_pages=32768) and not moves(scales, num_pages=32768)   # K/V: by its head axis too
    assert moves(sampling, page_size=20)   # were the pool [4096 pages, 20 tokens]: moved
    sizes = dict(d_model=4096, head_dim=128, num_pages=4096, page_size=16, max_tokens=512)
    problems = hlo.cross_host_problems(items, **sizes)
    assert len(problems) == 2 and "f32[1,8,4096,16]" in problems[0] and "bf16[1,8,4096,16,128]" in problems[1], problems
    assert hlo.cross_host_problems([sampling], **sizes) == []


@pytest.mark.soak
@needs_gpu_packages
def test_tensor_parallel_llama70b_over_2_hosts(tmp_path):
    """Llama-3-70B's shapes (2 of its 80 layers, for time) over 2 hosts x 8 compile-only H100s
    (topology 2x1x8, tp=16, each kv head replicated on 2 devices of one host): the unified step
    compiles, and of its collectives the only ones in a layer are the two row-parallel
    f32[tokens, 8192] all-reduces per model pass, which cross hosts; the rest are the per-step
    embedding lookup and sampling over the vocabulary shards; nothing with a head axis or a pool
    dimension moves; per-device weights + pool + temporaries fit an 80 GB H100. (The one-host tp=8
    check of an 8B, `--only tp --tp 8`, runs the same checks: it is left to the script.)"""
    proc, report = run_check(tmp_path, "--target", "h100", "--only", "tp", "--tp", "16", "--hosts", "2",
                             "--model", "llama3-70b", "--layers", "2", "--pool-gib", "2")
    recs = report["records"]
    assert proc.returncode == 0 and all(r["ok"] for r in recs), [(r["name"], r.get("error") or r["problems"]) for r in recs]
    (step,) = recs
    assert report["summary"]["topology"] == step["topology"] == "2x1x8"
    assert step["partition_hosts"] == [0] * 8 + [1] * 8
    assert step["head_plan"].startswith("tp=16 replicate") and step["kv_head_hosts"] == [[0], [0], [0], [0], [1], [1], [1], [1]]
    assert step["mosaic_calls"] == 3 and step["row_parallel_all_reduces"] == 2 * 2
    table = step["host_collectives"]
    layer = {r["type"]: r for r in table if r["where"] == "layer"}
    assert set(layer) == {"f32[512,8192]", "f32[64,8192]"}, layer   # ragged pass, decode loop
    for r in layer.values():
        assert r["op"] == "all-reduce" and r["per_layer"] == 2 and r["cross_host"] and r["hosts_per_group"] == 2
    roles = {r["role"] for r in table if r["cross_host"] and r["where"] != "layer"}
    assert roles == {"embedding lookup (vocabulary-parallel)", "sampling / logprobs over the vocabulary shards"}, roles
    for r in table:
        assert r["op"] in ("all-reduce", "all-gather") and ",128]" not in r["type"], r
    assert step["pool_copies"] == [] and step["alias_bytes"] >= step["pool_bytes"] == step["pool_bytes_per_device"]
    assert step["pool_spec"] == "P(None, 'tp')" and step["param_specs"]["wo"] == "P(None, 'tp', None)"


def test_a_plugin_of_another_jaxlib_version_is_named_not_crashed(monkeypatch):
    """JAX will not load a CUDA plugin whose version differs from jaxlib's (a newer jaxlib than the newest
    plugin on the registry: 0.12.1 vs 0.12.0.1); `missing_packages` then names both versions, so the
    deviceless tests skip with that reason instead of failing inside XLA. Matching versions pass."""
    from importlib import metadata

    versions = {"jax-cuda12-plugin": "0.12.0.1", "jaxlib": "0.12.1"}
    monkeypatch.setattr(metadata, "version", lambda name: versions[name])
    why = deviceless.plugin_mismatch()
    assert why is not None and "0.12.0.1" in why and "0.12.1" in why, why
    versions["jaxlib"] = "0.12.0.1"
    assert deviceless.plugin_mismatch() is None
    versions["jax-cuda12-plugin"] = "0.12.0.1.dev20261201"  # a suffix past the dotted release, as JAX ignores it
    assert deviceless.plugin_mismatch() is None
