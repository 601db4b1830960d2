"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE, gpt-oss): a router picks experts_per_token of
num_experts SwiGLU experts per token (gpt-oss: router and expert biases, clamped SwiGLU, `glu`);
the experts run as grouped matmuls over the tokens routed to them.

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
  blocked form (docs/models.md, "Mixture of experts"; `jpa tools traffic-moe`).

Under tensor parallelism (`moe_ffn(..., parallel=(mesh, layout))`, `expert_parallel`) the same forms run
per device inside one `jax.shard_map` over the device's shard of the experts ("experts": E/N whole
experts, the other devices' pairs masked; "ffn": F/N of every expert's width), then one psum of
f32[M, D]; models.sharding.plan_experts picks the layout.

`moe_dense` (every token through every expert, weighted by a mask of its choices) is the test
oracle only; the model never calls it.

Einsum letters: M tokens, D d_model, F expert ffn width, E experts, k experts per token.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jpa.core.sharding import TP

# MXFP4 (OCP microscaling FP4; gpt-oss's released experts): e2m1 codes, two per byte (the low nibble
# first), in blocks of MXFP4_BLOCK along a weight's `in` axis, each block times 2^(scale - 127)
# (an e8m0 byte). transformers' FP4_VALUES:
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    np.float32)
MXFP4_BLOCK = 32

# The grouped matmul: "blocked" (`_gathered` for M*k < E pairs, else `_blocked`) or "ragged_dot"
# (jax.lax.ragged_dot at every size).
# Blocked, by a deviceless H100 compile (docs/models.md, "Mixture of experts"): XLA's GPU ragged_dot is a
# dense dot over all E experts (E times the routed flops), the blocked form about the routed flops,
# for about the same bytes.
EXPERT_MATMUL = "blocked"


def dequantize_mxfp4(codes, scales, dtype):
    """The float weight of MXFP4 expert weights (jnp; inside the jit, fused into the matmul that reads it).

    Args:
      codes: u8[..., O, I / 2] (the checkpoint's `*_blocks` [..., O, I / 32, 16] with the last two axes
        merged; byte j holds values 2j (low nibble) and 2j + 1 (high nibble) of a row).
      scales: u8[..., O, I / 32] e8m0 exponents: a block's values are multiplied by 2^(scale - 127).
      dtype: the result's dtype (exact in bfloat16 and float32: 2-bit mantissas times powers of two).

    Returns:
      dtype[..., I, O], the x @ W layout.
    """
    lut = jnp.asarray(FP4_E2M1, dtype)  # in dtype throughout: no float32 copy of the weights
    v = jnp.stack([lut[codes & 15], lut[codes >> 4]], axis=-1)  # [..., O, I / 2, 2]
    nb = scales.shape[-1]
    v = v.reshape(*codes.shape[:-1], nb, MXFP4_BLOCK)
    v = jnp.ldexp(v, (scales.astype(jnp.int32) - 127)[..., None])
    return jnp.swapaxes(v.reshape(*codes.shape[:-1], nb * MXFP4_BLOCK), -1, -2)


def _mxfp4_matvec(a, codes, scales, dtype):
    """Per-pair products a[p] @ W[p] of MXFP4 weights without a float copy of them: f32[P, I] inputs
    (rounded to dtype, as the float forms' matmul inputs), codes u8[P, O, I / 2], scales u8[P, O, I / 32]
    -> f32[P, O]. Written as multiplies and sums (a block's 32 products, then its scale), so XLA makes
    the gather of the codes, their decode and the product one reduction that reads the packed bytes;
    a dot of `dequantize_mxfp4`'s result materializes the gathered experts' weights in float
    (a deviceless H100 compile of gpt-oss-20b's decode step: BENCHMARKS.md)."""
    lut = jnp.asarray(FP4_E2M1)
    num_pairs, out, half = codes.shape
    nb = scales.shape[-1]
    x = a.astype(dtype).astype(jnp.float32).reshape(num_pairs, 1, nb, MXFP4_BLOCK // 2, 2)
    c = codes.reshape(num_pairs, out, nb, MXFP4_BLOCK // 2)
    blk = jnp.sum(x[..., 0] * lut[c & 15] + x[..., 1] * lut[c >> 4], axis=-1)  # f32[P, O, I / 32]
    return jnp.sum(jnp.ldexp(blk, scales.astype(jnp.int32) - 127), axis=-1)


def _take(w, idx):
    """Expert weights (an array, or MXFP4 (codes, scales)) at expert ids idx (gathered on axis 0)."""
    if isinstance(w, tuple):
        return tuple(jnp.take(a, idx, axis=0, mode="clip") for a in w)
    return jnp.take(w, idx, axis=0, mode="clip")


def _float(w, dtype):
    """Expert weights as a float [..., in, out] array in dtype (MXFP4 dequantized; else as stored)."""
    return dequantize_mxfp4(*w, dtype) if isinstance(w, tuple) else w


def route(x, router, config, router_bias=None):
    """Router choices of tokens x f32[M, D] with router weights [D, E] (and bias [E], gpt-oss).

    Returns:
      (experts i32[M, k], weights f32[M, k]): the k experts of highest router logit per token (ties:
      the lower index first, as torch.topk on CPU) and their weights: with config.norm_topk_prob the
      softmax over the chosen logits (Mixtral, gpt-oss; the same as renormalizing the chosen
      softmax probabilities), else their softmax probabilities over all experts (Qwen3-MoE).
    """
    logits = jnp.dot(x.astype(router.dtype), router, preferred_element_type=jnp.float32)  # f32[M, E]
    if router_bias is not None:
        logits = logits + router_bias.astype(jnp.float32)
    chosen, experts = jax.lax.top_k(logits, config.experts_per_token)
    if config.norm_topk_prob:
        weights = jax.nn.softmax(chosen, axis=-1)
    else:
        weights = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), experts, axis=-1)
    return experts.astype(jnp.int32), weights


def glu(g, u, config):
    """The experts' gated activation of f32 gate and up projections: silu(g) * u, or with
    config.swiglu_clamp = (alpha, limit) gpt-oss's clamped form (transformers' GptOssExperts):
    g = min(g, limit), u = clip(u, -limit, limit), (u + 1) * g * sigmoid(alpha * g)."""
    if not config.swiglu_clamp:
        return jax.nn.silu(g) * u
    alpha, limit = config.swiglu_clamp
    g = jnp.minimum(g, limit)
    u = jnp.clip(u, -limit, limit)
    return (u + 1.0) * (g * jax.nn.sigmoid(g * alpha))


def moe_ffn(x, router, w_gate, w_up, w_down, config, dtype, *, router_bias=None, biases=None, parallel=None):
    """The MoE MLP of tokens x f32[M, D] as grouped matmuls (module docstring).

    Args:
      x: f32[M, D] (the normed residual stream).
      router: [D, E]; w_gate, w_up: [E, D, F]; w_down: [E, F, D] (the x @ W convention); or each
        MXFP4 (codes u8[E, out, in / 2], scales u8[E, out, in / 32]) (`dequantize_mxfp4`, applied
        to the gathered experts' weights inside the matmuls).
      config: the ModelConfig (experts_per_token, norm_topk_prob, swiglu_clamp).
      dtype: the matmuls' input dtype (the parameters'); they accumulate in float32.
      router_bias: [E] or None (gpt-oss).
      biases: None, or the experts' (gate [E, F], up [E, F], down [E, D]) biases (gpt-oss), each
        added to its projection's f32 result.
      parallel: None (one device), or (mesh, layout) with the expert weights sharded over the mesh's
        "tp" axis by models.sharding's expert layout "experts" or "ffn" (`expert_parallel`).

    Returns:
      f32[M, D].
    """
    if EXPERT_MATMUL not in ("blocked", "ragged_dot"):
        raise ValueError(f"models.moe.EXPERT_MATMUL must be 'blocked' or 'ragged_dot'; got {EXPERT_MATMUL!r}")
    biases = (None, None, None) if biases is None else tuple(biases)
    if parallel is not None:
        return expert_parallel(x, router, w_gate, w_up, w_down, config, dtype, router_bias, biases, *parallel)
    experts, weights = route(x, router, config, router_bias)  # [M, k]
    return _experts(x, experts, weights, None, w_gate, w_up, w_down, biases, config, dtype)


# The expert layouts of a tensor-parallel mixture of experts (models.sharding.plan_experts decides which):
# "experts": expert axis split, each device holds E/N whole experts; "ffn": each expert's ffn width split
# (gate/up column-parallel, down row-parallel), each device holds F/N of every expert.
EXPERT_LAYOUTS = ("experts", "ffn")


def expert_specs(layout, mxfp4):
    """PartitionSpecs of one layer's (w_gate, w_up, w_down, (gate, up, down) biases) under `layout`, each
    weight a spec or, MXFP4, a (codes, scales) pair of specs (their `in` axis last: codes [E, out, in / 2])."""
    tp = TP
    if layout == "experts":  # every expert tensor split on its leading expert axis
        w = (P(tp), P(tp)) if mxfp4 else P(tp)
        return w, w, w, (P(tp), P(tp), P(tp))
    if mxfp4:  # gate/up: out = F (axis 1); down: in = F, the codes' and scales' last axis
        col, row = (P(None, tp), P(None, tp)), (P(None, None, tp), P(None, None, tp))
    else:  # gate/up [E, D, F] split on F; down [E, F, D] split on F
        col, row = P(None, None, tp), P(None, tp)
    return col, col, row, (P(None, tp), P(None, tp), P())


def expert_parallel(x, router, w_gate, w_up, w_down, config, dtype, router_bias, biases, mesh, layout):
    """`moe_ffn` with its expert weights sharded over mesh's "tp" axis, one `jax.shard_map`: the router is
    replicated and every device routes every token (the same choices everywhere); each device runs the
    grouped matmuls of its shard, then ONE psum of f32[M, D] (a dense tensor-parallel MLP's collective).

    layout "experts": device d holds experts [d*E/N, (d+1)*E/N); every (token, choice) pair is computed
    against the device's experts with the other devices' pairs masked out (their ids clamped into the
    local range, their rows zeroed before the sum). Static shapes: each device computes as many rows as
    one device would (the routing is not known when the program is built), and reads only its own
    experts' weights.
    layout "ffn": every device holds every expert's ffn columns [d*F/N, (d+1)*F/N) (row-parallel down);
    each computes its partial products of every pair, the down bias added on device 0 only.
    """
    if layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert layout must be one of {EXPERT_LAYOUTS}; got {layout!r}")
    mxfp4 = isinstance(w_gate, tuple)
    sg, su, sd, sb = expert_specs(layout, mxfp4)
    has_bias = tuple(b is not None for b in biases)
    rb = router_bias if router_bias is not None else jnp.zeros((config.num_experts,), jnp.float32)
    bs = tuple(b if b is not None else jnp.zeros((), jnp.float32) for b in biases)
    bspecs = tuple(s if h else P() for s, h in zip(sb, has_bias))

    def local(x, router, rb, wg, wu, wd, bg, bu, bd):
        lb = tuple(b if h else None for b, h in zip((bg, bu, bd), has_bias))
        experts, weights = route(x, router, config, rb if router_bias is not None else None)
        d = jax.lax.axis_index(TP)
        valid = None
        if layout == "experts":
            num_local = (wg[0] if mxfp4 else wg).shape[0]
            local_ids = experts - d * num_local
            valid = (local_ids >= 0) & (local_ids < num_local)
            experts = jnp.clip(local_ids, 0, num_local - 1)
        elif lb[2] is not None:  # the down bias joins each pair's whole sum once
            lb = (lb[0], lb[1], jnp.where(d == 0, lb[2], jnp.zeros_like(lb[2])))
        y = _experts(x, experts, weights, valid, wg, wu, wd, lb, config, dtype)
        return jax.lax.psum(y, TP)

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), sg, su, sd) + bspecs, out_specs=P(),
                       check_vma=False)
    return fn(x, router, rb, w_gate, w_up, w_down, *bs)


def _experts(x, experts, weights, valid, w_gate, w_up, w_down, biases, config, dtype):
    """The routed pairs' expert outputs combined: sum over choices of weights * expert(x), pairs with
    valid False (None: all valid) left out. experts index the leading axis of the weights given."""
    num_tokens, d = x.shape
    k = config.experts_per_token
    w0 = w_gate[0] if isinstance(w_gate, tuple) else w_gate
    e = w0.shape[0]  # the experts held (all, or one device's)
    if EXPERT_MATMUL == "blocked" and num_tokens * k < e:  # few pairs: read only the chosen experts' weights
        y = _gathered(x, experts, w_gate, w_up, w_down, biases, config, dtype)
    elif EXPERT_MATMUL == "blocked":  # tiles of about the mean rows per expert, 8 to 128
        tile = int(min(128, max(8, 2 ** round(np.log2(max(1, num_tokens * k // e))))))
        y = _blocked(x, experts, w_gate, w_up, w_down, biases, config, dtype, tile, e)
    else:
        y = _ragged_dot(x, experts, w_gate, w_up, w_down, biases, config, dtype, e)
    if valid is not None:
        y = jnp.where(valid[..., None], y, 0.0)
    return jnp.einsum("MkD,Mk->MD", y, weights)


def _ragged_dot(x, experts, w_gate, w_up, w_down, biases, config, dtype, e):
    """The "ragged_dot" form: one jax.lax.ragged_dot per matmul over the pairs sorted by expert
    (group_sizes = rows per expert) -> f32[M, k, D], each pair's expert output."""
    num_tokens, d = x.shape
    k = experts.shape[1]
    flat = experts.reshape(num_tokens * k)  # pair p = token * k + choice
    order = jnp.argsort(flat, stable=True)  # pairs sorted by expert
    rows = jnp.take(x.astype(dtype), order // k, axis=0)  # [M*k, D] in expert order
    group_sizes = jnp.bincount(flat, length=e).astype(jnp.int32)  # [E], sums to M*k
    # Under a mesh with explicit axes (a deviceless compile's), ragged_dot needs its output's sharding
    # spelled out (JAX 0.12 has no inference rule for it): replicated, as the model runs on one device.
    sharding = getattr(jax.typeof(rows), "sharding", None)
    out = (NamedSharding(sharding.mesh, P()) if isinstance(sharding, NamedSharding) and not sharding.mesh.empty
           and not sharding.mesh.are_all_axes_auto and not sharding.mesh.manual_axes else None)
    sorted_e = flat[order]
    bias = lambda y, b: y if b is None else y + jnp.take(b, sorted_e, axis=0).astype(jnp.float32)
    mm = lambda a, w, b: bias(jax.lax.ragged_dot(a.astype(dtype), _float(w, dtype), group_sizes,
                                                 preferred_element_type=jnp.float32, out_sharding=out), b)
    h = glu(mm(rows, w_gate, biases[0]), mm(rows, w_up, biases[1]), config)  # f32[M*k, F]
    y = mm(h, w_down, biases[2])  # f32[M*k, D]
    return jnp.take(y, jnp.argsort(order), axis=0).reshape(num_tokens, k, d)  # back to (token, choice)


def _gathered(x, experts, w_gate, w_up, w_down, biases, config, dtype):
    """The small-batch form of `moe_ffn` (M*k < E pairs, e.g. a decode step): each pair's expert
    weights gathered ([M*k, D, F]) and applied to its token (batched matrix-vector products), so the
    step reads M*k experts' weights, not all E (XLA's GPU ragged_dot reads every expert)."""
    num_tokens, d = x.shape
    k = experts.shape[1]
    flat = experts.reshape(num_tokens * k)
    rows = jnp.repeat(x.astype(dtype), k, axis=0)  # [M*k, D], pair p = token * k + choice
    take = lambda w: _take(w, flat)  # [M*k, ...] (the router's ids are in range)
    bias = lambda y, b: y if b is None else y + take(b).astype(jnp.float32)
    mv = lambda a, w, b: bias(_mxfp4_matvec(a, *take(w), dtype) if isinstance(w, tuple) else jnp.einsum(
        "PI,PIO->PO", a.astype(dtype), take(w), preferred_element_type=jnp.float32), b)
    h = glu(mv(rows, w_gate, biases[0]), mv(rows, w_up, biases[1]), config)  # f32[M*k, F]
    return mv(h, w_down, biases[2]).reshape(num_tokens, k, d)  # f32[M, k, D]


def _blocked(x, experts, w_gate, w_up, w_down, biases, config, dtype, tile, e):
    """`moe_ffn` as tiles of `tile` rows, each tile one expert's (the pairs sorted by expert, each
    expert's run padded to whole tiles): the expert weights gathered per tile and one batched matmul
    [tiles, tile, D] x [tiles, D, F]. Static shapes: at most ceil(M*k / tile) + E tiles."""
    num_tokens, d = x.shape
    k = experts.shape[1]
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
    take = lambda w: _take(w, tile_expert)  # [tiles, ...]
    bias = lambda y, b: y if b is None else y + take(b).astype(jnp.float32)[:, None, :]
    mm = lambda a, w, b: bias(jnp.einsum("NTI,NIO->NTO", a.astype(dtype).reshape(num_tiles, tile, -1),
                                         _float(take(w), dtype), preferred_element_type=jnp.float32), b)
    h = glu(mm(rows, w_gate, biases[0]), mm(rows, w_up, biases[1]), config)  # f32[tiles, tile, F]
    y = mm(h, w_down, biases[2]).reshape(num_tiles * tile, d)[pos]  # f32[M*k, D] in sorted order
    return jnp.take(y, jnp.argsort(order), axis=0).reshape(num_tokens, k, d)  # f32[M, k, D]


def moe_dense(x, router, w_gate, w_up, w_down, config, dtype, *, router_bias=None, biases=None):
    """The test oracle of `moe_ffn`: every token through every expert, weighted by its routing
    (zero for experts it did not choose). Same arguments and result."""
    experts, weights = route(x, router, config, router_bias)
    mask = jnp.zeros((x.shape[0], config.num_experts), jnp.float32)
    mask = mask.at[jnp.arange(x.shape[0])[:, None], experts].set(weights)  # f32[M, E]
    bg, bu, bd = (None, None, None) if biases is None else biases
    bias = lambda y, b: y if b is None else y + b.astype(jnp.float32)[None]
    xd = x.astype(dtype)
    w_gate, w_up, w_down = (_float(w, dtype) for w in (w_gate, w_up, w_down))
    g = bias(jnp.einsum("MD,EDF->MEF", xd, w_gate, preferred_element_type=jnp.float32), bg)
    u = bias(jnp.einsum("MD,EDF->MEF", xd, w_up, preferred_element_type=jnp.float32), bu)
    y = bias(jnp.einsum("MEF,EFD->MED", glu(g, u, config).astype(dtype), w_down, preferred_element_type=jnp.float32),
             bd)
    return jnp.einsum("MED,ME->MD", y, mask)
