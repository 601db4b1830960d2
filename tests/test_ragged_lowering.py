"""The Triton-backend ragged attention lowers for CUDA (abstract A100 and H100, no GPU needed) with
the page pools reaching both Triton custom calls untouched: the decode kernel for every sequence's
last row (split-K on long contexts) and the ragged kernel for the other rows.
"""

import re

import jax
import jax.numpy as jnp
import pytest

import jpa
from jpa.pallas.triton import decode as triton_decode
from jpa.pallas.triton import ragged as triton_ragged
from test_triton_lowering import (A100, H100, TRITON_CALL, assert_pools_untouched, lower_text,
                                  tensor_type)

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

CONFIGS = [
    # (device, q dtype, cache dtype, q_per_kv, head_dim, page_size, features)
    (A100, "bfloat16", "bfloat16", 4, 128, 16, {}),
    (A100, "float16", "int8", 3, 80, 32, dict(soft_cap=30.0, alibi=True, sliding_window=1000)),
    (A100, "float32", "float8_e5m2", 8, 64, 8, {}),
    (H100, "bfloat16", "float8_e4m3fn", 4, 128, 16, dict(sliding_window=4096)),
    (H100, "bfloat16", "bfloat16", 1, 256, 128, dict(alibi=True)),
    (H100, "float16", "float16", 16, 64, 64, dict(soft_cap=50.0)),
]


def _config_id(c):
    device, q_dtype, cache_dtype, q_per_kv, head_dim, page_size, feats = c
    return "-".join([device[0].split()[1][:4], q_dtype, cache_dtype, f"G{q_per_kv}",
                     f"H{head_dim}", f"S{page_size}", *sorted(feats)])


@pytest.mark.parametrize("device,q_dtype,cache_dtype,q_per_kv,head_dim,page_size,feats", CONFIGS,
                         ids=[_config_id(c) for c in CONFIGS])
def test_lowers_with_whole_page_pools(device, q_dtype, cache_dtype, q_per_kv, head_dim, page_size,
                                      feats):
    num_tokens, max_num_seqs, num_kv_heads, num_pages, pages_per_seq = 512, 64, 8, 777, 128
    num_q_heads = num_kv_heads * q_per_kv
    quantized = cache_dtype in ("int8", "float8_e4m3fn", "float8_e5m2")
    pool = jax.ShapeDtypeStruct((num_kv_heads, num_pages, page_size, head_dim), cache_dtype)
    scales = jax.ShapeDtypeStruct((num_kv_heads, num_pages, page_size), jnp.float32)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    args = [jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), q_dtype), pool, pool,
            i32(max_num_seqs, pages_per_seq), i32(max_num_seqs), i32(max_num_seqs + 1), i32()]
    if quantized:
        args += [scales, scales]
    if feats.get("alibi"):
        args += [jax.ShapeDtypeStruct((num_q_heads,), jnp.float32)]

    def step(q, k_pages, v_pages, tables, lens, cu, num_seqs, *rest):
        rest = list(rest)
        k_scales, v_scales = (rest.pop(0), rest.pop(0)) if quantized else (None, None)
        slopes = rest.pop(0) if feats.get("alibi") else None
        return jpa.ragged_paged_attention(
            q, k_pages, v_pages, tables, lens, cu, num_seqs, k_scales=k_scales, v_scales=v_scales,
            alibi_slopes=slopes, soft_cap=feats.get("soft_cap"),
            sliding_window=feats.get("sliding_window"), impl="triton")

    text = lower_text(step, args, device)
    assert_pools_untouched(text, tensor_type(pool.shape, cache_dtype))
    calls = {re.search(r'name = "(jpa_\w+?)_', line).group(1): line
             for line in text.splitlines() if TRITON_CALL in line}
    assert sorted(calls) == ["jpa_paged", "jpa_ragged"], list(calls)
    grid = {name: [int(re.search(rf"grid_{d} = (\d+)", line).group(1)) for d in "xyz"]
            for name, line in calls.items()}
    # Ragged kernel: (tile slots, kv heads), sized from the static shapes only.
    p = triton_ragged.plan(num_tokens, max_num_seqs, q_per_kv, head_dim, page_size, pages_per_seq)
    assert grid["jpa_ragged"] == [p.num_tiles, num_kv_heads, 1]
    # Decode kernel: (max_num_seqs, kv heads, split-K partitions as its plan says).
    d = triton_decode.plan(max_num_seqs, num_kv_heads, q_per_kv, head_dim, page_size, pages_per_seq)
    assert grid["jpa_paged"] == [max_num_seqs, num_kv_heads, d.num_partitions]


@pytest.mark.parametrize("device,call", [(H100, "mosaic_gpu"), (A100, None)], ids=["H100", "A100"])
def test_auto_picks_the_kernel_for_a_gpu_target(device, call):
    """impl="auto" resolves for the device compiled for (here an abstract GPU), not the CPU host:
    Mosaic GPU on Hopper; on Ampere plain JAX (Triton is not in auto's ladder there), because
    outside the compile tier (no `deviceless.mosaic_arch`) Mosaic would lower for sm_90
    (`aot_unsupported_reason`, as paged_decode; test_mosaic_ampere lowers the A100's Mosaic ragged
    op under mosaic_arch)."""
    pool = jax.ShapeDtypeStruct((2, 64, 16, 128), jnp.bfloat16)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    args = (jax.ShapeDtypeStruct((64, 8, 128), jnp.bfloat16), pool, pool, i32(8, 4), i32(8),
            i32(9), i32())

    def step(*a):
        return jpa.ragged_paged_attention(*a, impl="auto")

    with pytest.warns(UserWarning if call else RuntimeWarning,
                      match="cannot be self-checked" if call else "would lower for sm_90.*reference path"):
        text = lower_text(step, args, device)
    assert TRITON_CALL not in text
    assert ("mosaic_gpu" in text) == (call == "mosaic_gpu")


def test_split_k_for_long_decode_contexts():
    """Few sequences with long contexts: the last rows' decode kernel is split into partitions."""
    pool = jax.ShapeDtypeStruct((2, 4096, 16, 128), jnp.bfloat16)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    args = (jax.ShapeDtypeStruct((64, 8, 128), jnp.bfloat16), pool, pool, i32(8, 2048), i32(8),
            i32(9), i32())

    def step(*a):
        return jpa.ragged_paged_attention(*a, impl="triton")

    text = lower_text(step, args, H100)
    assert_pools_untouched(text, tensor_type(pool.shape, "bfloat16"))
    decode = next(line for line in text.splitlines() if 'name = "jpa_paged_decode' in line)
    assert int(re.search(r"grid_z = (\d+)", decode).group(1)) == 2048 * 16 // 1024


MOSAIC_CONFIGS = [
    # (q dtype, cache dtype, q_per_kv, head_dim, page_size, features)
    ("bfloat16", "bfloat16", 4, 128, 16, {}),
    ("float16", "float16", 3, 64, 8, dict(alibi=True, sliding_window=100, soft_cap=5.0)),
    ("bfloat16", "int8", 8, 128, 32, dict(sliding_window=512)),
    ("float16", "float8_e4m3fn", 1, 192, 64, {}),  # 8-bit caches above head_dim 192 are refused
]


@pytest.mark.parametrize("q_dtype,cache_dtype,q_per_kv,head_dim,page_size,feats", MOSAIC_CONFIGS,
                         ids=lambda x: str(x))
def test_mosaic_lowers_for_h100_with_whole_page_pools(q_dtype, cache_dtype, q_per_kv, head_dim,
                                                      page_size, feats):
    num_tokens, max_num_seqs, num_kv_heads, num_pages, pages_per_seq = 256, 32, 4, 300, 64
    num_q_heads = num_kv_heads * q_per_kv
    quantized = cache_dtype != q_dtype
    pool = jax.ShapeDtypeStruct((num_kv_heads, num_pages, page_size, head_dim), cache_dtype)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    args = [jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), q_dtype), pool, pool,
            i32(max_num_seqs, pages_per_seq), i32(max_num_seqs), i32(max_num_seqs + 1), i32(),
            jax.ShapeDtypeStruct((num_q_heads,), jnp.float32)]
    if quantized:
        args += [jax.ShapeDtypeStruct((num_kv_heads, num_pages, page_size), jnp.float32)] * 2

    def step(q, k_pages, v_pages, tables, lens, cu, num_seqs, slopes, *scales):
        return jpa.ragged_paged_attention(
            q, k_pages, v_pages, tables, lens, cu, num_seqs, impl="mosaic",
            alibi_slopes=slopes if feats.get("alibi") else None, soft_cap=feats.get("soft_cap"),
            sliding_window=feats.get("sliding_window"),
            k_scales=scales[0] if quantized else None, v_scales=scales[1] if quantized else None)

    text = lower_text(step, args, H100)
    kernel_calls = [line for line in text.splitlines() if re.search(r"custom_call @mosaic_gpu", line)]
    assert len(kernel_calls) == 2, len(kernel_calls)  # the decode kernel and the tile kernel
    pool_t = tensor_type(pool.shape, cache_dtype)
    for line in text.splitlines():
        if pool_t in line:
            assert re.search(r"func\.func|\bcall @|custom_call @mosaic_gpu|return", line), line[:200]
    for call in kernel_calls:
        operands = re.search(r"custom_call @mosaic_gpu\w*\(([^)]*)\)", call).group(1).split(", ")
        assert all(re.fullmatch(r"%arg\d+", o) for o in operands[1:3]), operands
        assert call.count(pool_t) >= 2


@pytest.mark.parametrize("q_per_kv,rows,calls", [
    (4, 5, 1),
    pytest.param(4, 17, 2, marks=pytest.mark.bench),
    (3, 21, 1),
])
def test_mosaic_verify_rows_read_the_kv_once(q_per_kv, rows, calls):
    """Under `query_rows_at_most(rows)` (the engine's verify pass: k + 1 rows a sequence) the Mosaic
    ragged op on an H100 is ONE kernel call, the multi-row decode kernel that reads each sequence's
    KV once, when rows x q_per_kv fits its 64-row q tile; else the decode kernel for the last rows
    and the tile kernel for the others (two reads of the KV)."""
    from jpa.ops.ragged import query_rows_at_most
    num_tokens, max_num_seqs, num_kv_heads, num_pages, pages_per_seq, head_dim = 64, 8, 2, 64, 8, 128
    pool = jax.ShapeDtypeStruct((3, num_kv_heads, num_pages, 16, head_dim), "bfloat16")  # stacked, 3 layers
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    args = [jax.ShapeDtypeStruct((num_tokens, num_kv_heads * q_per_kv, head_dim), "bfloat16"), pool, pool,
            i32(max_num_seqs, pages_per_seq), i32(max_num_seqs), i32(max_num_seqs + 1), i32(), i32()]

    def step(q, k_pages, v_pages, tables, lens, cu, num_seqs, layer):
        with query_rows_at_most(rows):
            return jpa.ragged_paged_attention(q, k_pages, v_pages, tables, lens, cu, num_seqs, impl="mosaic",
                                              layer=layer)

    text = lower_text(step, args, H100)
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == calls
