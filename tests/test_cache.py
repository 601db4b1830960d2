"""write_kv, KVCache and copy_pages: round trips, padding, quantization and in-place updates."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jpa
from jpa.core.quant import QUANT_MAX


def random_pools(rng, shape, dtype="float32"):
    return (jnp.asarray(rng.standard_normal(shape), dtype),
            jnp.asarray(rng.standard_normal(shape), dtype))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_write_kv_round_trip_and_padding(dtype):
    rng = np.random.default_rng()
    num_kv_heads, num_pages, page_size, head_dim = 2, 9, 8, 16
    kp, vp = random_pools(rng, (num_kv_heads, num_pages, page_size, head_dim), dtype)
    num_tokens = 20
    slots = rng.choice(num_pages * page_size, num_tokens, replace=False).astype(np.int32)
    slots[::4] = -1 - rng.integers(0, 5, slots[::4].shape)  # padding, various negatives
    k = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads, head_dim)), dtype)
    nk, nv = jpa.write_kv(kp, vp, k, v, jnp.asarray(slots))
    chex.assert_trees_all_equal_shapes_and_dtypes((nk, nv), (kp, vp))
    flat = lambda x: np.asarray(x.astype(jnp.float32)).reshape(num_kv_heads, -1, head_dim)
    for new, old, src in ((nk, kp, k), (nv, vp, v)):
        new_f, old_f = flat(new), flat(old)
        src_f = np.asarray(src.astype(jnp.float32))
        for t, s in enumerate(slots):
            if s >= 0:
                np.testing.assert_array_equal(new_f[:, s], src_f[t])  # read back by slot
        untouched = np.setdiff1d(np.arange(num_pages * page_size), slots[slots >= 0])
        np.testing.assert_array_equal(new_f[:, untouched], old_f[:, untouched])


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn", "float8_e5m2"])
def test_write_kv_quantizes_per_token_and_head(dtype):
    rng = np.random.default_rng()
    shape = (2, 6, 8, 32)
    kp = jnp.zeros(shape, dtype); vp = jnp.zeros(shape, dtype)
    ks = jnp.ones(shape[:3], jnp.float32); vs = jnp.ones(shape[:3], jnp.float32)
    k = jnp.asarray(rng.standard_normal((5, 2, 32)) * rng.uniform(0.1, 10, (5, 2, 1)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((5, 2, 32)), jnp.float32)
    slots = jnp.array([3, 17, -1, 40, 47], jnp.int32)
    nk, nv, nks, nvs = jpa.write_kv(kp, vp, k, v, slots, k_scales=ks, v_scales=vs)
    deq = (np.asarray(nk.astype(jnp.float32)).reshape(2, -1, 32)
           * np.asarray(nks).reshape(2, -1)[..., None])
    rel = {"int8": 1 / 127, "float8_e4m3fn": 2 ** -3, "float8_e5m2": 2 ** -2}[dtype]
    for t, s in enumerate(np.asarray(slots)):
        if s < 0:
            continue
        amax = np.abs(np.asarray(k[t])).max(-1, keepdims=True)  # [K, 1]
        np.testing.assert_allclose(np.asarray(nks).reshape(2, -1)[:, s], amax[:, 0] / QUANT_MAX[np.dtype(dtype)],
                                   rtol=1e-6)
        assert np.all(np.abs(deq[:, s] - np.asarray(k[t])) <= rel * amax + 1e-7)
    assert np.asarray(nks).reshape(2, -1)[0, 0] == 1.0  # an unwritten slot keeps its scale


def test_write_kv_donated_updates_in_place():
    rng = np.random.default_rng()
    shape = (4, 512, 16, 64)  # 8 MiB per pool
    kp, vp = random_pools(rng, shape)
    k = jnp.asarray(rng.standard_normal((8, 4, 64)), jnp.float32)
    slots = jnp.asarray(rng.choice(512 * 16, 8, replace=False), jnp.int32)
    write = jax.jit(jpa.write_kv, donate_argnums=(0, 1))
    compiled = write.lower(kp, vp, k, k, slots).compile()
    mem = compiled.memory_analysis()
    pool_bytes = kp.size * kp.dtype.itemsize
    assert mem.temp_size_in_bytes < pool_bytes // 16, mem
    nk, nv = write(kp, vp, k, k, slots)
    assert kp.is_deleted() and vp.is_deleted()
    np.testing.assert_array_equal(np.asarray(nk).reshape(4, -1, 64)[:, np.asarray(slots)],
                                  np.swapaxes(np.asarray(k), 0, 1))


def test_cache_config_sizes():
    cfg = jpa.CacheConfig(num_layers=30, num_kv_heads=3, head_dim=64, num_pages=100, page_size=16,
                          dtype="bfloat16")
    assert cfg.bytes_per_page == 2 * 30 * 3 * 16 * 64 * 2
    cache = jpa.KVCache.create(cfg)
    assert cache.num_layers == 30 and len(cache.v) == 30
    assert cache.nbytes == cfg.nbytes
    assert "MiB" in cfg.describe()
    q8 = jpa.CacheConfig.from_memory(10 * 2 ** 20, num_layers=4, num_kv_heads=2, head_dim=64,
                                     page_size=16, dtype="int8")
    assert q8.nbytes <= 10 * 2 ** 20 < q8.nbytes + q8.bytes_per_page
    assert q8.bytes_per_page == 2 * 4 * 2 * 16 * (64 + 4)
    assert jpa.KVCache.create(q8).nbytes == q8.nbytes


def test_cache_write_then_decode_matches_dense():
    """KVCache.write per layer, then paged_decode, equals dense attention over the written tokens."""
    rng = np.random.default_rng()
    cfg = jpa.CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, num_pages=8, page_size=4)
    cache = jpa.KVCache.create(cfg)
    tables = rng.permutation(8)[:6].reshape(2, 3).astype(np.int32)
    n = 9
    pos = np.arange(n)
    slots = (tables[0, pos // 4] * 4 + pos % 4).astype(np.int32)
    k = jnp.asarray(rng.standard_normal((n, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((n, 2, 16)), jnp.float32)
    cache = cache.write(1, k, v, jnp.asarray(slots))
    q = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.float32)
    kp, vp, _, _ = cache.layer(1)
    out = jpa.paged_decode(q, kp, vp, jnp.asarray(tables), jnp.array([n, 0], jnp.int32))
    s = np.einsum("kgh,tkh->kgt", np.asarray(q[0]).reshape(2, 2, 16), np.asarray(k)) / 4.0
    p = np.exp(s - s.max(-1, keepdims=True)); p /= p.sum(-1, keepdims=True)
    want = np.einsum("kgt,tkh->kgh", p, np.asarray(v)).reshape(4, 16)
    np.testing.assert_allclose(np.asarray(out[0]), want, atol=1e-5)
    assert not np.asarray(cache.k[0]).any(), "layer 0 must be untouched"


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_copy_pages_in_place(dtype):
    rng = np.random.default_rng()
    cfg = jpa.CacheConfig(num_layers=2, num_kv_heads=2, head_dim=8, num_pages=6, page_size=4, dtype=dtype)
    cache = jpa.KVCache.create(cfg)
    slots = jnp.arange(24, dtype=jnp.int32)
    for i in range(2):
        x = jnp.asarray(rng.standard_normal((24, 2, 8)), jnp.float32)
        cache = cache.write(i, x, -x, slots)
    before = jax.tree_util.tree_map(lambda x: np.array(x, copy=True), cache)  # no views: donation needs sole ownership
    copy = jax.jit(jpa.copy_pages, donate_argnums=0)
    src, dst = jnp.array([1, 4, 0], jnp.int32), jnp.array([3, 5, -1], jnp.int32)
    after = copy(cache, src, dst)
    assert cache.k.is_deleted()
    for old, new in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after)):
        new = np.asarray(new)  # [num_layers, num_kv_heads, num_pages, ...]: every layer's pages copied
        np.testing.assert_array_equal(new[:, :, 3], old[:, :, 1])
        np.testing.assert_array_equal(new[:, :, 5], old[:, :, 4])
        np.testing.assert_array_equal(new[:, :, [0, 1, 2, 4]], old[:, :, [0, 1, 2, 4]])
