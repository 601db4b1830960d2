"""The mma.sync Mosaic GPU kernels (Ampere/Ada: cp.async; Blackwell: TMA): the decode kernel
(`jpa.pallas.mosaic.decode_ampere`) and the ragged tile kernel (`ragged_ampere`, through the Mosaic
ragged entry with the target's compute capability): GPU interpret mode against the float64 oracle
and the XLA path, what they refuse, how the dispatch routes to them, and (when the compile-only GPU
packages are installed) one deviceless sm_80 compile of the ragged op, which holds both kernels.

Interpret mode runs the kernel bodies (block walk through the block table, causal / window
masking, online softmax, split-K, sinks, the stacked pool's layer index) with three stand-ins for
primitives GPU interpret mode does not model: cp.async copies without a barrier, `mma`, and the
accumulator -> lhs relayout (`pipeline.MmaOps`); on the TMA path (Blackwell) the copies and
barriers are real. The deviceless compile covers the stand-ins. Hidden cache slots hold NaN and
unused block-table entries garbage (`kernel_cases`), so reading what a sequence cannot see shows.
The grids (head dims, dtypes, page sizes, generations) are tests/test_bench_mosaic_ampere.py.
"""

import os
import pathlib
import re
import subprocess
import sys

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from jpa.ops import dispatch
from jpa.ops.reference import paged_decode_xla
from jpa.pallas.mosaic import decode as mosaic_decode
from jpa.pallas.mosaic import decode_ampere
from jpa.pallas.mosaic import ragged as mosaic_ragged
from jpa.pallas.spec import DecodeSpec, RaggedSpec
from jpa.testing.kernel_cases import (Case, RaggedCase, make_inputs, make_ragged_inputs, np_ragged_reference,
                                      np_reference, tolerance)
from jpa.tools import deviceless
from jpa.tools.deviceless import mosaic_arch

ROOT = pathlib.Path(__file__).resolve().parents[1]
A100, L4, H100, B200 = 8.0, 8.9, 9.0, 10.0


def check(case, got, args, opts):
    want = np_reference(*args, **opts)
    chex.assert_shape(got, want.shape)
    assert got.dtype == args[0].dtype
    got = np.asarray(got.astype(jnp.float32), np.float64)
    assert np.isfinite(got).all(), case
    np.testing.assert_allclose(got, want, atol=tolerance(case), rtol=0, err_msg=str(case))
    xla = np.asarray(paged_decode_xla(*args, **opts).astype(jnp.float32), np.float64)
    np.testing.assert_allclose(got, xla, atol=tolerance(case), rtol=0, err_msg=str(case))


def test_matches_reference_with_every_option_and_split_k():
    # GQA 3, pages of 16 (4 per 64-token block), lengths 0 / 1 / 3 blocks (the last partial);
    # soft cap, ALiBi and a window that starts mid-block. Two blocks per partition: the longest
    # sequence has a full partition (2 blocks through the 3-slot cp.async ring) and a partial one
    # (split-K merge); the window's partition skips its first block.
    case = Case((0, 1, 150), num_q_heads=6, num_kv_heads=2, head_dim=64, page_size=16,
                pages_per_seq=10, soft_cap=10.0, alibi=True, sliding_window=100, share_page=True,
                seed=31, q_dtype="bfloat16", cache_dtype="bfloat16")
    args, opts = make_inputs(case)
    # Both copy paths: cp.async (Ampere/Ada) and TMA + mbarriers (Blackwell; the interpreter models
    # these barriers, so only mma and the relayout have stand-ins there).
    for tma in (False, True):
        got = decode_ampere.paged_decode(*args[:5], scale=opts["scale"], soft_cap=10.0,
                                         alibi_slopes=opts["alibi_slopes"], sliding_window=100,
                                         interpret=True, blocks_per_part=2, tma=tma)
        check(case, got, args, opts)
        assert not np.asarray(got[0].astype(jnp.float32)).any()  # length 0: exactly zero


@pytest.mark.parametrize("cache,q_dtype,fp8_cvt,tma", [
    ("int8", "bfloat16", True, False),           # Ampere/Ada: cp.async
    pytest.param("float8_e4m3fn", "float16", False, True, marks=pytest.mark.bench),  # bit-manipulated float8 (sm_80/86), TMA copies; CI bench tier
])
def test_8bit_caches_match_reference(cache, q_dtype, fp8_cvt, tma):
    # Per-token scales (NaN where a slot is hidden), blocks of 32 tokens from pages of 16 (two
    # pages' scales joined per block), ALiBi, soft cap, a window, split-K (a partial partition).
    case = Case((1, 90), num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16,
                pages_per_seq=6, soft_cap=10.0, alibi=True, sliding_window=70, share_page=True,
                seed=37, q_dtype=q_dtype, cache_dtype=cache)
    args, opts = make_inputs(case)
    got = decode_ampere.paged_decode(*args[:5], scale=opts["scale"], soft_cap=10.0,
                                     alibi_slopes=opts["alibi_slopes"], sliding_window=70,
                                     interpret=True, blocks_per_part=2, tma=tma, fp8_cvt=fp8_cvt,
                                     k_scales=opts["k_scales"], v_scales=opts["v_scales"])
    check(case, got, args, opts)


def test_head_dim_80_matches_reference():
    # Untiled q and K/V copies, V restaged through a tiled block, accumulators and the f32 partial
    # outputs padded to 96 columns (the padding sliced off): cp.async copies, split-K.
    case = Case((1, 70), num_q_heads=2, num_kv_heads=1, head_dim=80, page_size=16, pages_per_seq=5,
                alibi=True, seed=39, q_dtype="bfloat16", cache_dtype="bfloat16")
    args, opts = make_inputs(case)
    got = decode_ampere.paged_decode(*args[:5], scale=opts["scale"], alibi_slopes=opts["alibi_slopes"],
                                     interpret=True, blocks_per_part=1)
    check(case, got, args, opts)


def test_fp8_bit_widening_is_exact():
    from jpa.pallas.mosaic.pipeline import widen_fp8_bits
    for dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        x = jnp.asarray(np.arange(256, dtype=np.uint8)).view(dtype)
        want = np.asarray(x.astype(jnp.float32))
        got = np.asarray(widen_fp8_bits(x).astype(jnp.float32))
        finite = np.isfinite(want)
        np.testing.assert_array_equal(got[finite], want[finite])
        assert np.isinf(got[np.isinf(want)]).all()


def test_refusals_are_reasons_and_routing_follows_the_compute_capability():
    base = DecodeSpec("bfloat16", "bfloat16", 32, 8, 128, 16, 32, False, False, False, False, 64, 8192)
    assert mosaic_decode.unsupported_reason(base, A100) is None
    assert mosaic_decode.unsupported_reason(base, L4) is None
    assert mosaic_decode.unsupported_reason(base, H100) is None
    assert mosaic_decode.unsupported_reason(base, B200) is None
    assert mosaic_decode.unsupported_reason(base, 12.0) is None  # sm_120: the TMA path
    assert "Hopper and Blackwell (9.x, 10.x, 12.x)" in decode_ampere.unsupported_reason(base, 11.0)
    refused = {
        "mma.sync has no exact float32": base._replace(q_dtype="float32", cache_dtype="float32"),
        "must be a multiple of 16 (the mma's k) from 64 to 256": base._replace(head_dim=72),
        # head_dim 80 pages go untiled; 16 int8 rows of 80 bytes are 2-byte pieces per thread.
        ">= 4-byte pieces per thread": base._replace(cache_dtype="int8", quantized=True, head_dim=80),
    }
    for words, spec in refused.items():
        reason = mosaic_decode.unsupported_reason(spec, A100)
        assert reason and words in reason, (words, reason)
    # TMA copies (Blackwell) move that page; head dims 80 / 112 are served.
    assert mosaic_decode.unsupported_reason(refused[">= 4-byte pieces per thread"], B200) is None
    for hd in (80, 112):
        assert mosaic_decode.unsupported_reason(base._replace(head_dim=hd), A100) is None
    # 8-bit caches on every generation's mma path (fp8 widened by bit manipulation on sm_80/86).
    for cache in ("int8", "float8_e4m3fn", "float8_e5m2"):
        for cc in (A100, 8.6, L4, B200):  # (Hopper's WGMMA kernel has its own page-size rule)
            spec = base._replace(cache_dtype=cache, quantized=True)
            assert mosaic_decode.unsupported_reason(spec, cc) is None, (cache, cc)


def test_auto_picks_mosaic_on_ampere_and_ada_decode():
    spec = DecodeSpec("bfloat16", "bfloat16", 32, 8, 128, 16, 32, False, False, False, False, 64, 8192)
    # Ahead of time (no such GPU here), with Mosaic told the target's arch as the compile tier
    # does (`mosaic_arch`); test_dispatch.py covers the AOT case without it (Triton, with why).
    for kind, cc, want in (("NVIDIA A100-SXM4-80GB", A100, "mosaic"), ("NVIDIA L4", L4, "mosaic"),
                           ("NVIDIA H100 80GB HBM3", H100, "mosaic"), ("NVIDIA B200", B200, "mosaic"),
                           ("NVIDIA RTX PRO 6000 Blackwell", 12.0, "mosaic")):
        target = dispatch.Target("gpu", kind, cc, executable=False)
        with mosaic_arch((int(cc), int(round(cc * 10)) % 10)), pytest.warns(UserWarning, match="not attached"):
            assert dispatch.choose_impl("auto", spec, target) == want, kind
    # A configuration the Ampere kernel refuses falls to plain JAX there (Triton is not in auto's
    # ladder on 8.x / 10.x / 12.x), saying why; 8-bit caches are Mosaic's.
    f32 = spec._replace(q_dtype="float32", cache_dtype="float32")
    a100 = dispatch.Target("gpu", "NVIDIA A100-SXM4-80GB", A100, executable=False)
    with mosaic_arch((8, 0)), pytest.warns(RuntimeWarning, match="no exact float32.*reference path"):
        assert dispatch.choose_impl("auto", f32, a100) == "xla"
    with mosaic_arch((8, 0)), pytest.warns(UserWarning, match="not attached"):
        assert dispatch.choose_impl("auto", spec._replace(cache_dtype="int8", quantized=True), a100) == "mosaic"
    assert dispatch.kernel_options("mosaic", A100) == {"compute_capability": A100}
    assert dispatch.kernel_options("triton", A100) == {}


def ragged_check(case, got, args, opts):
    """A ragged result against the float64 oracle; padding rows exactly zero."""
    chex.assert_shape(got, args[0].shape)
    assert got.dtype == args[0].dtype
    got = np.asarray(got.astype(jnp.float32), np.float64)
    assert np.isfinite(got).all(), case
    np.testing.assert_allclose(got, np_ragged_reference(*args, **opts), atol=tolerance(case), rtol=0,
                               err_msg=str(case))
    np.testing.assert_array_equal(got[int(np.asarray(args[5])[len(case.q_lens)]):], 0.0)


def ragged_opts(case, opts, rng):
    """make_ragged_inputs' options with the scale set and attention sinks added."""
    opts = {k: v for k, v in opts.items() if v is not None}
    opts.setdefault("scale", case.head_dim ** -0.5)
    opts["sinks"] = jnp.asarray(rng.standard_normal(case.num_q_heads) + 1.0, jnp.float32)
    return opts


RAGGED_CASE = RaggedCase((9, 30, 41), q_lens=(1, 30, 5), num_tokens=40, max_num_seqs=4, num_q_heads=4,
                         num_kv_heads=1, head_dim=96, page_size=16, pages_per_seq=3, soft_cap=10.0,
                         alibi=True, sliding_window=19, share_page=True, seed=41,
                         q_dtype="bfloat16", cache_dtype="bfloat16")


def test_ragged_matches_reference_with_every_row_option():
    # head_dim 96 (mma chunks of 64 + 32 columns). A decode token, a prefill chunk of two tiles
    # (GQA 4: 16 tokens per 64-row tile) crossing pages, and a chunk starting mid-page after a cached prefix; padding rows (NaN q) and a dead
    # slot. Soft cap, ALiBi, a window shorter than the chunk and sinks: every row option at once.
    case = RAGGED_CASE
    args, opts = make_ragged_inputs(case)
    opts = ragged_opts(case, opts, np.random.default_rng(41))
    # cp.async (Ampere/Ada); the TMA path (Blackwell) runs the same case in the bench tier
    # (tests/test_bench_mosaic_ampere.py::test_ragged_grid_matches_reference).
    got = mosaic_ragged.ragged_paged_attention(*args, **opts, interpret=True, compute_capability=A100)
    ragged_check(case, got, args, opts)


def test_ragged_refusals_and_auto_routing():
    spec = RaggedSpec("bfloat16", "bfloat16", 512, 64, 32, 8, 128, 16, 256, 8192, True, False, True,
                      False, 1, False)
    for cc in (A100, 8.6, L4, H100, B200):
        assert mosaic_ragged.unsupported_reason(spec, cc) is None, cc
    assert mosaic_ragged.unsupported_reason(spec, 12.0) is None
    q8 = spec._replace(cache_dtype="int8", quantized=True, page_size=32)
    f32 = spec._replace(q_dtype="float32", cache_dtype="float32")
    for cc in (A100, H100, B200):  # 8-bit caches on both paths
        assert mosaic_ragged.unsupported_reason(q8, cc) is None, cc
    assert "no exact float32" in mosaic_ragged.unsupported_reason(f32, A100)
    from jpa.ops.ragged import RAGGED
    for kind, cc in (("NVIDIA A100-SXM4-80GB", A100), ("NVIDIA RTX A6000", 8.6), ("NVIDIA L4", L4),
                     ("NVIDIA B200", B200), ("NVIDIA RTX PRO 6000 Blackwell", 12.0)):
        target = dispatch.Target("gpu", kind, cc, executable=False)
        with mosaic_arch((int(cc), int(round(cc * 10)) % 10)), pytest.warns(UserWarning, match="not attached"):
            assert dispatch.choose_impl("auto", spec, target, RAGGED) == "mosaic", kind
        # What Mosaic refuses there falls to plain JAX, saying why.
        dispatch._announce_fallback.cache_clear()
        with mosaic_arch((int(cc), int(round(cc * 10)) % 10)), \
                pytest.warns(RuntimeWarning, match="mosaic ragged kernel refuses this configuration: q dtype"):
            assert dispatch.choose_impl("auto", f32, target, RAGGED) == "xla", kind
    assert dispatch.kernel_options("mosaic", A100, RAGGED) == {"compute_capability": A100}


@pytest.mark.bench
@pytest.mark.skipif(deviceless.missing_packages() is not None, reason=str(deviceless.missing_packages()))
def test_ragged_op_compiles_for_an_a100_as_mma_kernels_without_spills():
    # A fresh process: XLA's log must be configured before XLA starts to read ptxas's report. The
    # ragged op (impl="mosaic", the A100's compute capability passed on) holds the tile kernel and
    # the decode kernel of the last rows; each must be built for sm_80, not Mosaic's sm_90a default.
    code = """
from jpa.tools import deviceless
deviceless.configure_environment()
from jpa.tools.kernel_checks import ragged_call
spec, fn, args, pools = ragged_call("mosaic", "bfloat16", "bfloat16", 8, 64, 16, True)
rec = deviceless.Compiler("a100").compile("ragged", fn, args, pool_shapes=pools)
print("CALLS", rec["ok"], rec.get("mosaic_calls"), rec.get("triton_calls"), rec.get("error") or rec.get("problems"))
for name in ("jpa_mosaic_ragged_ampere", "jpa_mosaic_decode_ampere"):
    k = rec.get("kernels", {}).get(name, {})
    print("KERNEL", name, k.get("ptx_targets"), k.get("registers"), k.get("spill_stores"), k.get("ptxas_reports"))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_CPP_VMODULE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=env, cwd=ROOT)
    calls = next((x for x in proc.stdout.splitlines() if x.startswith("CALLS")), proc.stderr[-3000:])
    assert calls.split(" ", 4)[1:4] == ["True", "2", "0"], calls
    kernels = [x.split(" ", 3)[1:] for x in proc.stdout.splitlines() if x.startswith("KERNEL")]
    assert len(kernels) == 2, proc.stdout
    for name, targets, rest in kernels:
        regs, spills, reports = rest.split(" ")
        assert targets == "['sm_80']", (name, targets)  # built for the A100
        assert 0 < int(regs) <= 255 and spills == "0" and int(reports) >= 1, (name, rest)


@pytest.mark.parametrize("kind,cores,arch", [
    ("NVIDIA A100-SXM4-80GB", 108, (8, 0)),
    pytest.param("NVIDIA B200", 148, (10, 0), marks=pytest.mark.bench),  # CI's bench tier
])
def test_auto_ragged_lowers_to_mosaic_only_without_the_triton_warning(kind, cores, arch):
    """impl="auto" under an AOT lowering for an A100 / a B200 (Mosaic told the arch, as the compile
    tier does): the ragged op's program holds Mosaic kernels only, and JAX's Pallas Triton
    deprecation warning (emitted when a Triton kernel is lowered) does not appear."""
    import warnings

    import jax
    import jpa
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType
    dev = AbstractDevice(device_kind=kind, num_cores=cores, platform="cuda")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=dev)
    args, _ = make_ragged_inputs(RAGGED_CASE)
    fn = jax.jit(lambda *a: jpa.ragged_paged_attention(*a, soft_cap=10.0, sliding_window=19))
    with mosaic_arch(arch), jax.sharding.use_abstract_mesh(mesh), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    messages = [str(w.message) for w in seen]
    assert not [m for m in messages if "Triton backend is deprecated" in m], messages
    assert any("uses the mosaic ragged kernel" in m for m in messages), messages
    assert text.count("mosaic_gpu") >= 2 and "__gpu$xla.gpu.triton" not in text


def test_hopper_routes_what_wgmma_refuses_to_the_mma_path():
    """On an H100 a shape the WGMMA kernels refuse (an int8 cache in pages of 16: its scales are no
    128-byte TMA) goes to the mma.sync kernels with TMA copies, in the decode kernel entry point,
    the ragged op and `auto`; float32 q, which neither serves, still goes to Triton with both
    reasons. (Traces the entry point's jaxpr only: no lowering, no compile.)"""
    import jax
    from jpa.ops.ragged import RAGGED
    base = DecodeSpec("bfloat16", "bfloat16", 32, 8, 128, 16, 32, False, False, False, False, 64, 8192)
    q8 = base._replace(cache_dtype="int8", quantized=True)
    assert "page_size = 16 is too small" in mosaic_decode.wgmma_reason(q8, H100)
    assert mosaic_decode.runs_mma(q8, H100) and mosaic_decode.unsupported_reason(q8, H100) is None
    assert not mosaic_decode.runs_mma(base, H100)  # what WGMMA serves stays there
    assert not mosaic_decode.runs_mma(q8, None)  # interpret mode: the WGMMA kernel's contract
    f32 = base._replace(q_dtype="float32", cache_dtype="float32")
    assert not mosaic_decode.runs_mma(f32, H100)
    assert re.search("WGMMA has no exact float32.*mma.sync kernel .TMA copies. neither: q dtype float32",
                     mosaic_decode.unsupported_reason(f32, H100))
    rq8 = RaggedSpec("bfloat16", "int8", 512, 64, 32, 8, 128, 16, 256, 8192, True, False, True, True, 1, False)
    assert mosaic_ragged.runs_mma(rq8, H100) and mosaic_ragged.unsupported_reason(rq8, H100) is None
    assert not mosaic_ragged.runs_mma(rq8._replace(cache_dtype="bfloat16", quantized=False), H100)
    h100 = dispatch.Target("gpu", "NVIDIA H100 80GB HBM3", H100, executable=False)
    for spec, op in ((q8, None), (rq8, RAGGED)):
        with mosaic_arch((9, 0)), pytest.warns(UserWarning, match="not attached"):
            assert dispatch.choose_impl("auto", spec, h100, op) == "mosaic"
    # The entry point (the dispatch passes the H100's compute capability) runs the mma kernel.
    sds = jax.ShapeDtypeStruct
    pool = (8, 64, 16, 128)
    args = (sds((4, 32, 128), jnp.bfloat16), sds(pool, jnp.int8), sds(pool, jnp.int8),
            sds((4, 8), jnp.int32), sds((4,), jnp.int32))
    scales = dict(k_scales=sds(pool[:3], jnp.float32), v_scales=sds(pool[:3], jnp.float32))
    with mosaic_arch((9, 0)):
        jaxpr = str(jax.make_jaxpr(lambda *a, **kw: mosaic_decode.paged_decode(
            *a, scale=0.1, compute_capability=H100, **kw))(*args, **scales))
    assert "jpa_mosaic_decode_ampere" in jaxpr and "jpa_mosaic_decode\"" not in jaxpr
