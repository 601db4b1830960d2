"""Every ValueError at the public boundary: the message names the argument and what was given."""

import jax.numpy as jnp
import numpy as np
import pytest

import jpa

K, P, S, H, B, N = 2, 6, 8, 16, 3, 4


def good():
    rng = np.random.default_rng()
    q = jnp.asarray(rng.standard_normal((B, N, H)), jnp.float32)
    kp = jnp.asarray(rng.standard_normal((K, P, S, H)), jnp.float32)
    vp = jnp.asarray(rng.standard_normal((K, P, S, H)), jnp.float32)
    tables = jnp.asarray(rng.permutation(P).reshape(B, 2), jnp.int32)
    lens = jnp.array([0, 5, 16], jnp.int32)
    return dict(q=q, k_pages=kp, v_pages=vp, block_tables=tables, seq_lens=lens)


def call(**over):
    args = good()
    kw = {k: over.pop(k) for k in list(over) if k not in args}
    args.update(over)
    return jpa.paged_decode(args["q"], args["k_pages"], args["v_pages"], args["block_tables"],
                            args["seq_lens"], **kw)


f32 = lambda *shape: jnp.zeros(shape, jnp.float32)
i32 = lambda *shape: jnp.zeros(shape, jnp.int32)
q8 = lambda: jnp.zeros((K, P, S, H), jnp.int8)

DECODE_ERRORS = {
    "q rank": (dict(q=f32(B, N * H)), r"q must have shape \[num_seqs, num_q_heads, head_dim\]"),
    "q dtype": (dict(q=i32(B, N, H)), r"q must have dtype in .*got int32"),
    "k rank": (dict(k_pages=f32(K, P * S, H)), r"k_pages must have shape"),
    "v rank": (dict(v_pages=f32(K, P * S, H)), r"v_pages must have shape"),
    "v shape": (dict(v_pages=f32(K, P, S, H + 1)), r"v_pages must have the shape of k_pages"),
    "k dtype": (dict(k_pages=i32(K, P, S, H), v_pages=i32(K, P, S, H)), r"k_pages must have dtype in .*got int32"),
    "v dtype": (dict(v_pages=jnp.zeros((K, P, S, H), jnp.bfloat16)), r"v_pages must have the dtype of k_pages \(float32\); got bfloat16"),
    "head_dim": (dict(q=f32(B, N, H * 2)), r"q's head_dim must equal the cache's head_dim 16; got 32"),
    "gqa": (dict(q=f32(B, 3, H)), r"num_q_heads \(q.shape\[1\] = 3\) must be a multiple of num_kv_heads"),
    "tables rank": (dict(block_tables=i32(B)), r"block_tables must have shape i32\[num_seqs, pages_per_seq\]"),
    "tables dtype": (dict(block_tables=f32(B, 2)), r"block_tables must have dtype in \(int32\)"),
    "tables rows": (dict(block_tables=i32(B + 1, 2)), r"block_tables must have num_seqs = 3 rows .*got 4"),
    "tables cols": (dict(block_tables=i32(B, 0)), r"at least one column"),
    "lens rank": (dict(seq_lens=i32(B, 1)), r"seq_lens must have shape i32\[num_seqs\]"),
    "lens dtype": (dict(seq_lens=f32(B)), r"seq_lens must have dtype in \(int32\)"),
    "lens count": (dict(seq_lens=i32(B + 2)), r"seq_lens must have num_seqs = 3 entries; got 5"),
    "lens range": (dict(seq_lens=jnp.array([0, 5, 17], jnp.int32)), r"seq_lens must be in \[0, pages_per_seq \* page_size = 16\]; got values in \[0, 17\]"),
    "lens negative": (dict(seq_lens=jnp.array([-1, 5, 3], jnp.int32)), r"seq_lens must be in \[0, "),
    "table entry": (dict(block_tables=jnp.array([[0, 1], [2, 9], [4, 5]], jnp.int32), seq_lens=jnp.array([0, 9, 1], jnp.int32)),
                    r"block_tables entries .* in \[0, num_pages = 6\); got block_tables\[1, 1\] = 9"),
    "scale": (dict(scale=-1.0), r"scale must be a positive finite Python number or None; got -1.0"),
    "scale nan": (dict(scale=float("nan")), r"scale must be a positive finite"),
    "soft_cap": (dict(soft_cap=0.0), r"soft_cap must be a positive finite Python number or None; got 0.0"),
    "window": (dict(sliding_window=0), r"sliding_window must be a Python int >= 1 or None; got 0"),
    "window float": (dict(sliding_window=2.5), r"sliding_window must be a Python int >= 1"),
    "alibi rank": (dict(alibi_slopes=f32(N, 1)), r"alibi_slopes must have shape f32\[num_q_heads\]"),
    "alibi count": (dict(alibi_slopes=f32(N + 1)), r"alibi_slopes must have num_q_heads = 4 entries; got 5"),
    "alibi dtype": (dict(alibi_slopes=i32(N)), r"alibi_slopes must have dtype in"),
    "impl": (dict(impl="cuda"), r"impl must be one of .*got 'cuda'"),
    "interpret": (dict(interpret="yes"), r"interpret must be a bool; got 'yes'"),
    "scales missing": (dict(k_pages=q8(), v_pages=q8()), r"k_scales is required for a int8 cache"),
    "scales shape": (dict(k_pages=q8(), v_pages=q8(), k_scales=f32(K, P, S), v_scales=f32(K, P, S + 1)),
                     r"v_scales must have shape \[num_kv_heads, num_pages, page_size\] = \[2, 6, 8\]; got \[2, 6, 9\]"),
    "scales dtype": (dict(k_pages=q8(), v_pages=q8(), k_scales=jnp.zeros((K, P, S), jnp.bfloat16), v_scales=f32(K, P, S)),
                     r"k_scales must have dtype in \(float32\); got bfloat16"),
    "scales on float": (dict(k_scales=f32(K, P, S)), r"k_scales is only for int8/float8 caches; the cache dtype is float32"),
}


@pytest.mark.parametrize("case", DECODE_ERRORS)
def test_paged_decode_errors(case):
    over, msg = DECODE_ERRORS[case]
    with pytest.raises(ValueError, match=msg):
        call(**over)


def test_unavailable_kernel_is_a_clear_error(monkeypatch):
    from jpa.ops import dispatch
    monkeypatch.setitem(dispatch.KERNEL_MODULES, "triton", "jpa.pallas.no_such_kernel")
    with pytest.raises(ValueError, match=r"impl='triton' cannot serve this call: cannot import"):
        call(impl="triton")


def write_args():
    return dict(k_pages=f32(K, P, S, H), v_pages=f32(K, P, S, H), k=f32(4, K, H), v=f32(4, K, H),
                slot_mapping=jnp.array([0, 1, -1, 5], jnp.int32))


WRITE_ERRORS = {
    "k rank": (dict(k=f32(4, K * H)), r"k must have shape \[num_tokens, num_kv_heads, head_dim\]"),
    "k dtype": (dict(k=jnp.zeros((4, K, H), jnp.int8)), r"k must have dtype in"),
    "k heads": (dict(k=f32(4, K + 1, H)), r"k must have shape \[num_tokens, num_kv_heads = 2, head_dim = 16\]; got \[4, 3, 16\]"),
    "v shape": (dict(v=f32(5, K, H)), r"v must have the shape of k \[4, 2, 16\]; got \[5, 2, 16\]"),
    "slots rank": (dict(slot_mapping=i32(4, 1)), r"slot_mapping must have shape i32\[num_tokens\]"),
    "slots dtype": (dict(slot_mapping=f32(4)), r"slot_mapping must have dtype in \(int32\)"),
    "slots count": (dict(slot_mapping=i32(3)), r"slot_mapping must have num_tokens = 4 entries; got 3"),
    "slots range": (dict(slot_mapping=jnp.array([0, 1, 2, 48], jnp.int32)), r"slot_mapping entries must be < num_pages \* page_size = 48 .*got 48"),
    "cache pair": (dict(v_pages=f32(K, P, S, H * 2)), r"v_pages must have the shape of k_pages"),
}


@pytest.mark.parametrize("case", WRITE_ERRORS)
def test_write_kv_errors(case):
    args = write_args()
    over, msg = WRITE_ERRORS[case]
    args.update(over)
    with pytest.raises(ValueError, match=msg):
        jpa.write_kv(args.pop("k_pages"), args.pop("v_pages"), args.pop("k"), args.pop("v"),
                     args.pop("slot_mapping"), **args)


def test_copy_pages_errors():
    cache = jpa.KVCache.create(jpa.CacheConfig(1, 1, 8, 4, 4))
    with pytest.raises(ValueError, match=r"src must have shape i32\[num_copies\]"):
        jpa.copy_pages(cache, i32(2, 1), i32(2))
    with pytest.raises(ValueError, match=r"dst must have dtype in \(int32\)"):
        jpa.copy_pages(cache, i32(2), f32(2))
    with pytest.raises(ValueError, match=r"src and dst must have the same shape"):
        jpa.copy_pages(cache, i32(2), i32(3))


@pytest.mark.parametrize("kwargs,msg", [
    (dict(num_layers=0), r"CacheConfig.num_layers must be an int >= 1; got 0"),
    (dict(page_size=2.0), r"CacheConfig.page_size must be an int >= 1; got 2.0"),
    (dict(dtype="int32"), r"CacheConfig.dtype must be one of .*got 'int32'"),
    (dict(dtype="nonsense"), r"CacheConfig.dtype must be one of .*got 'nonsense'"),
])
def test_cache_config_errors(kwargs, msg):
    base = dict(num_layers=2, num_kv_heads=2, head_dim=8, num_pages=4, page_size=4)
    base.update(kwargs)
    with pytest.raises(ValueError, match=msg):
        jpa.CacheConfig(**base)


def test_cache_from_memory_too_small():
    with pytest.raises(ValueError, match=r"memory_bytes=100 holds no page: one page costs"):
        jpa.CacheConfig.from_memory(100, num_layers=2, num_kv_heads=2, head_dim=8)


@pytest.mark.parametrize("fn", ["paged_decode", "write_kv", "ragged_paged_attention"])
def test_stacked_pool_layer_errors(fn):
    """A stacked [L, K, P, S_p, H] pool needs an integer layer in [0, L); a per-layer pool takes none."""
    stacked, single = jnp.zeros((3, 2, 4, 8, 16)), jnp.zeros((2, 4, 8, 16))
    i32 = lambda *s: jnp.zeros(s, jnp.int32)
    calls = {
        "paged_decode": lambda k, **kw: jpa.paged_decode(jnp.zeros((2, 4, 16)), k, k, i32(2, 2), i32(2), **kw),
        "write_kv": lambda k, **kw: jpa.write_kv(k, k, jnp.zeros((2, 2, 16)), jnp.zeros((2, 2, 16)), i32(2), **kw),
        "ragged_paged_attention": lambda k, **kw: jpa.ragged_paged_attention(
            jnp.zeros((4, 4, 16)), k, k, i32(2, 2), jnp.ones(2, jnp.int32), jnp.array([0, 1, 2], jnp.int32), 2, **kw),
    }
    call = calls[fn]
    with pytest.raises(ValueError, match=r"stacked .* pool .*: pass layer="):
        call(stacked)
    with pytest.raises(ValueError, match=r"layer must be in \[0, num_layers = 3\).*got 3"):
        call(stacked, layer=3)
    with pytest.raises(ValueError, match=r"layer must be an int or an integer scalar array"):
        call(stacked, layer=1.0)
    with pytest.raises(ValueError, match=r"layer= is for a stacked"):
        call(single, layer=0)
    call(stacked, layer=jnp.int32(2))  # a valid layer passes
