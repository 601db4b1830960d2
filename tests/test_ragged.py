"""jpa.ragged_paged_attention (plain JAX, Triton and Mosaic GPU kernels in interpret mode) against the
float64 NumPy oracle, the tile map, one-trace-for-every-mix, a hand-worked case and the ValueErrors.

The case list is a covering design (interpret mode is slow on CPU): every page size, GQA ratio,
head_dim, dtype and option appears at least once, and the hard shapes recur: q_len 1 next to
prefill chunks, chunks crossing page boundaries, a chunk starting mid-page after a cached prefix,
chunks longer than one kernel tile, num_seqs 0 / 1 / max, q_len 0 in the middle of a batch.
JPA_RAGGED_FULL=1 adds a product grid to the Triton kernel's cases (an hour of interpret mode).
"""

import itertools
import os

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import jpa
from jpa.ops import dispatch
from jpa.ops import ragged
from jax.experimental.pallas import mosaic_gpu as plgpu

from jpa.pallas import compat
from jpa.pallas.mosaic import ragged as mosaic_ragged
from jpa.pallas.triton import ragged as triton_ragged
from jpa.pallas.common import max_query_tiles, query_tiles
from jpa.ops.ragged import ragged_paged_attention_xla
from jpa.testing.kernel_cases import RaggedCase, make_ragged_inputs, np_ragged_reference, tolerance
from marks import tiered

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

CASES = [
    # Decodes (q_len 1) next to a fresh prompt, a chunk crossing a page boundary and a chunk
    # starting mid-page (position 13 of page size 8) after a cached prefix; 2 dead slots, padding.
    RaggedCase((1, 9, 40, 20, 6), q_lens=(1, 1, 1, 7, 6), num_tokens=20, max_num_seqs=7,
               num_q_heads=2, num_kv_heads=2, head_dim=64, page_size=8, pages_per_seq=5),
    # GQA 4, head_dim 80, bf16, a shared first page, a chunk longer than one kernel tile (16 rows
    # of 4 heads per tile at rows 64).
    RaggedCase((17, 40, 3), q_lens=(1, 33, 3), num_tokens=40, num_q_heads=8, num_kv_heads=2,
               head_dim=80, page_size=16, q_dtype="bfloat16", cache_dtype="bfloat16",
               share_page=True, seed=1),
    # MQA (q_per_kv 8), head_dim 128, f16, page 32; one sequence (num_seqs 1) of 2 tiles.
    RaggedCase((70,), q_lens=(12,), num_tokens=16, max_num_seqs=3, num_q_heads=8, num_kv_heads=1,
               head_dim=128, page_size=32, pages_per_seq=3, q_dtype="float16",
               cache_dtype="float16", seed=2),
    # head_dim 256 (rows 32), page 128 (many steps per page), bf16.
    RaggedCase((129, 5), q_lens=(3, 5), num_tokens=8, num_q_heads=4, num_kv_heads=2,
               head_dim=256, page_size=128, pages_per_seq=2, q_dtype="bfloat16",
               cache_dtype="bfloat16", seed=3),
    # q_per_kv 3 (SmolLM2: 21 tokens per 64-row tile), soft cap, head_dim 64.
    RaggedCase((30, 1, 45), q_lens=(25, 1, 2), num_tokens=32, num_q_heads=9, num_kv_heads=3,
               soft_cap=5.0, seed=4),
    # ALiBi, q_per_kv 8, head_dim 128, bf16, all slots live (num_seqs = max), a q_len 0 inside.
    RaggedCase((1, 40, 8, 64), q_lens=(1, 10, 0, 4), num_tokens=15, num_q_heads=16,
               num_kv_heads=2, head_dim=128, alibi=True, q_dtype="bfloat16",
               cache_dtype="bfloat16", seed=5),
    # Sliding window shorter than the chunks and the prefix, page size 8 and 12 (not a power of 2).
    RaggedCase((3, 37, 40), q_lens=(3, 20, 1), num_tokens=24, head_dim=96, page_size=8,
               pages_per_seq=5, sliding_window=11, seed=6),
    RaggedCase((12, 13, 35), q_lens=(12, 1, 9), num_tokens=24, page_size=12, sliding_window=5,
               seed=16),
    # Quantized caches: int8 with bf16 q, float8_e4m3fn with f16, float8_e5m2 with f32.
    RaggedCase((0, 17, 63), q_lens=(0, 17, 2), num_tokens=20, max_num_seqs=4, num_q_heads=8,
               num_kv_heads=2, head_dim=80, q_dtype="bfloat16", cache_dtype="int8",
               share_page=True, seed=7),
    RaggedCase((1, 32, 50), q_lens=(1, 5, 30), num_tokens=40, num_q_heads=4, num_kv_heads=1,
               head_dim=64, q_dtype="float16", cache_dtype="float8_e4m3fn", seed=8),
    RaggedCase((16, 33), q_lens=(16, 9), num_tokens=25, num_q_heads=2, num_kv_heads=2,
               head_dim=64, q_dtype="float32", cache_dtype="float8_e5m2", soft_cap=20.0, seed=9),
    # Everything at once.
    RaggedCase((1, 25, 64, 9), q_lens=(1, 20, 3, 9), num_tokens=36, max_num_seqs=6,
               num_q_heads=8, num_kv_heads=2, head_dim=80, page_size=16, q_dtype="bfloat16",
               cache_dtype="int8", soft_cap=10.0, alibi=True, sliding_window=19, share_page=True,
               seed=11),
    # num_seqs 0: every row is (NaN) padding.
    RaggedCase((), q_lens=(), num_tokens=8, max_num_seqs=3, seed=12),
]

# Cases that also run through the interpret-mode kernels (each ~2-3 s on an idle 2-core CPU): all
# but those whose only new feature (ALiBi, a window with page size 8, float8_e5m2) recurs in
# another kernel case or in the decode kernel's own tests.
KERNEL_CASES = [c for i, c in enumerate(CASES) if i not in (5, 6, 10)]


def _full_grid():
    """Product grid for JPA_RAGGED_FULL=1."""
    out = []
    for (ps, (n, k), hd, (qd, cd), i) in itertools.product(
            (8, 16, 32, 128), ((4, 4), (8, 2), (8, 1), (9, 3)), (64, 80, 128, 256),
            (("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16"),
             ("bfloat16", "int8"), ("float16", "float8_e4m3fn"), ("float32", "float8_e5m2")),
            range(2)):
        pps = max(2, 160 // ps)
        q_lens = (1, 9, ps + 1, 40)
        out.append(RaggedCase((1, ps + 3, 2 * ps - 1, 150), q_lens=q_lens,
                              num_tokens=sum(q_lens) + 5, max_num_seqs=6, num_q_heads=n, num_kv_heads=k,
                              head_dim=hd, page_size=ps, pages_per_seq=pps, q_dtype=qd,
                              cache_dtype=cd, soft_cap=(7.0 if i else None), alibi=bool(i),
                              sliding_window=(33 if i else None), seed=i))
    return out


if os.environ.get("JPA_RAGGED_FULL"):
    KERNEL_CASES = CASES + _full_grid()


def _check(case, got, args, opts):
    chex.assert_shape(got, args[0].shape)
    chex.assert_type(got, args[0].dtype)
    got = np.asarray(got.astype(jnp.float32))
    assert np.isfinite(got).all()
    want = np_ragged_reference(*args, **opts)
    np.testing.assert_allclose(got, want, atol=tolerance(case), rtol=0)
    # Padding rows are exactly zero (their q is NaN).
    np.testing.assert_array_equal(got[int(np.asarray(args[5])[len(case.q_lens)]):], 0.0)


@pytest.mark.parametrize("case", tiered(CASES, bench=(4, 6, 7), soak=(1, 2, 3, 5, 8, 9)), ids=str)
def test_xla_matches_oracle(case):
    args, opts = make_ragged_inputs(case)
    _check(case, jpa.ragged_paged_attention(*args, **opts, impl="xla"), args, opts)


@pytest.mark.parametrize("case", tiered(KERNEL_CASES, soak=(1, 2, 3, 4, 5, 6, 7, 8)), ids=str)
def test_triton_matches_oracle(case):
    args, opts = make_ragged_inputs(case)
    got = jpa.ragged_paged_attention(*args, **opts, impl="triton", interpret=True)
    _check(case, got, args, opts)


BF16 = dict(q_dtype="bfloat16", cache_dtype="bfloat16")
# Mosaic GPU (GPU interpret mode, ~5-10 s each): the shapes its WGMMA/TMA limits accept (16-bit
# q, page sizes dividing 64 or multiples of 64, head_dim a multiple of 16, quantized pages >= 32).
MOSAIC_CASES = [
    # MHA (64-token tiles), page 8, decodes next to chunks crossing pages and starting mid-page.
    RaggedCase((1, 9, 40, 20, 6), q_lens=(1, 1, 1, 7, 6), num_tokens=20, max_num_seqs=7,
               num_q_heads=2, num_kv_heads=2, head_dim=64, page_size=8, pages_per_seq=5, **BF16),
    # GQA 4 (16-token tiles), head_dim 128, shared page, a chunk of 3 tiles, f16, soft cap.
    RaggedCase((17, 60, 3), q_lens=(1, 40, 3), num_tokens=48, num_q_heads=8, num_kv_heads=2,
               head_dim=128, page_size=16, q_dtype="float16", cache_dtype="float16",
               share_page=True, soft_cap=5.0, seed=1),
    # q_per_kv 3 (21 tokens in 63 of the 64 rows), ALiBi and a window, head_dim 80.
    RaggedCase((30, 1, 45), q_lens=(25, 1, 22), num_tokens=50, num_q_heads=9, num_kv_heads=3,
               head_dim=80, alibi=True, sliding_window=13, seed=4, **BF16),
    # int8 cache with page 32 and head_dim 128; float8_e4m3fn with page 64; a q_len 0 inside.
    RaggedCase((0, 70, 33), q_lens=(0, 30, 2), num_tokens=40, max_num_seqs=4, num_q_heads=8,
               num_kv_heads=2, head_dim=128, page_size=32, q_dtype="bfloat16",
               cache_dtype="int8", seed=7),
    RaggedCase((1, 100), q_lens=(1, 50), num_tokens=56, num_q_heads=4, num_kv_heads=1,
               head_dim=64, page_size=64, pages_per_seq=2, q_dtype="float16",
               cache_dtype="float8_e4m3fn", sliding_window=40, seed=8),
    # head_dim 256; num_seqs 0.
    RaggedCase((29, 5), q_lens=(20, 5), num_tokens=25, num_q_heads=2, num_kv_heads=1,
               head_dim=256, page_size=16, seed=3, **BF16),
    RaggedCase((), q_lens=(), num_tokens=8, max_num_seqs=3, seed=12, **BF16),
]


@pytest.mark.parametrize("case", tiered(MOSAIC_CASES, bench=(5,), soak=(0, 1, 2, 4)), ids=str)
def test_mosaic_matches_oracle(case):
    args, opts = make_ragged_inputs(case)
    spec = ragged.ragged_spec(args[0], args[1], args[3], soft_cap=opts["soft_cap"],
                              alibi_slopes=opts["alibi_slopes"],
                              sliding_window=opts["sliding_window"])
    assert mosaic_ragged.unsupported_reason(spec, 9.0) is None
    got = jpa.ragged_paged_attention(*args, **opts, impl="mosaic", interpret=True)
    _check(case, got, args, opts)


# Speculative verify passes (`max_q_len`: at most that many rows a sequence): on Hopper ONE multi-row
# decode kernel call, split-K, causal per row. Rows of the first case's 130-token sequence (rows at
# 125..129, 64-token blocks, one partition a block) see nothing of the last partition but keys
# 128-129; q_len 0 and 1 next to full ones; a dead slot.
VERIFY_CASES = [
    (RaggedCase((130, 9, 40, 70, 5), q_lens=(5, 1, 3, 0, 5), num_tokens=20, max_num_seqs=6, num_q_heads=8,
                num_kv_heads=2, head_dim=128, page_size=16, pages_per_seq=9, share_page=True, sinks=0.5,
                seed=40, **BF16), 5),
    # q_per_kv 3 (21 tokens fill 63 rows), ALiBi, a window shorter than the rows' span, a soft cap,
    # an int8 cache with page 32; one 64-token block a sequence: one partition (the kernel
    # normalizes and writes q's dtype itself).
    (RaggedCase((60, 21, 33), q_lens=(21, 4, 2), num_tokens=30, num_q_heads=6, num_kv_heads=2, head_dim=64,
                page_size=32, pages_per_seq=2, alibi=True, sliding_window=9, soft_cap=5.0, q_dtype="float16",
                cache_dtype="int8", seed=41), 21),
]


@pytest.mark.parametrize("case,rows", tiered(VERIFY_CASES, bench=(0,), unpack=True), ids=str)
def test_mosaic_verify_rows_match_oracle(case, rows):
    args, opts = make_ragged_inputs(case)
    q_per_kv = case.num_q_heads // case.num_kv_heads
    assert mosaic_ragged.short_rows(q_per_kv, rows, 9.0)   # the one-call path
    with ragged.query_rows_at_most(rows):
        got = jpa.ragged_paged_attention(*args, **opts, impl="mosaic", interpret=True)
    _check(case, got, args, opts)


def test_max_q_len_is_a_checked_promise():
    args, opts = make_ragged_inputs(VERIFY_CASES[0][0])
    with pytest.raises(ValueError, match=r"max_q_len = 4 but a live sequence has 5 query rows"):
        jpa.ragged_paged_attention(*args, **opts, impl="mosaic", interpret=True, max_q_len=4)
    with pytest.raises(ValueError, match=r"max_q_len must be None or a positive int"):
        jpa.ragged_paged_attention(*args, **opts, impl="xla", max_q_len=0)
    with pytest.raises(ValueError, match=r"query_rows_at_most needs a positive int"):
        with ragged.query_rows_at_most(0):
            pass


@pytest.mark.bench
@pytest.mark.skipif(not compat.RAISE_ON_RACE, reason=compat.RAISE_ON_RACE_MISSING)
def test_mosaic_no_races():
    """GPU interpret mode's race detector (every SMEM/GMEM access, TMA and barrier) over a chunk
    whose tiles walk several blocks through the slots, next to decodes (the decode kernel)."""
    case = RaggedCase((1, 300, 140), q_lens=(1, 20, 70), num_tokens=96, max_num_seqs=4,
                      num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                      pages_per_seq=19, alibi=True, sliding_window=200, seed=30, **BF16)
    args, opts = make_ragged_inputs(case)
    with plgpu.force_gpu_interpret_mode(compat.gpu_interpret_params(raise_on_race=True)):
        got = jax.block_until_ready(mosaic_ragged.ragged_paged_attention(*args, **opts,
                                                                         interpret=True))
    _check(case, got, args, opts)


def test_triton_small_tiles_and_xla_small_tiles():
    """Forced small tiles: many tiles per chunk, a tile boundary mid-page, q_per_kv 1 rows 16."""
    case = RaggedCase((1, 50, 21), q_lens=(1, 37, 21), num_tokens=64, max_num_seqs=5,
                      num_q_heads=2, num_kv_heads=2, page_size=8, pages_per_seq=7,
                      sliding_window=23, alibi=True, seed=21)
    args, opts = make_ragged_inputs(case)
    _check(case, triton_ragged.ragged_paged_attention(*args, **opts, interpret=True, rows=16),
           args, opts)
    _check(case, ragged_paged_attention_xla(*args, **opts, tile_tokens=5), args, opts)


@pytest.mark.soak
def test_triton_forced_split_k():
    """Last rows through the decode kernel split into partitions of 16 tokens (most of them past
    a sequence's end or before its window), next to prefill tiles."""
    case = RaggedCase((1, 60, 33, 47), q_lens=(1, 1, 30, 2), num_tokens=40, max_num_seqs=6,
                      num_q_heads=8, num_kv_heads=2, head_dim=80, page_size=8, pages_per_seq=8,
                      q_dtype="bfloat16", cache_dtype="int8", soft_cap=10.0, alibi=True,
                      sliding_window=19, seed=22)
    args, opts = make_ragged_inputs(case)
    got = triton_ragged.ragged_paged_attention(*args, **opts, interpret=True, partition_tokens=16)
    _check(case, got, args, opts)


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_by_hand(impl):
    """Page size 2, scale 1. Sequence 0 has 3 cached tokens, the last 2 are queries (positions 1, 2:
    the chunk starts mid-page and crosses into the next page); sequence 1 is one decode token.
    Row 0 (pos 1): scores (0, ln 3) -> weights (1, 3) / 4 -> 0.25 * 1 + 0.75 * 5 = 4.
    Row 1 (pos 2): scores (0, ln 3, ln 4) -> (1, 3, 4) / 8 -> (1 + 15 + 36) / 8 = 6.5.
    Row 2 (seq 1, one key): 7. Row 3 is NaN padding: 0."""
    head_dim = 16
    e0 = np.zeros(head_dim, np.float32)
    e0[0] = 1.0
    k = np.full((1, 4, 2, head_dim), np.nan, np.float32)  # [K, P, S_p, H]; NaN = never written
    v = np.full_like(k, np.nan)
    # seq 0: tokens 0, 1 in page 2, token 2 in page 0; seq 1: token 0 in page 3.
    for (page, off), key, val in [((2, 0), 0.0, 1.0), ((2, 1), np.log(3), 5.0),
                                  ((0, 0), np.log(4), 9.0), ((3, 0), 0.3, 7.0)]:
        k[0, page, off] = key * e0
        v[0, page, off] = val
    q = np.stack([e0, e0, e0, np.full(head_dim, np.nan, np.float32)])[:, None, :]  # [4, 1, H]
    out = jpa.ragged_paged_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.array([[2, 0], [3, -1]], jnp.int32),
        jnp.array([3, 1], jnp.int32), jnp.array([0, 2, 3], jnp.int32), jnp.int32(2), scale=1.0,
        impl=impl, interpret=True)
    want = np.array([4.0, 6.5, 7.0, 0.0])[:, None, None] * np.ones((1, 1, head_dim))
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_one_trace_serves_every_mix(impl):
    """Decode-only, mixed, one long chunk and empty batches: same shapes, one trace, right results."""
    base = dict(num_tokens=24, max_num_seqs=4, num_q_heads=4, num_kv_heads=2, page_size=8,
                pages_per_seq=6)
    mixes = [RaggedCase((5, 9, 30, 1), q_lens=(1, 1, 1, 1), **base),
             RaggedCase((40, 3), q_lens=(20, 3), seed=1, **base),
             RaggedCase((48,), q_lens=(24,), seed=2, **base),
             RaggedCase((), q_lens=(), seed=3, **base)]
    traces = []

    @jax.jit
    def step(*args):
        traces.append(1)
        return jpa.ragged_paged_attention(*args, scale=0.2, impl=impl, interpret=True)

    for case in mixes:
        args, _ = make_ragged_inputs(case)
        got = np.asarray(step(*args))
        np.testing.assert_allclose(got, np_ragged_reference(*args, scale=0.2), atol=2e-5, rtol=0)
    assert len(traces) == 1


_query_tiles_jit = jax.jit(query_tiles, static_argnames=("num_tokens", "tile_tokens", "num_tiles",
                                                        "skip_last"))


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_query_tiles_cover_each_live_row_once(data):
    """Every live row is in exactly one tile, tiles stay inside one sequence, the live tiles fit
    the static slot count, dead slots are empty, positions are the last q_len of seq_len."""
    # Fixed shapes and few tile sizes: the jitted map compiles at most 6 times.
    max_num_seqs, num_tokens = 6, 60
    num_seqs = data.draw(st.integers(0, max_num_seqs))
    q_lens = data.draw(st.lists(st.integers(0, 10), min_size=num_seqs, max_size=num_seqs))
    tile = data.draw(st.sampled_from([1, 3, 8]))
    skip_last = data.draw(st.booleans())
    cu = np.concatenate([[0], np.cumsum(q_lens, dtype=np.int64),
                         np.full(max_num_seqs - num_seqs, 10**6)]).astype(np.int32)
    seq_lens = np.array([ql + 3 * i for i, ql in enumerate(q_lens)]
                        + [-7] * (max_num_seqs - num_seqs), np.int32)
    num_tiles = max_query_tiles(num_tokens, max_num_seqs, tile)
    seq, row0, ntok, pos0 = map(np.asarray, _query_tiles_jit(
        jnp.asarray(cu), jnp.asarray(seq_lens), jnp.int32(num_seqs), num_tokens=num_tokens,
        tile_tokens=tile, num_tiles=num_tiles, skip_last=skip_last))
    covered = np.zeros(num_tokens, int)
    live = ntok > 0
    assert (ntok >= 0).all() and (ntok <= tile).all()
    assert (np.diff(live.astype(int)) <= 0).all()  # live tiles first
    for w in np.nonzero(live)[0]:
        i = seq[w]
        rows = np.arange(row0[w], row0[w] + ntok[w])
        assert cu[i] <= rows[0] and rows[-1] < cu[i + 1]
        np.testing.assert_array_equal(pos0[w] + rows - row0[w],
                                      seq_lens[i] - q_lens[i] + rows - cu[i])
        covered[rows] += 1
    want = np.zeros(num_tokens, int)
    for i, ql in enumerate(q_lens):
        want[cu[i]: cu[i] + ql - (1 if skip_last and ql else 0)] = 1
    np.testing.assert_array_equal(covered, want)


def _args(**over):
    case = RaggedCase((5, 9), q_lens=(2, 1), num_tokens=4, max_num_seqs=3, page_size=4)
    args, _ = make_ragged_inputs(case)
    names = ["q", "k_pages", "v_pages", "block_tables", "seq_lens", "cu_q_lens", "num_seqs"]
    kw = dict(zip(names, args))
    kw.update(over)
    return kw


@pytest.mark.parametrize("over,match", [
    (dict(q=jnp.zeros((4, 4, 64))[None]), r"q must have shape \[num_tokens"),
    (dict(q=jnp.zeros((4, 4, 64), jnp.int32)), r"q must have dtype"),
    (dict(q=jnp.zeros((0, 4, 64))), r"num_tokens = q.shape\[0\] >= 1"),
    (dict(q=jnp.zeros((4, 4, 32))), r"head_dim must equal"),
    (dict(q=jnp.zeros((4, 3, 64))), r"multiple of num_kv_heads"),
    (dict(seq_lens=jnp.zeros((3,), jnp.float32)), r"seq_lens must have dtype"),
    (dict(seq_lens=jnp.zeros((0,), jnp.int32)), r"max_num_seqs >= 1"),
    (dict(block_tables=jnp.zeros((2, 3), jnp.int32)),
     r"block_tables must have num_seqs = 3 rows \(seq_lens.shape\[0\]\)"),
    (dict(cu_q_lens=jnp.zeros((3,), jnp.int32)), r"cu_q_lens must have max_num_seqs \+ 1 = 4"),
    (dict(cu_q_lens=jnp.zeros((4,), jnp.float32)),
     r"cu_q_lens must have dtype"),
    (dict(num_seqs=jnp.zeros((1,), jnp.int32)), r"num_seqs must be an i32 scalar .*int32\[1\]"),
    (dict(num_seqs=2.0), r"num_seqs must be an i32 scalar"),
    (dict(num_seqs=4), r"num_seqs must be in \[0, max_num_seqs = 3\]; got 4"),
    (dict(cu_q_lens=jnp.array([1, 2, 3, 3], jnp.int32)), r"cu_q_lens\[0\] must be 0; got 1"),
    (dict(cu_q_lens=jnp.array([0, 2, 1, 1], jnp.int32)), r"non-decreasing"),
    (dict(cu_q_lens=jnp.array([0, 2, 5, 5], jnp.int32)), r"at most num_tokens = 4"),
    (dict(seq_lens=jnp.array([5, 0, 0], jnp.int32)), r"got seq_lens\[1\] = 0 with q_len 1"),
    (dict(seq_lens=jnp.array([5, 999, 0], jnp.int32)), r"got seq_lens\[1\] = 999"),
    (dict(block_tables=jnp.array([[0, 99, 5], [2, 3, 4], [0, 0, 0]], jnp.int32)),
     r"block_tables\[0, 1\] = 99"),
])
def test_value_errors(over, match):
    kw = _args(**over)
    with pytest.raises(ValueError, match=match):
        jpa.ragged_paged_attention(*kw.values(), impl="xla")


def test_option_errors():
    with pytest.raises(ValueError, match=r"soft_cap must be a positive"):
        jpa.ragged_paged_attention(*_args().values(), soft_cap=-1.0)
    with pytest.raises(ValueError, match=r"impl must be one of"):
        jpa.ragged_paged_attention(*_args().values(), impl="cuda")
    with pytest.raises(ValueError, match=r"alibi_slopes must have num_q_heads = 4"):
        jpa.ragged_paged_attention(*_args().values(), alibi_slopes=jnp.zeros(3))
    with pytest.raises(dispatch.KernelUnavailable, match=r"impl='mosaic' cannot serve this call: "
                       r"q dtype float32 is not supported"):
        jpa.ragged_paged_attention(*_args().values(), impl="mosaic")


def test_auto_is_xla_without_a_gpu():
    if dispatch.current_target().is_nvidia_gpu:
        pytest.skip("a GPU is attached")
    kw = _args()
    np.testing.assert_array_equal(jpa.ragged_paged_attention(*kw.values(), impl="auto"),
                                  jpa.ragged_paged_attention(*kw.values(), impl="xla"))
