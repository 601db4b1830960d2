"""The Mosaic GPU decode kernel lowers for an H100 (sm_90a) on this CPU-only machine, feeds the
page pools to the kernel whole (no slice or copy of the cache in front of it), and every
configuration it cannot serve is refused with a ValueError that says why."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

import jpa
from jpa.pallas.mosaic import decode as mosaic_decode
from jpa.pallas.mosaic import tuning as mosaic_tuning
from jpa.pallas.spec import DecodeSpec

H100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")

LOWERING_CONFIGS = [
    # (dtype, num_q_heads, num_kv_heads, head_dim, page_size, options)
    ("bfloat16", 32, 8, 128, 16, {}),
    ("bfloat16", 8, 1, 128, 32, {"soft_cap": 30.0}),
    ("float16", 4, 4, 64, 8, {"alibi": True, "sliding_window": 100, "soft_cap": 5.0}),
    ("bfloat16", 16, 2, 192, 64, {"sliding_window": 512}),
    ("float16", 8, 2, 128, 128, {}),
    ("bfloat16", 4, 1, 256, 64, {"alibi": True}),
    ("float16", 8, 2, 80, 16, {}),
    ("bfloat16", 12, 4, 112, 8, {"sliding_window": 64}),
    ("bfloat16", 16, 4, 128, 32, {"cache_dtype": "int8"}),
    ("float16", 8, 2, 96, 32, {"cache_dtype": "int8", "alibi": True}),
    ("float16", 8, 8, 64, 64, {"cache_dtype": "float8_e4m3fn", "soft_cap": 30.0}),
    ("bfloat16", 8, 2, 128, 128, {"cache_dtype": "float8_e5m2", "sliding_window": 300}),
]


def lower_for_h100(fn, *args):
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=H100)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("dtype,num_q_heads,num_kv_heads,head_dim,page_size,options",
                         LOWERING_CONFIGS, ids=lambda x: str(x))
def test_lowers_for_h100_without_copying_the_cache(dtype, num_q_heads, num_kv_heads, head_dim,
                                                   page_size, options):
    num_seqs, num_pages, pages_per_seq = 8, 96, 24
    sds = jax.ShapeDtypeStruct
    cache_dtype = options.get("cache_dtype", dtype)
    quantized = cache_dtype != dtype
    pool = sds((num_kv_heads, num_pages, page_size, head_dim), cache_dtype)
    args = [sds((num_seqs, num_q_heads, head_dim), dtype), pool, pool,
            sds((num_seqs, pages_per_seq), jnp.int32), sds((num_seqs,), jnp.int32),
            sds((num_q_heads,), jnp.float32)]
    alibi = options.get("alibi", False)
    if quantized:
        args += [sds((num_kv_heads, num_pages, page_size), jnp.float32)] * 2

    def f(q, k_pages, v_pages, block_tables, seq_lens, slopes, *scales):
        return jpa.paged_decode(q, k_pages, v_pages, block_tables, seq_lens, impl="mosaic",
                                soft_cap=options.get("soft_cap"),
                                sliding_window=options.get("sliding_window"),
                                alibi_slopes=slopes if alibi else None,
                                k_scales=scales[0] if quantized else None,
                                v_scales=scales[1] if quantized else None)

    text = lower_for_h100(f, *args)
    calls = [l for l in text.splitlines() if "stablehlo.custom_call" in l]
    kernel_calls = [l for l in calls if re.search(r"custom_call @mosaic_gpu", l)]
    assert len(kernel_calls) == 1, calls

    # The pools' (and scales') tensor type appears only in function signatures, calls and the
    # kernel call: no slice, dynamic_slice, gather, copy, transpose or reshape of the cache.
    el = {"bfloat16": "bf16", "float16": "f16", "int8": "i8", "float8_e4m3fn": "f8E4M3FN",
          "float8_e5m2": "f8E5M2"}[cache_dtype]
    pool_type = f"tensor<{num_kv_heads}x{num_pages}x{page_size}x{head_dim}x{el}>"
    scales_type = f"tensor<{num_kv_heads}x{num_pages}x{page_size}xf32>"
    for line in text.splitlines():
        if pool_type in line or (quantized and scales_type in line):
            assert re.search(r"func\.func|\bcall @|custom_call @mosaic_gpu|return", line), line

    # The kernel's operands 1 and 2 (k_pages, v_pages) are the enclosing function's own
    # arguments, i.e. the buffers the caller passed in.
    operands = re.search(r"custom_call @mosaic_gpu\w*\(([^)]*)\)", kernel_calls[0]).group(1)
    operands = [o.strip() for o in operands.split(",")]
    assert all(re.fullmatch(r"%arg\d+", o) for o in operands[1:3]), operands
    # ... and their types are the pool's.
    assert kernel_calls[0].count(pool_type) >= 2


def _call(q_dtype="bfloat16", cache_dtype=None, num_q_heads=4, num_kv_heads=2, head_dim=64,
          page_size=16, quantized=False):
    cache_dtype = cache_dtype or q_dtype
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, num_q_heads, head_dim)), q_dtype)
    shape = (num_kv_heads, 5, page_size, head_dim)
    pages = jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(cache_dtype)
    scales = jnp.ones(shape[:3], jnp.float32) if quantized else None
    tables = jnp.array([[0, 1], [2, 3]], jnp.int32)
    lens = jnp.array([3, page_size + 1], jnp.int32)
    return jpa.paged_decode(q, pages, pages, tables, lens, k_scales=scales, v_scales=scales,
                            impl="mosaic", interpret=True)


@pytest.mark.parametrize("kwargs,message", [
    (dict(q_dtype="float32"), "q dtype float32 is not supported: WGMMA has no exact float32"),
    (dict(q_dtype="bfloat16", cache_dtype="float32"),
     r"the cache dtype \(float32\) must equal q's"),
    (dict(q_dtype="float16", cache_dtype="int8", quantized=True),
     "page_size = 16 is too small for a quantized cache"),
    (dict(q_dtype="float32", cache_dtype="float8_e4m3fn", quantized=True, page_size=32),
     "q dtype float32 is not supported"),
    (dict(head_dim=120), "head_dim = 120 is not supported: it must be a multiple of 16"),
    (dict(head_dim=80, cache_dtype="int8", quantized=True, page_size=32),
     "head_dim = 80 is not supported with an 8-bit cache: it must be a multiple of 32"),
    (dict(head_dim=320), "head_dim = 320 is not supported"),
    (dict(page_size=24), "page_size = 24 is not supported: it must divide 64"),
    (dict(page_size=4), "page_size = 4 is not supported"),
    (dict(page_size=96), "page_size = 96 is not supported"),
    (dict(num_q_heads=130, num_kv_heads=2), "q_per_kv = 65 exceeds the 64-row WGMMA q tile"),
    (dict(head_dim=256, cache_dtype="int8", quantized=True, page_size=32),
     "head_dim = 256 with an 8-bit cache is not supported"),
], ids=lambda x: str(x))
def test_unsupported_configurations_raise(kwargs, message):
    with pytest.raises(ValueError, match=r"impl='mosaic' cannot serve this call: " + message):
        _call(**kwargs)


def test_wgmma_refusal_of_head_dim_256_with_an_8bit_cache_names_what_serves_it():
    """The WGMMA kernel refuses head_dim 256 with an 8-bit cache (it spills); its message names the
    kernel that serves it on Hopper, the mma.sync one with TMA copies, and that one does take it."""
    for cache in ("int8", "float8_e5m2"):
        spec = DecodeSpec("bfloat16", cache, 32, 8, 256, 32, 16, False, False, False, True, num_pages=1024)
        assert mosaic_decode.wgmma_reason(spec, 9.0).endswith("on Hopper the mma.sync kernel (TMA copies) serves it")
        assert mosaic_decode.runs_mma(spec, 9.0) and mosaic_decode.unsupported_reason(spec, 9.0) is None


def test_smem_overflow_is_refused():
    """With 64-token blocks every accepted shape fits an H100's SMEM (head_dim 256: 2 slots in
    168 KiB); a smaller budget shows the refusal that keeps an overflow out of the compile."""
    spec = DecodeSpec("bfloat16", "bfloat16", 8, 2, 256, 128, 4, False, False, False, False)
    assert mosaic_decode.unsupported_reason(spec, 9.0) is None
    small = dataclasses.replace(mosaic_tuning.lookup(9.0, 256), smem_budget=96 * 1024)
    assert "needs more than 96 KiB of SMEM" in mosaic_decode.unsupported_reason(spec, 9.0, tuning=small)


def test_partitions_fill_an_h100():
    # Few sequences: split-K gives >= 2 programs per SM (132 SMs); many: one partition each.
    assert 1 * 8 * mosaic_decode.num_partitions(1, 8, 64) >= 2 * 132
    assert mosaic_decode.num_partitions(1, 8, 4) == 4  # at most one block per partition
    assert mosaic_decode.num_partitions(256, 8, 64) == 1
