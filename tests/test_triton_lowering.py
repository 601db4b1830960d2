"""The Triton-backend decode kernel lowers for CUDA (abstract A100 and H100, no GPU needed), and the
page pools reach the Triton custom call untouched: no slice, copy or gather of the cache in front.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

import jpa
from jpa.pallas.triton import decode as triton_decode
from jpa.pallas.triton import tuning as triton_tuning

TRITON_CALL = "__gpu$xla.gpu.triton"
A100 = ("NVIDIA A100-SXM4-80GB", 108)
H100 = ("NVIDIA H100 80GB HBM3", 132)
# Ops that would mean the cache is copied or re-laid-out before the kernel sees it.
FORBIDDEN = ("slice", "dynamic_slice", "gather", "copy", "pad", "transpose", "reshape", "convert",
             "bitcast_convert", "concatenate", "select", "broadcast_in_dim", "dynamic_update_slice")


def lower_text(fn, args, device):
    kind, cores = device
    dev = AbstractDevice(device_kind=kind, num_cores=cores, platform="cuda")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=dev)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def tensor_type(shape, dtype):
    names = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "int8": "i8",
             "float8_e4m3fn": "f8E4M3FN", "float8_e5m2": "f8E5M2"}
    return "tensor<" + "x".join(map(str, shape)) + "x" + names[dtype] + ">"


def assert_pools_untouched(text, pool_t):
    """Asserts the page pools (type `pool_t`) go from main's arguments to the kernel unchanged."""
    # Every line that mentions the pool's type is a function signature, a call, or the kernel.
    for line in text.splitlines():
        if pool_t not in line:
            continue
        assert ("func.func" in line or re.search(r"\bcall @", line) or TRITON_CALL in line
                or line.strip().startswith("return")), f"the page pool is touched by: {line[:200]}"
        op = re.search(r"stablehlo\.(\w+)", line)
        assert op is None or op.group(1) not in FORBIDDEN, line[:200]

    # The kernel's pool operands, and the pool operands of every call on the way down from main,
    # are function arguments: main's own pool arguments, never a value computed from them.
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert main.count(pool_t) == 2
    for line in text.splitlines():
        m = re.search(r"(?:call @[\w$.]+|custom_call @[\w$.]+)\(([^)]*)\).*:\s*\((.*?)\)\s*->", line)
        if m is None or pool_t not in m.group(2):
            continue
        operands = m.group(1).split(", ")
        types = re.findall(r"tensor<[^>]*>", m.group(2))
        assert len(operands) == len(types), line[:200]
        pool_operands = [o for o, t in zip(operands, types) if t == pool_t]
        assert len(pool_operands) == 2, line[:200]
        assert all(re.fullmatch(r"%arg\d+", o) for o in pool_operands), pool_operands


CONFIGS = [
    # (device, q dtype, cache dtype, head_dim, pages_per_seq, features)
    (A100, "bfloat16", "bfloat16", 128, 64, {}),
    (A100, "float16", "int8", 80, 256, dict(soft_cap=30.0, alibi=True, sliding_window=1000)),
    (A100, "float32", "float8_e5m2", 192, 32, {}),
    (H100, "bfloat16", "float8_e4m3fn", 128, 2048, dict(sliding_window=4096)),
    (H100, "bfloat16", "bfloat16", 96, 16, dict(alibi=True)),
]


def _config_id(c):
    device, q_dtype, cache_dtype, head_dim, pages_per_seq, feats = c
    return "-".join([device[0].split()[1][:4], q_dtype, cache_dtype, f"H{head_dim}",
                     f"pages{pages_per_seq}", *sorted(feats)])


pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


@pytest.mark.parametrize("device,q_dtype,cache_dtype,head_dim,pages_per_seq,feats", CONFIGS,
                         ids=[_config_id(c) for c in CONFIGS])
def test_lowers_with_whole_page_pools(device, q_dtype, cache_dtype, head_dim, pages_per_seq, feats):
    num_seqs, num_q_heads, num_kv_heads, page_size, num_pages = 4, 32, 8, 16, 777
    quantized = cache_dtype in ("int8", "float8_e4m3fn", "float8_e5m2")
    pool = jax.ShapeDtypeStruct((num_kv_heads, num_pages, page_size, head_dim), cache_dtype)
    scales = jax.ShapeDtypeStruct((num_kv_heads, num_pages, page_size), jnp.float32)
    args = [jax.ShapeDtypeStruct((num_seqs, num_q_heads, head_dim), q_dtype), pool, pool,
            jax.ShapeDtypeStruct((num_seqs, pages_per_seq), jnp.int32),
            jax.ShapeDtypeStruct((num_seqs,), jnp.int32)]
    if quantized:
        args += [scales, scales]
    if feats.get("alibi"):
        args += [jax.ShapeDtypeStruct((num_q_heads,), jnp.float32)]

    def step(q, k_pages, v_pages, tables, lens, *rest):
        rest = list(rest)
        k_scales, v_scales = (rest.pop(0), rest.pop(0)) if quantized else (None, None)
        slopes = rest.pop(0) if feats.get("alibi") else None
        return jpa.paged_decode(q, k_pages, v_pages, tables, lens, k_scales=k_scales,
                                v_scales=v_scales, alibi_slopes=slopes,
                                soft_cap=feats.get("soft_cap"),
                                sliding_window=feats.get("sliding_window"), impl="triton")

    text = lower_text(step, args, device)
    calls = [line for line in text.splitlines() if TRITON_CALL in line]
    assert len(calls) == 1, f"expected one Triton custom call, found {len(calls)}"
    call = calls[0]

    assert_pools_untouched(text, tensor_type(pool.shape, cache_dtype))

    # Split-K shows up as the grid's z extent: long contexts are partitioned, short are not.
    grid_z = int(re.search(r"grid_z = (\d+)", call).group(1))
    max_tokens = pages_per_seq * page_size
    assert (grid_z > 1) == (max_tokens > triton_tuning.decode_tuning().partition_tokens)


def test_checker_catches_a_sliced_pool():
    """The pool check is not vacuous: a cache sliced in front of the kernel is reported."""
    pool = jax.ShapeDtypeStruct((2, 64, 16, 128), jnp.bfloat16)
    args = (jax.ShapeDtypeStruct((2, 8, 128), jnp.bfloat16), pool, pool,
            jax.ShapeDtypeStruct((2, 4), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32))

    def sliced(q, k_pages, v_pages, tables, lens):  # docs/architecture.md's first pitfall
        return jpa.paged_decode(q, k_pages[:, :32], v_pages[:, :32], tables, lens, impl="triton")

    def whole(q, k_pages, v_pages, tables, lens):
        return jpa.paged_decode(q, k_pages, v_pages, tables, lens, impl="triton")

    pool_t = tensor_type(pool.shape, "bfloat16")
    assert_pools_untouched(lower_text(whole, args, A100), pool_t)
    with pytest.raises(AssertionError):
        assert_pools_untouched(lower_text(sliced, args, A100), pool_t)


def test_lowers_for_a_pool_over_4gb():
    """A pool larger than 2**32 bytes (64-bit pointer offsets) lowers; nothing is allocated here."""
    pool = jax.ShapeDtypeStruct((8, 140_000, 16, 128), jnp.bfloat16)  # 4.6 GB per pool
    args = (jax.ShapeDtypeStruct((64, 32, 128), jnp.bfloat16), pool, pool,
            jax.ShapeDtypeStruct((64, 2048), jnp.int32), jax.ShapeDtypeStruct((64,), jnp.int32))

    def step(q, k_pages, v_pages, tables, lens):
        return jpa.paged_decode(q, k_pages, v_pages, tables, lens, impl="triton")

    text = lower_text(step, args, H100)
    assert text.count(TRITON_CALL) == 1
    assert_pools_untouched(text, tensor_type(pool.shape, "bfloat16"))
