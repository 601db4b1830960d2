"""Attention sinks (gpt-oss): a learned logit per q head that joins every softmax as one more
column with no value. The plain-JAX paths and the decode kernels (Pallas interpret mode, split-K
with several partitions: the sink is folded in at the combine) against the float64 oracle with an
explicit extra column, on fresh random inputs; the ragged kernels (the sink folded into each tile
row's final state); a kernel that refuses sinks is passed over by `auto`. Larger grids, and the
Mosaic mma.sync (Ampere/Ada/Blackwell) decode kernel: tests/test_bench_sinks.py."""

import jax.numpy as jnp
import numpy as np
import pytest

import jpa
from jpa.ops import dispatch
from jpa.ops.ragged import RAGGED, ragged_paged_attention_xla, ragged_spec
from jpa.ops.reference import paged_decode_xla
from jpa.testing.kernel_cases import (Case, RaggedCase, make_inputs, make_ragged_inputs,
                                      np_ragged_reference, np_reference, tolerance)

# Lengths 0 (all weight on the sink: output 0), 1, a page multiple and more than one chunk.
REF_CASES = [
    Case((0, 1, 16, 37), num_q_heads=4, num_kv_heads=2, head_dim=32, sinks=0.0, seed=11),
    Case((5, 0, 40), num_q_heads=8, num_kv_heads=2, head_dim=16, page_size=8, pages_per_seq=6,
         soft_cap=5.0, alibi=True, sliding_window=9, share_page=True, sinks=1.5, seed=12),
    # Sinks far above / below every logit: every weight on the sink (0) / none on it (no sink).
    Case((3, 29), num_q_heads=2, num_kv_heads=1, head_dim=16, sinks=1e4, seed=13),
    Case((3, 29), num_q_heads=2, num_kv_heads=1, head_dim=16, sinks=-1e4, seed=13),
    Case((0, 7), num_q_heads=2, num_kv_heads=2, head_dim=16, sinks=-1e29, seed=14),
]


@pytest.mark.parametrize("case", REF_CASES, ids=str)
def test_decode_reference_matches_oracle(case):
    args, opts = make_inputs(case)
    want = np_reference(*args, **opts)
    got = np.asarray(jpa.paged_decode(*args, **opts, impl="xla"), np.float64)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=tolerance(case), rtol=0)
    lens = np.asarray(args[4])
    assert not np.abs(got[lens == 0]).any()  # length 0: all weight on the sink
    # The sink matters (a bug that dropped it would pass the oracle only by accident).
    if abs(case.sinks) < 100:
        no_sink = {k: v for k, v in opts.items() if k != "sinks"}
        plain = np.asarray(jpa.paged_decode(*args, **no_sink, impl="xla"), np.float64)
        assert np.abs(plain - want).max() > 100 * tolerance(case)


def test_extreme_sinks():
    case = Case((3, 29), num_q_heads=2, num_kv_heads=1, head_dim=16, seed=13)
    args, opts = make_inputs(case)
    plain = np.asarray(paged_decode_xla(*args, **opts), np.float64)
    for sink, want in ((1e4, 0.0 * plain), (3e38, 0.0 * plain), (-1e4, plain), (-3e38, plain)):
        got = np.asarray(paged_decode_xla(*args, **opts, sinks=jnp.full((2,), sink, jnp.float32)))
        assert np.isfinite(got).all(), sink
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0, err_msg=str(sink))


@pytest.mark.parametrize("tile_tokens", [None, 4])
def test_ragged_reference_matches_oracle(tile_tokens):
    # A decode token, a chunk from position 0, a chunk after a cached prefix, a dead slot.
    case = RaggedCase((9, 6, 30), q_lens=(1, 6, 11), num_tokens=20, max_num_seqs=4,
                      num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=8, pages_per_seq=4,
                      sliding_window=13, sinks=0.5, seed=21)
    args, opts = make_ragged_inputs(case)
    want = np_ragged_reference(*args, **opts)
    scale = opts.pop("scale")
    got = np.asarray(ragged_paged_attention_xla(*args, scale=scale, tile_tokens=tile_tokens, **opts))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=tolerance(case), rtol=0)
    # The public op, impl="auto" on this CPU: the same path.
    pub = jpa.ragged_paged_attention(*args, scale=scale, **opts)
    np.testing.assert_allclose(np.asarray(pub), want, atol=tolerance(case), rtol=0)


KERNEL_CASE = Case((0, 1, 70, 128), num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                   pages_per_seq=8, q_dtype="bfloat16", cache_dtype="bfloat16", sinks=1.0, seed=31)


def _check_kernel(fn, case=KERNEL_CASE):
    args, opts = make_inputs(case)
    want = np_reference(*args, **opts)
    got = np.asarray(fn(*args, **opts).astype(jnp.float32), np.float64)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=tolerance(case), rtol=0)


def test_mosaic_decode_interpret_split_k():
    from jpa.pallas.mosaic import decode as mosaic_decode
    # One 64-token block per partition: the 128-token sequence spans two, the sink joins once.
    _check_kernel(lambda *a, **o: mosaic_decode._paged_decode(
        *a, **o, interpret=True, blocks_per_part=1))


def test_triton_decode_interpret_split_k():
    from jpa.pallas.triton import decode as triton_decode
    _check_kernel(lambda *a, **o: triton_decode.paged_decode(*a, **o, interpret=True,
                                                             partition_tokens=32))


def test_public_op_passes_sinks_to_the_kernel():
    _check_kernel(lambda *a, **o: jpa.paged_decode(*a, **o, impl="triton", interpret=True))


@pytest.mark.parametrize("bad, match", [
    (jnp.zeros((3,), jnp.float32), "sinks must have num_q_heads = 4 entries"),
    (jnp.zeros((4,), jnp.bfloat16), "sinks must have dtype in"),
    (jnp.zeros((2, 2), jnp.float32), r"sinks must have shape f32\[num_q_heads\]"),
    (jnp.asarray([0, 0, -np.inf, 0], jnp.float32), "sinks must be finite"),
])
def test_bad_sinks_are_refused(bad, match):
    case = Case((3, 9), num_q_heads=4, num_kv_heads=2, head_dim=16)
    args, opts = make_inputs(case)
    with pytest.raises(ValueError, match=match):
        jpa.paged_decode(*args, **opts, sinks=bad)
    rcase = RaggedCase((3, 9), q_lens=(1, 2), num_q_heads=4, num_kv_heads=2, head_dim=16)
    rargs, ropts = make_ragged_inputs(rcase)
    with pytest.raises(ValueError, match=match):
        jpa.ragged_paged_attention(*rargs, **ropts, sinks=bad)
    q, kp, vp, tables, lens, _ = _as_prefill(rargs)
    with pytest.raises(ValueError, match=match):
        jpa.paged_prefill(q, kp, vp, tables, lens - 2, jnp.full_like(lens, 2), sinks=bad)


def _as_prefill(rargs):
    """A ragged call's arguments as paged_prefill's: (q [B, T, N, H], k_pages, v_pages, tables, seq_lens,
    q_lens) with each sequence's rows right-padded to the longest."""
    q, kp, vp, tables, lens, cu, num_seqs = rargs
    cu = np.asarray(cu)[: int(num_seqs) + 1]
    q_lens = np.diff(cu)
    out = np.zeros((len(q_lens), int(q_lens.max()), *q.shape[1:]), np.float32)
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        out[i, : b - a] = np.asarray(q[a:b], np.float32)
    return (jnp.asarray(out, q.dtype), kp, vp, tables[: len(q_lens)], lens[: len(q_lens)],
            jnp.asarray(q_lens, jnp.int32))


def test_prefill_passes_sinks():
    """jpa.paged_prefill(sinks=) = the oracle-checked ragged reference on the same chunks (a decode
    token, a chunk from position 0, a chunk after a cached prefix; a sliding window), and the sink
    changes the result."""
    case = RaggedCase((9, 6, 30), q_lens=(1, 6, 11), num_tokens=20, max_num_seqs=3, num_q_heads=4,
                      num_kv_heads=2, head_dim=16, page_size=4, pages_per_seq=8, sliding_window=7, sinks=0.7,
                      seed=23)
    rargs, ropts = make_ragged_inputs(case)
    want = np.asarray(ragged_paged_attention_xla(*rargs, **ropts), np.float64)
    q, kp, vp, tables, lens, q_lens = _as_prefill(rargs)
    opts = {k: v for k, v in ropts.items() if k in ("sinks", "sliding_window", "scale", "soft_cap")}
    got = np.asarray(jpa.paged_prefill(q, kp, vp, tables, lens - q_lens, q_lens, **opts), np.float64)
    no_sink = np.asarray(jpa.paged_prefill(q, kp, vp, tables, lens - q_lens, q_lens,
                                           **{k: v for k, v in opts.items() if k != "sinks"}), np.float64)
    cu = np.concatenate([[0], np.cumsum(np.asarray(q_lens))])
    for i, n in enumerate(np.asarray(q_lens)):
        np.testing.assert_allclose(got[i, :n], want[cu[i]: cu[i] + n], atol=1e-5, rtol=0)
        assert np.abs(no_sink[i, :n] - want[cu[i]: cu[i] + n]).max() > 1e-2


RAGGED_KERNEL_CASE = RaggedCase((9, 6, 30), q_lens=(1, 6, 11), num_tokens=20, max_num_seqs=4,
                                num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                                pages_per_seq=4, sliding_window=13, sinks=0.5, seed=21,
                                q_dtype="bfloat16", cache_dtype="bfloat16")


@pytest.mark.parametrize("impl", ["mosaic", pytest.param("triton", marks=pytest.mark.bench)])
def test_ragged_kernels_interpret(impl):
    # Tile rows (the sink folded into each row's final state in the tile kernel) and last rows
    # (the decode kernel's split-K combine), through the public op.
    args, opts = make_ragged_inputs(RAGGED_KERNEL_CASE)
    want = np_ragged_reference(*args, **opts)
    got = np.asarray(jpa.ragged_paged_attention(*args, **opts, impl=impl, interpret=True)
                     .astype(jnp.float32), np.float64)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=tolerance(RAGGED_KERNEL_CASE), rtol=0)


def test_kernels_accept_sinks_and_refuse_with_a_reason_otherwise(monkeypatch):
    rargs, _ = make_ragged_inputs(RaggedCase((3, 9), q_lens=(1, 2), num_q_heads=4, num_kv_heads=2,
                                             head_dim=64, q_dtype="bfloat16", cache_dtype="bfloat16"))
    q, k = rargs[0], rargs[1]
    sinks = jnp.zeros((4,), jnp.float32)
    rspec = ragged_spec(q, k, rargs[3], soft_cap=None, alibi_slopes=None, sliding_window=None,
                        sinks=sinks)
    dspec = jpa.ops.decode.decode_spec(q, k, rargs[3], soft_cap=None, alibi_slopes=None,
                                       sliding_window=None, sinks=sinks)
    assert rspec.sinks and dspec.sinks
    for impl in ("mosaic", "triton"):
        for cc in (8.0, 9.0):
            assert dispatch.unsupported_reason(impl, dspec, cc) is None
        assert dispatch.unsupported_reason(impl, rspec, 9.0, RAGGED) is None
    # A kernel that refuses sinks (as every kernel without them must) is passed over by auto,
    # never run with the sinks dropped: both ragged kernels refusing, an H100 (AOT) gets "xla".
    from jpa.pallas.mosaic import ragged as mosaic_ragged
    from jpa.pallas.triton import ragged as triton_ragged
    for mod in (mosaic_ragged, triton_ragged):
        real = mod.unsupported_reason
        monkeypatch.setattr(mod, "unsupported_reason", lambda spec, cc=None, real=real, **kw: (
            "no attention sinks" if spec.sinks else real(spec, cc, **kw)))
    aot_h100 = dispatch.Target("gpu", "NVIDIA H100 80GB HBM3", 9.0, executable=False)
    assert dispatch.choose_impl("auto", rspec, aot_h100, RAGGED) == "xla"
    with pytest.raises(dispatch.KernelUnavailable, match="no attention sinks"):
        dispatch.choose_impl("triton", rspec, aot_h100, RAGGED)
