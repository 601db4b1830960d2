"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks experts_per_token of num_experts
SwiGLU experts per token; the experts run as grouped matmuls over the tokens routed to them.

Formulation: the M tokens' M*k (token, expert) pairs are sorted by expert (each expert's rows a
contiguous run, an expert nobody chose an empty one), the three expert matmuls run over those runs,
and the rows are put back in (token, choice) order, weighted by the router's probabilities and
summed over the k choices (a fixed-order sum, not a scatter-add). Shapes are static whatever the
routing, so it runs inside the engine's one jitted step and the scan over layers. Three forms of
the grouped matmul, picked statically by the shapes and `EXPERT_MATMUL`:

- "blocked" (default) and M*k < E (a decode step at small batch): `_gathered`, each pair's
  expert weights gathered and applied as batched matrix-vector products; XLA fuses the layer
  slice, the gather and the product, so the step reads only the chosen experts' weights.
- "blocked" and M*k >= E: `_blocked`, each expert's run padded to whole tiles of rows, each
  tile's expert weights gathered, one batched matmul over the tiles (about the routed flops; the
  gathered tiles' weights are materialized).
- "ragged_dot", any size: ONE `jax.lax.ragged_dot` per matmul with group_sizes = rows per
  expert. A deviceless H100 compile (JAX 0.12) shows XLA lowering it to a dense dot over ALL E
  experts with the rows masked per group: E times the routed flops, for about the bytes of the
  blocked form (README, "Mixture of experts"; scripts/moe_traffic.py).

`moe_dense` (every token through every expert, weighted by a mask of its choices) is the test
oracle only; the model never calls it.

Einsum letters: M tokens, D d_model, F expert ffn width, E experts, k experts per token.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

# The grouped matmul: "blocked" (`_gathered` for M*k < E pairs, else `_blocked`) or "ragged_dot"
# (jax.lax.ragged_dot at every size).
# Blocked, by a deviceless H100 compile (README, "Mixture of experts"): XLA's GPU ragged_dot is a
# dense dot over all E experts (E times the routed flops), the blocked form about the routed flops,
# for about the same bytes.
EXPERT_MATMUL = "blocked"


def route(x, router, config):
    """Router choices of tokens x f32[M, D] with router weights [D, E].

    Returns:
      (experts i32[M, k], weights f32[M, k]): the k experts of highest softmax probability per
      token (ties: the lower index first, as torch.topk on CPU) and their probabilities,
      renormalized to sum to 1 when config.norm_topk_prob.
    """
    logits = jnp.dot(x.astype(router.dtype), router, preferred_element_type=jnp.float32)  # f32[M, E]
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, config.experts_per_token)
    if config.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return experts.astype(jnp.int32), weights


def moe_ffn(x, router, w_gate, w_up, w_down, config, dtype):
    """The MoE MLP of tokens x f32[M, D] as grouped matmuls (module docstring).

    Args:
      x: f32[M, D] (the normed residual stream).
      router: [D, E]; w_gate, w_up: [E, D, F]; w_down: [E, F, D] (the x @ W convention).
      config: the ModelConfig (experts_per_token, norm_topk_prob).
      dtype: the matmuls' input dtype (the parameters'); they accumulate in float32.

    Returns:
      f32[M, D].
    """
    num_tokens, d = x.shape
    k, e = config.experts_per_token, config.num_experts
    experts, weights = route(x, router, config)  # [M, k]
    if EXPERT_MATMUL not in ("blocked", "ragged_dot"):
        raise ValueError(f"models.moe.EXPERT_MATMUL must be 'blocked' or 'ragged_dot'; got {EXPERT_MATMUL!r}")
    if EXPERT_MATMUL == "blocked" and num_tokens * k < e:  # few pairs: read only the chosen experts' weights
        return _gathered(x, experts, weights, w_gate, w_up, w_down, dtype)
    if EXPERT_MATMUL == "blocked":  # tiles of about the mean rows per expert, 8 to 128
        tile = int(min(128, max(8, 2 ** round(np.log2(max(1, num_tokens * k // e))))))
        return _blocked(x, experts, weights, w_gate, w_up, w_down, dtype, tile)
    flat = experts.reshape(num_tokens * k)  # pair p = token * k + choice
    order = jnp.argsort(flat, stable=True)  # pairs sorted by expert
    rows = jnp.take(x.astype(dtype), order // k, axis=0)  # [M*k, D] in expert order
    group_sizes = jnp.bincount(flat, length=e).astype(jnp.int32)  # [E], sums to M*k
    # Under a mesh with explicit axes (a deviceless compile's), ragged_dot needs its output's sharding
    # spelled out (JAX 0.12 has no inference rule for it): replicated, as the model runs on one device.
    sharding = getattr(jax.typeof(rows), "sharding", None)
    out = (NamedSharding(sharding.mesh, P()) if isinstance(sharding, NamedSharding) and not sharding.mesh.empty
           and not sharding.mesh.are_all_axes_auto else None)
    mm = lambda a, w: jax.lax.ragged_dot(a.astype(dtype), w, group_sizes, preferred_element_type=jnp.float32,
                                         out_sharding=out)
    h = jax.nn.silu(mm(rows, w_gate)) * mm(rows, w_up)  # f32[M*k, F]
    y = mm(h, w_down)  # f32[M*k, D]
    y = jnp.take(y, jnp.argsort(order), axis=0).reshape(num_tokens, k, d)  # back to (token, choice)
    return jnp.einsum("MkD,Mk->MD", y, weights)


def _gathered(x, experts, weights, w_gate, w_up, w_down, dtype):
    """The small-batch form of `moe_ffn` (M*k < E pairs, e.g. a decode step): each pair's expert
    weights gathered ([M*k, D, F]) and applied to its token (batched matrix-vector products), so the
    step reads M*k experts' weights, not all E (XLA's GPU ragged_dot reads every expert)."""
    num_tokens, d = x.shape
    k = experts.shape[1]
    flat = experts.reshape(num_tokens * k)
    rows = jnp.repeat(x.astype(dtype), k, axis=0)  # [M*k, D], pair p = token * k + choice
    take = lambda w: jnp.take(w, flat, axis=0, mode="clip")  # [M*k, ...] (the router's ids are in range)
    mv = lambda a, w: jnp.einsum("PI,PIO->PO", a.astype(dtype), take(w), preferred_element_type=jnp.float32)
    h = jax.nn.silu(mv(rows, w_gate)) * mv(rows, w_up)  # f32[M*k, F]
    y = mv(h, w_down).reshape(num_tokens, k, d)
    return jnp.einsum("MkD,Mk->MD", y, weights)


def _blocked(x, experts, weights, w_gate, w_up, w_down, dtype, tile):
    """`moe_ffn` as tiles of `tile` rows, each tile one expert's (the pairs sorted by expert, each
    expert's run padded to whole tiles): the expert weights gathered per tile and one batched matmul
    [tiles, tile, D] x [tiles, D, F]. Static shapes: at most ceil(M*k / tile) + E tiles."""
    num_tokens, d = x.shape
    k, e = experts.shape[1], w_gate.shape[0]
    pairs = num_tokens * k
    num_tiles = -(-pairs // tile) + e
    flat = experts.reshape(pairs)
    order = jnp.argsort(flat, stable=True)  # pairs sorted by expert
    sorted_e = flat[order]
    counts = jnp.bincount(flat, length=e)
    group_start = jnp.cumsum(counts) - counts  # first sorted pair of each expert
    tiles = -(-counts // tile)
    tile_end = jnp.cumsum(tiles)
    tile_start = tile_end - tiles  # first tile of each expert
    pos = tile_start[sorted_e] * tile + jnp.arange(pairs) - group_start[sorted_e]  # padded row of each sorted pair
    rows = jnp.zeros((num_tiles * tile, d), dtype).at[pos].set(jnp.take(x.astype(dtype), order // k, axis=0))
    tile_expert = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(num_tiles), side="right"), e - 1)
    take = lambda w: jnp.take(w, tile_expert, axis=0, mode="clip")  # [tiles, ...]
    mm = lambda a, w: jnp.einsum("NTI,NIO->NTO", a.astype(dtype).reshape(num_tiles, tile, -1), take(w),
                                 preferred_element_type=jnp.float32)
    h = jax.nn.silu(mm(rows, w_gate)) * mm(rows, w_up)  # f32[tiles, tile, F]
    y = mm(h, w_down).reshape(num_tiles * tile, d)[pos]  # f32[M*k, D] in sorted order
    y = jnp.take(y, jnp.argsort(order), axis=0).reshape(num_tokens, k, d)
    return jnp.einsum("MkD,Mk->MD", y, weights)


def moe_dense(x, router, w_gate, w_up, w_down, config, dtype):
    """The test oracle of `moe_ffn`: every token through every expert, weighted by its routing
    (zero for experts it did not choose). Same arguments and result."""
    experts, weights = route(x, router, config)
    mask = jnp.zeros((x.shape[0], config.num_experts), jnp.float32)
    mask = mask.at[jnp.arange(x.shape[0])[:, None], experts].set(weights)  # f32[M, E]
    xd = x.astype(dtype)
    g = jnp.einsum("MD,EDF->MEF", xd, w_gate, preferred_element_type=jnp.float32)
    u = jnp.einsum("MD,EDF->MEF", xd, w_up, preferred_element_type=jnp.float32)
    y = jnp.einsum("MEF,EFD->MED", (jax.nn.silu(g) * u).astype(dtype), w_down, preferred_element_type=jnp.float32)
    return jnp.einsum("MED,ME->MD", y, mask)
