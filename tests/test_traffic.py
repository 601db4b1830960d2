"""The traffic model of a compiled GPU program (`jpa.tools.traffic`): its accounting on a
hand-written HLO module (bytes worked out by hand below), and on a small program compiled for an
H100 that is not here: a matmul over stacked weights in a scan of known trip count, where the
weights' bytes are known. The Llama-3-8B-shaped engine step's table is in the bench tier
(tests/test_bench_traffic.py)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jpa.tools import deviceless
from jpa.tools import traffic as tr

ROOT = pathlib.Path(__file__).resolve().parents[1]

# A loop of 4 over stacked weights w bf16[4,64,128] (16384 bytes a layer): a fusion that copies
# layer i out (reads the slice, writes it), a gemm over that copy, a gemm that slices w itself (in
# place), an in-place update of one row of acc f32[4,8,128]; then a conditional whose branch a
# moves 16384 bytes and branch b 8192.
HAND = """HloModule traffic_test, entry_computation_layout={(f32[8,64]{1,0}, bf16[4,64,128]{2,1,0}, f32[4,8,128]{2,1,0}, pred[], f32[8,128]{1,0})->(f32[4,8,128]{2,1,0}, f32[8,128]{1,0})}

%fused_slice (p0: bf16[4,64,128], p1: s32[]) -> bf16[1,64,128] {
  %p0 = bf16[4,64,128]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c0 = s32[] constant(0)
  ROOT %ds = bf16[1,64,128]{2,1,0} dynamic-slice(%p0, %p1, %c0, %c0), dynamic_slice_sizes={1,64,128}
}

%fused_dot (p0.1: f32[8,64], p1.1: bf16[1,64,128]) -> f32[8,128] {
  %p0.1 = f32[8,64]{1,0} parameter(0)
  %p1.1 = bf16[1,64,128]{2,1,0} parameter(1)
  %b = bf16[64,128]{1,0} bitcast(%p1.1)
  %cv = f32[64,128]{1,0} convert(%b)
  ROOT %d = f32[8,128]{1,0} dot(%p0.1, %cv), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_inplace_dot (p0.2: f32[8,64], p1.2: bf16[4,64,128], p2.2: s32[]) -> f32[8,128] {
  %p0.2 = f32[8,64]{1,0} parameter(0)
  %p1.2 = bf16[4,64,128]{2,1,0} parameter(1)
  %p2.2 = s32[] parameter(2)
  %c0.2 = s32[] constant(0)
  %ds.2 = bf16[1,64,128]{2,1,0} dynamic-slice(%p1.2, %p2.2, %c0.2, %c0.2), dynamic_slice_sizes={1,64,128}
  %b.2 = bf16[64,128]{1,0} bitcast(%ds.2)
  %cv.2 = f32[64,128]{1,0} convert(%b.2)
  ROOT %d.2 = f32[8,128]{1,0} dot(%p0.2, %cv.2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_update (p0.3: f32[4,8,128], p1.3: f32[8,128], p2.3: s32[]) -> f32[4,8,128] {
  %p0.3 = f32[4,8,128]{2,1,0} parameter(0)
  %p1.3 = f32[8,128]{1,0} parameter(1)
  %b.3 = f32[1,8,128]{2,1,0} bitcast(%p1.3)
  %p2.3 = s32[] parameter(2)
  %c0.3 = s32[] constant(0)
  ROOT %dus = f32[4,8,128]{2,1,0} dynamic-update-slice(%p0.3, %b.3, %p2.3, %c0.3, %c0.3)
}

%body (arg: (s32[], f32[8,64], bf16[4,64,128], f32[4,8,128])) -> (s32[], f32[8,64], bf16[4,64,128], f32[4,8,128]) {
  %arg = (s32[], f32[8,64]{1,0}, bf16[4,64,128]{2,1,0}, f32[4,8,128]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[8,64]{1,0} get-tuple-element(%arg), index=1
  %w = bf16[4,64,128]{2,1,0} get-tuple-element(%arg), index=2
  %acc = f32[4,8,128]{2,1,0} get-tuple-element(%arg), index=3
  %slice = bf16[1,64,128]{2,1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  %y = f32[8,128]{1,0} fusion(%x, %slice), kind=kCustom, calls=%fused_dot
  %y2 = f32[8,128]{1,0} fusion(%x, %w, %i), kind=kCustom, calls=%fused_inplace_dot
  %acc2 = f32[4,8,128]{2,1,0} fusion(%acc, %y2, %i), kind=kLoop, calls=%fused_update
  %one = s32[] constant(1)
  %i2 = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8,64]{1,0}, bf16[4,64,128]{2,1,0}, f32[4,8,128]{2,1,0}) tuple(%i2, %x, %w, %acc2)
}

%cond (arg.1: (s32[], f32[8,64], bf16[4,64,128], f32[4,8,128])) -> pred[] {
  %arg.1 = (s32[], f32[8,64]{1,0}, bf16[4,64,128]{2,1,0}, f32[4,8,128]{2,1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%arg.1), index=0
  %four = s32[] constant(4)
  ROOT %lt = pred[] compare(%i.1, %four), direction=LT
}

%branch_a (pa: f32[8,128]) -> f32[8,128] {
  %pa = f32[8,128]{1,0} parameter(0)
  %ea = f32[8,128]{1,0} exponential(%pa)
  ROOT %la = f32[8,128]{1,0} log(%ea)
}

%branch_b (pb: f32[8,128]) -> f32[8,128] {
  %pb = f32[8,128]{1,0} parameter(0)
  ROOT %eb = f32[8,128]{1,0} exponential(%pb)
}

ENTRY %main (x.0: f32[8,64], w.0: bf16[4,64,128], acc.0: f32[4,8,128], p.0: pred[], z.0: f32[8,128]) -> (f32[4,8,128], f32[8,128]) {
  %x.0 = f32[8,64]{1,0} parameter(0)
  %w.0 = bf16[4,64,128]{2,1,0} parameter(1)
  %acc.0 = f32[4,8,128]{2,1,0} parameter(2)
  %p.0 = pred[] parameter(3)
  %z.0 = f32[8,128]{1,0} parameter(4)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,64]{1,0}, bf16[4,64,128]{2,1,0}, f32[4,8,128]{2,1,0}) tuple(%zero, %x.0, %w.0, %acc.0)
  %loop = (s32[], f32[8,64]{1,0}, bf16[4,64,128]{2,1,0}, f32[4,8,128]{2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %out = f32[4,8,128]{2,1,0} get-tuple-element(%loop), index=3
  %c = f32[8,128]{1,0} conditional(%p.0, %z.0, %z.0), true_computation=%branch_a, false_computation=%branch_b
  ROOT %r = (f32[4,8,128]{2,1,0}, f32[8,128]{1,0}) tuple(%out, %c)
}
"""

LAYER = 64 * 128 * 2


def hand_rows():
    spec = tr.Spec(weight_types={("bf16", (4, 64, 128)), ("bf16", (1, 64, 128)), ("bf16", (64, 128))})
    return tr.traffic(HAND, spec)


def test_hand_written_module_accounting():
    rows = {r["name"]: r for r in hand_rows()}
    # Kernels only: no parameter, tuple, bitcast, get-tuple-element, while or conditional.
    assert set(rows) == {"slice", "y", "y2", "acc2", "i2", "lt", "ea", "la", "eb"}
    for name in ("slice", "y", "y2", "acc2", "i2", "lt"):
        assert rows[name]["executions"] == 4 and rows[name]["loops"] == [("body", 4)], name
    # The copy reads one layer's slice (not the stack) and writes it.
    assert rows["slice"]["read"]["weights"] == LAYER and rows["slice"]["written"]["weights"] == LAYER
    # A gemm over the copy reads the copy whole; one that slices in place reads the slice.
    assert rows["y"]["read"] == {**{p: 0 for p in tr.PURPOSES}, "weights": LAYER, "other": 8 * 64 * 4}
    assert rows["y2"]["read"]["weights"] == LAYER and rows["y2"]["read"]["other"] == 8 * 64 * 4
    assert rows["y2"]["written"]["weights"] == 0 and rows["y2"]["written"]["other"] == 8 * 128 * 4
    # The in-place update reads its update and index, not acc, and writes one row of acc.
    assert rows["acc2"]["read"] == {**{p: 0 for p in tr.PURPOSES}, "other": 8 * 128 * 4, "pages": 4}
    assert sum(rows["acc2"]["written"].values()) == 8 * 128 * 4
    assert rows["ea"]["branch"] == "c:0" and rows["eb"]["branch"] == "c:1"


def test_hand_written_module_summary():
    step = tr.select(hand_rows())
    assert {r["name"] for r in step} == {"slice", "y", "y2", "acc2", "i2", "lt", "ea", "la"}  # branch a: costlier
    s = tr.summary(step, dict(weights=4 * LAYER))
    # Per layer: the copy reads and writes the slice, each gemm reads one slice: 3 reads, 1 write.
    assert s["weights"]["read"] == 4 * 3 * LAYER and s["weights"]["written"] == 4 * LAYER
    assert s["weights"]["total"] / s["weights"]["ideal"] == 4.0
    assert s["weight_copies"] == [dict(name="slice", type="bf16[1,64,128]{2,1,0}", result="bf16[1,64,128]{2,1,0}",
                                       bytes=4 * LAYER)]
    assert tr.matrix_copies(s) == s["weight_copies"]
    # other: x twice + y2 + the update per layer (4 x 4096 x 2 + 4 x 2 x 4096), branch a's two ops.
    assert s["other"]["read"] == 4 * (2 * 2048 + 4096) + 2 * 4096
    assert s["other"]["written"] == 4 * (2 * 4096 + 4096) + 2 * 4096
    assert "| weights | 196608.000 | 65536.000 | 262144.000 | 65536.000 | 4.00 |" in tr.table(s, 1, "B")


def test_purpose_by_size_and_pool():
    spec = tr.Spec(weight_types={("bf16", (4096, 14336))}, pool_types={("bf16", (32, 8, 4096, 16, 128))},
                   vocab_size=128256)
    assert spec.purpose("bf16", (8, 512, 14336)) == "weights"          # a split-K view of the weight
    assert spec.purpose("bf16", (32, 8, 65536, 128)) == "kv_read"      # the pool, pages merged
    assert spec.purpose("bf16", (8, 4096, 16, 128)) == "kv_read"       # one layer of it
    assert spec.purpose("f32", (64, 128256)) == "logits"
    assert spec.purpose("s32", (64, 128)) == "pages"
    assert spec.purpose("bf16", (64, 4096)) == "other"


COMPILE = """
import json, os, sys
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from jpa.tools import deviceless
deviceless.configure_environment()
import jax, jax.numpy as jnp
from jpa.tools.deviceless import Compiler
from jpa.tools import traffic as tr
def fn(x, w1, w2):
    def layer(x, ws):
        a, b = ws
        h = jnp.dot(x, a, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        return jnp.dot(h, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16) + x, None
    return jax.lax.scan(layer, x, (w1, w2))[0]
c = Compiler("h100")
out = {}
for name, (L, d, f, B), opts in [("default", (4, 1024, 2048, 64), None),
                                 ("in_place", (4, 1024, 2048, 64), tr.WEIGHTS_IN_PLACE),
                                 ("in_place_1", (2, 4096, 14336, 1), tr.WEIGHTS_IN_PLACE)]:
    args = (jax.ShapeDtypeStruct((B, d), jnp.bfloat16), jax.ShapeDtypeStruct((L, d, f), jnp.bfloat16),
            jax.ShapeDtypeStruct((L, f, d), jnp.bfloat16))
    rec = c.compile(name, fn, args, keep_hlo=True, compiler_options=opts)
    rows = tr.traffic(rec["hlo"], tr.Spec(weight_types=tr.weight_types_of(args[1:], (L,))))
    s = tr.summary(tr.select(rows))
    out[name] = dict(stack=2 * L * d * f * 2, weights_read=s["weights"]["read"],
                     weights_written=s["weights"]["written"],
                     biggest_write=max(sum(r["written"].values()) for r in rows), layer=d * f * 2,
                     copies=len(s["weight_copies"]),
                     loops=sorted({t for r in rows for _, t in r["loops"]}), layers=L)
print(json.dumps(out))
"""


@pytest.mark.skipif(deviceless.missing_packages() is not None, reason=str(deviceless.missing_packages()))
def test_compiled_scan_weights():
    """Two gemms a layer over stacked weights, the layers scanned (XLA knows the trip count): every
    weight byte is read once per layer's gemm, plus twice more (the copy's read and write) for each
    layer slice XLA materializes, as its Triton gemms do; under WEIGHTS_IN_PLACE (cuBLAS fed the
    slice's offset) exactly the stack's bytes, at 64 rows and at one (a vector-matrix product)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_CPP_VMODULE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, r in out.items():
        assert r["loops"] == [r["layers"]], (name, r)
        assert r["weights_read"] == r["stack"] + r["weights_written"], (name, r)
    assert out["default"]["copies"] == 2 and out["default"]["weights_written"] == out["default"]["stack"]
    for name in ("in_place", "in_place_1"):
        r = out[name]
        assert r["copies"] == 0 and r["weights_read"] == r["stack"], (name, r)
        assert r["biggest_write"] < r["layer"] / 2, (name, r)   # no float32 copy of a weight (2x its bytes)


def test_matrix_copies_leave_out_vectors():
    vec = dict(name="n", type="bf16[32,4096]{1,0}", result="bf16[1,4096]{1,0}", bytes=8192)
    mat = dict(name="w", type="bf16[32,4096,1024]{2,1,0}", result="bf16[1,4096,1024]{2,1,0}", bytes=8 << 20)
    assert tr.matrix_copies(dict(weight_copies=[vec, mat])) == [mat]


def test_step_compiler_options_per_platform():
    from jpa.core.xla_options import WEIGHTS_IN_PLACE, step_compiler_options
    assert step_compiler_options("cpu") == {}
    for platform in ("gpu", "cuda", "rocm"):
        assert step_compiler_options(platform, env={}) == WEIGHTS_IN_PLACE
    # The user's XLA_FLAGS win over the engine's default; overrides replace or (None) remove one.
    env = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/x"}
    got = step_compiler_options("gpu", env=env)
    assert "xla_gpu_enable_triton_gemm" not in got and len(got) == len(WEIGHTS_IN_PLACE) - 1
    got = step_compiler_options("cuda", {"xla_gpu_dot_merger_threshold_mb": None, "xla_gpu_autotune_level": 0},
                                env={})
    assert got == {"xla_gpu_enable_triton_gemm": False, "xla_gpu_default_to_alg_dot_bf16_bf16_f32": True,
                   "xla_gpu_autotune_level": 0}
    assert step_compiler_options("cpu", {"xla_cpu_enable_fast_math": False}) == {"xla_cpu_enable_fast_math": False}


def test_runner_jit_options_carry_the_gpu_options_only_on_a_gpu(engines):
    from jpa.core.xla_options import WEIGHTS_IN_PLACE
    from jpa.engine.runner import ModelRunner
    eng = engines.get()
    runner = eng.runner
    assert runner.platform == "cpu" and "compiler_options" not in runner.jit_options()
    assert runner.jit_options("cuda")["compiler_options"] == {
        k: v for k, v in WEIGHTS_IN_PLACE.items() if f"--{k}" not in os.environ.get("XLA_FLAGS", "")}
    # A user's options over the engine's, on an abstract runner (nothing allocated).
    r = ModelRunner(runner.model, runner.cache_config, shapes=runner.shapes, stop_ids=(0,), allocate=False,
                    compiler_options={"xla_gpu_enable_triton_gemm": None, "xla_gpu_autotune_level": 0})
    opts = r.jit_options("gpu")["compiler_options"]
    assert "xla_gpu_enable_triton_gemm" not in opts and opts["xla_gpu_autotune_level"] == 0
    with pytest.raises(ValueError, match="compiler option names"):
        ModelRunner(runner.model, runner.cache_config, shapes=runner.shapes, stop_ids=(0,), allocate=False,
                    compiler_options={3: True})


ENGINE_STEP = """
import json, os
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from jpa.tools import deviceless
deviceless.configure_environment()
from jpa.tools import traffic as tr
from jpa.engine import sampling
# A Llama-shaped model with small widths (`jpa tools traffic`'s llama-small), 2 layers.
# (A vocabulary of 640: no activation of the ragged pass, [budget, d_model], has the embedding's type.
# The GPU sampler's candidates scaled with it: 64 of 640, as 4096 of Llama-3's 128256 are 1/31.)
sampling.GPU_CANDIDATE_BLOCK, sampling.GPU_CANDIDATE_BLOCKS = 16, 4
cfg = dict(family="llama", vocab_size=640, d_model=256, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64,
           ffn_dim=768, max_seq_len=2048, rope_base=500000.0, norm_eps=1e-5, tie_embeddings=False,
           bos_token_id=256, eos_token_id=257)
r = tr.engine_traffic("h100", cfg, max_seqs=4, context=256, pool_gib=0.25, label="llama-small", budget=64,
                      engine_options=ENGINE_OPTIONS)
s = r["summary"]
print(json.dumps(dict(options=r["compiler_options"], matrix_copies=r["matrix_copies"], checks=r["checks"],
                      weights=s["weights"], kv_read=s["kv_read"], kv_write=s["kv_write"], logits=s["logits"],
                      logits_passes=tr.passes(r["rows"], "logits", r["max_seqs"] * cfg["vocab_size"] * 4))))
"""


def engine_step_traffic(engine_options: bool = True) -> dict:
    """ENGINE_STEP's record, in a fresh process (a deviceless compile sets XLA's logging first)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_CPP_VMODULE", "XLA_FLAGS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    code = ENGINE_STEP.replace("ENGINE_OPTIONS", str(engine_options))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.bench
@pytest.mark.skipif(deviceless.missing_packages() is not None, reason=str(deviceless.missing_packages()))
def test_engine_gpu_step_reads_weights_in_place():
    """The engine's own unified step as it compiles it for an H100 (deviceless: `step_program`,
    the runner's jit options with `jpa.core.xla_options.WEIGHTS_IN_PLACE`), a small 2-layer Llama:
    no weight matrix (or layer slice of one) materialized anywhere in the program, every weight
    byte of the decode step read once, no copy of a page pool, the donated pools aliased, the
    Mosaic kernels in place (3 a layer body), the sampler's passes over the logits few. XLA's
    default compile copies the slices
    (tests/test_bench_traffic.py: this program and Llama-3-8B's, both ways)."""
    from jpa.core.xla_options import WEIGHTS_IN_PLACE
    out = engine_step_traffic()
    assert out["options"] == WEIGHTS_IN_PLACE
    assert out["matrix_copies"] == [], out["matrix_copies"]
    assert out["weights"]["read"] <= 1.01 * out["weights"]["ideal"], out["weights"]
    c = out["checks"]
    assert c["ok"] and c["pool_copies"] == [] and c["alias_bytes"] >= c["pool_bytes"] > 0, c
    assert c["mosaic_calls"] == 3, c
    assert out["kv_read"]["total"] == out["kv_read"]["ideal"] > 0
    assert out["kv_write"]["total"] == out["kv_write"]["ideal"]
    # The GPU sampler (`jpa.engine.sampling._sample_candidates`, the decode and verify passes' own)
    # reads the step's [rows, vocab] logits twice: 9.4 reads of them in all here (at a vocabulary of
    # 640 the logit controls' dense branch counts too; 2.05 for Llama-3-8B at 64 sequences); the dense
    # formulation's threshold searches: 184 (their [rows, vocab, 15] compares written out at this size).
    assert out["logits_passes"] <= 14, (out["logits_passes"], out["logits"])


def test_projection_from_bytes_and_bandwidth():
    from jpa.tools.deviceless import TARGETS
    bw = TARGETS["h100"]["memory_bandwidth"]
    s = {"total": dict(total=0.8 * bw / 100)}   # a step of 10 ms at 80% of peak
    p = tr.projection(s, "h100", 64, kv_bytes=60e9, weight_bytes=16e9)
    assert abs(p["step_ms"] - 10.0) < 1e-9 and abs(p["tokens_per_s"] - 6400) < 1e-6 and p["fits"]
    assert not tr.projection(s, "h100", 64, kv_bytes=69e9, weight_bytes=16e9)["fits"]   # > 0.9 x 80 GB
    assert tr.projection(s, "a100", 1)["fits"] is None
    assert tr.projection(s, "a100", 1, efficiency=0.4)["step_ms"] > 2 * p["step_ms"]
