"""`jpa.ragged_paged_attention`: one attention call for a ragged batch of prefill chunks and
decode tokens over a paged KV cache (vLLM v1's "unified" attention, TPU's ragged paged attention).

Legend (docs/architecture.md's names; T = num_tokens, the static token budget):

- q [T, num_q_heads, head_dim]: the query tokens of all sequences back to back, padded to T.
- Sequence i < num_seqs owns query rows `cu_q_lens[i]:cu_q_lens[i + 1]`; q_len_i is their count.
  They are the LAST q_len_i positions of its `seq_lens[i]` cached tokens: row
  `cu_q_lens[i] + t` sits at position `seq_lens[i] - q_len_i + t`. Their K/V are already in the
  cache (`jpa.write_kv` first). A decode token has q_len 1; a prefill chunk any q_len <= T; a
  chunk may start mid-page after a cached prefix.
- Attention is causal within the chunk and sees the whole cached prefix: the query at position p
  sees keys [0, p] (or (p - sliding_window, p]).
- `num_seqs` is a device scalar i32. Rows past `cu_q_lens[num_seqs]` are padding: they get no work
  and a zero output; block_tables rows, seq_lens and cu_q_lens entries past num_seqs are ignored.

Lengths, offsets and num_seqs are data, so one compiled program serves every mix of q lengths
and every num_seqs under the same static shapes.

The plain-JAX path (`ragged_paged_attention_xla`) is the CPU/TPU path and the oracle for the
kernels. It splits the rows in two kinds and reuses an existing online-softmax path for each:

1. each sequence's last query row sits at position seq_len - 1: it is a decode query, and all
   of them run as one batched `paged_decode_xla` over the max_num_seqs sequences;
2. the other rows (the body of prefill chunks) are cut into tiles of `tile_tokens` rows that never
   span two sequences (`jpa.pallas.common.query_tiles`), and a loop over the live tiles only runs
   the plain-JAX prefill on each, so padding and decode-only steps cost no prefill work.
"""

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jpa.ops import dispatch
from jpa.pallas.common import decode_last_rows, max_query_tiles, query_tiles
from jpa.pallas.spec import RaggedSpec, ragged_spec  # noqa: F401 (ragged_spec re-exported)
from jpa.core.quant import FLOAT_DTYPES
from jpa.ops.reference import paged_decode_xla, paged_prefill_xla
from jpa.ops.validate import (check_cache_pair, check_dtype, check_layer, check_ndim, check_options,
                              check_tables, check_used_pages, is_concrete)

# Query rows per tile of the plain-JAX prefill loop: one tile is one loop iteration with a
# [tile_tokens * q_per_kv, keys] score block per kv head, large enough to amortize the loop on a
# CPU, and capped at T so that small budgets do not compute padding rows.
XLA_TILE_TOKENS = 128
# When no live sequence has more query rows than this, the plain-JAX path runs every row as its own
# decode query (one batched call) instead of tiles (speculative verify passes: k + 1 <= 17 rows).
SHORT_QUERY_ROWS = 17
# Kernel modules behind impl="triton"/"mosaic" (each exposes `unsupported_reason(RaggedSpec,
# compute_capability)` and `ragged_paged_attention` with this module's argument order).
KERNEL_MODULES = {"triton": "jpa.pallas.triton.ragged", "mosaic": "jpa.pallas.mosaic.ragged"}


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "tile_tokens", "per_row"))
def ragged_paged_attention_xla(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, num_seqs,
                               *, scale, soft_cap=None, alibi_slopes=None, sliding_window=None,
                               k_scales=None, v_scales=None, tile_tokens=None, layer=None,
                               sinks=None, per_row=False):
    """Ragged paged attention in plain JAX. Arguments as `ragged_paged_attention` (validated;
    `layer` an i32[] with stacked pools; `sinks` f32[num_q_heads] or None). per_row: every row a
    decode query of its own whatever the query lengths (`rows_independent`).

    Returns:
      [num_tokens, num_q_heads, head_dim] in q's dtype; zero rows for padding.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    max_num_seqs = seq_lens.shape[0]
    tile = tile_tokens or min(XLA_TILE_TOKENS, num_tokens)
    opts = dict(scale=scale, soft_cap=soft_cap, alibi_slopes=alibi_slopes,
                sliding_window=sliding_window, k_scales=k_scales, v_scales=v_scales, layer=layer,
                sinks=sinks)
    num_seqs = jnp.asarray(num_seqs, jnp.int32)
    live = jnp.arange(max_num_seqs + 1, dtype=jnp.int32) <= num_seqs
    cu = jnp.where(live, cu_q_lens, cu_q_lens[num_seqs])  # entries past num_seqs ignored
    max_q = jnp.max(cu[1:] - cu[:-1])

    def per_row(_):
        # Only short sequences (decode tokens, speculative verify rows): every row is a decode
        # query of its own at its position, all in one batched decode call (the tiles below would
        # each pad one sequence's few rows to a whole tile, one sequence at a time).
        row = jnp.arange(num_tokens, dtype=jnp.int32)
        seq = jnp.clip(jnp.searchsorted(cu[1:], row, side="right"), 0, max_num_seqs - 1).astype(jnp.int32)
        row_live = row < cu[-1]
        pos = seq_lens[seq] - (cu[seq + 1] - cu[seq]) + (row - cu[seq])
        o = paged_decode_xla(jnp.where(row_live[:, None, None], q, 0), k_pages, v_pages, block_tables[seq],
                             jnp.where(row_live, pos + 1, 0), **opts)  # [T, N, H]
        return jnp.where(row_live[:, None, None], o, 0).astype(q.dtype)

    def tiles(_):
        return _ragged_tiles_xla(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, num_seqs, tile, opts)

    if per_row:   # each row's result independent of the others (`rows_independent`)
        return per_row(None)
    if tile_tokens is not None:   # tiles asked for by size: always tiles
        return tiles(None)
    return lax.cond(max_q <= SHORT_QUERY_ROWS, per_row, tiles, None)


def _ragged_tiles_xla(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, num_seqs, tile, opts):
    """`ragged_paged_attention_xla` for any query lengths: each sequence's last row as a decode
    query (one batched call), the other rows in tiles of one sequence at a time."""
    num_tokens = q.shape[0]
    max_num_seqs = seq_lens.shape[0]
    # 1. Last rows: decode queries at position seq_len - 1, one batched decode call.
    out = decode_last_rows(paged_decode_xla, q, k_pages, v_pages, block_tables, seq_lens,
                           cu_q_lens, num_seqs, **opts)  # [T, N, H]
    # `tile` spare rows at the end let every tile write a whole [tile] slice without clamping.
    out = jnp.pad(out, ((0, tile), (0, 0), (0, 0)))  # [T + tile, N, H]

    # 2. The other rows, a tile of one sequence at a time, live tiles only.
    seq, row0, ntok, pos0 = query_tiles(
        cu_q_lens, seq_lens, num_seqs, num_tokens=num_tokens, tile_tokens=tile,
        num_tiles=max_query_tiles(num_tokens, max_num_seqs, tile), skip_last=True)
    q_pad = jnp.pad(q, ((0, tile), (0, 0), (0, 0)))  # [T + tile, N, H]
    t = jnp.arange(tile, dtype=jnp.int32)  # i32[tile]

    def one_tile(w, out):
        rows_ok = (t < ntok[w])[:, None, None]  # [tile, 1, 1]
        # Rows past the tile belong to another sequence or are padding (maybe NaN): zeroed.
        qt = jnp.where(rows_ok, lax.dynamic_slice_in_dim(q_pad, row0[w], tile), 0)  # [tile, N, H]
        table = lax.dynamic_slice_in_dim(block_tables, seq[w], 1)  # i32[1, pages_per_seq]
        o = paged_prefill_xla(qt[None], k_pages, v_pages, table, pos0[w][None], ntok[w][None],
                               **opts)[0]  # [tile, N, H]
        old = lax.dynamic_slice_in_dim(out, row0[w], tile)  # [tile, N, H]
        return lax.dynamic_update_slice_in_dim(out, jnp.where(rows_ok, o, old), row0[w], 0)

    out = lax.fori_loop(0, jnp.sum(ntok > 0), one_tile, out)
    return out[:num_tokens]


def check_ragged_args(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, num_seqs, *, scale,
                      soft_cap, alibi_slopes, sliding_window, k_scales, v_scales, impl, interpret,
                      layer=None, sinks=None):
    """Validates `ragged_paged_attention`'s arguments; raises ValueError on the first problem."""
    check_ndim("q", q, 3, "[num_tokens, num_q_heads, head_dim]")
    check_dtype("q", q, FLOAT_DTYPES)
    num_kv_heads, num_pages, page_size, head_dim = check_cache_pair(k_pages, v_pages, k_scales, v_scales,
                                                                    layer)
    num_tokens, num_q_heads, q_head_dim = q.shape
    if num_tokens < 1:
        raise ValueError("q must hold at least one token row (num_tokens = q.shape[0] >= 1); got 0")
    if q_head_dim != head_dim:
        raise ValueError(f"q's head_dim must equal the cache's head_dim {head_dim}; got {q_head_dim}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads (q.shape[1] = {num_q_heads}) must be a multiple of "
                         f"num_kv_heads (k_pages.shape[-4] = {num_kv_heads})")
    check_ndim("seq_lens", seq_lens, 1, "i32[max_num_seqs]")
    check_dtype("seq_lens", seq_lens, (np.int32,))
    max_num_seqs = seq_lens.shape[0]
    if max_num_seqs < 1:
        raise ValueError("seq_lens must have at least one entry (max_num_seqs >= 1); got 0")
    pages_per_seq = check_tables(block_tables, max_num_seqs, source="seq_lens.shape[0]")
    check_ndim("cu_q_lens", cu_q_lens, 1, "i32[max_num_seqs + 1]")
    check_dtype("cu_q_lens", cu_q_lens, (np.int32,))
    if cu_q_lens.shape[0] != max_num_seqs + 1:
        raise ValueError(f"cu_q_lens must have max_num_seqs + 1 = {max_num_seqs + 1} entries "
                         f"(seq_lens.shape[0] + 1); got {cu_q_lens.shape[0]}")
    if hasattr(num_seqs, "dtype"):
        if np.dtype(num_seqs.dtype) != np.int32 or np.shape(num_seqs) != ():
            raise ValueError(f"num_seqs must be an i32 scalar (shape ()) or a Python int; got "
                             f"{np.dtype(num_seqs.dtype).name}{list(np.shape(num_seqs))}")
    elif isinstance(num_seqs, bool) or not isinstance(num_seqs, int):
        raise ValueError(f"num_seqs must be an i32 scalar (shape ()) or a Python int; got "
                         f"{num_seqs!r}")
    check_options(num_q_heads, scale=scale, soft_cap=soft_cap, alibi_slopes=alibi_slopes,
                  sliding_window=sliding_window, impl=impl, interpret=interpret, sinks=sinks)
    if not is_concrete(num_seqs):
        return
    n = int(num_seqs)
    if not 0 <= n <= max_num_seqs:
        raise ValueError(f"num_seqs must be in [0, max_num_seqs = {max_num_seqs}]; got {n}")
    if is_concrete(cu_q_lens):
        cu = np.asarray(cu_q_lens)[: n + 1]
        if cu[0] != 0:
            raise ValueError(f"cu_q_lens[0] must be 0; got {cu[0]}")
        if n and (np.diff(cu).min() < 0 or cu[-1] > num_tokens):
            raise ValueError(f"cu_q_lens[:num_seqs + 1] must be non-decreasing and at most "
                             f"num_tokens = {num_tokens}; got {cu.tolist()}")
        if n and is_concrete(seq_lens):
            lens = np.asarray(seq_lens)[:n]
            max_len = pages_per_seq * page_size
            q_lens = np.diff(cu)
            if lens.max() > max_len or (lens < q_lens).any():
                i = int(np.argmax((lens > max_len) | (lens < q_lens)))
                raise ValueError(f"seq_lens[i] must be in [q_len_i = cu_q_lens[i + 1] - "
                                 f"cu_q_lens[i], pages_per_seq * page_size = {max_len}] (the "
                                 f"query rows are the last cached tokens); got seq_lens[{i}] = "
                                 f"{lens[i]} with q_len {q_lens[i]}")
            check_used_pages(np.asarray(block_tables)[:n] if is_concrete(block_tables)
                             else block_tables, lens, page_size, num_pages)


# The `max_q_len` that `ragged_paged_attention` calls traced under `query_rows_at_most` get.
_MAX_Q_LEN = contextvars.ContextVar("jpa_max_q_len", default=None)
_ROWS_INDEPENDENT = contextvars.ContextVar("jpa_rows_independent", default=False)


@contextlib.contextmanager
def rows_independent(on: bool = True):
    """Within this context (while a program is traced), `ragged_paged_attention` computes every query
    row as a decode query of its own, in plain JAX: its key chunks aligned to absolute positions, the
    same operations in the same order whatever the other rows, the chunking of its prompt or the
    batch (chunks past a row's length are exact no-ops of the online softmax). The engine's
    batch-invariant mode (`EngineConfig.batch_invariant`) traces its ragged pass in it."""
    token = _ROWS_INDEPENDENT.set(bool(on))
    try:
        yield
    finally:
        _ROWS_INDEPENDENT.reset(token)


@contextlib.contextmanager
def query_rows_at_most(n: int):
    """Within this context (while a program is traced), `ragged_paged_attention` calls that do not
    pass `max_q_len` get max_q_len=n: the caller promises that no sequence has more than n query
    rows. The engine's speculative verify pass wraps its model pass in it (k + 1 rows a sequence),
    so the model's attention reads each sequence's KV once (see `ragged_paged_attention`)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"query_rows_at_most needs a positive int; got {n!r}")
    token = _MAX_Q_LEN.set(n)
    try:
        yield n
    finally:
        _MAX_Q_LEN.reset(token)


def ragged_paged_attention(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, num_seqs, *,
                           scale=None, soft_cap=None, alibi_slopes=None, sliding_window=None,
                           k_scales=None, v_scales=None, impl="auto", interpret=False, layer=None,
                           sinks=None, max_q_len=None):
    """Attention for a ragged batch of prefill chunks and decode tokens over a paged KV cache.

    Sequence i < num_seqs owns query rows cu_q_lens[i]:cu_q_lens[i + 1] (q_len_i rows), the last
    q_len_i positions of its seq_lens[i] cached tokens; row cu_q_lens[i] + t is at position
    p = seq_lens[i] - q_len_i + t and attends causally to the cached keys [0, p] of its own
    sequence (a decode token: q_len 1, p = seq_len - 1). Token p lives in physical page
    block_tables[i, p // page_size] at offset p % page_size. Write the new tokens' K/V with
    `jpa.write_kv` first. Rows past cu_q_lens[num_seqs] are padding: zero output, no work.

    Args:
      q: [num_tokens, num_q_heads, head_dim] float32, bfloat16 or float16; num_tokens is the static
        token budget T.
      k_pages: [num_kv_heads, num_pages, page_size, head_dim]; float32/bfloat16/float16, or
        int8/float8_e4m3fn/float8_e5m2 with scales.
      v_pages: same shape and dtype as k_pages.
      block_tables: i32[max_num_seqs, pages_per_seq]; entries past a sequence's pages, and rows
        past num_seqs, are never read into the result.
      seq_lens: i32[max_num_seqs]; for i < num_seqs, in [q_len_i, pages_per_seq * page_size].
      cu_q_lens: i32[max_num_seqs + 1]; cu_q_lens[0] = 0, non-decreasing up to
        cu_q_lens[num_seqs] <= num_tokens. Entries past num_seqs are ignored.
      num_seqs: i32 scalar (a device array, so that it is data, or a Python int), in
        [0, max_num_seqs].
      scale: softmax scale; default head_dim ** -0.5.
      soft_cap: if set, logits become soft_cap * tanh(logits / soft_cap) (after scaling).
      alibi_slopes: f32[num_q_heads]; adds slope_h * (key_pos - p) to the logits (vLLM).
      sliding_window: the query at position p attends only to keys (p - sliding_window, p].
      k_scales, v_scales: f32[num_kv_heads, num_pages, page_size], required for quantized caches.
      sinks: f32[num_q_heads] attention sinks or None, as `jpa.paged_decode` (every row's softmax
        gets the extra logit of its head).
      layer: with stacked pools `[num_layers, num_kv_heads, num_pages, page_size, head_dim]` (scales
        `f32[num_layers, num_kv_heads, num_pages, page_size]`), the layer to attend over: an int or
        an i32[] (traced, e.g. a scan's layer index: clamped to [0, num_layers)); the whole pool
        goes to the kernel. None with per-layer pools.
      impl: "xla" (plain JAX), "triton" (Pallas Triton-backend kernels, sm_80+), "mosaic"
        (Pallas Mosaic GPU kernels: WGMMA on Hopper, mma.sync on Ampere/Ada and Blackwell), or "auto": as `jpa.paged_decode` (`jpa.ops.dispatch`):
        the kernel for the GPU being compiled for after a one-time self-check, else "xla".
      interpret: run a Pallas kernel in interpret mode (CPU); ignored by "xla".
      max_q_len: None, or a promise (a static int) that no live sequence has more query rows
        (q_len_i <= max_q_len; checked when cu_q_lens is concrete). Default: the value of an
        enclosing `query_rows_at_most`, else None. The Mosaic kernels on Hopper then run every row
        in one multi-row decode kernel call that reads each sequence's KV once (a speculative
        verify pass), when max_q_len tokens' q heads fit its 64-row tile; the other paths ignore it.

    Returns:
      [num_tokens, num_q_heads, head_dim] in q's dtype; zeros at padding rows.
    """
    check_ragged_args(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, num_seqs,
                      scale=scale, soft_cap=soft_cap, alibi_slopes=alibi_slopes,
                      sliding_window=sliding_window, k_scales=k_scales, v_scales=v_scales,
                      impl=impl, interpret=interpret, layer=layer, sinks=sinks)
    if max_q_len is None:
        max_q_len = _MAX_Q_LEN.get()
    check_max_q_len(max_q_len, cu_q_lens, num_seqs)
    if layer is not None:
        layer = check_layer(layer, k_pages.shape[0])
    scale = float(scale) if scale is not None else float(q.shape[-1]) ** -0.5
    soft_cap = float(soft_cap) if soft_cap is not None else None
    sliding_window = int(sliding_window) if sliding_window is not None else None
    num_seqs = jnp.asarray(num_seqs, jnp.int32)
    opts = dict(scale=scale, soft_cap=soft_cap, alibi_slopes=alibi_slopes,
                sliding_window=sliding_window, k_scales=k_scales, v_scales=v_scales)
    if layer is not None:
        opts["layer"] = layer
    if sinks is not None:
        opts["sinks"] = sinks
    args = (q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, num_seqs)
    if _ROWS_INDEPENDENT.get():
        return ragged_paged_attention_xla(*args, **opts, per_row=True)
    chosen = choose_impl(impl, ragged_spec(q, k_pages, block_tables, soft_cap=soft_cap,
                                           alibi_slopes=alibi_slopes,
                                           sliding_window=sliding_window, sinks=sinks))
    if chosen == "xla":
        return ragged_paged_attention_xla(*args, **opts)
    if chosen == "mosaic" and max_q_len is not None:
        opts["max_q_len"] = max_q_len  # only the Mosaic kernels use it
    return kernel_module(chosen).ragged_paged_attention(
        *args, interpret=interpret, **opts, **dispatch.target_kernel_options(chosen, RAGGED))


def check_max_q_len(max_q_len, cu_q_lens, num_seqs):
    """Validates `ragged_paged_attention`'s max_q_len (None or a positive int; with concrete
    cu_q_lens and num_seqs, no live sequence longer)."""
    if max_q_len is None:
        return
    if isinstance(max_q_len, bool) or not isinstance(max_q_len, int) or max_q_len < 1:
        raise ValueError(f"max_q_len must be None or a positive int (static); got {max_q_len!r}")
    if is_concrete(cu_q_lens) and is_concrete(num_seqs):
        cu = np.asarray(cu_q_lens)[: int(num_seqs) + 1]
        longest = int(np.diff(cu).max()) if len(cu) > 1 else 0
        if longest > max_q_len:
            raise ValueError(f"max_q_len = {max_q_len} but a live sequence has {longest} query rows "
                             f"(cu_q_lens[i + 1] - cu_q_lens[i])")


def kernel_module(impl: str):
    """Imports the ragged kernel module for impl."""
    return dispatch.kernel_module(impl, RAGGED)


def unsupported_reason(impl: str, spec: RaggedSpec, compute_capability: float | None = None):
    """Why kernel `impl` cannot serve `spec` on a GPU of that compute capability (None: it can;
    compute_capability None skips device-specific limits, as in interpret mode)."""
    return dispatch.unsupported_reason(impl, spec, compute_capability, RAGGED)


def choose_impl(impl: str, spec: RaggedSpec) -> str:
    """Resolves impl for the device being compiled for, by `jpa.ops.dispatch`'s rules: "auto" is a
    kernel on an NVIDIA GPU after its one-time self-check there (exact-shape compile + small
    run against the plain-JAX path), the kernel `unsupported_reason` accepts under an AOT compile
    for an absent GPU, and "xla" elsewhere or on any failure."""
    return dispatch.choose_impl(impl, spec, op=RAGGED)


def self_check_inputs(spec: RaggedSpec, seed: int = 0):
    """A small random ragged batch with `spec`'s static configuration: a decode token, a prefill
    chunk from position 0 and a chunk after a cached prefix (as many as the budget and the
    sequence slots hold), each sequence on its own pages of a small pool."""
    rng = np.random.default_rng(seed)
    T, B, ps, pps = spec.num_tokens, spec.max_num_seqs, spec.page_size, spec.pages_per_seq
    max_len = ps * pps
    wanted = [1, max(1, (T - 1) // 2), max(1, T - 1 - (T - 1) // 2)]
    q_lens, left = [], T
    for want in wanted[: min(B, 3)]:
        q = min(want, left, max_len)
        if q < 1:
            break
        q_lens.append(q)
        left -= q
    n = len(q_lens)
    seq_lens = np.zeros(B, np.int32)
    for i, q in enumerate(q_lens):
        # The decode token and the third chunk sit after a random cached prefix; the second starts at 0.
        seq_lens[i] = q if i == 1 else q + rng.integers(0, max_len - q + 1)
    cu = np.zeros(B + 1, np.int32)
    cu[1: n + 1] = np.cumsum(q_lens)
    cu[n + 1:] = cu[n]
    num_pages = n * pps + 1
    pages = rng.permutation(num_pages)[: n * pps].reshape(n, pps)
    tables = np.zeros((B, pps), np.int32)
    tables[:n] = pages
    q = jnp.asarray(rng.standard_normal((T, spec.num_q_heads, spec.head_dim)), spec.q_dtype)
    k, v, opts = dispatch.random_pools_and_options(rng, spec, num_pages, max_len)
    args = (q, k, v, jnp.asarray(tables), jnp.asarray(seq_lens), jnp.asarray(cu),
            jnp.int32(n))
    return args, opts


def exact_shapes(spec: RaggedSpec, opts: dict):
    """ShapeDtypeStructs of a call with `spec`'s real shapes (the whole pool) and its array options."""
    sds = jax.ShapeDtypeStruct
    pool = dispatch.pool_shape(spec)
    b = spec.max_num_seqs
    args = (sds((spec.num_tokens, spec.num_q_heads, spec.head_dim), spec.q_dtype), sds(pool, spec.cache_dtype),
            sds(pool, spec.cache_dtype), sds((b, spec.pages_per_seq), jnp.int32), sds((b,), jnp.int32),
            sds((b + 1,), jnp.int32), sds((), jnp.int32))
    return args, dispatch.option_shapes(spec, opts)


RAGGED = dispatch.Op("ragged", tuple(KERNEL_MODULES.items()), "ragged_paged_attention",
                     "jpa.ops.ragged:ragged_paged_attention_xla", "jpa.ops.ragged:self_check_inputs",
                     "jpa.ops.ragged:exact_shapes")
