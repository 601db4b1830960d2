"""jpa.ops.prefill.paged_prefill against a float64 NumPy dense causal reference, and its ValueErrors."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from jpa.kv.cache import write_kv
from jpa.ops.prefill import paged_prefill


def scattered_tables(rng, num_seqs, pages_per_seq, num_pages):
    """Block tables whose pages are interleaved round-robin across sequences, then permuted."""
    assert num_seqs * pages_per_seq <= num_pages
    order = np.arange(pages_per_seq)[None, :] * num_seqs + np.arange(num_seqs)[:, None]  # [B, pps]
    return rng.permutation(num_pages)[order].astype(np.int32)


def fill_cache(rng, tables, lens, num_kv_heads, page_size, head_dim, num_pages):
    """Pools holding NaN everywhere except at each sequence's first `lens[b]` tokens.

    Returns (k_pages, v_pages) f32[K, P, S_p, H] and the dense keys/values f64[B][len, K, H].
    """
    k_pages = np.full((num_kv_heads, num_pages, page_size, head_dim), np.nan, np.float32)
    v_pages = np.full_like(k_pages, np.nan)
    ks, vs = [], []
    for b, n in enumerate(lens):
        k = rng.normal(size=(n, num_kv_heads, head_dim)).astype(np.float32)
        v = rng.normal(size=(n, num_kv_heads, head_dim)).astype(np.float32)
        for t in range(n):
            page, off = tables[b, t // page_size], t % page_size
            k_pages[:, page, off] = k[t]
            v_pages[:, page, off] = v[t]
        ks.append(k.astype(np.float64))
        vs.append(v.astype(np.float64))
    return k_pages, v_pages, ks, vs


def reference(q, ks, vs, start, chunk_lens, scale, soft_cap=None, sliding_window=None):
    """float64 dense causal attention; q [B, T, N, H]; zeros at padding rows."""
    num_seqs, num_tokens, num_q_heads, head_dim = q.shape
    out = np.zeros(q.shape, np.float64)
    for b in range(num_seqs):
        q_per_kv = num_q_heads // ks[b].shape[1]
        for t in range(chunk_lens[b]):
            p = start[b] + t
            lo = 0 if sliding_window is None else max(0, p + 1 - sliding_window)
            for n in range(num_q_heads):
                k = ks[b][lo: p + 1, n // q_per_kv]  # [p + 1 - lo, H]
                v = vs[b][lo: p + 1, n // q_per_kv]
                s = k @ q[b, t, n].astype(np.float64) * scale
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                w = np.exp(s - s.max())
                out[b, t, n] = (w / w.sum()) @ v
    return out


CASES = [
    # page_size, num_kv_heads, q_per_kv, head_dim, start, chunk_lens, num_tokens
    (4, 2, 2, 16, [0, 5, 8, 3], [7, 0, 4, 1], 7),  # fresh, empty row, page multiple, one token
    (1, 1, 4, 8, [0, 2], [3, 3], 3),  # page_size 1, MQA
    (16, 3, 1, 32, [15, 0, 16], [2, 16, 1], 16),  # crosses a page boundary; full page; multiple + 1
    (8, 2, 3, 80, [4, 0], [5, 9], 9),  # head_dim 80, GQA 3
]


@pytest.mark.parametrize("page_size,num_kv_heads,q_per_kv,head_dim,start,chunk_lens,num_tokens", CASES)
def test_matches_float64_reference(page_size, num_kv_heads, q_per_kv, head_dim, start, chunk_lens,
                                   num_tokens):
    rng = np.random.default_rng(page_size * 100 + head_dim)
    num_seqs = len(start)
    ends = np.array(start) + np.array(chunk_lens)
    pages_per_seq = int(-(-ends.max() // page_size)) + 1  # one spare column that is never read
    num_pages = num_seqs * pages_per_seq + 3
    tables = scattered_tables(rng, num_seqs, pages_per_seq, num_pages)
    k_pages, v_pages, ks, vs = fill_cache(rng, tables, ends, num_kv_heads, page_size, head_dim, num_pages)
    num_q_heads = num_kv_heads * q_per_kv
    q = rng.normal(size=(num_seqs, num_tokens, num_q_heads, head_dim)).astype(np.float32)
    out = paged_prefill(jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(tables),
                        jnp.asarray(start, jnp.int32), jnp.asarray(chunk_lens, jnp.int32))
    chex.assert_shape(out, q.shape)
    chex.assert_type(out, jnp.float32)
    want = reference(q, ks, vs, start, chunk_lens, head_dim ** -0.5)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=1e-5)


def test_long_context_visits_several_chunks_with_custom_scale():
    # 130 pages of 4 tokens > the 128 pages the loop takes per iteration: the fori_loop path.
    rng = np.random.default_rng(7)
    page_size, pages_per_seq, num_kv_heads, head_dim = 4, 131, 1, 8
    start, chunk_lens = [509, 3], [6, 2]
    num_pages = 2 * pages_per_seq
    tables = scattered_tables(rng, 2, pages_per_seq, num_pages)
    ends = np.array(start) + np.array(chunk_lens)
    k_pages, v_pages, ks, vs = fill_cache(rng, tables, ends, num_kv_heads, page_size, head_dim, num_pages)
    q = rng.normal(size=(2, 6, 2, head_dim)).astype(np.float32)
    out = paged_prefill(jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(tables),
                        jnp.asarray(start, jnp.int32), jnp.asarray(chunk_lens, jnp.int32), scale=0.7)
    want = reference(q, ks, vs, start, chunk_lens, 0.7)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("soft_cap,sliding_window,pages_per_seq", [
    (None, 5, 4), (2.0, None, 4), (1.5, 3, 4), (3.0, 7, 131)])  # 131 pages: the fori_loop path
def test_soft_cap_and_sliding_window(soft_cap, sliding_window, pages_per_seq):
    rng = np.random.default_rng(17)
    page_size, num_kv_heads, head_dim = 4, 2, 16
    start, chunk_lens = [0, 6, 2], [9, 5, 0]
    ends = np.array(start) + np.array(chunk_lens)
    num_pages = 3 * pages_per_seq
    tables = scattered_tables(rng, 3, pages_per_seq, num_pages)
    k_pages, v_pages, ks, vs = fill_cache(rng, tables, ends, num_kv_heads, page_size, head_dim, num_pages)
    # Large logits, so that the cap bends them.
    q = 3 * rng.normal(size=(3, 9, 4, head_dim)).astype(np.float32)
    out = paged_prefill(jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(tables),
                        jnp.asarray(start, jnp.int32), jnp.asarray(chunk_lens, jnp.int32),
                        soft_cap=soft_cap, sliding_window=sliding_window)
    want = reference(q, ks, vs, start, chunk_lens, head_dim ** -0.5, soft_cap, sliding_window)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=1e-5)
    plain = reference(q, ks, vs, start, chunk_lens, head_dim ** -0.5)
    assert np.abs(plain - want).max() > 1e-2  # the option changed the result


def test_hand_worked_case():
    # One head, head_dim 1, keys [0, 0, ln 3] and values [1, 2, 3] at positions 0..2; q = 1.
    # Position 1 sees two equal scores -> mean of 1 and 2 = 1.5. Position 2 weights 1:1:3 -> 12/5.
    k = np.zeros((1, 2, 2, 1), np.float32)
    v = np.zeros((1, 2, 2, 1), np.float32)
    # Token t of the sequence lives in page [1, 0][t // 2], offset t % 2.
    k[0, 1, 0, 0], k[0, 1, 1, 0], k[0, 0, 0, 0] = 0.0, 0.0, np.log(3.0)
    v[0, 1, 0, 0], v[0, 1, 1, 0], v[0, 0, 0, 0] = 1.0, 2.0, 3.0
    q = jnp.ones((1, 2, 1, 1), jnp.float32)
    out = paged_prefill(q, jnp.asarray(k), jnp.asarray(v), jnp.array([[1, 0]], jnp.int32),
                        jnp.array([1], jnp.int32), jnp.array([2], jnp.int32), scale=1.0)
    np.testing.assert_allclose(np.asarray(out)[0, :, 0, 0], [1.5, 12 / 5], rtol=1e-6)


@pytest.mark.parametrize("cache_dtype", ["int8", "float8_e4m3fn"])
def test_quantized_cache_matches_dequantized_reference(cache_dtype):
    rng = np.random.default_rng(3)
    page_size, num_kv_heads, head_dim, num_pages = 4, 2, 16, 8
    tables = np.array([[5, 2, 7], [0, 6, 3]], np.int32)
    start, chunk_lens = [3, 0], [5, 4]
    ends = [8, 4]
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k_pages, v_pages = jnp.zeros(shape, cache_dtype), jnp.zeros(shape, cache_dtype)
    k_sc, v_sc = jnp.ones(shape[:3], jnp.float32), jnp.ones(shape[:3], jnp.float32)
    slots = np.concatenate([tables[b, np.arange(n) // page_size] * page_size + np.arange(n) % page_size
                            for b, n in enumerate(ends)]).astype(np.int32)
    k_new = rng.normal(size=(len(slots), num_kv_heads, head_dim)).astype(np.float32)
    v_new = rng.normal(size=(len(slots), num_kv_heads, head_dim)).astype(np.float32)
    k_pages, v_pages, k_sc, v_sc = write_kv(k_pages, v_pages, jnp.asarray(k_new), jnp.asarray(v_new),
                                            jnp.asarray(slots), k_scales=k_sc, v_scales=v_sc)
    # Reference on what the cache holds: dequantized values read back through the tables.
    deq = lambda p, s: np.asarray(p.astype(jnp.float32)) * np.asarray(s)[..., None]
    kd, vd = deq(k_pages, k_sc), deq(v_pages, v_sc)
    read = lambda x, b: np.stack([x[:, tables[b, t // page_size], t % page_size] for t in range(ends[b])])
    ks = [read(kd, b).astype(np.float64) for b in range(2)]
    vs = [read(vd, b).astype(np.float64) for b in range(2)]
    q = rng.normal(size=(2, 5, 4, head_dim)).astype(np.float32)
    out = paged_prefill(jnp.asarray(q), k_pages, v_pages, jnp.asarray(tables), jnp.asarray(start, jnp.int32),
                        jnp.asarray(chunk_lens, jnp.int32), k_scales=k_sc, v_scales=v_sc)
    want = reference(q, ks, vs, start, chunk_lens, head_dim ** -0.5)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=1e-5)


def test_bfloat16_close_to_float32():
    rng = np.random.default_rng(11)
    page_size, num_kv_heads, head_dim = 4, 2, 16
    start, chunk_lens = [2, 0, 6], [5, 3, 1]
    ends = np.array(start) + np.array(chunk_lens)
    tables = scattered_tables(rng, 3, 3, 12)
    k_pages, v_pages, ks, vs = fill_cache(rng, tables, ends, num_kv_heads, page_size, head_dim, 12)
    q = rng.normal(size=(3, 5, 4, head_dim)).astype(np.float32)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)
    out = paged_prefill(bf(q), bf(k_pages), bf(v_pages), jnp.asarray(tables), jnp.asarray(start, jnp.int32),
                        jnp.asarray(chunk_lens, jnp.int32))
    chex.assert_type(out, jnp.bfloat16)
    want = reference(q, ks, vs, start, chunk_lens, head_dim ** -0.5)
    # bf16 has 8 mantissa bits: inputs and output each round at ~0.4% relative.
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), want, atol=3e-2, rtol=3e-2)


def _args(**over):
    """A valid call (2 seqs, 3 tokens, 4 q heads, 2 kv heads, head_dim 8, 6 pages of 4) with overrides."""
    args = dict(
        q=jnp.zeros((2, 3, 4, 8), jnp.float32),
        k_pages=jnp.zeros((2, 6, 4, 8), jnp.float32),
        v_pages=jnp.zeros((2, 6, 4, 8), jnp.float32),
        block_tables=jnp.array([[0, 1], [2, 3]], jnp.int32),
        start=jnp.array([0, 5], jnp.int32),
        chunk_lens=jnp.array([3, 3], jnp.int32),
    )
    args.update(over)
    return args


def test_valid_args_run():
    chex.assert_shape(paged_prefill(**_args()), (2, 3, 4, 8))


@pytest.mark.parametrize("over,match", [
    (dict(q=jnp.zeros((2, 3, 8), jnp.float32)), r"q must have shape \[num_seqs, num_tokens, num_q_heads"),
    (dict(q=jnp.zeros((2, 3, 4, 8), jnp.int32)), r"q must have dtype in"),
    (dict(q=jnp.zeros((2, 3, 4, 16), jnp.float32)), r"q's head_dim \(q.shape\[3\] = 16\) must equal"),
    (dict(q=jnp.zeros((2, 3, 3, 8), jnp.float32)), r"num_q_heads \(q.shape\[2\] = 3\) must be a multiple"),
    (dict(v_pages=jnp.zeros((2, 5, 4, 8), jnp.float32)), r"v_pages must have the shape of k_pages"),
    (dict(k_scales=jnp.ones((2, 6, 4), jnp.float32)), r"k_scales is only for int8/float8 caches"),
    (dict(block_tables=jnp.array([0, 1], jnp.int32)), r"block_tables must have shape i32\[num_seqs"),
    (dict(block_tables=jnp.array([[0, 1]], jnp.int32)), r"block_tables must have num_seqs = 2 rows"),
    (dict(block_tables=jnp.array([[0., 1.], [2., 3.]])), r"block_tables must have dtype in \(int32\)"),
    (dict(block_tables=jnp.zeros((2, 0), jnp.int32)), r"at least one column"),
    (dict(start=jnp.array([0], jnp.int32)), r"start must have num_seqs = 2 entries"),
    (dict(start=jnp.array([0., 5.])), r"start must have dtype in \(int32\)"),
    (dict(chunk_lens=jnp.array([[3, 3]], jnp.int32)), r"chunk_lens must have shape i32\[num_seqs\]"),
    (dict(start=jnp.array([-1, 0], jnp.int32)), r"start must be >= 0"),
    (dict(chunk_lens=jnp.array([4, 0], jnp.int32)), r"chunk_lens must be in \[0, num_tokens = 3\]"),
    (dict(chunk_lens=jnp.array([-1, 0], jnp.int32)), r"chunk_lens must be in \[0, num_tokens = 3\]"),
    (dict(start=jnp.array([0, 6], jnp.int32)), r"start \+ chunk_lens must be <= pages_per_seq \* page_size = 8"),
    (dict(block_tables=jnp.array([[0, 1], [2, 6]], jnp.int32)),
     r"must be in \[0, num_pages = 6\); got block_tables\[1, 1\] = 6"),
    (dict(block_tables=jnp.array([[-1, 1], [2, 3]], jnp.int32)), r"got block_tables\[0, 0\] = -1"),
])
def test_value_errors(over, match):
    with pytest.raises(ValueError, match=match):
        paged_prefill(**_args(**over))


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), "1"])
def test_bad_scale(scale):
    with pytest.raises(ValueError, match=r"scale must be a positive finite Python number"):
        paged_prefill(**_args(), scale=scale)


@pytest.mark.parametrize("over,match", [
    (dict(soft_cap=0.0), r"soft_cap must be a positive finite Python number"),
    (dict(soft_cap=float("inf")), r"soft_cap must be a positive finite Python number"),
    (dict(sliding_window=0), r"sliding_window must be a Python int >= 1 or None; got 0"),
    (dict(sliding_window=2.0), r"sliding_window must be a Python int >= 1 or None; got 2.0"),
    (dict(sliding_window=True), r"sliding_window must be a Python int >= 1 or None; got True"),
])
def test_bad_soft_cap_or_window(over, match):
    with pytest.raises(ValueError, match=match):
        paged_prefill(**_args(), **over)


def test_unused_table_entries_are_not_checked():
    # Sequence 0 holds 3 tokens: only its first page is in use; garbage after it is fine.
    out = paged_prefill(**_args(block_tables=jnp.array([[0, -7], [2, 3]], jnp.int32)))
    assert np.isfinite(np.asarray(out)).all()
