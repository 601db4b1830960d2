"""`jpa.paged_decode`: decode attention over a paged KV cache, with backend dispatch."""

from jpa.ops import dispatch
from jpa.pallas.spec import decode_spec
from jpa.ops.reference import paged_decode_xla
from jpa.ops.validate import check_decode_args, check_layer


def resolve_decode_impl(q, k_pages, block_tables, *, soft_cap=None, alibi_slopes=None,
                        sliding_window=None, impl="auto", sinks=None) -> str:
    """The implementation `paged_decode` will use for a call of these shapes on the current target.

    Call it once at set-up, outside any trace, with the exact shapes the jitted step will use
    (arrays or `jax.ShapeDtypeStruct`s): on a GPU it runs the kernel's one-time self-check there
    (compiled for these shapes, run on a small case), so the step itself only finds the cached
    answer. Pass the result as `impl=` to pin the choice.

    Args:
      q: [num_seqs, num_q_heads, head_dim] (its shape and dtype are used).
      k_pages: [num_kv_heads, num_pages, page_size, head_dim], or a stacked
        [num_layers, num_kv_heads, num_pages, page_size, head_dim] pool (shape and dtype).
      block_tables: i32[num_seqs, pages_per_seq] (shape).
      soft_cap, alibi_slopes, sliding_window, sinks: as `paged_decode` (only whether each is set
        matters).
      impl: as `paged_decode`.

    Returns:
      "xla", "triton" or "mosaic".
    """
    spec = decode_spec(q, k_pages, block_tables, soft_cap=soft_cap, alibi_slopes=alibi_slopes,
                       sliding_window=sliding_window, sinks=sinks)
    return dispatch.choose_impl(impl, spec)


def paged_decode(q, k_pages, v_pages, block_tables, seq_lens, *, scale=None, soft_cap=None,
                 alibi_slopes=None, sliding_window=None, k_scales=None, v_scales=None,
                 impl="auto", interpret=False, layer=None, sinks=None):
    """Decode attention (one query token per sequence) over a paged KV cache.

    Sequence b attends to its first `seq_lens[b]` cached tokens; token t lives in physical page
    `block_tables[b, t // page_size]` at offset `t % page_size`. Write the new token's K/V with
    `jpa.write_kv` first, then call this with lengths that include it (vLLM order).

    Args:
      q: [num_seqs, num_q_heads, head_dim] float32, bfloat16 or float16.
      k_pages: [num_kv_heads, num_pages, page_size, head_dim]; float32/bfloat16/float16, or
        int8/float8_e4m3fn/float8_e5m2 with scales.
      v_pages: same shape and dtype as k_pages.
      block_tables: i32[num_seqs, pages_per_seq]. Entries past a sequence's pages are never read
        into the result.
      seq_lens: i32[num_seqs], each in [0, pages_per_seq * page_size]. 0 gives a zero output.
      scale: softmax scale; default head_dim ** -0.5.
      soft_cap: if set, logits become soft_cap * tanh(logits / soft_cap) (after scaling).
      alibi_slopes: f32[num_q_heads]; adds slope_h * (pos - seq_len + 1) to the logits (vLLM).
      sliding_window: attend only to the last `sliding_window` tokens.
      k_scales, v_scales: f32[num_kv_heads, num_pages, page_size], required for quantized caches.
      sinks: f32[num_q_heads] attention sinks (gpt-oss), finite, or None: head h's softmax gets one
        more logit sinks[h] with a zero value, out = sum_j e^(s_j) v_j / (e^(sinks[h]) + sum_j e^(s_j));
        a length-0 sequence still gives 0.
      layer: with stacked pools `[num_layers, num_kv_heads, num_pages, page_size, head_dim]` (scales
        `f32[num_layers, num_kv_heads, num_pages, page_size]`, as `jpa.KVCache` holds them), the
        layer to attend over: an int or an i32[] (traced, e.g. the index of a scan over layers:
        clamped to [0, num_layers)). The whole stacked pool goes to the kernel, never a per-layer
        slice (which XLA would copy). None with per-layer pools.
      impl: "xla" (plain JAX), "triton" or "mosaic" (Pallas GPU kernels), or "auto": for the
        device being compiled for, a GPU kernel on an NVIDIA GPU after a one-time self-check
        there: the first of Mosaic (Hopper; Ampere/Ada) and Triton whose `unsupported_reason` accepts the
        configuration and whose check passes (one warning names the ones passed over and why),
        else "xla"; under an AOT compile for an absent GPU, the first kernel its
        `unsupported_reason` accepts. See `jpa.ops.dispatch`.
      interpret: run a Pallas kernel in interpret mode (CPU); ignored by "xla".

    Returns:
      [num_seqs, num_q_heads, head_dim] in q's dtype.
    """
    check_decode_args(q, k_pages, v_pages, block_tables, seq_lens, scale=scale, soft_cap=soft_cap,
                      alibi_slopes=alibi_slopes, sliding_window=sliding_window, k_scales=k_scales,
                      v_scales=v_scales, impl=impl, interpret=interpret, layer=layer, sinks=sinks)
    if layer is not None:
        layer = check_layer(layer, k_pages.shape[0])
    scale = float(scale) if scale is not None else float(q.shape[-1]) ** -0.5
    soft_cap = float(soft_cap) if soft_cap is not None else None
    sliding_window = int(sliding_window) if sliding_window is not None else None
    opts = dict(scale=scale, soft_cap=soft_cap, alibi_slopes=alibi_slopes,
                sliding_window=sliding_window, k_scales=k_scales, v_scales=v_scales)
    if layer is not None:
        opts["layer"] = layer
    if sinks is not None:
        opts["sinks"] = sinks
    chosen = "xla" if impl == "xla" else dispatch.choose_impl(
        impl, decode_spec(q, k_pages, block_tables, soft_cap=soft_cap, alibi_slopes=alibi_slopes,
                          sliding_window=sliding_window, sinks=sinks))
    if chosen == "xla":
        return paged_decode_xla(q, k_pages, v_pages, block_tables, seq_lens, **opts)
    return dispatch.kernel_module(chosen).paged_decode(
        q, k_pages, v_pages, block_tables, seq_lens, interpret=interpret, **opts,
        **dispatch.target_kernel_options(chosen))
