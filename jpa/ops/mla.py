"""Multi-head latent attention (DeepSeek's MLA) over a paged latent cache, in plain JAX: the oracle.

MLA caches one latent per token for all heads: `latent = [c (kv_lora_rank), k_rope (rope_dim)]`,
`latent_dim = kv_lora_rank + rope_dim` values. In the absorbed form (DeepSeek-V2 paper, "absorb"), head n's
query is `q = [q_nope_n @ W_UK_n (kv_lora_rank), q_rope_n (rope_dim)]` (`latent_dim` wide), its score against
a token is `q . latent`, and its output is the softmax-weighted sum of the tokens' `c` (the first
`kv_lora_rank` values of the same latent), which the model maps through W_UV_n after. So attention is MQA with
one shared head whose key is the whole latent and whose value is its first kv_lora_rank values: nothing but the
latent is stored or read.

Pools: the latent pages are a `jpa.KVCache`'s K pool with one kv head, `[num_layers, 1, num_pages, page_size,
latent_dim]` (read at `layer`), or one layer's `[1, num_pages, page_size, latent_dim]` (layer None). Its V
pool is not read (the engine allocates it zero wide: `jpa.kv.cache.CacheConfig.v_head_dim`).

- `mla_paged_decode`: one query row per sequence. Each chunk of a sequence's pages is gathered ONCE and
  serves both dots, all N heads at once (the heads are the rows of one [N, latent_dim] x [latent_dim, S]
  product, the M dimension of a kernel), online softmax over the chunks.
- `mla_ragged_attention`: prefill chunks and decode rows back to back, as `jpa.ragged_paged_attention`
  (its plain-JAX path run with the latent pool as K and as V, the value columns past kv_lora_rank dropped).
  That path gathers K and V pages apart, so the latent may be read twice here unless XLA merges the two
  gathers of one operand (not checked); the engine's decode steps run `mla_paged_decode`, which reads it once.

Einsum letters: B num_seqs, N q heads, S key tokens of a chunk, D latent_dim, R kv_lora_rank.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jpa.core.numerics import MASK_VALUE
from jpa.ops.ragged import check_ragged_args, ragged_paged_attention_xla
from jpa.ops.reference import chunk_pages, gather_pages
from jpa.ops.validate import check_decode_args, check_layer


def _check_latent(q, latent_pages, kv_lora_rank):
    if latent_pages.shape[-4] != 1:
        raise ValueError(f"latent_pages must hold one kv head (the latent shared by all heads): shape "
                         f"[num_layers, 1, num_pages, page_size, latent_dim] or [1, num_pages, page_size, "
                         f"latent_dim]; got {list(latent_pages.shape)}")
    latent_dim = latent_pages.shape[-1]
    if not isinstance(kv_lora_rank, int) or isinstance(kv_lora_rank, bool) or not 1 <= kv_lora_rank <= latent_dim:
        raise ValueError(f"kv_lora_rank must be an int in [1, latent_dim = {latent_dim}] (the latent's value "
                         f"part); got {kv_lora_rank!r}")


def mla_paged_decode(q, latent_pages, block_tables, seq_lens, *, kv_lora_rank: int, scale: float, layer=None):
    """Absorbed MLA decode: each sequence's query row against its cached latents.

    Args:
      q: [num_seqs, num_q_heads, latent_dim]; per head [q_nope @ W_UK (kv_lora_rank), q_rope (rope_dim)].
      latent_pages: [num_layers, 1, num_pages, page_size, latent_dim] (with `layer`) or
        [1, num_pages, page_size, latent_dim].
      block_tables: i32[num_seqs, pages_per_seq].
      seq_lens: i32[num_seqs]; tokens each sequence attends over (0 = idle: a zero row).
      kv_lora_rank: the value width (the latent's first kv_lora_rank values).
      scale: the softmax scale (DeepSeek: qk_head_dim ** -0.5, times YaRN's mscale squared).
      layer: the layer of a stacked pool (int or i32[]), None for one layer's pool.

    Returns:
      [num_seqs, num_q_heads, kv_lora_rank] in q's dtype.
    """
    check_decode_args(q, latent_pages, latent_pages, block_tables, seq_lens, scale=scale, soft_cap=None,
                      alibi_slopes=None, sliding_window=None, k_scales=None, v_scales=None, impl="xla",
                      interpret=False, layer=layer)
    _check_latent(q, latent_pages, kv_lora_rank)
    if layer is not None:
        layer = check_layer(layer, latent_pages.shape[0])
    return mla_decode_xla(q, latent_pages, block_tables, seq_lens, kv_lora_rank=kv_lora_rank, scale=float(scale),
                          layer=layer)


@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "scale", "pages_per_chunk"))
def mla_decode_xla(q, latent_pages, block_tables, seq_lens, *, kv_lora_rank, scale, layer=None,
                   pages_per_chunk=None):
    """`mla_paged_decode` without validation (arguments checked; `layer` an i32[] or None)."""
    num_seqs, num_q_heads, latent_dim = q.shape
    page_size = latent_pages.shape[-2]
    pages_per_seq = block_tables.shape[1]
    ppc = pages_per_chunk or chunk_pages(page_size, pages_per_seq)
    num_chunks = -(-pages_per_seq // ppc)
    chunk_tokens = ppc * page_size
    if num_chunks * ppc != pages_per_seq:
        # Padding entries are never visible: their positions are >= every seq_len.
        block_tables = jnp.pad(block_tables, ((0, 0), (0, num_chunks * ppc - pages_per_seq)))
    seq_lens = seq_lens.astype(jnp.int32)  # i32[B]
    qs = q.astype(jnp.float32) * scale  # [B, N, D]

    def body(c, carry):
        m, l, acc = carry  # [B, N], [B, N], [B, N, R]
        tbl = lax.dynamic_slice_in_dim(block_tables, c * ppc, ppc, axis=1)  # i32[B, ppc]
        lat = gather_pages(latent_pages, tbl, layer)[0]  # [B, ppc, S_p, D]: the chunk, read once
        lat = lat.reshape(num_seqs, chunk_tokens, latent_dim).astype(jnp.float32)  # [B, S, D]
        pos = c * chunk_tokens + jnp.arange(chunk_tokens, dtype=jnp.int32)  # i32[S]
        valid = pos[None, :] < seq_lens[:, None]  # [B, S]
        s = jnp.einsum("BND,BSD->BNS", qs, lat, preferred_element_type=jnp.float32)
        s = jnp.where(valid[:, None, :], s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        # Rescale what was accumulated under the old max before adding this chunk.
        alpha = jnp.exp(m - m_new)
        p = jnp.where(valid[:, None, :], jnp.exp(s - m_new[..., None]), 0.0)
        # Slots a sequence cannot see may hold garbage (even NaN): 0 * NaN = NaN.
        c_lat = jnp.where(valid[:, :, None], lat[..., :kv_lora_rank], 0.0)  # [B, S, R]
        l_new = l * alpha + jnp.sum(p, axis=-1)
        acc_new = acc * alpha[..., None] + jnp.einsum("BNS,BSR->BNR", p, c_lat, preferred_element_type=jnp.float32)
        return m_new, l_new, acc_new

    init = (jnp.full((num_seqs, num_q_heads), MASK_VALUE, jnp.float32),
            jnp.zeros((num_seqs, num_q_heads), jnp.float32),
            jnp.zeros((num_seqs, num_q_heads, kv_lora_rank), jnp.float32))
    if num_chunks == 1:
        m, l, acc = body(0, init)
    else:
        # Visit only the chunks some sequence occupies: lengths are data, so this is a while loop.
        m, l, acc = lax.fori_loop(0, -(-jnp.max(seq_lens) // chunk_tokens), body, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return out.astype(q.dtype)


def mla_ragged_attention(q, latent_pages, block_tables, seq_lens, cu_q_lens, num_seqs, *, kv_lora_rank: int,
                         scale: float, layer=None):
    """Absorbed MLA over a ragged batch (prefill chunks and decode rows back to back), with the row
    layout of `jpa.ragged_paged_attention`: sequence i owns rows cu_q_lens[i]:cu_q_lens[i + 1], the last
    q_len_i positions of its seq_lens[i] cached tokens, causal within the chunk.

    Args:
      q: [num_tokens, num_q_heads, latent_dim].
      latent_pages, kv_lora_rank, scale, layer: as `mla_paged_decode`.
      block_tables: i32[max_num_seqs, pages_per_seq]; seq_lens: i32[max_num_seqs];
      cu_q_lens: i32[max_num_seqs + 1]; num_seqs: i32[] or int (rows past cu_q_lens[num_seqs] are padding).

    Returns:
      [num_tokens, num_q_heads, kv_lora_rank] in q's dtype; zero rows for padding.
    """
    check_ragged_args(q, latent_pages, latent_pages, block_tables, seq_lens, cu_q_lens, num_seqs, scale=scale,
                      soft_cap=None, alibi_slopes=None, sliding_window=None, k_scales=None, v_scales=None,
                      impl="xla", interpret=False, layer=layer)
    _check_latent(q, latent_pages, kv_lora_rank)
    if layer is not None:
        layer = check_layer(layer, latent_pages.shape[0])
    return mla_ragged_xla(q, latent_pages, block_tables, seq_lens, cu_q_lens, num_seqs, kv_lora_rank=kv_lora_rank,
                          scale=float(scale), layer=layer)


def mla_ragged_xla(q, latent_pages, block_tables, seq_lens, cu_q_lens, num_seqs, *, kv_lora_rank, scale,
                   layer=None):
    """`mla_ragged_attention` without validation."""
    out = ragged_paged_attention_xla(q, latent_pages, latent_pages, block_tables, seq_lens, cu_q_lens,
                                     jnp.asarray(num_seqs, jnp.int32), scale=scale, layer=layer)
    return out[..., :kv_lora_rank]
