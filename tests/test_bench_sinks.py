"""Attention sinks over a grid (bench tier: interpret mode is slow on CPU). Every decode kernel that
takes sinks (Mosaic Hopper, Mosaic mma.sync for Ampere/Ada/Blackwell, Triton) in Pallas interpret
mode, with split-K, against the float64 oracle with an explicit sink column; the plain-JAX ragged
path over both its row paths. The fast cases are in tests/test_sinks.py."""

import jax.numpy as jnp
import numpy as np
import pytest

from jpa.ops.ragged import ragged_paged_attention_xla
from jpa.ops.reference import paged_decode_xla
from jpa.testing.kernel_cases import (Case, RaggedCase, make_inputs, make_ragged_inputs,
                                      np_ragged_reference, np_reference, tolerance)

pytestmark = pytest.mark.bench

BF16 = dict(q_dtype="bfloat16", cache_dtype="bfloat16")
F16 = dict(q_dtype="float16", cache_dtype="float16")

CASES = [
    Case((0, 1, 8, 9, 40), num_q_heads=2, num_kv_heads=2, head_dim=80, page_size=8,
         pages_per_seq=5, sinks=0.0, **BF16),
    Case((16, 17, 64, 65, 200), num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
         pages_per_seq=13, share_page=True, sinks=2.0, seed=1, **BF16),
    Case((33, 64, 1), num_q_heads=8, num_kv_heads=1, head_dim=64, page_size=32, pages_per_seq=3,
         soft_cap=5.0, sinks=-1.0, seed=2, **F16),
    Case((0, 1, 25, 130), num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
         pages_per_seq=9, soft_cap=10.0, alibi=True, sliding_window=19, sinks=0.5, seed=3, **BF16),
    Case((0, 3, 150), num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, pages_per_seq=10,
         sinks=1e4, seed=4, **F16),
    Case((0, 3, 150), num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, pages_per_seq=10,
         sinks=-1e4, seed=5, **BF16),
]


def _mosaic(*a, **o):
    from jpa.pallas.mosaic import decode
    return decode._paged_decode(*a, **o, interpret=True, blocks_per_part=1)


def _ampere(*a, **o):
    from jpa.pallas.mosaic import decode_ampere
    o = {k: v for k, v in o.items() if k not in ("k_scales", "v_scales")}  # 16-bit caches only
    for tma in (False, True):
        out = decode_ampere.paged_decode(*a, **o, interpret=True, blocks_per_part=1, tma=tma)
    return out


def _triton(*a, **o):
    from jpa.pallas.triton import decode
    return decode.paged_decode(*a, **o, interpret=True, partition_tokens=32)


@pytest.mark.soak
@pytest.mark.parametrize("kernel", [_mosaic, _ampere, _triton], ids=["mosaic", "ampere", "triton"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_decode_kernels_with_sinks(kernel, case):
    args, opts = make_inputs(case)
    from jpa.ops import dispatch
    from jpa.ops.decode import decode_spec
    spec = decode_spec(args[0], args[1], args[3], soft_cap=opts["soft_cap"],
                       alibi_slopes=opts["alibi_slopes"], sliding_window=opts["sliding_window"],
                       sinks=opts["sinks"])
    impl, cc = {"_mosaic": ("mosaic", 9.0), "_ampere": ("mosaic", 8.0), "_triton": ("triton", 9.0)}[kernel.__name__]
    reason = dispatch.unsupported_reason(impl, spec, cc)
    if reason is not None:  # a configuration the kernel refuses (sinks are never the reason)
        assert "sink" not in reason
        pytest.skip(reason)
    want = np_reference(*args, **opts)
    got = np.asarray(kernel(*args, **opts).astype(jnp.float32), np.float64)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=tolerance(case), rtol=0)
    xla = np.asarray(paged_decode_xla(*args, **opts).astype(jnp.float32), np.float64)
    np.testing.assert_allclose(got, xla, atol=tolerance(case), rtol=0)


@pytest.mark.parametrize("tile_tokens", [None, 8])
@pytest.mark.parametrize("sinks", [0.0, 3.0, -50.0])
def test_ragged_reference_with_sinks(tile_tokens, sinks):
    case = RaggedCase((1, 40, 70, 3), q_lens=(1, 17, 30, 3), num_tokens=64, max_num_seqs=6,
                      num_q_heads=8, num_kv_heads=2, head_dim=32, page_size=16, pages_per_seq=6,
                      soft_cap=20.0, alibi=True, sinks=sinks, seed=int(abs(sinks)) + 7)
    args, opts = make_ragged_inputs(case)
    want = np_ragged_reference(*args, **opts)
    got = np.asarray(ragged_paged_attention_xla(*args, tile_tokens=tile_tokens, **opts))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=tolerance(case), rtol=0)


RAGGED_CASES = [
    RaggedCase((1, 40, 70, 3), q_lens=(1, 17, 30, 3), num_tokens=64, max_num_seqs=6,
               num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, pages_per_seq=6,
               soft_cap=20.0, alibi=True, sinks=1.0, seed=41, **BF16),
    RaggedCase((20, 90), q_lens=(20, 33), num_tokens=56, num_q_heads=4, num_kv_heads=1,
               head_dim=128, page_size=32, pages_per_seq=3, sliding_window=25, sinks=-2.0,
               seed=42, **F16),
]


@pytest.mark.parametrize("impl", ["mosaic", pytest.param("triton", marks=pytest.mark.soak)])
@pytest.mark.parametrize("case", RAGGED_CASES, ids=str)
def test_ragged_kernels_with_sinks(impl, case):
    import jpa
    args, opts = make_ragged_inputs(case)
    want = np_ragged_reference(*args, **opts)
    got = np.asarray(jpa.ragged_paged_attention(*args, **opts, impl=impl, interpret=True)
                     .astype(jnp.float32), np.float64)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=tolerance(case), rtol=0)
