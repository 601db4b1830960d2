"""A tiny hybrid EngineModel with recurrent state beside paged attention, and a plain reference.

`TinyHybrid` follows the recurrent-state contract of `jpa.engine.model.EngineModel` (`jpa.engine.states`):
its cache spec has a recurrent group over layers 0 and 2 and a full-attention group over layers 1 and 3,
so the pool holds 2 layers (pool layer j = attention layer `paged_layers()[j]`). A recurrent layer keeps,
per sequence, a short causal-conv window of its inputs (`conv` [conv - 1, d_model]) and a decaying
running sum (`ssm` [d_model]):

    u_t = x_t W_in;  w_t = (conv state, u_t);  h_t = decay * h_{t-1} + sum(w_t * conv_w);  x_t += tanh(h_t) W_out

and obeys the reset rule (a row at position 0 starts from zero states). The logits therefore depend on the
whole context through both the states and the paged attention, and a state read from the wrong slot, a
missed write or a missed reset changes them. `reference_logits` computes the same function for one
sequence alone, in float64 numpy, with no cache, no pages and no engine.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jpa.kv.cache import write_kv
from jpa.kv.spec import CacheGroup, CacheSpec, FullAttention, RecurrentState
from jpa.ops.decode import paged_decode
from jpa.ops.ragged import ragged_paged_attention


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """The sizes the engine reads (`jpa.engine.model.ModelSizes`) and the hybrid's own."""
    vocab_size: int = 512          # models.ByteTokenizer's
    d_model: int = 32
    num_q_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 16
    conv: int = 3                  # causal-conv width (the state keeps conv - 1 inputs)
    max_seq_len: int = 256
    recurrent_layers: tuple = (0, 2)
    attention_layers: tuple = (1, 3)

    @property
    def num_layers(self) -> int:
        return len(self.recurrent_layers) + len(self.attention_layers)


class TinyHybrid:
    """The hybrid test model (float32). seed: the random weights'; hidden_pair: whether it has
    EngineModel's optional ragged_hidden/head pair (the engine then runs its ragged step through it)."""

    dtype = jnp.float32

    def __init__(self, seed: int = 0, config: HybridConfig = HybridConfig(), *, hidden_pair: bool = True):
        self.config = config
        c, rng = config, np.random.default_rng(seed)
        g, d = len(c.recurrent_layers), c.d_model
        a = len(c.attention_layers)
        f = lambda *shape, scale=1.0: jnp.asarray(rng.normal(0, scale, shape), jnp.float32)  # noqa: E731
        self.params = {
            "emb": f(c.vocab_size, d),
            "w_in": f(g, d, d, scale=d ** -0.5), "conv_w": f(g, c.conv, d, scale=0.7),
            "decay": jnp.asarray(rng.uniform(0.6, 0.97, (g, d)), jnp.float32), "w_out": f(g, d, d, scale=d ** -0.5),
            "wq": f(a, d, c.num_q_heads * c.head_dim, scale=2 * d ** -0.5),
            "wk": f(a, d, c.num_kv_heads * c.head_dim, scale=2 * d ** -0.5),
            "wv": f(a, d, c.num_kv_heads * c.head_dim, scale=d ** -0.5),
            "wo": f(a, c.num_q_heads * c.head_dim, d, scale=(c.num_q_heads * c.head_dim) ** -0.5),
            "head": f(d, c.vocab_size, scale=2 * d ** -0.5),
        }
        if not hidden_pair:
            self.ragged_hidden = self.head = None   # EngineModel's optional pair: absent

    def cache_spec(self) -> CacheSpec:
        c = self.config
        state = RecurrentState((("conv", (c.conv - 1, c.d_model), "float32"), ("ssm", (c.d_model,), "float32")))
        groups = (CacheGroup("linear", c.recurrent_layers, state),)
        if c.attention_layers:
            groups = (CacheGroup("attention", c.attention_layers, FullAttention(c.num_kv_heads, c.head_dim)),) + groups
        return CacheSpec(groups)

    # ------------------------------------------------------------------ layers

    def _recurrent(self, params, g, states, x, row_slot, row_pos):
        """Recurrent group layer g over rows x [T, d_model] in row order; row_slot i32[T] (-1: neither read
        nor written), row_pos i32[T] (0: start from zero states). Returns (x, states)."""
        conv, ssm = states["linear"]["conv"][g], states["linear"]["ssm"][g]  # [S, conv - 1, D], [S, D]
        num_slots = ssm.shape[0]
        u = x @ params["w_in"][g]   # [T, D]

        def row(carry, inp):
            conv, ssm = carry
            u_t, s, pos = inp
            at = jnp.clip(s, 0, num_slots - 1)
            fresh = pos == 0
            window = jnp.concatenate([jnp.where(fresh, 0.0, conv[at]), u_t[None]], axis=0)  # [conv, D]
            h = params["decay"][g] * jnp.where(fresh, 0.0, ssm[at]) + jnp.sum(window * params["conv_w"][g], axis=0)
            to = jnp.where(s >= 0, s, num_slots)   # padding: dropped
            return (conv.at[to].set(window[1:], mode="drop"), ssm.at[to].set(h, mode="drop")), jnp.tanh(h)

        (conv, ssm), y = lax.scan(row, (conv, ssm), (u, row_slot, row_pos))
        lin = states["linear"]
        states = {**states, "linear": {"conv": lin["conv"].at[g].set(conv), "ssm": lin["ssm"].at[g].set(ssm)}}
        return x + y @ params["w_out"][g], states

    def _qkv(self, params, j, x):
        c = self.config
        t = x.shape[0]
        return ((x @ params["wq"][j]).reshape(t, c.num_q_heads, c.head_dim),
                (x @ params["wk"][j]).reshape(t, c.num_kv_heads, c.head_dim),
                (x @ params["wv"][j]).reshape(t, c.num_kv_heads, c.head_dim))

    def _layers(self, params, cache, states, x, row_slot, row_pos, slot_mapping, attend):
        """Every layer in model order; attend(q, cache, pool layer j) -> [T, N, H]."""
        c = self.config
        for layer in range(c.num_layers):
            if layer in c.recurrent_layers:
                x, states = self._recurrent(params, c.recurrent_layers.index(layer), states, x, row_slot, row_pos)
                continue
            j = c.attention_layers.index(layer)   # pool layer
            q, k, v = self._qkv(params, j, x)
            kp, vp = write_kv(cache.k, cache.v, k, v, slot_mapping, layer=j)
            cache = cache.replace(k=kp, v=vp)
            x = x + attend(q, cache, j).reshape(x.shape[0], -1) @ params["wo"][j]
        return x, cache, states

    # ------------------------------------------------------------------ EngineModel

    def ragged_hidden(self, params, cache, tokens, positions, slot_mapping, block_tables, seq_lens, cu_q_lens,
                      num_seqs, *, impl="auto", states, state_slots):
        num_tokens = tokens.shape[0]
        row = jnp.arange(num_tokens, dtype=jnp.int32)
        entry = jnp.clip(jnp.searchsorted(cu_q_lens[1:], row, side="right"), 0, state_slots.shape[0] - 1)
        row_slot = jnp.where(row < cu_q_lens[num_seqs], state_slots[entry], -1)  # i32[T]

        def attend(q, cache, j):
            return ragged_paged_attention(q, cache.k, cache.v, block_tables, seq_lens, cu_q_lens, num_seqs,
                                          impl=impl, layer=j)

        return self._layers(params, cache, states, params["emb"][tokens], row_slot, positions, slot_mapping, attend)

    def head(self, params, hidden):
        return hidden @ params["head"]

    def ragged(self, params, cache, tokens, positions, slot_mapping, block_tables, seq_lens, cu_q_lens, num_seqs,
               *, impl="auto", states, state_slots):
        hidden, cache, states = TinyHybrid.ragged_hidden(self, params, cache, tokens, positions, slot_mapping,
                                                         block_tables, seq_lens, cu_q_lens, num_seqs, impl=impl,
                                                         states=states, state_slots=state_slots)
        last = jnp.clip(cu_q_lens[1:] - 1, 0, tokens.shape[0] - 1)
        return hidden[last] @ params["head"], cache, states

    def decode(self, params, cache, tokens, seq_lens, slot_mapping, block_tables, *, impl="auto", states,
               state_slots):
        def attend(q, cache, j):
            return paged_decode(q, cache.k, cache.v, block_tables, seq_lens, impl=impl, layer=j)

        row_slot = jnp.where(seq_lens > 0, state_slots, -1)
        x, cache, states = self._layers(params, cache, states, params["emb"][tokens], row_slot,
                                        jnp.maximum(seq_lens - 1, 0), slot_mapping, attend)
        return x @ params["head"], cache, states


def reference_logits(model: TinyHybrid, tokens) -> np.ndarray:
    """f64[len(tokens), vocab]: the logits after each token of ONE sequence, computed alone in float64 numpy
    (no cache, no pages, no slots): the recurrences from zero, full causal attention."""
    c = model.config
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), model.params)
    x = p["emb"][np.asarray(tokens)]   # [L, D]
    n = len(tokens)
    for layer in range(c.num_layers):
        if layer in c.recurrent_layers:
            g = c.recurrent_layers.index(layer)
            u = x @ p["w_in"][g]
            window, h, y = np.zeros((c.conv, c.d_model)), np.zeros(c.d_model), np.zeros_like(x)
            for t in range(n):
                window = np.concatenate([window[1:], u[t][None]])
                h = p["decay"][g] * h + (window * p["conv_w"][g]).sum(0)
                y[t] = np.tanh(h)
            x = x + y @ p["w_out"][g]
            continue
        j = c.attention_layers.index(layer)
        q = (x @ p["wq"][j]).reshape(n, c.num_q_heads, c.head_dim)
        k = (x @ p["wk"][j]).reshape(n, c.num_kv_heads, c.head_dim)
        v = (x @ p["wv"][j]).reshape(n, c.num_kv_heads, c.head_dim)
        kv = np.arange(c.num_q_heads) // (c.num_q_heads // c.num_kv_heads)
        s = np.einsum("tnh,snh->nts", q, k[:, kv]) * c.head_dim ** -0.5
        s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        x = x + np.einsum("nts,snh->tnh", w, v[:, kv]).reshape(n, -1) @ p["wo"][j]
    return x @ p["head"]


def reference_logprobs(model: TinyHybrid, prompt, token_ids) -> tuple[np.ndarray, np.ndarray]:
    """(logprob of each generated token, the best logprob at its position), both f64[len(token_ids)], of the
    sequence prompt + token_ids computed alone (`reference_logits`)."""
    if not token_ids:
        return np.zeros(0), np.zeros(0)
    seq = list(prompt) + list(token_ids)
    logits = reference_logits(model, seq[:-1])[len(prompt) - 1:]   # [len(token_ids), vocab]
    lsm = logits - logits.max(-1, keepdims=True)
    lsm = lsm - np.log(np.exp(lsm).sum(-1, keepdims=True))
    return lsm[np.arange(len(token_ids)), np.asarray(token_ids)], lsm.max(-1)
