"""Benchmark: what paging costs in decode attention on this CPU (paged reference vs dense attention).

"paged" is `jpa.paged_decode(..., impl="xla")` under `jax.jit` (the plain-JAX reference, `jpa.ops.reference
.paged_decode_xla`) over a paged cache [K, P, page_size, H] whose block tables are a random
permutation of the pool (so no sequence's pages are contiguous). "dense" is a jitted plain-jnp
softmax attention over an already contiguous cache [B, K, S, H] holding the same tokens (every
sequence at the full context, so dense needs no mask: the cheapest possible baseline). Both are f32,
one query token per sequence, GQA (8 q heads over 2 kv heads); outputs are checked to agree.

Timing: each function is jitted and run `--warmup` times; then `--reps` rounds each time every
function once, in turn (so load from other processes on this shared CPU hits all alike), from call
to `block_until_ready`; the median per function is reported, with the ratio to dense. Target:
paged / dense <= 1.3x.

Experimental variants (`--variants`), measured to explain the ratio and to test changes to
jpa/reference.py without editing it (each is checked against dense too):
  ref128        the reference itself with 128-token chunks (pages_per_chunk = 128 // page_size)
                instead of its CHUNK_TOKENS = 512: isolates the effect of the chunk size.
  kbgs          a copy of the reference's loop (same 512-token chunks) with the dots written in
                the gathered chunk's own batch order ("KBGH,KBSH->KBGS": the small q and the
                running state are laid out [K, B, ...], so XLA never transposes the big chunk), and
                V masked only in a chunk some sequence ends inside.
  kbgs128       kbgs with 128-token chunks: both changes together.
  gather_only   just the page gather of K and V over the whole table at once (jnp.take), no math:
                what materializing the gathered K/V costs (skipped above 64 MB of KV).

    .venv/bin/python benchmarks/bench_attention.py [--reps 10] [--variants ref128,kbgs,kbgs128,gather_only]
"""

import argparse
import functools
import itertools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jpa
from jpa.ops.reference import MASK_VALUE, chunk_pages, paged_decode_xla

from jpa.tools.bench import machine, write_json
from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)

TARGET = 1.3
NUM_Q_HEADS, NUM_KV_HEADS = 8, 2




@functools.partial(jax.jit, static_argnames=("scale",))
def dense_decode(q, k, v, *, scale):
    """q [B, N, H], k/v [B, K, S, H] (contiguous, all S tokens visible) -> [B, N, H]."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    qg = q.reshape(num_seqs, num_kv_heads, num_q_heads // num_kv_heads, head_dim) * scale  # [B, K, G, H]
    s = jnp.einsum("BKGH,BKSH->BKGS", qg, k, preferred_element_type=jnp.float32)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("BKGS,BKSH->BKGH", p, v, preferred_element_type=jnp.float32)
    return o.reshape(num_seqs, num_q_heads, head_dim).astype(q.dtype)


@jax.jit
def gather_only(k_pages, v_pages, block_tables):
    """The gather alone: [K, P, S_p, H] through i32[B, pages_per_seq] -> two [K, B, S, H]."""
    num_kv_heads, _, page_size, head_dim = k_pages.shape
    num_seqs, pps = block_tables.shape
    g = lambda x: jnp.take(x, block_tables, axis=1, mode="clip").reshape(
        num_kv_heads, num_seqs, pps * page_size, head_dim)
    return g(k_pages), g(v_pages)


@functools.partial(jax.jit, static_argnames=("scale", "pages_per_chunk"))
def paged_kbgs(q, k_pages, v_pages, block_tables, seq_lens, *, scale, pages_per_chunk=None):
    """Experimental variant of jpa.ops.reference.paged_decode_xla (no soft cap/alibi/window/quant).

    Differences from the reference: the online-softmax state is kept [K, B, G(, H)] so both dots
    have the gathered chunk's own batch order (K, B) and XLA never transposes the big operand; V is
    masked (against garbage past seq_len) only in each sequence's last chunk.
    """
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    pages_per_seq = block_tables.shape[1]
    q_per_kv = num_q_heads // num_kv_heads
    ppc = pages_per_chunk or chunk_pages(page_size, pages_per_seq)
    num_chunks = -(-pages_per_seq // ppc)
    chunk_tokens = ppc * page_size
    if num_chunks * ppc != pages_per_seq:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, num_chunks * ppc - pages_per_seq)))
    seq_lens = seq_lens.astype(jnp.int32)
    qg = (q.astype(jnp.float32).reshape(num_seqs, num_kv_heads, q_per_kv, head_dim) * scale
          ).transpose(1, 0, 2, 3)  # [K, B, G, H]

    def gather(pages, tbl):
        x = jnp.take(pages, tbl, axis=1, mode="clip").astype(jnp.float32)  # [K, B, C, S_p, H]
        return x.reshape(num_kv_heads, num_seqs, ppc * page_size, head_dim)  # [K, B, S, H]

    def body(c, carry):
        m, l, acc = carry  # [K, B, G], [K, B, G], [K, B, G, H]
        tbl = lax.dynamic_slice_in_dim(block_tables, c * ppc, ppc, axis=1)
        k, v = gather(k_pages, tbl), gather(v_pages, tbl)
        pos = c * chunk_tokens + jnp.arange(chunk_tokens, dtype=jnp.int32)
        valid = pos[None, :] < seq_lens[:, None]  # [B, S]
        s = jnp.einsum("KBGH,KBSH->KBGS", qg, k, preferred_element_type=jnp.float32)
        s = jnp.where(valid[None, :, None, :], s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(valid[None, :, None, :], jnp.exp(s - m_new[..., None]), 0.0)
        # Garbage past seq_len can only sit in a chunk some sequence ends inside.
        tail = jnp.any((seq_lens > c * chunk_tokens) & (seq_lens < (c + 1) * chunk_tokens))
        v = lax.cond(tail, lambda v: jnp.where(valid[None, :, :, None], v, 0.0), lambda v: v, v)
        acc_new = acc * alpha[..., None] + jnp.einsum("KBGS,KBSH->KBGH", p, v,
                                                      preferred_element_type=jnp.float32)
        return m_new, l * alpha + jnp.sum(p, axis=-1), acc_new

    init = (jnp.full((num_kv_heads, num_seqs, q_per_kv), MASK_VALUE, jnp.float32),
            jnp.zeros((num_kv_heads, num_seqs, q_per_kv), jnp.float32),
            jnp.zeros((num_kv_heads, num_seqs, q_per_kv, head_dim), jnp.float32))
    if num_chunks == 1:
        m, l, acc = body(0, init)
    else:
        last = -(-jnp.max(seq_lens) // chunk_tokens)
        m, l, acc = lax.fori_loop(0, last, body, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)  # [K, B, G, H]
    return out.transpose(1, 0, 2, 3).reshape(num_seqs, num_q_heads, head_dim).astype(q.dtype)


def time_interleaved(fns, warmup, reps):
    """{name: (fn, args)} -> {name: median ms}. One round times every function once, in turn, so a
    change in the machine's load (this CPU is shared) hits all of them alike."""
    for fn, args in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    ts = {name: [] for name in fns}
    for _ in range(reps):
        for name, (fn, args) in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            ts[name].append(time.perf_counter() - t0)
    return {name: 1e3 * statistics.median(t) for name, t in ts.items()}


def make_case(batch, context, head_dim, page_size, seed):
    rng = np.random.default_rng(seed)
    pps = context // page_size
    num_pages = batch * pps
    q = rng.standard_normal((batch, NUM_Q_HEADS, head_dim), np.float32)
    k = rng.standard_normal((batch, NUM_KV_HEADS, context, head_dim), np.float32)  # [B, K, S, H]
    v = rng.standard_normal((batch, NUM_KV_HEADS, context, head_dim), np.float32)
    tables = rng.permutation(num_pages).astype(np.int32).reshape(batch, pps)  # i32[B, pages_per_seq]

    def to_pages(x):  # [B, K, S, H] -> [K, P, S_p, H] with page tables[b, j] = tokens j*S_p.. of b
        out = np.empty((NUM_KV_HEADS, num_pages, page_size, head_dim), np.float32)
        out[:, tables.ravel()] = x.reshape(batch, NUM_KV_HEADS, pps, page_size, head_dim).transpose(
            1, 0, 2, 3, 4).reshape(NUM_KV_HEADS, num_pages, page_size, head_dim)
        return out

    kp, vp = to_pages(k), to_pages(v)
    lens = np.full((batch,), context, np.int32)
    put = jax.device_put
    return dict(q=put(q), k=put(k), v=put(v), k_pages=put(kp), v_pages=put(vp), tables=put(tables),
                lens=put(lens))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variants", default="ref128,kbgs,kbgs128,gather_only",
                    help="experimental variants to time too ('' for none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/attention.json")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    m = machine()
    print(f"machine: {m['platform']}, {m['processor']}, {m['cpu_count']} cpus, jax {m['jax_version']}, "
          f"device {m['device']}")
    print(f"f32, {NUM_Q_HEADS} q heads / {NUM_KV_HEADS} kv heads (GQA {NUM_Q_HEADS // NUM_KV_HEADS}), "
          f"page_size {args.page_size}, permuted block tables, all sequences at the full context; "
          f"median of {args.reps} interleaved timed rounds after {args.warmup} warm-up runs (ms)")
    rows = []
    head = ("| batch | context | head_dim | KV MB | dense ms | paged ms | paged/dense | "
            + " | ".join(f"{v} ms (/dense)" for v in variants) + " |")
    print("\n" + head)
    print("|" + "---:|" * (7 + len(variants)))
    for b, ctx, hd in itertools.product(*(map(int, s.split(",")) for s in
                                          (args.batches, args.contexts, args.head_dims))):
        c = make_case(b, ctx, hd, args.page_size, args.seed)
        scale = hd ** -0.5
        dense = functools.partial(dense_decode, scale=scale)
        # Jitted as it runs inside a model: an eager call would add the host-side validation of
        # concrete seq_lens/block_tables (a device->host copy) to every call.
        paged = jax.jit(lambda q, kp, vp, t, l: jpa.paged_decode(q, kp, vp, t, l, scale=scale, impl="xla"))
        pargs = (c["q"], c["k_pages"], c["v_pages"], c["tables"], c["lens"])
        ref = np.asarray(dense(c["q"], c["k"], c["v"]))
        err = float(np.max(np.abs(np.asarray(paged(*pargs)) - ref)))
        if err > 1e-4:
            raise SystemExit(f"paged disagrees with dense: max abs err {err}")
        r = dict(batch=b, context=ctx, head_dim=hd, kv_mb=2 * c["k"].nbytes / 2 ** 20, paged_max_abs_err=err)
        fns = dict(dense=(dense, (c["q"], c["k"], c["v"])), paged=(paged, pargs))
        for vname in variants:
            if vname == "gather_only":
                if r["kv_mb"] > 64:
                    continue
                fn, vargs = gather_only, pargs[1:4]
            elif vname == "ref128":
                fn = functools.partial(paged_decode_xla, scale=scale,
                                       pages_per_chunk=max(1, 128 // args.page_size))
                vargs = pargs
            elif vname == "kbgs":
                fn, vargs = functools.partial(paged_kbgs, scale=scale), pargs
            elif vname == "kbgs128":
                fn = functools.partial(paged_kbgs, scale=scale, pages_per_chunk=max(1, 128 // args.page_size))
                vargs = pargs
            else:
                raise SystemExit(f"unknown variant {vname!r}")
            if vname != "gather_only":
                verr = float(np.max(np.abs(np.asarray(fn(*vargs)) - ref)))
                if verr > 1e-4:
                    raise SystemExit(f"variant {vname} disagrees with dense: max abs err {verr}")
            fns[vname] = (fn, vargs)
        ms = time_interleaved(fns, args.warmup, args.reps)
        r["dense_ms"], r["paged_ms"] = ms.pop("dense"), ms.pop("paged")
        r["ratio"] = r["paged_ms"] / r["dense_ms"]
        for vname, t in ms.items():
            r[f"{vname}_ms"], r[f"{vname}_ratio"] = t, t / r["dense_ms"]
        rows.append(r)
        print(f"| {b} | {ctx} | {hd} | {r['kv_mb']:.0f} | {r['dense_ms']:.2f} | {r['paged_ms']:.2f} | "
              f"{r['ratio']:.2f}x | " + " | ".join(f"{r[v + '_ms']:.2f} ({r[v + '_ratio']:.2f}x)"
                                                   if v + "_ms" in r else "-" for v in variants) + " |",
              flush=True)
        del c
    ratios = [r["ratio"] for r in rows]
    gm = float(np.exp(np.mean(np.log(ratios))))
    met = max(ratios) <= TARGET
    print(f"\npaged/dense: geometric mean {gm:.2f}x, worst {max(ratios):.2f}x, best {min(ratios):.2f}x")
    for v in variants:
        vr = [r[f"{v}_ratio"] for r in rows if f"{v}_ratio" in r]
        if vr:
            print(f"{v}/dense: geometric mean {np.exp(np.mean(np.log(vr))):.2f}x, worst {max(vr):.2f}x "
                  f"({len(vr)} points)")
    print(f"target: paged/dense <= {TARGET}x at every point: {'MET' if met else 'MISSED'} "
          f"(worst {max(ratios):.2f}x)")
    summary = {v: dict(geomean=float(np.exp(np.mean(np.log([r[f"{v}_ratio"] for r in rows if f"{v}_ratio" in r])))),
                       worst=max(r[f"{v}_ratio"] for r in rows if f"{v}_ratio" in r))
               for v in variants if any(f"{v}_ratio" in r for r in rows)}
    out = dict(machine=m, command=" ".join([os.path.basename(sys.executable)] + sys.argv),
               variant_ratio_summary=summary,
               config=dict(vars(args), num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, dtype="float32"),
               target=TARGET, target_met=met, ratio_geomean=gm, ratio_worst=max(ratios), rows=rows)
    if args.out:
        write_json(args.out, out)


if __name__ == "__main__":
    main()
