"""A plain NumPy float32 llama forward pass, written from Hugging Face's LlamaModel, for tests.

It shares no code with models/gpt.py, so agreeing with transformers' logits proves the weights
(including the Q/K un-permutation in models/smollm2.py) independently of the jpa model.

Weights follow models.smollm2.read_gguf: x @ W, Q/K in rotate_half order.
"""

import numpy as np


def _rms_norm(x, w, eps):  # x [T, d], w [d]
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, positions, base):  # x [T, heads, H], positions i[T]
    head_dim = x.shape[-1]
    inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)  # [H/2]
    angles = positions[:, None].astype(np.float32) * inv_freq  # [T, H/2]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]  # [T, 1, H/2]
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
    # HF: x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), rotate_half(x) = cat(-x2, x1)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def forward(weights: dict, meta: dict, ids, last_only: bool = True) -> np.ndarray:
    """Logits f32[vocab] of the last token (or f32[T, vocab]) for one sequence of token ids."""
    n, k, h, eps = meta["num_q_heads"], meta["num_kv_heads"], meta["head_dim"], meta["norm_eps"]
    ids = np.asarray(ids)
    t = len(ids)
    positions = np.arange(t)
    x = weights["tok_embeddings"][ids]  # [T, d]
    causal = np.tril(np.ones((t, t), bool))  # [T, S]
    for lw in weights["layers"]:
        a = _rms_norm(x, lw["attn_norm"], eps)
        q = _rope((a @ lw["wq"]).reshape(t, n, h), positions, meta["rope_base"])  # [T, N, H]
        kk = _rope((a @ lw["wk"]).reshape(t, k, h), positions, meta["rope_base"])  # [S, K, H]
        v = (a @ lw["wv"]).reshape(t, k, h)  # [S, K, H]
        q = q.reshape(t, k, n // k, h)  # [T, K, G, H]
        s = np.einsum("TKGH,SKH->KGTS", q, kk) / np.sqrt(h)
        s = np.where(causal, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("KGTS,SKH->TKGH", p, v).reshape(t, n * h)
        x = x + o @ lw["wo"]
        f = _rms_norm(x, lw["ffn_norm"], eps)
        g = f @ lw["w_gate"]
        x = x + (g / (1 + np.exp(-g)) * (f @ lw["w_up"])) @ lw["w_down"]
    x = _rms_norm(x[-1:] if last_only else x, weights["norm"], eps)
    head = weights["output"] if "output" in weights else weights["tok_embeddings"].T  # [d, vocab]
    logits = (x @ head).astype(np.float32)
    return logits[0] if last_only else logits
