"""Checks at the public boundary. Every message names the argument, the rule and what was given."""

import jax
import numpy as np

from jpa.core.quant import FLOAT_DTYPES, QUANT_MAX, is_quantized

CACHE_DTYPES = FLOAT_DTYPES + tuple(QUANT_MAX)
IMPLS = ("auto", "xla", "triton", "mosaic")


def _names(dtypes):
    return ", ".join(np.dtype(d).name for d in dtypes)


def is_concrete(x) -> bool:
    """True when x holds values we can look at on the host (not a tracer)."""
    return not isinstance(x, jax.core.Tracer)


def check_ndim(name, x, ndim, shape_doc):
    if getattr(x, "ndim", None) != ndim:
        raise ValueError(f"{name} must have shape {shape_doc} ({ndim} dims); got shape "
                         f"{getattr(x, 'shape', type(x).__name__)}")


def check_dtype(name, x, allowed):
    if np.dtype(x.dtype) not in [np.dtype(d) for d in allowed]:
        raise ValueError(f"{name} must have dtype in ({_names(allowed)}); got {np.dtype(x.dtype).name}")


POOL_DOC = "[num_kv_heads, num_pages, page_size, head_dim]"
STACKED_POOL_DOC = "[num_layers, num_kv_heads, num_pages, page_size, head_dim]"


def check_layer(layer, num_layers):
    """Validates the layer index of a stacked pool of `num_layers` layers.

    Args:
      layer: a Python int in [0, num_layers), or an integer scalar array (a tracer inside a jit or
        a scan over layers: clamped to [0, num_layers - 1], since it cannot be looked at).

    Returns:
      The layer as an i32[] array.
    """
    if isinstance(layer, bool) or not (isinstance(layer, (int, np.integer)) or hasattr(layer, "dtype")):
        raise ValueError(f"layer must be an int or an integer scalar array (the layer of a stacked "
                         f"{STACKED_POOL_DOC} pool); got {layer!r}")
    if hasattr(layer, "dtype"):
        if not np.issubdtype(np.dtype(layer.dtype), np.integer) or np.shape(layer) != ():
            raise ValueError(f"layer must be an integer scalar (shape ()); got "
                             f"{np.dtype(layer.dtype).name}{list(np.shape(layer))}")
    if is_concrete(layer):
        i = int(layer)
        if not 0 <= i < num_layers:
            raise ValueError(f"layer must be in [0, num_layers = {num_layers}) (k_pages.shape[0]); got {i}")
        return jax.numpy.asarray(i, jax.numpy.int32)
    return jax.numpy.clip(layer.astype(jax.numpy.int32), 0, num_layers - 1)


def check_cache_pair(k_pages, v_pages, k_scales, v_scales, layer=None):
    """Validates K/V page pools and their scales: per-layer pools `[K, P, S_p, H]` (layer None), or
    stacked pools `[L, K, P, S_p, H]` read at `layer` (scales `f32[L, K, P, S_p]`).

    Returns (num_kv_heads, num_pages, page_size, head_dim) of one layer. The layer index itself is
    checked (and normalized) by `check_layer`, which every public entry calls next."""
    stacked = getattr(k_pages, "ndim", None) == 5
    if stacked:
        if layer is None:
            raise ValueError(f"k_pages is a stacked {STACKED_POOL_DOC} pool (shape {list(k_pages.shape)}): "
                             f"pass layer= (which layer to read and write)")
        check_ndim("v_pages", v_pages, 5, STACKED_POOL_DOC)
    else:
        if layer is not None:
            raise ValueError(f"layer= is for a stacked {STACKED_POOL_DOC} pool; k_pages has shape "
                             f"{getattr(k_pages, 'shape', None)} (a per-layer pool takes no layer)")
        check_ndim("k_pages", k_pages, 4, f"{POOL_DOC} or {STACKED_POOL_DOC} with layer=")
        check_ndim("v_pages", v_pages, 4, POOL_DOC)
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"v_pages must have the shape of k_pages {k_pages.shape}; got {v_pages.shape}")
    check_dtype("k_pages", k_pages, CACHE_DTYPES)
    if v_pages.dtype != k_pages.dtype:
        raise ValueError(f"v_pages must have the dtype of k_pages ({np.dtype(k_pages.dtype).name}); "
                         f"got {np.dtype(v_pages.dtype).name}")
    num_kv_heads, num_pages, page_size, head_dim = k_pages.shape[-4:]
    scale_shape = tuple(k_pages.shape[:-1])
    scale_doc = ("[num_layers, num_kv_heads, num_pages, page_size]" if stacked
                 else "[num_kv_heads, num_pages, page_size]")
    if is_quantized(k_pages.dtype):
        for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
            if s is None:
                raise ValueError(f"{name} is required for a {np.dtype(k_pages.dtype).name} cache: "
                                 f"f32{scale_doc} = f32{list(scale_shape)}")
            if tuple(s.shape) != scale_shape:
                raise ValueError(f"{name} must have shape {scale_doc} = {list(scale_shape)}; got {list(s.shape)}")
            check_dtype(name, s, (np.float32,))
    else:
        for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
            if s is not None:
                raise ValueError(f"{name} is only for int8/float8 caches; the cache dtype is "
                                 f"{np.dtype(k_pages.dtype).name}, so {name} must be None")
    return num_kv_heads, num_pages, page_size, head_dim


def check_tables(block_tables, num_seqs, source="q.shape[0]"):
    """Validates block_tables i32[num_seqs, pages_per_seq]; returns pages_per_seq.

    `source` names where num_seqs was read from (for the message).
    """
    check_ndim("block_tables", block_tables, 2, "i32[num_seqs, pages_per_seq]")
    check_dtype("block_tables", block_tables, (np.int32,))
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must have num_seqs = {num_seqs} rows ({source}); "
                         f"got {block_tables.shape[0]}")
    if block_tables.shape[1] < 1:
        raise ValueError("block_tables must have at least one column (pages_per_seq >= 1); got 0")
    return block_tables.shape[1]


def check_positive(name, value):
    """A positive finite Python number, or None."""
    if value is not None and not (isinstance(value, (int, float)) and np.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite Python number or None; got {value!r}")


def check_used_pages(block_tables, lens, page_size, num_pages):
    """Concrete tables: entries a sequence of length lens[b] uses must name real pages."""
    if not is_concrete(block_tables):
        return
    tables = np.asarray(block_tables)
    used = np.arange(tables.shape[1])[None, :] < -(-np.asarray(lens)[:, None] // page_size)
    bad = used & ((tables < 0) | (tables >= num_pages))
    if bad.any():
        b, j = map(int, np.argwhere(bad)[0])
        raise ValueError(f"block_tables entries for a sequence's pages must be in [0, num_pages = "
                         f"{num_pages}); got block_tables[{b}, {j}] = {tables[b, j]}")


def check_sinks(sinks, num_q_heads):
    """Attention sinks: None, or a float32 array [num_q_heads] (one logit per q head)."""
    if sinks is None:
        return
    check_ndim("sinks", sinks, 1, f"f32[num_q_heads] = f32[{num_q_heads}]")
    if sinks.shape[0] != num_q_heads:
        raise ValueError(f"sinks must have num_q_heads = {num_q_heads} entries (one logit per q "
                         f"head); got {sinks.shape[0]}")
    check_dtype("sinks", sinks, (np.float32,))
    if is_concrete(sinks) and not np.isfinite(np.asarray(sinks)).all():
        raise ValueError("sinks must be finite (a sink of -inf is no sink: pass sinks=None)")


def check_options(num_q_heads, *, scale, soft_cap, alibi_slopes, sliding_window, impl, interpret,
                  sinks=None):
    """Validates the keyword options shared by `paged_decode` and `ragged_paged_attention`."""
    check_sinks(sinks, num_q_heads)
    check_positive("scale", scale)
    check_positive("soft_cap", soft_cap)
    if sliding_window is not None and not (isinstance(sliding_window, (int, np.integer))
                                           and not isinstance(sliding_window, bool)
                                           and sliding_window >= 1):
        raise ValueError(f"sliding_window must be a Python int >= 1 or None; got {sliding_window!r}")
    if alibi_slopes is not None:
        check_ndim("alibi_slopes", alibi_slopes, 1, f"f32[num_q_heads] = f32[{num_q_heads}]")
        if alibi_slopes.shape[0] != num_q_heads:
            raise ValueError(f"alibi_slopes must have num_q_heads = {num_q_heads} entries; "
                             f"got {alibi_slopes.shape[0]}")
        check_dtype("alibi_slopes", alibi_slopes, FLOAT_DTYPES)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
    if not isinstance(interpret, bool):
        raise ValueError(f"interpret must be a bool; got {interpret!r}")


def check_decode_args(q, k_pages, v_pages, block_tables, seq_lens, *, scale, soft_cap,
                      alibi_slopes, sliding_window, k_scales, v_scales, impl, interpret, layer=None,
                      sinks=None):
    """Validates `paged_decode`'s arguments; raises ValueError on the first problem found."""
    check_ndim("q", q, 3, "[num_seqs, num_q_heads, head_dim]")
    check_dtype("q", q, FLOAT_DTYPES)
    num_kv_heads, num_pages, page_size, head_dim = check_cache_pair(k_pages, v_pages, k_scales, v_scales,
                                                                    layer)
    num_seqs, num_q_heads, q_head_dim = q.shape
    if q_head_dim != head_dim:
        raise ValueError(f"q's head_dim must equal the cache's head_dim {head_dim}; got {q_head_dim}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads (q.shape[1] = {num_q_heads}) must be a multiple of "
                         f"num_kv_heads (k_pages.shape[-4] = {num_kv_heads})")
    pages_per_seq = check_tables(block_tables, num_seqs)
    check_ndim("seq_lens", seq_lens, 1, "i32[num_seqs]")
    check_dtype("seq_lens", seq_lens, (np.int32,))
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens must have num_seqs = {num_seqs} entries; got {seq_lens.shape[0]}")
    check_options(num_q_heads, scale=scale, soft_cap=soft_cap, alibi_slopes=alibi_slopes,
                  sliding_window=sliding_window, impl=impl, interpret=interpret, sinks=sinks)
    max_len = pages_per_seq * page_size
    if is_concrete(seq_lens):
        lens = np.asarray(seq_lens)
        if lens.size and (lens.min() < 0 or lens.max() > max_len):
            raise ValueError(f"seq_lens must be in [0, pages_per_seq * page_size = {max_len}]; "
                             f"got values in [{lens.min()}, {lens.max()}]")
        if lens.size:
            check_used_pages(block_tables, lens, page_size, num_pages)
