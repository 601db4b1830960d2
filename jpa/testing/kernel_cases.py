"""Random paged-decode cases and a float64 NumPy oracle, shared by the kernel tests.

API (kept small so every kernel's tests can use it):

- `Case(...)`: a frozen, hashable description of one call (shapes, dtypes, lengths, features).
- `make_inputs(case) -> (args, opts)`: fresh random inputs; call `f(*args, **opts)` with any
  `paged_decode`-style function (`jpa.paged_decode`, `paged_decode_xla`, a kernel module).
  Physical pages are a random permutation of the pool; with `share_page` sequence 1 reuses
  sequence 0's first page (prefix sharing). Cache slots no visible token uses (free pages,
  the tail of a last page) hold NaN (float caches) or NaN scales (quantized caches), and
  block-table entries past a sequence's pages hold garbage (-1 or far out of range): a kernel
  that reads any of them into the result fails the comparison.
- `np_reference(*args, **opts) -> float64 ndarray`: dense softmax attention per sequence over
  the gathered (dequantized) tokens; shares no code with the online-softmax implementations.
- `tolerance(case) -> float`: max abs error allowed against the oracle (outputs are O(v_gain), O(1)
  but for cases that shrink V).
"""

import dataclasses

import jax.numpy as jnp
import numpy as np

from jpa.core.quant import is_quantized, quantize

# Max abs error vs the float64 oracle on O(1) outputs (q, K, V ~ N(0, 1)), per q dtype.
#   float32: f32 accumulation order only.
#   float16: p is rounded to f16 for the P.V dot (11-bit mantissa) + f16 output rounding.
#   bfloat16: p rounded to bf16 (8-bit mantissa) for the P.V dot + bf16 output rounding.
TOL = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2.5e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    """One paged-decode call. `seq_lens` has num_seqs entries, each <= pages_per_seq * page_size."""
    seq_lens: tuple
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    page_size: int = 16
    pages_per_seq: int = 4
    q_dtype: str = "float32"
    cache_dtype: str = "float32"
    soft_cap: float | None = None
    alibi: bool = False
    sliding_window: int | None = None
    share_page: bool = False
    spare_pages: int = 3
    seed: int = 0
    # Attention sinks: None (off), or the centre of random per-head sinks (N(0, 1) + this value;
    # +-1e4 puts every weight on / no weight on the sink).
    sinks: float | None = None
    # V's values times this before quantization (8-bit caches: smaller per-token V scales); the
    # output and `tolerance` scale with it. 1e-2 with float8 e5m2 and float16 q puts p * v_scale
    # in float16's subnormals (the kernels must shift it out of them).
    v_gain: float = 1.0

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def __str__(self):
        feats = [f"sc{self.soft_cap}" if self.soft_cap else "", "alibi" if self.alibi else "",
                 f"win{self.sliding_window}" if self.sliding_window else "",
                 "shared" if self.share_page else "",
                 f"sink{self.sinks:g}" if self.sinks is not None else ""]   # (v_gain: not in the id)
        return (f"N{self.num_q_heads}K{self.num_kv_heads}H{self.head_dim}S{self.page_size}"
                f"x{self.pages_per_seq}-{self.q_dtype}-{self.cache_dtype}-L{list(self.seq_lens)}"
                + "".join(f"-{f}" for f in feats if f))


def tolerance(case: Case) -> float:
    return TOL[case.q_dtype] * case.v_gain


def make_inputs(case: Case):
    """Fresh random inputs for `case`. Returns (args, opts) as described in the module docstring."""
    rng = np.random.default_rng(case.seed)
    num_seqs, page_size, pages_per_seq = case.num_seqs, case.page_size, case.pages_per_seq
    num_kv_heads, head_dim = case.num_kv_heads, case.head_dim
    lens = np.asarray(case.seq_lens, np.int32)  # i32[num_seqs]
    assert lens.max(initial=0) <= pages_per_seq * page_size, case
    num_pages = num_seqs * pages_per_seq + case.spare_pages
    perm = rng.permutation(num_pages)
    tables = perm[: num_seqs * pages_per_seq].reshape(num_seqs, pages_per_seq).astype(np.int32)
    if case.share_page and num_seqs > 1:
        tables[1, 0] = tables[0, 0]
    pages_used = -(-lens // page_size)  # i32[num_seqs]
    # Garbage past each sequence's pages: never valid indices.
    garbage = rng.choice(np.array([-1, num_pages + 7, 2**30], np.int32), size=tables.shape)
    unused_col = np.arange(pages_per_seq)[None, :] >= pages_used[:, None]  # [B, pages_per_seq]
    tables = np.where(unused_col, garbage, tables).astype(np.int32)

    # Slots some sequence can see (used pages, positions < len).
    visible = np.zeros((num_pages, page_size), bool)
    for b in range(num_seqs):
        pos = np.arange(lens[b])
        visible[tables[b, pos // page_size], pos % page_size] = True
    hidden = ~visible[None, :, :, None]  # [1, P, S_p, 1]

    cache_shape = (num_kv_heads, num_pages, page_size, head_dim)
    q = jnp.asarray(rng.standard_normal((num_seqs, case.num_q_heads, head_dim)), case.q_dtype)
    pools, scales = [], []
    for gain in (1.0, case.v_gain):
        x = rng.standard_normal(cache_shape).astype(np.float32) * np.float32(gain)
        if is_quantized(case.cache_dtype):
            vals, s = quantize(jnp.asarray(x), case.cache_dtype)
            s = np.where(visible[None], np.asarray(s), np.nan).astype(np.float32)
            pools.append(vals)
            scales.append(jnp.asarray(s))
        else:
            pools.append(jnp.asarray(np.where(hidden, np.nan, x), case.cache_dtype))
            scales.append(None)
    opts = dict(
        scale=head_dim ** -0.5 * 1.3,
        soft_cap=case.soft_cap,
        alibi_slopes=(jnp.asarray(2.0 ** -np.linspace(0.5, 4, case.num_q_heads), jnp.float32)
                      if case.alibi else None),
        sliding_window=case.sliding_window,
        k_scales=scales[0], v_scales=scales[1])
    if case.sinks is not None:
        opts["sinks"] = jnp.asarray(rng.standard_normal(case.num_q_heads) + case.sinks, jnp.float32)
    args = (q, pools[0], pools[1], jnp.asarray(tables), jnp.asarray(lens))
    return args, opts


def np_reference(q, k_pages, v_pages, block_tables, seq_lens, *, scale=None, soft_cap=None,
                 alibi_slopes=None, sliding_window=None, k_scales=None, v_scales=None, sinks=None):
    """float64 dense attention over each sequence's gathered tokens -> [num_seqs, num_q_heads, head_dim].

    sinks (f32[num_q_heads] or None): one more softmax column per head with logit sinks[h] and a
    zero value (a length-0 sequence: all weight on the sink, output 0)."""
    q = np.asarray(q.astype(jnp.float32), np.float64)  # [B, N, H]
    k_pages = np.asarray(k_pages.astype(jnp.float32), np.float64)  # [K, P, S_p, H]
    v_pages = np.asarray(v_pages.astype(jnp.float32), np.float64)
    if k_scales is not None:
        k_pages = k_pages * np.asarray(k_scales, np.float64)[..., None]
        v_pages = v_pages * np.asarray(v_scales, np.float64)[..., None]
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    tables, lens = np.asarray(block_tables), np.asarray(seq_lens)
    out = np.zeros_like(q)
    for b in range(num_seqs):
        n = int(lens[b])
        if n == 0:
            continue
        pos = np.arange(n)
        pages = tables[b, pos // page_size]
        keys = k_pages[:, pages, pos % page_size]  # [K, n, H]
        vals = v_pages[:, pages, pos % page_size]  # [K, n, H]
        qb = q[b].reshape(num_kv_heads, group, head_dim)  # [K, G, H]
        s = np.einsum("KGH,KSH->KGS", qb, keys) * scale
        if soft_cap is not None:
            s = soft_cap * np.tanh(s / soft_cap)
        if alibi_slopes is not None:
            slopes = np.asarray(alibi_slopes, np.float64).reshape(num_kv_heads, group, 1)
            s = s + slopes * (pos - n + 1)
        if sliding_window is not None:
            s = np.where(pos >= n - sliding_window, s, -np.inf)
        if sinks is not None:
            # The sink as an explicit extra column, normalized with the rest, then dropped.
            sink_col = np.asarray(sinks, np.float64).reshape(num_kv_heads, group, 1)
            s = np.concatenate([s, sink_col], axis=-1)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p = p / p.sum(axis=-1, keepdims=True)
        if sinks is not None:
            p = p[..., :-1]
        out[b] = np.einsum("KGS,KSH->KGH", p, vals).reshape(num_q_heads, head_dim)
    return out


# ---- Ragged batches (jpa.ragged_paged_attention) ----

@dataclasses.dataclass(frozen=True)
class RaggedCase(Case):
    """A ragged call: live sequence i has `seq_lens[i]` cached tokens of which the last `q_lens[i]`
    are queries. `max_num_seqs` (default: the live count) adds dead sequence slots, `num_tokens`
    (default: sum of q_lens) pads q."""
    q_lens: tuple = ()
    num_tokens: int = 0
    max_num_seqs: int = 0

    def __str__(self):
        return (super().__str__() + f"-Q{list(self.q_lens)}-T{self.num_tokens}"
                + (f"-B{self.max_num_seqs}" if self.max_num_seqs else ""))


def make_ragged_inputs(case: RaggedCase):
    """Fresh random inputs for a ragged call: (args, opts) for
    `f(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, num_seqs, **opts)`.

    On top of `make_inputs`' poisoning (NaN in every slot no live token uses, garbage table
    entries past each sequence's pages), padding rows of q are NaN, and the entries of dead
    sequence slots (seq_lens, block_tables rows, cu_q_lens past num_seqs) are garbage.
    """
    num_live = len(case.seq_lens)
    assert len(case.q_lens) == num_live, case
    assert all(ql <= n for ql, n in zip(case.q_lens, case.seq_lens)), case
    max_num_seqs = case.max_num_seqs or max(num_live, 1)
    num_tokens = case.num_tokens or max(sum(case.q_lens), 1)
    assert sum(case.q_lens) <= num_tokens and num_live <= max_num_seqs, case
    base = Case(**{f.name: getattr(case, f.name) for f in dataclasses.fields(Case)
                   if f.name != "seq_lens"},
                seq_lens=tuple(case.seq_lens) + (0,) * (max_num_seqs - num_live))
    (_, k_pages, v_pages, tables, lens), opts = make_inputs(base)
    rng = np.random.default_rng(case.seed + 1000)
    lens = np.asarray(lens).copy()
    lens[num_live:] = rng.integers(0, 2**20, max_num_seqs - num_live)
    cu = np.zeros(max_num_seqs + 1, np.int32)
    cu[1:num_live + 1] = np.cumsum(case.q_lens)
    cu[num_live + 1:] = rng.integers(-5, num_tokens + 50, max_num_seqs - num_live)
    q = rng.standard_normal((num_tokens, case.num_q_heads, case.head_dim)).astype(np.float32)
    q[cu[num_live]:] = np.nan
    args = (jnp.asarray(q, case.q_dtype), k_pages, v_pages, tables, jnp.asarray(lens, jnp.int32),
            jnp.asarray(cu), jnp.asarray(num_live, jnp.int32))
    return args, opts


def np_ragged_reference(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, num_seqs, **opts):
    """float64 oracle for a ragged call -> [num_tokens, num_q_heads, head_dim], zero padding rows.

    The query at position p of sequence i is exactly a decode query of a sequence of length
    p + 1 over the same block table, so every live row is one `np_reference` row."""
    tables, lens, cu = np.asarray(block_tables), np.asarray(seq_lens), np.asarray(cu_q_lens)
    rows, row_tables, row_lens = [], [], []
    for i in range(int(num_seqs)):
        q_len = int(cu[i + 1] - cu[i])
        for t in range(q_len):
            rows.append(int(cu[i]) + t)
            row_tables.append(tables[i])
            row_lens.append(int(lens[i]) - q_len + t + 1)
    out = np.zeros(q.shape, np.float64)
    if rows:
        out[rows] = np_reference(jnp.asarray(q)[np.asarray(rows)], k_pages, v_pages,
                                 np.stack(row_tables), np.asarray(row_lens), **opts)
    return out
