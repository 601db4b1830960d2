"""The Triton-backend decode kernel in interpret mode against the float64 oracle and the XLA path.

The grid is a covering design rather than a full product (interpret mode is slow on CPU): every
page size, q_per_kv, head_dim, dtype and feature appears at least once, and the hard lengths
(0, 1, page multiples, page multiple + 1, one partition exactly, several partitions) recur.
Tolerances per q dtype are in `kernel_cases.TOL`.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jpa
from jpa.pallas.triton import decode as triton_decode
from jpa.pallas.triton import tuning as triton_tuning
from jpa.pallas.spec import DecodeSpec
from jpa.ops.reference import paged_decode_xla
from jpa.testing.kernel_cases import Case, make_inputs, np_reference, tolerance
from marks import tiered

CASES = [
    # page_size 8, MHA (q_per_kv 1), edge lengths 0, 1, page multiple, +1.
    Case((0, 1, 8, 9, 40), num_q_heads=2, num_kv_heads=2, head_dim=64, page_size=8, pages_per_seq=5),
    # page_size 16, GQA 4, head_dim 80, bf16, shared page.
    Case((16, 17, 3, 64), num_q_heads=8, num_kv_heads=2, head_dim=80, page_size=16,
         q_dtype="bfloat16", cache_dtype="bfloat16", share_page=True, seed=1),
    # page_size 32, MQA with q_per_kv 8, head_dim 192, f16.
    Case((33, 64, 1), num_q_heads=8, num_kv_heads=1, head_dim=192, page_size=32, pages_per_seq=3,
         q_dtype="float16", cache_dtype="float16", seed=2),
    # page_size 128 (pages larger than a step), head_dim 256, bf16.
    Case((128, 129, 255), num_q_heads=8, num_kv_heads=2, head_dim=256, page_size=128,
         pages_per_seq=2, q_dtype="bfloat16", cache_dtype="bfloat16", seed=3),
    # soft cap, head_dim 96.
    Case((5, 31, 48), num_q_heads=4, num_kv_heads=1, head_dim=96, soft_cap=5.0, seed=4),
    # ALiBi with q_per_kv 8, head_dim 128, bf16.
    Case((1, 40, 64), num_q_heads=16, num_kv_heads=2, head_dim=128, alibi=True,
         q_dtype="bfloat16", cache_dtype="bfloat16", seed=5),
    # sliding window shorter than some sequences, page_size 8, head_dim 112.
    Case((3, 20, 21, 40), head_dim=112, page_size=8, pages_per_seq=5, sliding_window=11, seed=6),
    # quantized caches.
    Case((0, 17, 63), num_q_heads=8, num_kv_heads=2, head_dim=80, q_dtype="bfloat16",
         cache_dtype="int8", share_page=True, seed=7),
    Case((1, 32, 50), num_q_heads=4, num_kv_heads=1, head_dim=120, q_dtype="float16",
         cache_dtype="float8_e4m3fn", seed=8),
    Case((16, 33, 64), num_q_heads=2, num_kv_heads=2, head_dim=64, q_dtype="float32",
         cache_dtype="float8_e5m2", soft_cap=20.0, seed=9),
    # q bf16 with an f32 cache: dots run in f32.
    Case((9, 47), num_q_heads=4, num_kv_heads=2, head_dim=64, q_dtype="bfloat16", seed=10),
    # q_per_kv 5 (rows padded to 16), page_size 128 with MHA, page size not a power of two.
    Case((7, 70), num_q_heads=10, num_kv_heads=2, head_dim=64, page_size=16, pages_per_seq=5,
         seed=14),
    Case((1, 129, 256), num_q_heads=2, num_kv_heads=2, head_dim=128, page_size=128,
         pages_per_seq=2, q_dtype="float16", cache_dtype="float16", seed=15),
    Case((12, 13, 35), num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=12, seed=16),
    # everything at once.
    Case((0, 1, 25, 64), num_q_heads=8, num_kv_heads=2, head_dim=80, page_size=16,
         q_dtype="bfloat16", cache_dtype="int8", soft_cap=10.0, alibi=True, sliding_window=19,
         share_page=True, seed=11),
    # exactly one partition: max context = the default partition_tokens (1024).
    Case((1024, 1023, 513), num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
         pages_per_seq=64, seed=12),
    # several partitions (2560 tokens -> 3 of 1024), with a window crossing partition borders.
    Case((2560, 1025, 1024, 7), num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=32,
         pages_per_seq=80, q_dtype="bfloat16", cache_dtype="bfloat16", sliding_window=1500,
         seed=13),
]


def _check(case, got, args, opts):
    chex.assert_shape(got, args[0].shape)
    chex.assert_type(got, args[0].dtype)
    got = np.asarray(got.astype(jnp.float32))
    assert np.isfinite(got).all()
    want = np_reference(*args, **opts)
    np.testing.assert_allclose(got, want, atol=tolerance(case), rtol=0)
    xla = np.asarray(paged_decode_xla(*args, **opts).astype(jnp.float32))
    np.testing.assert_allclose(got, xla, atol=tolerance(case), rtol=0)
    # Zero-length sequences give exactly zero.
    np.testing.assert_array_equal(got[np.asarray(args[4]) == 0], 0.0)


@pytest.mark.parametrize("case", tiered(CASES, soak=(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 15, 16)), ids=str)
def test_matches_reference(case):
    args, opts = make_inputs(case)
    got = jpa.paged_decode(*args, **opts, impl="triton", interpret=True)
    _check(case, got, args, opts)


@pytest.mark.parametrize("case,partition_tokens", [
    # Many small partitions: most programs are past their sequence's end or before the window.
    pytest.param(Case((0, 1, 25, 64, 47), num_q_heads=8, num_kv_heads=2, head_dim=80, page_size=8,
          pages_per_seq=8, q_dtype="bfloat16", cache_dtype="int8", soft_cap=10.0, alibi=True,
          sliding_window=19, share_page=True, seed=20), 16, marks=pytest.mark.soak),
    # A partition holding exactly one page of 16, all lengths around it.
    (Case((15, 16, 17, 48), num_q_heads=4, num_kv_heads=4, head_dim=64, page_size=16,
          seed=21), 16),
], ids=str)
def test_forced_split_k(case, partition_tokens):
    args, opts = make_inputs(case)
    p = triton_decode.plan(case.num_seqs, case.num_kv_heads,
                           case.num_q_heads // case.num_kv_heads, case.head_dim, case.page_size,
                           case.pages_per_seq, partition_tokens)
    assert p.num_partitions > 1
    got = triton_decode.paged_decode(*args, **opts, interpret=True,
                                     partition_tokens=partition_tokens)
    _check(case, got, args, opts)


def test_by_hand():
    """One sequence, two tokens, scale 1: scores (0, ln 3) -> weights (1/4, 3/4), out 0.25*1 + 0.75*5."""
    head_dim, page_size = 16, 8
    q = jnp.zeros((1, 1, head_dim), jnp.float32).at[0, 0, 0].set(1.0)
    k = jnp.zeros((1, 2, page_size, head_dim), jnp.float32).at[0, 1, 1, 0].set(np.log(3.0))
    v = jnp.zeros((1, 2, page_size, head_dim), jnp.float32)
    v = v.at[0, 1, 0].set(1.0).at[0, 1, 1].set(5.0).at[0, 0].set(jnp.nan)  # page 0 never used
    out = jpa.paged_decode(q, k, v, jnp.array([[1]], jnp.int32), jnp.array([2], jnp.int32),
                           scale=1.0, impl="triton", interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.full((1, 1, head_dim), 4.0), rtol=1e-6)


def test_plan_heuristic():
    short = triton_decode.plan(4, 8, 4, 128, 16, 64)  # 1024 tokens: one pass
    assert short.num_partitions == 1
    long = triton_decode.plan(1, 8, 4, 128, 16, 2048)  # 32k tokens, small batch: split
    assert long.num_partitions == 32768 // triton_tuning.decode_tuning().partition_tokens
    full = triton_decode.plan(256, 8, 4, 128, 16, 512)  # 8k tokens, 2048 programs: no split
    assert full.num_partitions == 1
    for p, page_size in ((short, 16), (long, 16), (triton_decode.plan(2, 2, 1, 80, 128, 40), 128)):
        assert p.block_k >= 16 and p.rows >= 16 and p.head_dim_pad >= 16
        assert p.partition_tokens % p.block_k == 0
        if p.num_partitions > 1:
            assert p.partition_tokens % page_size == 0
    # The two long cases of CASES: exactly one partition, and three.
    assert triton_decode.plan(3, 2, 2, 64, 16, 64).num_partitions == 1
    assert triton_decode.plan(4, 2, 4, 64, 32, 80).num_partitions == 3
    assert triton_decode.plan(2, 2, 5, 80, 16, 4).rows == 16
    assert triton_decode.plan(2, 2, 5, 80, 16, 4).head_dim_pad == 128
    assert triton_decode.plan(2, 1, 32, 192, 16, 4).rows == 32


def _spec(**kw):
    base = dict(q_dtype="bfloat16", cache_dtype="bfloat16", num_q_heads=8, num_kv_heads=2,
                head_dim=128, page_size=16, pages_per_seq=8, soft_cap=False, alibi=False,
                sliding_window=False, quantized=False)
    return DecodeSpec(**{**base, **kw})


def test_unsupported_reason():
    assert triton_decode.unsupported_reason(_spec()) is None
    assert triton_decode.unsupported_reason(_spec(head_dim=80, cache_dtype="int8",
                                                  quantized=True)) is None
    assert "head_dim" in triton_decode.unsupported_reason(_spec(head_dim=512))
    with pytest.raises(jpa.ops.dispatch.KernelUnavailable, match="head_dim"):
        jpa.ops.dispatch.choose_impl("triton", _spec(head_dim=512))


@pytest.mark.parametrize("seed", [
    40,
    pytest.param(41, marks=pytest.mark.soak),
    pytest.param(42, marks=pytest.mark.soak),
])
def test_random_lengths(seed):
    """Random ragged lengths and a random configuration from the covered axes."""
    rng = np.random.default_rng(seed)
    page_size = int(rng.choice([8, 16, 32]))
    pages_per_seq = int(rng.integers(1, 9))
    num_kv_heads = int(rng.choice([1, 2]))
    q_dtype, cache_dtype = [("float32", "float32"), ("bfloat16", "bfloat16"),
                            ("float16", "int8")][seed % 3]
    case = Case(tuple(int(x) for x in rng.integers(0, pages_per_seq * page_size + 1, size=4)),
                num_q_heads=num_kv_heads * int(rng.choice([1, 4, 8])), num_kv_heads=num_kv_heads,
                head_dim=int(rng.choice([64, 80, 96])), page_size=page_size,
                pages_per_seq=pages_per_seq, q_dtype=q_dtype, cache_dtype=cache_dtype,
                sliding_window=int(rng.integers(1, 40)) if rng.random() < 0.5 else None,
                share_page=bool(rng.random() < 0.5), seed=seed)
    args, opts = make_inputs(case)
    got = triton_decode.paged_decode(*args, **opts, interpret=True, partition_tokens=32)
    _check(case, got, args, opts)


def test_partition_tokens_must_be_positive():
    args, opts = make_inputs(Case((3,)))
    for bad in (0, -16, 2.5, True):
        with pytest.raises(ValueError, match="partition_tokens must be a positive int"):
            triton_decode.paged_decode(*args, **opts, interpret=True, partition_tokens=bad)


def test_float8_e4m3_needs_sm89():
    """On an Ampere GPU an e4m3 cache is refused up front (Triton has no fp8e4nv before sm_89)."""
    spec = _spec(cache_dtype="float8_e4m3fn", quantized=True)
    assert triton_decode.unsupported_reason(spec) is None  # no device: interpret mode serves it
    assert "8.9" in triton_decode.unsupported_reason(spec, 8.0)
    assert triton_decode.unsupported_reason(_spec(cache_dtype="float8_e5m2", quantized=True), 8.0) is None
    assert triton_decode.unsupported_reason(spec, 9.0) is None


@pytest.mark.parametrize("dtype,num_pages,refused", [
    ("int8", 2 ** 31 // (2 * 16 * 128), False),          # exactly 2**31 elements: 32-bit offsets fit
    ("int8", 2 ** 31 // (2 * 16 * 128) + 1, True),       # past 2**31 elements, <= 2**32 bytes
    ("float8_e5m2", 2 ** 32 // (2 * 16 * 128), True),    # 2**32 bytes exactly: still 32-bit
    ("int8", 2 ** 32 // (2 * 16 * 128) + 1, False),      # > 2**32 bytes: Pallas uses 64-bit offsets
    ("bfloat16", 2 ** 31 // (2 * 16 * 128) + 1, False),  # 16-bit: > 2**32 bytes, 64-bit offsets
])
def test_one_byte_pools_needing_64_bit_offsets_are_refused(dtype, num_pages, refused):
    spec = _spec(cache_dtype=dtype, quantized=dtype != "bfloat16", num_pages=num_pages)
    reason = triton_decode.unsupported_reason(spec, 9.0)
    assert (reason is not None) == refused, reason
    if refused:
        assert "64-bit offsets" in reason


def test_one_compile_for_all_lengths():
    """A jitted multi-layer step (tuple of per-layer pools) traces and compiles once for any lengths."""
    num_layers = 3
    case = Case((5, 40), num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8, pages_per_seq=6)
    args, opts = make_inputs(case)
    q, _, _, tables, _ = args
    rng = np.random.default_rng(30)
    pools = tuple((jnp.asarray(rng.standard_normal(args[1].shape), jnp.float32),
                   jnp.asarray(rng.standard_normal(args[2].shape), jnp.float32))
                  for _ in range(num_layers))
    traces = []

    @jax.jit
    def step(x, pools, tables, lens):
        traces.append(1)
        for k_pages, v_pages in pools:
            x = x + jpa.paged_decode(x, k_pages, v_pages, tables, lens, impl="triton",
                                     interpret=True)
        return x

    outs = [step(q, pools, tables, jnp.asarray(lens, jnp.int32))
            for lens in ((5, 40), (48, 0), (1, 17))]
    assert len(traces) == 1
    assert step._cache_size() == 1
    # And the lengths really were used: the step equals the same layers on the XLA path.
    want = q
    for k_pages, v_pages in pools:
        want = want + paged_decode_xla(want, k_pages, v_pages, tables, jnp.asarray([1, 17], jnp.int32),
                                       scale=64 ** -0.5)
    np.testing.assert_allclose(np.asarray(outs[-1]), np.asarray(want), atol=1e-4)
    assert not np.allclose(np.asarray(outs[0]), np.asarray(outs[1]))
