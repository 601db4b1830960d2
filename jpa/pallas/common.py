"""Math shared by the Pallas decode kernels (plain jnp; runs outside the kernels).

Split-K (flash-decoding / vLLM v2): each partition of a sequence's keys produces an
unnormalized accumulator acc_p, its running max m_p and running sum l_p. The partitions are
combined with a log-sum-exp merge:

    M = max_p m_p,  w_p = exp(m_p - M),  out = sum_p w_p acc_p / sum_p w_p l_p

An empty partition has m_p = MASK_VALUE, l_p = 0 and acc_p = 0, so it contributes nothing; a
sequence with no keys at all gets l = 0 and a zero output (never NaN).
"""

import jax.numpy as jnp

from jpa.reference import MASK_VALUE  # noqa: F401  (re-exported: kernels use the same mask)


def merge_partitions(acc, m, l, out_dtype):
    """Merges per-partition online-softmax states along axis `-3` of acc / `-2` of m and l.

    Args:
      acc: f32[..., num_partitions, rows, head_dim] unnormalized accumulators.
      m: f32[..., num_partitions, rows] running maxima.
      l: f32[..., num_partitions, rows] running sums.
      out_dtype: dtype of the result.

    Returns:
      [..., rows, head_dim] in out_dtype.
    """
    m_max = jnp.max(m, axis=-2, keepdims=True)  # [..., 1, rows]
    w = jnp.exp(m - m_max)  # [..., num_partitions, rows]
    l_tot = jnp.sum(w * l, axis=-2)  # [..., rows]
    acc_tot = jnp.sum(w[..., None] * acc, axis=-3)  # [..., rows, head_dim]
    out = jnp.where(l_tot[..., None] > 0, acc_tot / jnp.where(l_tot > 0, l_tot, 1.0)[..., None], 0.0)
    return out.astype(out_dtype)
