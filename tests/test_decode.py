"""paged_decode (impl="xla") against an independent float64 NumPy reference.

The NumPy reference (`kernel_cases.np_reference`, shared with the kernel tests) gathers each
sequence's tokens through its block table and runs a dense softmax, so it shares no code with
the online-softmax implementation under test.
"""


import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jpa
from jpa.core.quant import is_quantized, quantize
from jpa.testing.kernel_cases import np_reference

# Tolerances on outputs of O(1) magnitude (q, k, v ~ N(0, 1)), per q/cache dtype.
#   f32: only summation order differs from float64.
#   f16/bf16: q and K/V are rounded to the storage dtype before the reference sees them, so what
#   remains is f32 accumulation plus the final cast of the output to q's dtype (8/11-bit mantissa).
TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def make_case(rng, *, num_seqs, num_kv_heads, q_per_kv, head_dim, page_size, pages_per_seq,
              seq_lens, q_dtype="float32", cache_dtype="float32", share_page=False, spare_pages=3):
    """A random case: permuted block tables, optionally one page shared by sequences 0 and 1."""
    num_pages = num_seqs * pages_per_seq + spare_pages
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    q = jnp.asarray(rng.standard_normal((num_seqs, num_kv_heads * q_per_kv, head_dim)), q_dtype)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    tables = rng.permutation(num_pages)[: num_seqs * pages_per_seq].reshape(num_seqs, pages_per_seq)
    if share_page and num_seqs >= 2:
        tables[1, 0] = tables[0, 0]  # both sequences read the same first page
    extra = {}
    if is_quantized(cache_dtype):
        k, ks = quantize(jnp.asarray(k), cache_dtype)
        v, vs = quantize(jnp.asarray(v), cache_dtype)
        extra = dict(k_scales=ks, v_scales=vs)
    else:
        k, v = jnp.asarray(k, cache_dtype), jnp.asarray(v, cache_dtype)
    return (q, k, v, jnp.asarray(tables, jnp.int32), jnp.asarray(seq_lens, jnp.int32)), extra


def ragged_lens(page_size, pages_per_seq):
    """Edge-case lengths: 0, 1, page multiples, page multiples + 1, full."""
    full = page_size * pages_per_seq
    return [0, 1, page_size, page_size + 1, 2 * page_size, full - 1, full]


GRID = [
    # page_size, num_kv_heads, q_per_kv, head_dim
    (8, 2, 1, 64),
    (16, 1, 8, 128),   # MQA
    (16, 2, 4, 80),
    (32, 2, 4, 192),
    (64, 1, 4, 96),
    (128, 2, 1, 32),
    (16, 1, 4, 112),
    (8, 2, 2, 120),
    (16, 1, 2, 256),
]


@pytest.mark.parametrize("page_size,num_kv_heads,q_per_kv,head_dim", GRID)
def test_matches_numpy_reference(page_size, num_kv_heads, q_per_kv, head_dim):
    rng = np.random.default_rng()
    pages_per_seq = max(3, 600 // page_size)  # > one 512-token chunk for small pages
    lens = ragged_lens(page_size, pages_per_seq)
    args, extra = make_case(rng, num_seqs=len(lens), num_kv_heads=num_kv_heads, q_per_kv=q_per_kv,
                            head_dim=head_dim, page_size=page_size, pages_per_seq=pages_per_seq,
                            seq_lens=lens, share_page=True)
    got = jpa.paged_decode(*args, impl="xla")
    want = np_reference(*args)
    chex.assert_shape(got, args[0].shape)
    np.testing.assert_allclose(np.asarray(got), want, atol=TOL["float32"], rtol=TOL["float32"])
    assert not np.asarray(got[0]).any(), "seq_len 0 must give zeros"


OPTIONS = {
    "scale": dict(scale=0.3),
    "soft_cap": dict(soft_cap=5.0, scale=1.0),
    "alibi": dict(alibi=True),
    "window_short": dict(sliding_window=7),
    "window_long": dict(sliding_window=40),
    "all": dict(soft_cap=10.0, alibi=True, sliding_window=20, scale=0.5),
}


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("page_size,q_per_kv", [(8, 4), (32, 1)])
def test_options_match_numpy_reference(option, page_size, q_per_kv):
    rng = np.random.default_rng()
    opts = dict(OPTIONS[option])
    pages_per_seq = max(2, 100 // page_size + 1)
    lens = ragged_lens(page_size, pages_per_seq)
    args, _ = make_case(rng, num_seqs=len(lens), num_kv_heads=2, q_per_kv=q_per_kv, head_dim=64,
                        page_size=page_size, pages_per_seq=pages_per_seq, seq_lens=lens)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = jnp.asarray(rng.uniform(0.01, 0.5, args[0].shape[1]), jnp.float32)
    got = jpa.paged_decode(*args, impl="xla", **opts)
    want = np_reference(*args, **opts)
    np.testing.assert_allclose(np.asarray(got), want, atol=TOL["float32"], rtol=TOL["float32"])


@pytest.mark.parametrize("q_dtype,cache_dtype", [
    ("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "bfloat16"),
    ("bfloat16", "int8"), ("float32", "int8"), ("float16", "float8_e4m3fn"), ("bfloat16", "float8_e5m2"),
])
def test_dtypes_match_numpy_reference(q_dtype, cache_dtype):
    rng = np.random.default_rng()
    page_size, pages_per_seq = 16, 5
    lens = ragged_lens(page_size, pages_per_seq)
    args, extra = make_case(rng, num_seqs=len(lens), num_kv_heads=2, q_per_kv=4, head_dim=64,
                            page_size=page_size, pages_per_seq=pages_per_seq, seq_lens=lens,
                            q_dtype=q_dtype, cache_dtype=cache_dtype, share_page=True)
    got = jpa.paged_decode(*args, impl="xla", **extra)
    assert got.dtype == jnp.dtype(q_dtype)
    # The reference sees exactly the stored (rounded/quantized) cache, so the tolerance only
    # covers the computation and the output cast.
    want = np_reference(np.asarray(args[0].astype(jnp.float32)), *args[1:], **extra)
    tol = TOL[q_dtype]
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, atol=tol, rtol=tol)


def test_quantized_cache_close_to_float_cache():
    """int8/fp8 storage error stays small relative to the float result (storage, not compute).

    The error depends on the draw with a heavy tail: over 2000 seeds the worst was int8 0.0247
    (mean 0.0103), e4m3 0.137 (0.054), e5m2 0.222 (0.108), so no measured figure bounds a fresh
    draw's failure below 1e-6 under these tolerances. The seed is fixed (its errors sit well inside
    them: 0.016, 0.057, 0.115); a dequantization bug (a scale ignored) gives errors ~1 on any draw."""
    rng = np.random.default_rng(0)
    args, _ = make_case(rng, num_seqs=3, num_kv_heads=2, q_per_kv=2, head_dim=64, page_size=16,
                        pages_per_seq=4, seq_lens=[10, 33, 64])
    want = np.asarray(jpa.paged_decode(*args))
    # Tolerances ~1.8x the worst error over 40 seeds (int8 0.016, e4m3 0.115, e5m2 0.167; outputs
    # ~1): e4m3 at 0.1 failed 1 seed in 40. A dequantization bug (a scale ignored) gives errors ~1.
    for dtype, tol in (("int8", 0.03), ("float8_e4m3fn", 0.2), ("float8_e5m2", 0.3)):
        kq, ks = quantize(args[1], dtype)
        vq, vs = quantize(args[2], dtype)
        got = jpa.paged_decode(args[0], kq, vq, *args[3:], k_scales=ks, v_scales=vs)
        assert np.max(np.abs(np.asarray(got) - want)) < tol, dtype


def test_small_case_by_hand():
    """One sequence, one head, head_dim 2, page_size 2, three tokens over two permuted pages.

    q = [1, 0]; keys k0 = [0, 0], k1 = [ln 2, 0], k2 = [ln 4, 0]; scale 1 -> logits 0, ln 2, ln 4
    -> softmax weights 1/7, 2/7, 4/7. Values v0 = [7, 0], v1 = [0, 7], v2 = [0, 0]
    -> output [1, 2].
    """
    k = np.zeros((1, 3, 2, 2), np.float32)  # [K, P, S_p, H]
    v = np.zeros((1, 3, 2, 2), np.float32)
    # Logical page 0 -> physical page 2, logical page 1 -> physical page 0.
    k[0, 2, 0] = [0.0, 0.0]; v[0, 2, 0] = [7.0, 0.0]
    k[0, 2, 1] = [np.log(2), 0.0]; v[0, 2, 1] = [0.0, 7.0]
    k[0, 0, 0] = [np.log(4), 0.0]; v[0, 0, 0] = [0.0, 0.0]
    k[0, 0, 1] = [100.0, 0.0]; v[0, 0, 1] = [1e6, 1e6]  # past seq_len: must not be read
    k[0, 1] = np.nan; v[0, 1] = np.nan  # a page the table does not use at all
    out = jpa.paged_decode(jnp.array([[[1.0, 0.0]]]), jnp.asarray(k), jnp.asarray(v),
                           jnp.array([[2, 0]], jnp.int32), jnp.array([3], jnp.int32), scale=1.0)
    np.testing.assert_allclose(np.asarray(out), [[[1.0, 2.0]]], rtol=1e-6)


def test_entries_past_a_sequence_are_never_read():
    """Pages a sequence does not own may hold NaN; table entries past its end may name them."""
    rng = np.random.default_rng()
    args, _ = make_case(rng, num_seqs=3, num_kv_heads=1, q_per_kv=2, head_dim=32, page_size=8,
                        pages_per_seq=4, seq_lens=[0, 5, 17], spare_pages=2)
    q, k, v, tables, lens = args
    tables = np.asarray(tables).copy()
    want = jpa.paged_decode(q, k, v, jnp.asarray(tables), lens)
    owned = {int(tables[b, j]) for b, n in enumerate([0, 5, 17]) for j in range(-(-n // 8))}
    poison = min(set(range(k.shape[1])) - owned)  # a page no sequence owns
    tables[0, :] = poison
    tables[1, 1:] = poison
    tables[2, 3:] = poison
    k = k.at[:, poison].set(jnp.nan)
    v = v.at[:, poison].set(jnp.inf)
    got = jpa.paged_decode(q, k, v, jnp.asarray(tables), lens)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_compiles_once_for_any_lengths():
    rng = np.random.default_rng()
    traces = []

    @jax.jit
    def step(q, k, v, tables, lens):
        traces.append(1)
        return jpa.paged_decode(q, k, v, tables, lens)

    args, _ = make_case(rng, num_seqs=4, num_kv_heads=2, q_per_kv=2, head_dim=32, page_size=8,
                        pages_per_seq=80, seq_lens=[0, 1, 2, 3])
    for lens in ([0, 1, 2, 3], [640, 1, 0, 9], [100, 200, 300, 400], [8, 8, 8, 8]):
        got = step(*args[:4], jnp.asarray(lens, jnp.int32))
        want = np_reference(*args[:4], np.asarray(lens))
        np.testing.assert_allclose(np.asarray(got), want, atol=TOL["float32"])
    assert len(traces) == 1
