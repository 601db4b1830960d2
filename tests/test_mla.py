"""jpa.ops.mla (absorbed multi-head latent attention over latent pages) against a NumPy oracle, and the latent
pool (CacheConfig v_head_dim 0, KVCache.write_latent, CacheSpec.latent)."""

import jax.numpy as jnp
import numpy as np
import pytest

import jpa
from jpa.kv.cache import CacheConfig
from jpa.kv.spec import CacheGroup, CacheSpec, LatentAttention, RecurrentState
from jpa.ops.mla import mla_decode_xla, mla_paged_decode, mla_ragged_attention


def numpy_mla(q, lat, positions, rank, scale):
    """q f32[N, D] of a query at `positions` (it sees latents 0..positions) over lat f32[S, D]."""
    s = (q @ lat[: positions + 1].T) * scale  # [N, S]
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ lat[: positions + 1, :rank]


def make_pool(rng, num_layers, num_pages, page_size, dim):
    return rng.standard_normal((num_layers, 1, num_pages, page_size, dim)).astype(np.float32)


def tables_for(rng, lens, page_size, num_pages, pages_per_seq, share=False):
    """Permuted, disjoint block tables (share: sequence 1 reuses sequence 0's first page)."""
    perm = rng.permutation(num_pages)
    out = np.zeros((len(lens), pages_per_seq), np.int32)
    k = 0
    for b, n in enumerate(lens):
        for j in range(-(-n // page_size)):
            out[b, j] = perm[k]
            k += 1
    if share and len(lens) > 1:
        out[1, 0] = out[0, 0]
    return out


def seq_latents(pool, layer, table, n, page_size):
    return np.concatenate([pool[layer, 0, table[j]] for j in range(-(-n // page_size))] or
                          [np.zeros((0, pool.shape[-1]), np.float32)])[:n]


@pytest.mark.parametrize("page_size,rank,rope,heads,chunk", [
    (4, 16, 8, 4, None), pytest.param(8, 32, 4, 2, 1, marks=pytest.mark.bench),
    pytest.param(16, 24, 8, 3, 2, marks=pytest.mark.bench)])
def test_decode_equals_numpy(page_size, rank, rope, heads, chunk):
    """Ragged lengths 0, 1, a page multiple, a multiple + 1 and longer; permuted tables; a shared page;
    a stacked pool read at layer 1; several chunks of pages (the online softmax across chunks)."""
    rng = np.random.default_rng(page_size)
    dim = rank + rope
    lens = [0, 1, page_size, page_size + 1, 5 * page_size + 3]
    pages_per_seq = 6
    num_pages = sum(-(-n // page_size) for n in lens) + 3
    pool = make_pool(rng, 2, num_pages, page_size, dim)
    tables = tables_for(rng, lens, page_size, num_pages, pages_per_seq, share=True)
    q = rng.standard_normal((len(lens), heads, dim)).astype(np.float32)
    scale = dim ** -0.5
    got = np.asarray(mla_decode_xla(jnp.asarray(q), jnp.asarray(pool), jnp.asarray(tables),
                                    jnp.asarray(lens, jnp.int32), kv_lora_rank=rank, scale=scale,
                                    layer=jnp.asarray(1, jnp.int32), pages_per_chunk=chunk))
    public = np.asarray(mla_paged_decode(jnp.asarray(q), jnp.asarray(pool), jnp.asarray(tables),
                                         jnp.asarray(lens, jnp.int32), kv_lora_rank=rank, scale=scale, layer=1))
    assert got.shape == (len(lens), heads, rank)
    for b, n in enumerate(lens):
        if n == 0:
            np.testing.assert_array_equal(got[b], 0)
            continue
        want = numpy_mla(q[b], seq_latents(pool, 1, tables[b], n, page_size), n - 1, rank, scale)
        np.testing.assert_allclose(got[b], want, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(public[b], want, atol=1e-5, rtol=1e-5)


def test_ragged_equals_numpy():
    """A prefill chunk after a cached prefix, a whole prompt, a decode row; causal within each chunk."""
    rng = np.random.default_rng(1)
    page_size, rank, rope, heads = 4, 16, 8, 4
    dim = rank + rope
    lens, q_lens = [13, 7, 9], [6, 7, 1]
    pages_per_seq = 4
    num_pages = 12
    pool = make_pool(rng, 1, num_pages, page_size, dim)
    tables = tables_for(rng, lens, page_size, num_pages, pages_per_seq)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(cu[-1]) + 3  # padding rows
    q = rng.standard_normal((num_tokens, heads, dim)).astype(np.float32)
    got = np.asarray(mla_ragged_attention(jnp.asarray(q), jnp.asarray(pool), jnp.asarray(tables),
                                          jnp.asarray(lens, jnp.int32), jnp.asarray(cu), 3, kv_lora_rank=rank,
                                          scale=0.3, layer=0))
    for b in range(3):
        lat = seq_latents(pool, 0, tables[b], lens[b], page_size)
        for t in range(q_lens[b]):
            pos = lens[b] - q_lens[b] + t
            np.testing.assert_allclose(got[cu[b] + t], numpy_mla(q[cu[b] + t], lat, pos, rank, 0.3), atol=1e-5,
                                       rtol=1e-5)
    np.testing.assert_array_equal(got[cu[-1]:], 0)


def test_mla_argument_errors():
    pool = jnp.zeros((2, 1, 4, 4, 24))
    q, tbl, lens = jnp.zeros((1, 2, 24)), jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match=r"kv_lora_rank must be an int in \[1, latent_dim = 24\]"):
        mla_paged_decode(q, pool, tbl, lens, kv_lora_rank=25, scale=1.0, layer=0)
    with pytest.raises(ValueError, match="latent_pages must hold one kv head"):
        mla_paged_decode(q, jnp.zeros((2, 2, 4, 4, 24)), tbl, lens, kv_lora_rank=8, scale=1.0, layer=0)
    with pytest.raises(ValueError, match="q's head_dim must equal the cache's head_dim 24"):
        mla_paged_decode(jnp.zeros((1, 2, 16)), pool, tbl, lens, kv_lora_rank=8, scale=1.0, layer=0)
    with pytest.raises(ValueError, match=r"layer must be in \[0, num_layers = 2\)"):
        mla_paged_decode(q, pool, tbl, lens, kv_lora_rank=8, scale=1.0, layer=2)
    with pytest.raises(ValueError, match="kv_lora_rank must be an int"):
        mla_ragged_attention(q, pool, tbl, lens, jnp.asarray([0, 1], jnp.int32), 1, kv_lora_rank=0, scale=1.0,
                             layer=0)


def test_latent_pool_config_write_and_copy():
    """v_head_dim 0: a zero-wide V pool, bytes of the latents only; write_latent lands each latent at its slot
    (padding skipped); copy_pages (copy-on-write) moves latents."""
    cc = CacheConfig(2, 1, 24, 6, 4, "float32", v_head_dim=0)
    assert cc.bytes_per_page == 2 * 4 * 24 * 4 and cc.nbytes == 6 * cc.bytes_per_page
    assert "latent [6, 4, 24]" in cc.describe()
    cache = jpa.KVCache.create(cc)
    assert cache.v.shape == (2, 1, 6, 4, 0) and cache.nbytes == cc.nbytes
    lat = np.random.default_rng(0).standard_normal((3, 24)).astype(np.float32)
    cache = cache.write_latent(1, jnp.asarray(lat), jnp.asarray([5, -1, 22], jnp.int32))
    k = np.asarray(cache.k)
    np.testing.assert_array_equal(k[1, 0, 1, 1], lat[0])
    np.testing.assert_array_equal(k[1, 0, 5, 2], lat[2])
    assert np.count_nonzero(k) == np.count_nonzero(lat[[0, 2]]) and not k[0].any()
    copied = jpa.copy_pages(cache, jnp.asarray([1], jnp.int32), jnp.asarray([3], jnp.int32))
    np.testing.assert_array_equal(np.asarray(copied.k)[:, :, 3], k[:, :, 1])
    with pytest.raises(ValueError, match="a latent cache \\(v_head_dim=0\\) is kept in a float dtype"):
        CacheConfig(2, 1, 24, 6, 4, "int8", v_head_dim=0)
    with pytest.raises(ValueError, match=r"v_head_dim must be None \(V as wide as K\) or 0 \(a latent cache\); got 8"):
        CacheConfig(2, 1, 24, 6, 4, "float32", v_head_dim=8)
    assert cc.latent and not CacheConfig(2, 1, 24, 6, 4).latent
    with pytest.raises(ValueError, match="write_latent needs a latent cache"):
        jpa.KVCache.create(CacheConfig(2, 1, 24, 6, 4)).write_latent(0, jnp.asarray(lat), jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match=r"latent must be \[num_tokens, latent_dim = 24\]"):
        cache.write_latent(0, jnp.zeros((3, 16)), jnp.zeros(3, jnp.int32))


def test_the_engine_serves_one_latent_group_and_refuses_it_beside_others():
    latent = CacheSpec((CacheGroup("latent", (0, 1, 2), LatentAttention(576)),))
    assert latent.latent and latent.check_served() == (1, 576)
    assert not CacheSpec.attention(2, 2, 8).latent
    mixed = CacheSpec((CacheGroup("latent", (0,), LatentAttention(576)),
                       CacheGroup("state", (1,), RecurrentState((("s", (4,), "float32"),)))))
    with pytest.raises(ValueError, match="cache group 'latent' keeps a latent \\[576\\]"):
        mixed.check_served()
