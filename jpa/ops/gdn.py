"""Gated DeltaNet (GDN) linear attention in plain JAX: the recurrent form (decode), the chunked form
(prefill), the causal depthwise conv1d with its state, the gated RMSNorm and the l2 norm of q / k.

Qwen3-Next and Qwen3.5 keep, per GDN layer and per sequence, a state S and the last kernel - 1 inputs of a
short causal conv. One token t updates S by the gated delta rule (transformers'
`torch_recurrent_gated_delta_rule`, fla's `fused_recurrent_gated_delta_rule`), with S as transformers' [dk, dv]:

    S  <- exp(g_t) * S                         (g_t <= 0: the gate, a decay in log space)
    S  <- S + k_t (beta_t * (v_t - k_t^T S))^T  (the delta rule: write the correction of what S predicts)
    o_t = S^T q_t

jpa stores S transposed, f32[heads, dv, dk] (transformers' [dk, dv] swapped): every read of the state is then a
sum over its minor axis, which a GPU does in one pass; with dk second XLA transposes the state into a copy
before each read (measured with jpa.tools.traffic, jpa tools traffic-hybrid).

The chunked form (transformers' `torch_chunk_gated_delta_rule`, the WY / UT representation of the
DeltaNet paper) computes the same over chunks of 64 tokens: inside a chunk the updates are condensed
into one unit lower-triangular solve and a few matmuls, and only the chunk-to-chunk state carry is
sequential. It is exact against the recurrent form up to float rounding (tests/test_gdn.py).

Ragged batches: `gdn_ragged` and `conv_ragged` take the engine's ragged layout (sequence i owns rows
cu_q_lens[i]:cu_q_lens[i + 1], rows past cu_q_lens[num_seqs] are padding) and a state per sequence
entry; the chunks are cut per sequence (each sequence's rows from its first row, 64 at a time), so a
sequence never shares a chunk with another, and a sequence split into pieces anywhere over several calls
gives the same result as one piece (the state carried).

Shape letters: T tokens (rows), B sequence entries, H value heads (q and k already repeated to them),
Dk key head dim, Dv value head dim, C conv channels, W conv kernel width, L chunk length, N chunks.
Einsums: "NHLK,NHMK->NHLM" (within-chunk products), "HLK,HVK->HLV" (reads of the state).
"""

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

CHUNK = 64
HIGHEST = jax.lax.Precision.HIGHEST  # f32 products in f32 (a GPU's default for f32 may be TF32)


def l2norm(x, eps: float = 1e-6):
    """x / sqrt(sum(x^2) + eps) over the last axis, in f32 (fla's and transformers' l2norm)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gated_rms_norm(x, gate, weight, eps: float):
    """Qwen3-Next's RMSNormGated: rms_norm(x) * weight * silu(gate), in f32; x, gate [..., Dv], weight [Dv]."""
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * weight.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))


# ------------------------------------------------------------------------------------------------
# The causal conv1d (depthwise, kernel W, silu), with the last W - 1 inputs as its state.


def conv_step(x, weight, conv_state):
    """One token per row through the causal conv (decode; transformers' causal_conv1d_update).

    Args:
      x: [B, C] the row's new input.
      weight: [C, W].
      conv_state: f32[B, C, W - 1], the row's previous W - 1 inputs, oldest first.

    Returns:
      (silu(conv) f32[B, C], the new state f32[B, C, W - 1]).
    """
    window = jnp.concatenate([conv_state.astype(jnp.float32), x.astype(jnp.float32)[:, :, None]], axis=-1)  # [B, C, W]
    y = jnp.sum(window * weight.astype(jnp.float32)[None], axis=-1)
    return jax.nn.silu(y), window[:, :, 1:]


def _row_seqs(cu_q_lens, num_seqs, num_tokens):
    """(seq i32[T], cu i32[B + 1]): each row's sequence entry (clamped for padding rows), and cu_q_lens with
    the entries past num_seqs made empty."""
    batch = cu_q_lens.shape[0] - 1
    num_seqs = jnp.asarray(num_seqs, jnp.int32)
    cu = jnp.where(jnp.arange(batch + 1) <= num_seqs, cu_q_lens, cu_q_lens[num_seqs])  # entries past num_seqs: empty
    row = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu[1:], row, side="right"), 0, batch - 1).astype(jnp.int32)
    return seq, cu


def _history(x, conv_state, rows, seq, cu, width):
    """The W - 1 inputs before each of `rows` (i32[R], rows of sequence entries seq i32[R]), oldest first:
    x's rows of the same sequence where they exist, else the entry's conv_state. -> f32[R, C, W - 1]."""
    start = cu[seq]  # [R]
    cols = []
    for d in range(width - 1, 0, -1):  # oldest (d = W - 1) first
        src = rows - d
        from_x = x[jnp.clip(src, 0, x.shape[0] - 1)]  # [R, C]
        idx = jnp.clip(width - 1 - d + (rows - start), 0, width - 2)  # the state column of src < start
        from_state = jnp.take_along_axis(conv_state[seq], idx[:, None, None], axis=-1)[..., 0]  # [R, C]
        cols.append(jnp.where((src >= start)[:, None], from_x, from_state))
    return jnp.stack(cols, axis=-1)


def conv_ragged(x, weight, conv_states, cu_q_lens, num_seqs):
    """A ragged batch through the causal conv (prefill chunks and decode rows; transformers'
    causal_conv1d_fn with the state in front).

    Args:
      x: [T, C] inputs; rows of sequence entry i are cu_q_lens[i]:cu_q_lens[i + 1].
      weight: [C, W].
      conv_states: f32[B, C, W - 1], each entry's previous W - 1 inputs (zeros for a fresh sequence).
      cu_q_lens: i32[B + 1]; num_seqs: i32[] live entries.

    Returns:
      (silu(conv) f32[T, C] (finite garbage on padding rows), f32[B, C, W - 1]: each entry's state after
       its last row; entries with no rows, or past num_seqs, as given).
    """
    num_tokens, _ = x.shape
    width = weight.shape[-1]
    x = x.astype(jnp.float32)
    conv_states = conv_states.astype(jnp.float32)
    seq, cu = _row_seqs(cu_q_lens, num_seqs, num_tokens)
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    hist = _history(x, conv_states, rows, seq, cu, width)  # [T, C, W - 1]
    window = jnp.concatenate([hist, x[:, :, None]], axis=-1)  # [T, C, W]
    y = jax.nn.silu(jnp.sum(window * weight.astype(jnp.float32)[None], axis=-1))
    batch = cu.shape[0] - 1
    entries = jnp.arange(batch, dtype=jnp.int32)
    new = _history(x, conv_states, cu[1:], entries, cu, width)  # the inputs before the row after the last
    q_lens = cu[1:] - cu[:-1]
    return y, jnp.where((q_lens > 0)[:, None, None], new, conv_states)


# ------------------------------------------------------------------------------------------------
# The gated delta rule.


def gdn_step(q, k, v, g, beta, state):
    """The recurrent form, one token per row (decode).

    Args:
      q, k: f32[B, H, Dk] (q l2-normed and scaled by Dk^-0.5, k l2-normed: the model does it).
      v: f32[B, H, Dv]; g: f32[B, H] the log decay (<= 0); beta: f32[B, H].
      state: f32[B, H, Dv, Dk].

    Returns:
      (o f32[B, H, Dv], the new state f32[B, H, Dv, Dk]).
    """
    f32 = lambda a: a.astype(jnp.float32)
    q, k, v, g, beta, state = map(f32, (q, k, v, g, beta, state))
    decay = jnp.exp(g)[..., None]  # [B, H, 1]
    # Both reads of the old state first (S^T k and S^T q: one pass over S), then the new state (one more read,
    # one write): o = S'^T q = decay S^T q + (k . q) delta, the same as reading S' again, without that pass.
    kv_mem = decay * jnp.sum(state * k[..., None, :], axis=-1)  # sums over the minor axis, Dk
    read_q = decay * jnp.sum(state * q[..., None, :], axis=-1)
    delta = (v - kv_mem) * beta[..., None]
    o = read_q + jnp.sum(k * q, axis=-1, keepdims=True) * delta
    state = state * decay[..., None] + delta[..., :, None] * k[..., None, :]
    return o, state


def gdn_recurrent(q, k, v, g, beta, state):
    """The recurrent form over one sequence's T tokens (a scan of `gdn_step`): q, k f32[T, H, Dk], v f32[T, H, Dv],
    g, beta f32[T, H], state f32[H, Dv, Dk] -> (o f32[T, H, Dv], the state after the last token)."""
    def body(s, xs):
        o, s = gdn_step(*(a[None] for a in xs), s[None])
        return s[0], o[0]
    state, o = jax.lax.scan(body, state.astype(jnp.float32), (q, k, v, g, beta))
    return o, state


def _chunks(cu, num_tokens, chunk):
    """The chunk layout of a ragged batch: each live entry's rows cut into runs of `chunk` from its first row.

    Returns (rows i32[N, L] (num_tokens where the chunk has no such row), seq i32[N], first bool[N],
    last bool[N], valid bool[N]) with N = min(T, ceil(T / L) + B), the most chunks T rows in B entries cut so
    can need."""
    batch = cu.shape[0] - 1
    n = min(num_tokens, -(-num_tokens // chunk) + batch)
    q_lens = cu[1:] - cu[:-1]  # [B]
    per = -(-q_lens // chunk)  # chunks per entry
    off = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(per).astype(jnp.int32)])  # [B + 1]
    c = jnp.arange(n, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(off[1:], c, side="right"), 0, batch - 1).astype(jnp.int32)
    j = c - off[seq]  # the chunk's index within its entry
    valid = c < off[-1]
    row0 = cu[seq] + chunk * j
    length = jnp.where(valid, jnp.minimum(chunk, cu[seq + 1] - row0), 0)
    i = jnp.arange(chunk, dtype=jnp.int32)
    rows = jnp.where(i[None] < length[:, None], row0[:, None] + i[None], num_tokens)
    return rows, seq, j == 0, valid & (j == per[seq] - 1), valid


def gdn_ragged(q, k, v, g, beta, states, cu_q_lens, num_seqs, *, chunk: int = CHUNK):
    """The chunked form over a ragged batch (prefill chunks and decode rows back to back).

    Args:
      q, k: f32[T, H, Dk] (q l2-normed and scaled by Dk^-0.5, k l2-normed); v: f32[T, H, Dv].
      g, beta: f32[T, H].
      states: f32[B, H, Dv, Dk], each sequence entry's state before its first row (zeros for a fresh one).
      cu_q_lens: i32[B + 1]; num_seqs: i32[] live entries (rows past cu_q_lens[num_seqs] are padding).
      chunk: rows per chunk (64, as fla and transformers).

    Returns:
      (o f32[T, H, Dv] (zeros on padding rows), f32[B, H, Dv, Dk]: each entry's state after its last row;
       entries with no rows, or past num_seqs, as given).
    """
    num_tokens, heads, dk = k.shape
    dv = v.shape[-1]
    _, cu = _row_seqs(cu_q_lens, num_seqs, num_tokens)
    rows, seq, first, last, _ = _chunks(cu, num_tokens, chunk)  # rows [N, L]
    pad = lambda a: jnp.concatenate([a.astype(jnp.float32), jnp.zeros((1, *a.shape[1:]), jnp.float32)])
    # Padding rows of a chunk: k = 0 and g = 0 (they neither write nor decay the state), q = 0.
    qc, kc, vc, gc, bc = (jnp.moveaxis(pad(a)[rows], 2, 1) for a in (q, k, v, g, beta))  # [N, H, L, ...]

    cum = jnp.cumsum(gc, axis=-1)  # [N, H, L] log decay from the chunk's start
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    diff = jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf)
    decay = jnp.exp(diff)  # [N, H, L, L] decay between rows j <= i
    k_beta = kc * bc[..., None]
    v_beta = vc * bc[..., None]
    # The UT transform: (I + strictly_lower(beta k k^T * decay)) u = v_beta condenses the chunk's delta updates.
    ut = jnp.einsum("NHLK,NHMK->NHLM", k_beta, kc, precision=HIGHEST) * decay
    ut = jnp.where(jnp.tril(causal, -1), ut, 0.0)
    eye = jnp.eye(chunk, dtype=jnp.float32)
    solve = lambda b: solve_triangular(ut + eye, b, lower=True, unit_diagonal=True)
    new_values = solve(v_beta)  # [N, H, L, Dv]
    k_cumdecay = solve(k_beta * jnp.exp(cum)[..., None])  # [N, H, L, Dk]
    intra = jnp.einsum("NHLK,NHMK->NHLM", qc, kc, precision=HIGHEST) * decay  # [N, H, L, L]
    q_dec = qc * jnp.exp(cum)[..., None]
    k_dec = kc * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]  # [N, H, 1, 1]

    def body(carry, xs):
        s, finals = carry
        nv, kcd, qd, kd, cd, att, seq_c, first_c, last_c = xs
        s = jnp.where(first_c, finals[seq_c], s)  # a sequence's first chunk starts from its entry state
        v_new = nv - jnp.einsum("HLK,HVK->HLV", kcd, s, precision=HIGHEST)
        o = jnp.einsum("HLK,HVK->HLV", qd, s, precision=HIGHEST) + jnp.einsum("HLM,HMV->HLV", att, v_new,
                                                                              precision=HIGHEST)
        s = s * cd + jnp.einsum("HLV,HLK->HVK", v_new, kd, precision=HIGHEST)
        finals = finals.at[seq_c].set(jnp.where(last_c, s, finals[seq_c]))
        return (s, finals), o

    init = (jnp.zeros((heads, dv, dk), jnp.float32), states.astype(jnp.float32))
    (_, finals), o = jax.lax.scan(body, init, (new_values, k_cumdecay, q_dec, k_dec, chunk_decay, intra, seq, first,
                                               last))
    o = jnp.moveaxis(o, 1, 2)  # [N, L, H, Dv]
    out = jnp.zeros((num_tokens, heads, dv), jnp.float32).at[rows.reshape(-1)].set(
        o.reshape(-1, heads, dv), mode="drop")
    return out, finals


# ------------------------------------------------------------------------------------------------
# State slots: the engine's per-sequence states, read and written by slot.


def read_slots(states, state_slots, fresh, *, layer=None):
    """Each entry's starting state: zeros where `fresh` (its first row is position 0) or its slot is -1, else
    states[slot] (states [num_slots, ...]), or with `layer` (i32[]) states[layer, slot] (states [layers,
    num_slots, ...]: one gather of the entries' slots, no copy of the layer). state_slots i32[B]; fresh bool[B]
    -> f32[B, ...]."""
    states = jnp.asarray(states)
    slots = jnp.clip(state_slots, 0, states.shape[0 if layer is None else 1] - 1)
    got = (states[slots] if layer is None else states[layer, slots]).astype(jnp.float32)
    keep = (~fresh) & (state_slots >= 0)
    return jnp.where(keep.reshape(-1, *([1] * (got.ndim - 1))), got, 0.0)


def write_slots(states, state_slots, new, write, *, layer=None):
    """states with new[b] stored at slot state_slots[b] (with `layer`: at [layer, slot], in place) where write[b]
    and the slot is >= 0; others untouched."""
    states = jnp.asarray(states)
    ok = write & (state_slots >= 0)
    idx = jnp.where(ok, state_slots, states.shape[0 if layer is None else 1])  # out of range: dropped
    new = new.astype(states.dtype)
    if layer is None:
        return states.at[idx].set(new, mode="drop")
    return states.at[layer, idx].set(new, mode="drop")
