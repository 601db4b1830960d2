"""The Mosaic GPU decode kernel in GPU interpret mode against the float64 oracle and the XLA path.

The grid is a covering design rather than a full product (interpret mode is slow on CPU): every
supported page size, q_per_kv, head_dim, dtype and feature appears at least once, and the hard
lengths (0, 1, page multiples, page multiple + 1, partial blocks, several partitions) recur.
Unused cache slots hold NaN and unused block-table entries hold out-of-range garbage
(`kernel_cases`), and GPU interpret mode fills fresh SMEM with NaN, so reading anything a
sequence cannot see shows up as a NaN in the result.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import jpa
from jpa.pallas import compat
from jpa.pallas.mosaic import decode as mosaic_decode
from jpa.pallas.mosaic import pipeline as mosaic_pipeline
from jpa.pallas.mosaic import tuning as mosaic_tuning
from jpa.pallas.spec import DecodeSpec
from jpa.ops.reference import paged_decode_xla
from jpa.testing.kernel_cases import Case, make_inputs, np_reference, tolerance
from marks import tiered

BF16 = dict(q_dtype="bfloat16", cache_dtype="bfloat16")
F16 = dict(q_dtype="float16", cache_dtype="float16")

CASES = [
    # page_size 8 (8 pages per block), MHA (q_per_kv 1), head_dim 80 (32-byte swizzle),
    # lengths 0, 1, page multiple, +1.
    Case((0, 1, 8, 9, 40), num_q_heads=2, num_kv_heads=2, head_dim=80, page_size=8,
         pages_per_seq=5, **BF16),
    # page_size 16, GQA 4, head_dim 128, shared page, a block exactly full (64) and one past it.
    Case((16, 17, 64, 65), num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
         pages_per_seq=6, share_page=True, seed=1, **BF16),
    # page_size 32, q_per_kv 8, head_dim 192 (not a power of two), f16.
    Case((33, 64, 1), num_q_heads=8, num_kv_heads=1, head_dim=192, page_size=32, pages_per_seq=3,
         seed=2, **F16),
    # page_size 64 (one page per block) and 128 (one page, 128-token blocks), head_dim 256.
    Case((64, 65, 127), num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=64,
         pages_per_seq=2, seed=3, **BF16),
    Case((128, 129, 255), num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=128,
         pages_per_seq=2, seed=4, **F16),
    Case((3, 50), num_q_heads=2, num_kv_heads=1, head_dim=256, page_size=16, pages_per_seq=4,
         seed=5, **BF16),
    # q_per_kv 16 (more heads than one 8-row output tile).
    Case((7, 48), num_q_heads=16, num_kv_heads=1, head_dim=64, page_size=16, seed=6, **BF16),
    # soft cap, head_dim 96 (64-byte swizzle).
    Case((5, 31, 48), num_q_heads=4, num_kv_heads=1, head_dim=96, soft_cap=5.0, seed=7, **F16),
    # ALiBi with q_per_kv 8.
    Case((1, 40, 64), num_q_heads=16, num_kv_heads=2, head_dim=128, alibi=True, seed=8, **BF16),
    # sliding window shorter than some sequences: blocks before the window are skipped and the
    # window's first block is partial on its left.
    Case((3, 20, 70, 150), num_q_heads=4, num_kv_heads=2, head_dim=112, page_size=8,
         pages_per_seq=20, sliding_window=11, seed=9, **F16),
    # everything at once.
    Case((0, 1, 25, 64), num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
         soft_cap=10.0, alibi=True, sliding_window=19, share_page=True, seed=10, **BF16),
    # 8-bit cache at head_dim 192 (K/V widened and invisible V rows zeroed a column slice at a
    # time), blocks cut at the sequence end; an 8-bit page of 256 tokens read in 64-token slices.
    Case((5, 70, 129), num_q_heads=4, num_kv_heads=2, head_dim=192, page_size=64, pages_per_seq=3,
         q_dtype="bfloat16", cache_dtype="int8", seed=20),
    # V scaled by 1e-2: float8 e5m2's per-token V scale (amax / 57344) times p lies in float16's
    # subnormals unless the kernel shifts it out (`pipeline.p_shift`); seen as a 5-15% error.
    Case((1, 100, 256), num_q_heads=6, num_kv_heads=2, head_dim=64, page_size=256, pages_per_seq=1,
         q_dtype="float16", cache_dtype="float8_e5m2", seed=21, v_gain=1e-2),
    # quantized caches (unwritten slots carry NaN scales): int8, float8_e4m3fn, float8_e5m2.
    Case((0, 32, 33, 100), num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=32,
         q_dtype="bfloat16", cache_dtype="int8", share_page=True, seed=14),
    Case((1, 64, 65), num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=64, pages_per_seq=2,
         q_dtype="float16", cache_dtype="float8_e4m3fn", soft_cap=20.0, seed=15),
    Case((129, 20), num_q_heads=2, num_kv_heads=2, head_dim=96, page_size=32, pages_per_seq=5,
         q_dtype="bfloat16", cache_dtype="float8_e5m2", alibi=True, sliding_window=70, seed=16),
    # One 64-token block a sequence: one partition, so the kernel normalizes and writes q's dtype
    # itself (no split-K merge); a sequence of length 0 next to full ones.
    Case((0, 5, 40, 64), num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16, pages_per_seq=4,
         seed=17, **BF16),
]


def _check(case, got, args, opts):
    want = np_reference(*args, **opts)
    chex.assert_shape(got, want.shape)
    assert got.dtype == args[0].dtype
    got = np.asarray(got.astype(jnp.float32), np.float64)
    assert np.isfinite(got).all(), case
    np.testing.assert_allclose(got, want, atol=tolerance(case), rtol=0, err_msg=str(case))
    xla = np.asarray(paged_decode_xla(*args, **opts).astype(jnp.float32), np.float64)
    np.testing.assert_allclose(got, xla, atol=tolerance(case), rtol=0, err_msg=str(case))


@pytest.mark.parametrize("case", tiered(CASES, bench=(2, 3, 5, 6, 7, 16), soak=(0, 1, 4, 8, 9, 12, 13, 14)), ids=str)
def test_matches_reference(case):
    args, opts = make_inputs(case)
    got = jpa.paged_decode(*args, impl="mosaic", interpret=True, **opts)
    _check(case, got, args, opts)
    # A sequence of length 0 gets exactly zero (not NaN, not garbage).
    for b, n in enumerate(case.seq_lens):
        if n == 0:
            assert not np.asarray(got[b].astype(jnp.float32)).any()


@pytest.mark.soak
def test_long_context_several_partitions_and_slots():
    # 33 blocks of 64 tokens: the default split gives 33 one-block partitions here; forcing 5
    # blocks per partition runs the multi-buffered loop (4 slots, 3 blocks in flight) through
    # full, partial and empty partitions, with a window crossing partition borders.
    case = Case((2100, 1025, 640, 7), num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=32,
                pages_per_seq=66, sliding_window=1500, seed=11, **BF16)
    args, opts = make_inputs(case)
    assert mosaic_decode.num_partitions(4, 2, 33) > 1
    assert mosaic_decode.num_slots(64, 32) == mosaic_tuning.lookup(None, 64).max_slots
    _check(case, jpa.paged_decode(*args, impl="mosaic", interpret=True, **opts), args, opts)
    forced = mosaic_decode._paged_decode(*args[:5], scale=opts["scale"], soft_cap=None,
                                         alibi_slopes=None, sliding_window=1500, interpret=True,
                                         blocks_per_part=5)
    _check(case, forced, args, opts)


def test_one_compilation_serves_every_mix_of_lengths():
    # Lengths and block tables are data: a jitted decode step traces once for all of them.
    traces = []

    def step(*args):
        traces.append(1)
        return jpa.paged_decode(*args, scale=0.125, impl="mosaic", interpret=True)

    step = jax.jit(step)
    cases = [Case(lens, num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=32,
                  pages_per_seq=5, seed=20 + i, **BF16)
             for i, lens in enumerate([(5, 40), (64, 0), (1, 129), (160, 33)])]
    # The first run of the GPU interpreter in a process adds a JAX config value to the tracing
    # context, which retraces once; that is interpret-mode bookkeeping, so warm up twice.
    for _ in range(2):
        jax.block_until_ready(step(*make_inputs(cases[0])[0]))
    traces.clear()
    for case in cases[1:]:
        args, opts = make_inputs(case)
        got = step(*args)
        opts["scale"] = 0.125
        _check(case, got, args, opts)
    assert traces == []


def test_one_block_by_hand():
    # One sequence of 2 tokens, one head, head_dim 64: keys e0 and 2*e0, q = e0, scale 1, so the
    # logits are 1 and 2 and the output is softmax([1, 2]) . [v0, v1] with v_t = (t + 1) * e1.
    head_dim, page_size = 64, 16
    q = jnp.zeros((1, 1, head_dim), jnp.float32).at[0, 0, 0].set(1.0).astype(jnp.bfloat16)
    k = jnp.zeros((1, 2, page_size, head_dim), jnp.float32)
    k = k.at[0, 1, 0, 0].set(1.0).at[0, 1, 1, 0].set(2.0)
    v = jnp.zeros((1, 2, page_size, head_dim), jnp.float32)
    v = v.at[0, 1, 0, 1].set(1.0).at[0, 1, 1, 1].set(2.0)
    tables = jnp.array([[1, 0]], jnp.int32)
    got = jpa.paged_decode(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), tables,
                           jnp.array([2], jnp.int32), scale=1.0, impl="mosaic", interpret=True)
    p1 = np.exp(2.0) / (np.exp(1.0) + np.exp(2.0))
    want = np.zeros(head_dim)
    want[1] = (1 - p1) * 1.0 + p1 * 2.0
    np.testing.assert_allclose(np.asarray(got[0, 0], np.float32), want, atol=1e-2)


def _race_params():
    return compat.gpu_interpret_params(raise_on_race=True)


needs_on_race = pytest.mark.skipif(not compat.RAISE_ON_RACE, reason=compat.RAISE_ON_RACE_MISSING)


@pytest.mark.parametrize("case", [
    Case((1, 17, 400, 40), num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
         pages_per_seq=26, share_page=True, seed=12, **BF16),
    pytest.param(Case((450, 9), num_q_heads=8, num_kv_heads=1, head_dim=64, page_size=32, pages_per_seq=15,
         alibi=True, sliding_window=400, q_dtype="float16", cache_dtype="int8", seed=13), marks=pytest.mark.soak),
], ids=str)
@needs_on_race
def test_no_races(case):
    # The race detector runs the kernel with happens-before tracking of every SMEM/GMEM access,
    # TMA and barrier; with on_race="raise" a race is an exception. Partitions of up to 6
    # blocks through 4 slots exercise slot reuse (a TMA refilling a slot the previous block's
    # WGMMA read), the V zeroing, the p tile and (int8) the widened K/V tiles every block
    # rewrites.
    args, opts = make_inputs(case)
    with plgpu.force_gpu_interpret_mode(_race_params()):
        got = mosaic_decode._paged_decode(
            *args[:5], scale=opts["scale"], soft_cap=None, alibi_slopes=opts["alibi_slopes"],
            sliding_window=opts["sliding_window"], k_scales=opts["k_scales"],
            v_scales=opts["v_scales"], interpret=True, blocks_per_part=6)
        got = jax.block_until_ready(got)
    _check(case, got, args, opts)


@needs_on_race
def test_race_detector_catches_a_missing_barrier_wait():
    # The negative control for test_no_races: reading SMEM that a TMA is still writing (the
    # barrier_wait is missing) must be reported under the same parameters.
    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)

    def body(x_ref, o_ref, smem, bar):
        plgpu.copy_gmem_to_smem(x_ref, smem, bar.at[0])
        o_ref[...] = smem[...] + 1.0  # races with the copy
        plgpu.barrier_wait(bar.at[0])

    racy = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        scratch_types=[plgpu.SMEM(x.shape, x.dtype), plgpu.Barrier()])
    with pytest.raises(Exception, match="(?i)race"):
        with plgpu.force_gpu_interpret_mode(_race_params()):
            jax.block_until_ready(racy(x))


def test_unsupported_reason_none_for_tested_specs():
    for case in CASES:
        spec = DecodeSpec(case.q_dtype, case.cache_dtype, case.num_q_heads, case.num_kv_heads,
                          case.head_dim, case.page_size, case.pages_per_seq,
                          case.soft_cap is not None,
                          case.alibi, case.sliding_window is not None,
                          case.cache_dtype in ("int8", "float8_e4m3fn", "float8_e5m2"))
        assert mosaic_decode.unsupported_reason(spec) is None, case


def test_smem_fits_and_pages_in_flight():
    # head_dim 128, page_size 16 and 32: 4 slots of 64-token K+V blocks (32 KiB each), q 16 KiB,
    # slopes 256 B -> 144.25 KiB of the 227 KiB an H100 block may use; interpret mode adds the
    # 8 KiB p tile.
    for page_size in (16, 32):
        assert mosaic_decode.num_slots(128, page_size) == 4
        assert mosaic_decode.smem_bytes(128, page_size) == 4 * 32768 + 16384 + 256
        assert mosaic_decode.smem_bytes(128, page_size, register_acc=False) == 4 * 32768 + 16384 + 8192 + 256
    assert mosaic_decode.smem_bytes(256, 64, register_acc=False) <= mosaic_tuning.lookup(9.0, 256).smem_budget
    # int8 cache, bf16 q, head_dim 128, page_size 32: 4 slots of 8-bit K+V blocks with scales
    # (16.5 KiB each) + q, slopes + the widened K and V blocks (32 KiB).
    assert mosaic_decode.num_slots(128, 32, 2, 1) == 4
    assert mosaic_decode.smem_bytes(128, 32, 2, 1) == 4 * (16384 + 512) + 16384 + 256 + 32768


def test_unsupported_reason_refuses_what_does_not_lower():
    """Pages over 256 tokens (the kernel reads keys in 64-token blocks, pages up to 256) and targets
    no Mosaic decode kernel serves are refused."""
    base = DecodeSpec("bfloat16", "bfloat16", 8, 2, 32, 64, 4, False, False, False, False)
    assert mosaic_decode.unsupported_reason(base) is None
    assert mosaic_decode.unsupported_reason(base, 9.0) is None
    for ps in (320, 512):
        assert "up to 256" in mosaic_decode.unsupported_reason(base._replace(page_size=ps))
    assert mosaic_decode.unsupported_reason(base._replace(page_size=256)) is None
    assert "Hopper" in mosaic_decode.unsupported_reason(base, 11.0)
    # Ampere/Ada and Blackwell are judged by the mma.sync kernel (`decode_ampere`): head_dim 32 is
    # refused there, head_dim 64 accepted.
    for cc in (8.0, 8.9, 10.0, 12.0):
        assert "must be a multiple of 16 (the mma's k) from 64 to 256" in mosaic_decode.unsupported_reason(base, cc)
        assert mosaic_decode.unsupported_reason(base._replace(head_dim=64), cc) is None
    # Measured spills are refused with the reason (auto then takes the Triton kernel).
    quant = base._replace(quantized=True, cache_dtype="int8", page_size=32)
    assert mosaic_decode.unsupported_reason(quant._replace(head_dim=192)) is None
    assert "8-bit cache" in mosaic_decode.unsupported_reason(quant._replace(head_dim=256))


def test_blocks_stay_64_tokens_and_wide_tiles_are_sliced():
    """Every page size is read as 64-token blocks (whole small pages, or 64-token slices of large
    ones: 128/256-token blocks spilled), and register tiles wider than 128 columns are processed
    in slices that are whole SMEM tiles and cover head_dim exactly once."""
    for ps in (8, 16, 32, 64, 128, 256):
        bt = mosaic_tuning.lookup(9.0, 128).block_tokens
        assert bt == 64 and (bt % ps == 0 or ps % bt == 0)
        assert mosaic_decode.num_blocks(3, ps, bt) * bt >= 3 * ps > (mosaic_decode.num_blocks(3, ps, bt) - 1) * bt
    assert mosaic_pipeline.tmas_per_block(16, 64, True) == 8 and mosaic_pipeline.tmas_per_block(256, 64, False) == 1
    for hd, dtypes, width in ((128, ("bfloat16",), 128), (192, ("bfloat16",), 64), (256, ("float16",), 64),
                              (192, ("int8", "bfloat16"), 64), (160, ("bfloat16",), 32)):
        chunks = mosaic_pipeline.col_chunks(hd, *dtypes)
        assert {w for _, w in chunks} == {width}, (hd, dtypes, chunks)
        assert [c for c, _ in chunks] == list(range(0, hd, width))


def test_compat_race_params_follow_the_jax_version():
    """The shim's raise-on-race parameters exist exactly when this JAX has `on_race`; asking for
    them on a JAX without it is an error that names the missing keyword, never a silent no-op."""
    import inspect
    has = "on_race" in inspect.signature(plgpu.InterpretGPUParams).parameters
    assert compat.RAISE_ON_RACE == has
    if has:
        params = compat.gpu_interpret_params(raise_on_race=True)
        assert params.detect_races and params.on_race == "raise"
    else:
        with pytest.raises(NotImplementedError, match="on_race"):
            compat.gpu_interpret_params(raise_on_race=True)
    assert compat.gpu_interpret_params(detect_races=True).detect_races
    assert not compat.gpu_interpret_params().detect_races
