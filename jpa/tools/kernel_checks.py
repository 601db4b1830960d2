"""Deviceless compile checks of jpa's attention kernels, called alone and over stacked pools.

1. `check_kernels`: every decode-kernel configuration of a covering grid (`covering_grid`: page
   sizes 8-256, head dims 64-256, q_per_kv 1-16, 16-bit, int8 and fp8 caches, every option,
   split-K on and off; or `random_grid`) that the kernel's `unsupported_reason` accepts for the
   target compiles, as one kernel call, without spills.
2. `check_ragged`: the ragged op (`jpa.ragged_paged_attention`) at a serving size: its tile kernel
   and the decode kernel of the last rows, two calls in one program (`ragged_grid`).
3. `check_stacked_kernels`, `check_stacked_ragged`: the kernels called in a loop over layers on
   ONE [num_layers, num_kv_heads, num_pages, page_size, head_dim] pool per K/V (carried, written
   each layer, donated) with the loop index as the layer, as the layer-scanned model calls them;
   each next to the registers of its per-layer twin.

Each returns records of `jpa.tools.deviceless.Compiler.compile` with `kind` and the check's own
problems added; a configuration the dispatch refuses is a record with `refused` (its reason).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jpa.ops import dispatch
from jpa.pallas.spec import DecodeSpec
from jpa.tools.deviceless import Compiler, compute_capability, record_line


# ---- 1. Kernel configurations ----

@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One paged_decode configuration of the covering grid: the kernel (`impl`, forced), dtypes,
    shapes and options. `spec()` is the DecodeSpec the dispatch judges; the sizes are a serving
    batch (64 sequences of 512 tokens) or, with split_k, a long-context one (4 of 8192)."""

    impl: str
    q_dtype: str = "bfloat16"
    cache_dtype: str = "bfloat16"
    page_size: int = 16
    head_dim: int = 128
    num_kv_heads: int = 8
    q_per_kv: int = 4
    soft_cap: bool = False
    alibi: bool = False
    sliding_window: bool = False
    split_k: bool = False   # long contexts and few sequences (several partitions per sequence)
    num_pages: int = 8192
    sinks: bool = False     # attention sinks f32[num_q_heads] (folded in at the split-K combine)

    @property
    def num_seqs(self) -> int:
        return 4 if self.split_k else 64

    @property
    def pages_per_seq(self) -> int:
        return -(-(8192 if self.split_k else 512) // self.page_size)

    def spec(self) -> DecodeSpec:
        return DecodeSpec(self.q_dtype, self.cache_dtype, self.num_kv_heads * self.q_per_kv,
                          self.num_kv_heads, self.head_dim, self.page_size, self.pages_per_seq,
                          self.soft_cap, self.alibi, self.sliding_window,
                          self.cache_dtype in ("int8", "float8_e4m3fn", "float8_e5m2"),
                          self.num_seqs, self.num_pages, sinks=self.sinks)

    @property
    def name(self) -> str:
        opts = "+".join(o for o in ("soft_cap", "alibi", "sliding_window", "split_k", "sinks")
                        if getattr(self, o))
        return (f"{self.impl} q={self.q_dtype} kv={self.cache_dtype} ps={self.page_size} "
                f"hd={self.head_dim} G={self.q_per_kv}" + (f" {opts}" if opts else ""))


PAGE_SIZES = (8, 16, 32, 64, 128, 256)
HEAD_DIMS = (64, 80, 96, 128, 192, 256)
Q_PER_KV = (1, 2, 4, 8, 16)
DTYPES = (("bfloat16", "bfloat16"), ("float16", "float16"), ("bfloat16", "int8"),
          ("bfloat16", "float8_e4m3fn"), ("float16", "float8_e5m2"), ("float32", "float32"))
OPTIONS = ("soft_cap", "alibi", "sliding_window")


def covering_grid(impl: str, subset: str = "full") -> list:
    """Kernel configurations covering every axis value, every page size x head dim pair (the
    tile and SMEM sizes), each with a 16-bit and a 1-byte cache, and every option with split-K
    on and off. "fast" is a spread-out subset for CI."""
    base = KernelConfig(impl)
    out = []
    for ps in PAGE_SIZES:
        for hd in HEAD_DIMS:
            for q_dtype, cache_dtype in (DTYPES[0], DTYPES[2]):
                out.append(dataclasses.replace(base, page_size=ps, head_dim=hd, q_dtype=q_dtype,
                                               cache_dtype=cache_dtype))
    out += [dataclasses.replace(base, q_per_kv=g) for g in Q_PER_KV]
    out += [dataclasses.replace(base, q_dtype=q, cache_dtype=c) for q, c in DTYPES]
    for split in (False, True):
        for opt in OPTIONS:
            out.append(dataclasses.replace(base, split_k=split, **{opt: True}))
        out.append(dataclasses.replace(base, split_k=split, soft_cap=True, alibi=True, sliding_window=True,
                                       cache_dtype="int8", q_per_kv=8, head_dim=80))
    # Attention sinks, split-K off and on: shapes no other entry has, so each kernel is compiled (and
    # ptxas reports) here: a Mosaic decode kernel with sinks is the same cubin as without (the sink
    # joins at the split-K combine), which one process compiles once.
    sinks = [dataclasses.replace(base, split_k=split, sinks=True, sliding_window=True, q_per_kv=8,
                                 head_dim=64) for split in (False, True)]
    out = list(dict.fromkeys(out))
    if subset == "fast":
        out = out[::9] + [c for c in out if c.split_k][:2]
        out = list(dict.fromkeys(out)) + sinks[1:]
    else:
        out += sinks
    return out


def random_grid(impl: str, count: int, seed: int) -> list:
    """`count` configurations drawn from the full product of the grid's axes (with options and
    split-K at random), for the property "whatever unsupported_reason accepts compiles"."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        q_dtype, cache_dtype = DTYPES[rng.integers(len(DTYPES))]
        out.append(KernelConfig(
            impl, q_dtype=q_dtype, cache_dtype=cache_dtype, page_size=int(rng.choice(PAGE_SIZES)),
            head_dim=int(rng.choice(HEAD_DIMS)), num_kv_heads=int(rng.choice((1, 2, 8))),
            q_per_kv=int(rng.choice(Q_PER_KV)), soft_cap=bool(rng.random() < 0.5),
            alibi=bool(rng.random() < 0.3), sliding_window=bool(rng.random() < 0.3),
            split_k=bool(rng.random() < 0.5), num_pages=int(rng.choice((64, 1024, 8192)))))
    return out


def kernel_call(cfg: KernelConfig):
    """(fn, args, kwargs, pool shapes) of one paged_decode call with cfg's shapes, impl forced."""
    spec = cfg.spec()
    sds = jax.ShapeDtypeStruct
    pool = (spec.num_kv_heads, spec.num_pages, spec.page_size, spec.head_dim)
    args = (sds((spec.num_seqs, spec.num_q_heads, spec.head_dim), spec.q_dtype), sds(pool, spec.cache_dtype),
            sds(pool, spec.cache_dtype), sds((spec.num_seqs, spec.pages_per_seq), jnp.int32),
            sds((spec.num_seqs,), jnp.int32))
    kwargs = {}
    if spec.alibi:
        kwargs["alibi_slopes"] = sds((spec.num_q_heads,), jnp.float32)
    if spec.quantized:
        kwargs["k_scales"] = kwargs["v_scales"] = sds(pool[:3], jnp.float32)
    if spec.sinks:
        kwargs["sinks"] = sds((spec.num_q_heads,), jnp.float32)
    import jpa
    fn = functools.partial(jpa.paged_decode, impl=cfg.impl, soft_cap=30.0 if spec.soft_cap else None,
                           sliding_window=1024 if spec.sliding_window else None)
    return fn, args, kwargs, [(pool, spec.cache_dtype)] * 2


def check_kernels(compiler: Compiler, impls, subset: str, log=print, random: int = 0, seed: int = 0) -> list:
    """Compiles each kernel of `impls` over the covering grid (`subset` "fast" or "full"), or over
    `random` configurations drawn with `seed`: one kernel call per program; the Mosaic kernel's
    planned SMEM recorded next to it. Refused configurations are recorded with their reason."""
    cc = compute_capability(compiler.target)
    records = []
    for impl in impls:
        grid = random_grid(impl, random, seed) if random else covering_grid(impl, subset)
        for cfg in grid:
            reason = dispatch.unsupported_reason(impl, cfg.spec(), cc)
            if reason is not None:
                records.append(dict(name=cfg.name, target=compiler.target, kind="kernel", ok=True,
                                    refused=reason, config=dataclasses.asdict(cfg)))
                continue
            fn, args, kwargs, pools = kernel_call(cfg)
            rec = compiler.compile(cfg.name, fn, args, kwargs=kwargs, pool_shapes=pools)
            rec.update(kind="kernel", config=dataclasses.asdict(cfg))
            want = "triton_calls" if impl == "triton" else "mosaic_calls"
            if rec["ok"] and rec[want] != 1:
                rec["ok"] = False
                rec["problems"].append(f"expected one {impl} kernel call, found {rec[want]}")
            from jpa.pallas.mosaic import decode as mosaic_decode, decode_ampere
            if impl == "mosaic" and rec["ok"] and mosaic_decode.runs_mma(cfg.spec(), cc):
                from jpa.pallas.mosaic import tuning as mosaic_tuning
                q_item = np.dtype(jnp.dtype(cfg.q_dtype)).itemsize
                quantized = cfg.spec().quantized
                rec["mosaic_smem_planned"] = decode_ampere.smem_plan(
                    cfg.head_dim, q_item, tuning=mosaic_tuning.lookup_ampere(cc, cfg.head_dim, quantized),
                    cache_itemsize=1 if quantized else None, page_size=cfg.page_size)[1]
            elif impl == "mosaic" and rec["ok"]:
                from jpa.pallas.mosaic import decode as mosaic_decode
                q_item = np.dtype(jnp.dtype(cfg.q_dtype)).itemsize
                c_item = np.dtype(jnp.dtype(cfg.cache_dtype)).itemsize
                rec["mosaic_smem_planned"] = mosaic_decode.smem_bytes(cfg.head_dim, cfg.page_size, q_item, c_item)
                # Before the register-accumulator path (p through SMEM, as interpret mode still runs).
                rec["mosaic_smem_interpret_path"] = mosaic_decode.smem_bytes(
                    cfg.head_dim, cfg.page_size, q_item, c_item, register_acc=False)
            records.append(rec)
            log(record_line(rec))
    return records


# ---- 2. Ragged paged attention (prefill chunks and decode tokens in one call) ----

# (q dtype, cache dtype, q_per_kv, head_dim, page_size) at a serving size: a 512-token budget, 64
# sequences of up to 4096 tokens, 8 kv heads; soft cap and sliding window on.
RAGGED_CONFIGS = (("bfloat16", "bfloat16", 4, 128, 16), ("bfloat16", "bfloat16", 1, 256, 16),
                  ("float16", "int8", 3, 64, 32), ("float32", "float32", 8, 128, 16),
                  ("bfloat16", "float8_e5m2", 8, 80, 128),
                  # A sixth entry True: attention sinks (f32[num_q_heads]).
                  ("bfloat16", "bfloat16", 8, 64, 16, True))
RAGGED_SIZES = dict(num_tokens=512, max_num_seqs=64, num_kv_heads=8, num_pages=4096, max_tokens=4096)


def ragged_grid(subset: str = "full") -> list:
    """RAGGED_CONFIGS ("fast") plus, for "full", every head dim with a 16-bit, an int8, an fp8 and
    a float32 cache, q_per_kv and page size cycling through the grid's values."""
    out = list(RAGGED_CONFIGS)
    if subset == "full":
        pairs = (("bfloat16", "bfloat16"), ("bfloat16", "int8"), ("float16", "float8_e5m2"),
                 ("float32", "float32"))
        i = 0
        for hd in HEAD_DIMS:
            for q_dtype, cache_dtype in pairs:
                out.append((q_dtype, cache_dtype, Q_PER_KV[i % len(Q_PER_KV)], hd,
                            PAGE_SIZES[(i * 7) % len(PAGE_SIZES)]))
                i += 1
    return list(dict.fromkeys(out))


def ragged_call(impl, q_dtype, cache_dtype, q_per_kv, head_dim, page_size, sinks=False, max_q_len=None):
    """(spec, fn, args, pool shapes) of one ragged_paged_attention call with the impl forced
    (max_q_len: as the op's, e.g. a verify pass's k + 1 rows a sequence)."""
    import jpa
    from jpa.ops.ragged import ragged_spec
    z = RAGGED_SIZES
    sds = jax.ShapeDtypeStruct
    k, n, b = z["num_kv_heads"], z["num_kv_heads"] * q_per_kv, z["max_num_seqs"]
    pool = (k, z["num_pages"], page_size, head_dim)
    quantized = cache_dtype in ("int8", "float8_e4m3fn", "float8_e5m2")
    args = (sds((z["num_tokens"], n, head_dim), q_dtype), sds(pool, cache_dtype), sds(pool, cache_dtype),
            sds((b, z["max_tokens"] // page_size), jnp.int32), sds((b,), jnp.int32), sds((b + 1,), jnp.int32),
            sds((), jnp.int32)) + ((sds(pool[:3], jnp.float32),) * 2 if quantized else ())
    sink_arg = (sds((n,), jnp.float32),) if sinks else ()
    args = args + sink_arg

    def fn(q, k_pages, v_pages, tables, lens, cu, num_seqs, *rest):
        scales, sink = (rest[:-1], rest[-1]) if sinks else (rest, None)
        return jpa.ragged_paged_attention(q, k_pages, v_pages, tables, lens, cu, num_seqs, soft_cap=30.0,
                                          sliding_window=1024, k_scales=scales[0] if scales else None,
                                          v_scales=scales[1] if scales else None, impl=impl, sinks=sink,
                                          max_q_len=max_q_len)
    spec = ragged_spec(args[0], args[1], args[3], soft_cap=30.0, alibi_slopes=None, sliding_window=1024,
                       sinks=sink_arg[0] if sinks else None)
    return spec, fn, args, [(pool, cache_dtype)] * 2


def check_ragged(compiler: Compiler, impls, log=print, subset: str = "fast") -> list:
    """Each ragged kernel over RAGGED_CONFIGS: the ragged kernel plus the decode kernel that serves
    every sequence's last row, both in the one program."""
    from jpa.ops import ragged
    cc = compute_capability(compiler.target)
    records = []
    for impl in impls:
        for cfg in ragged_grid(subset):
            spec, fn, args, pools = ragged_call(impl, *cfg)
            name = (f"ragged {impl} q={cfg[0]} kv={cfg[1]} G={cfg[2]} hd={cfg[3]} ps={cfg[4]}"
                    + (" sinks" if cfg[5:] and cfg[5] else ""))
            reason = ragged.unsupported_reason(impl, spec, cc)
            if reason is not None:
                records.append(dict(name=name, target=compiler.target, kind="ragged", ok=True, refused=reason))
                continue
            rec = compiler.compile(name, fn, args, pool_shapes=pools)
            rec.update(kind="ragged")
            calls = rec.get("triton_calls" if impl == "triton" else "mosaic_calls", 0)
            if rec["ok"] and calls != 2:
                rec["ok"] = False
                rec["problems"].append(f"expected two {impl} kernel calls (ragged + decode), found {calls}")
            records.append(rec)
            log(record_line(rec))
    return records


def check_verify_rows(compiler: Compiler, log=print, max_q_len: int = 5) -> list:
    """The Mosaic ragged op over RAGGED_CONFIGS with max_q_len (a speculative verify pass: k + 1
    rows a sequence): on Hopper, when max_q_len tokens' heads fit the 64-row q tile, ONE kernel
    call (the multi-row decode kernel, `jpa.pallas.mosaic.decode.paged_decode_rows`) that reads
    each sequence's KV once; elsewhere the two calls of `check_ragged`. No spills either way."""
    from jpa.ops import ragged
    from jpa.pallas.mosaic.ragged import runs_mma, short_rows
    cc = compute_capability(compiler.target)
    records = []
    for cfg in RAGGED_CONFIGS:
        spec, fn, args, pools = ragged_call("mosaic", *cfg[:5], sinks=bool(cfg[5:] and cfg[5]), max_q_len=max_q_len)
        name = (f"ragged mosaic rows<={max_q_len} q={cfg[0]} kv={cfg[1]} G={cfg[2]} hd={cfg[3]} ps={cfg[4]}"
                + (" sinks" if cfg[5:] and cfg[5] else ""))
        reason = ragged.unsupported_reason("mosaic", spec, cc)
        if reason is not None:
            records.append(dict(name=name, target=compiler.target, kind="verify_rows", ok=True, refused=reason))
            continue
        rec = compiler.compile(name, fn, args, pool_shapes=pools)
        rec.update(kind="verify_rows")
        # (A shape on Hopper's mma route runs the two kernels: the short-rows call is WGMMA's.)
        want = 1 if short_rows(cfg[2], max_q_len, cc) and not runs_mma(spec, cc) else 2
        if rec["ok"] and rec.get("mosaic_calls", 0) != want:
            rec["ok"] = False
            rec["problems"].append(f"expected {want} mosaic kernel call(s), found {rec.get('mosaic_calls', 0)}")
        records.append(rec)
        log(record_line(rec))
    return records


# ---- 2b. Stacked page pools: a loop over layers, the layer a traced index ----

# The layer-scanned model's shape of a call: ONE pool per K and V, [L, K, P, S_p, H] (scales
# f32[L, K, P, S_p]), carried through a loop over layers; each layer writes its new tokens into the
# carried pool, then calls the kernel on the WHOLE pool with the loop index as its layer. Checked:
# it compiles, the kernel is in the loop body once, no pool-shaped copy (of the stacked shape), the
# donated pools aliased, temporaries far below the pools, and the kernel's registers and spills
# against its per-layer twin (the same configuration over a [K, P, S_p, H] pool): taken from the
# records of the grid compiled before it in the same run, or (full subset) compiled here.
#
# The fast subset is one ragged configuration per kernel family: the ragged op runs both kernels
# (the tile kernel and the decode kernel of the last rows) over the stacked pool. Its 40 bf16
# layers make each pool 5 GiB, over 2**32 bytes: Pallas Triton's 64-bit offsets.
#
# (decode KernelConfig overrides, num_layers). The 4-layer bf16 pool is 1 GiB per K/V (32-bit
# offsets in Triton); the 32-layer one 8 GiB (64-bit offsets; the Llama-3-8B shape of pool).
STACKED_KERNEL_CONFIGS = (
    ({}, 4),
    ({}, 32),
    (dict(cache_dtype="int8", page_size=32), 4),
    (dict(split_k=True, soft_cap=True, alibi=True, sliding_window=True), 4),
    (dict(q_dtype="float16", cache_dtype="float8_e5m2", head_dim=64, q_per_kv=3, num_kv_heads=3), 30),
)
# (RAGGED_CONFIGS entry, num_layers, in the fast subset).
STACKED_RAGGED_CONFIGS = (
    (RAGGED_CONFIGS[0], 40, True),
    (RAGGED_CONFIGS[0], 4, False),
    (RAGGED_CONFIGS[2], 4, False),
    (RAGGED_CONFIGS[4], 4, False),
)


def _stacked_loop(call, num_layers: int, num_extra: int, quantized: bool):
    """fn(q, k_pages, v_pages, block_tables, seq_lens, *extra, *scales) -> (k_pages, v_pages,
    *scales, out): `num_layers` iterations of "write one token per sequence into layer l of the
    carried pools (the model's cache write), then `call(q, k, v, tables, lens, *extra, k_scales,
    v_scales, layer=l)`", the outputs summed. `extra` are num_extra index arrays (ragged: cu_q_lens,
    num_seqs)."""
    from jax import lax

    def fn(q, k_pages, v_pages, tables, lens, *rest):
        extra, scales = rest[:num_extra], rest[num_extra:]
        num_seqs, page_size = tables.shape[0], k_pages.shape[3]
        num_kv_heads, num_pages = k_pages.shape[1], k_pages.shape[2]
        pos = jnp.maximum(lens - 1, 0)
        page = jnp.clip(tables[jnp.arange(num_seqs), pos // page_size], 0, num_pages - 1)  # i32[B]
        off = pos % page_size  # i32[B]

        def body(layer, carry):
            k, v, *sc, out = carry
            new = q[:num_seqs, :num_kv_heads].astype(k.dtype)  # [B, K, H]
            k = k.at[layer, :, page, off].set(new)
            v = v.at[layer, :, page, off].set(new)
            sc = [s.at[layer, :, page, off].set(1.0) for s in sc]
            o = call(q, k, v, tables, lens, *extra, k_scales=sc[0] if quantized else None,
                     v_scales=sc[1] if quantized else None, layer=layer)
            return (k, v, *sc, out + o.astype(jnp.float32))

        init = (k_pages, v_pages, *scales, jnp.zeros(q.shape, jnp.float32))
        return lax.fori_loop(0, num_layers, body, init)

    return fn


def _stacked_args(q_shape, q_dtype, pool, cache_dtype, num_layers, index_args, quantized):
    """(args, donate_argnums, pool shapes) of a `_stacked_loop` program: q, the stacked K and V
    pools, the index arrays, and (quantized) the stacked scales; pools and scales donated."""
    sds = jax.ShapeDtypeStruct
    stacked = (num_layers, *pool)
    args = (sds(q_shape, q_dtype), sds(stacked, cache_dtype), sds(stacked, cache_dtype), *index_args)
    scale_shapes = [(stacked[:4], "float32")] * 2 if quantized else []
    args += tuple(sds(s, d) for s, d in scale_shapes)
    donate = (1, 2) + tuple(range(len(args) - len(scale_shapes), len(args)))
    return args, donate, [(stacked, cache_dtype)] * 2 + scale_shapes


def _kernel_twin(records, name):
    """{kernel: {registers, spill_stores, shared_memory}} of an already compiled record `name`."""
    for r in records:
        if r.get("name") == name and "kernels" in r:
            return {k: {f: v.get(f) for f in ("registers", "spill_stores", "shared_memory")}
                    for k, v in r["kernels"].items()}
    return None


def _compare_twin(rec, twin):
    """Records the per-layer twin's kernel resources next to the stacked ones; more registers than
    the twin is reported in `register_growth` (a problem only when it brings spills, which
    `Compiler.compile` already fails)."""
    rec["per_layer_kernels"] = twin
    if not twin or not rec.get("kernels"):
        return
    growth = {}
    for k, v in rec["kernels"].items():
        t = twin.get(k)
        if t and v.get("registers") is not None and t.get("registers") is not None:
            growth[k] = v["registers"] - t["registers"]
            if v.get("spill_stores", 0) > (t.get("spill_stores") or 0):
                rec["problems"].append(f"{k} spills {v['spill_stores']} B over a stacked pool, "
                                       f"{t.get('spill_stores') or 0} B per layer")
                rec["ok"] = False
    rec["register_growth"] = growth


def check_stacked_kernels(compiler: Compiler, impls, subset: str, records=(), log=print) -> list:
    """Each decode kernel over a stacked pool in a loop over layers (STACKED_KERNEL_CONFIGS, full
    subset only); the per-layer twin is taken from `records` (the grid) or compiled here."""
    from jpa.pallas.mosaic import decode as mosaic_decode
    from jpa.pallas.triton import decode as triton_decode
    cc = compute_capability(compiler.target)
    modules = dict(triton=triton_decode, mosaic=mosaic_decode)
    out, records = [], list(records)
    for impl in impls:
        for overrides, num_layers in STACKED_KERNEL_CONFIGS:
            if subset == "fast":
                continue
            cfg = dataclasses.replace(KernelConfig(impl), **overrides)
            spec = cfg.spec()._replace(num_layers=num_layers)
            name = f"{cfg.name} stacked L={num_layers}"
            reason = modules[impl].unsupported_reason(spec, cc)
            if reason is not None:
                out.append(dict(name=name, target=compiler.target, kind="stacked", ok=True, refused=reason))
                continue
            twin = _kernel_twin(records, cfg.name)
            if twin is None and dispatch.unsupported_reason(impl, cfg.spec(), cc) is None:
                fn, args, kwargs, pools = kernel_call(cfg)
                trec = compiler.compile(cfg.name, fn, args, kwargs=kwargs, pool_shapes=pools)
                records.append(trec)
                twin = _kernel_twin(records, cfg.name)
            pool = (spec.num_kv_heads, spec.num_pages, spec.page_size, spec.head_dim)
            index_args = (jax.ShapeDtypeStruct((spec.num_seqs, spec.pages_per_seq), jnp.int32),
                          jax.ShapeDtypeStruct((spec.num_seqs,), jnp.int32))
            args, donate, pools = _stacked_args((spec.num_seqs, spec.num_q_heads, spec.head_dim), spec.q_dtype,
                                                pool, spec.cache_dtype, num_layers, index_args, spec.quantized)
            call = functools.partial(modules[impl].paged_decode, scale=spec.head_dim ** -0.5,
                                     soft_cap=30.0 if spec.soft_cap else None,
                                     sliding_window=1024 if spec.sliding_window else None,
                                     **dispatch.kernel_options(impl, cc))
            if spec.alibi:
                slopes = 2.0 ** -jnp.linspace(0.5, 8, spec.num_q_heads)
                call = functools.partial(call, alibi_slopes=slopes)
            fn = _stacked_loop(call, num_layers, 0, spec.quantized)
            rec = compiler.compile(name, fn, args, donate_argnums=donate, pool_shapes=pools)
            rec.update(kind="stacked", num_layers=num_layers, config=dataclasses.asdict(cfg))
            want = "triton_calls" if impl == "triton" else "mosaic_calls"
            if rec["ok"] and rec[want] != 1:
                rec["ok"] = False
                rec["problems"].append(f"expected one {impl} kernel call (in the loop body), found {rec[want]}")
            _compare_twin(rec, twin)
            out.append(rec)
            log(record_line(rec) + _growth(rec))
    return out


def check_stacked_ragged(compiler: Compiler, impls, subset: str, records=(), log=print) -> list:
    """Each ragged kernel (its tile kernel and the decode kernel of the last rows) over a stacked
    pool in a loop over layers (STACKED_RAGGED_CONFIGS); twins from `records` or (full subset)
    compiled here."""
    from jpa.ops import ragged
    from jpa.pallas.mosaic import ragged as mosaic_ragged
    from jpa.pallas.triton import ragged as triton_ragged
    cc = compute_capability(compiler.target)
    modules = dict(triton=triton_ragged, mosaic=mosaic_ragged)
    out, records = [], list(records)
    for impl in impls:
        for cfg, num_layers, fast in STACKED_RAGGED_CONFIGS:
            if subset == "fast" and not fast:
                continue
            spec, twin_fn, twin_args, twin_pools = ragged_call(impl, *cfg)
            twin_name = f"ragged {impl} q={cfg[0]} kv={cfg[1]} G={cfg[2]} hd={cfg[3]} ps={cfg[4]}"
            name = f"{twin_name} stacked L={num_layers}"
            reason = modules[impl].unsupported_reason(spec._replace(num_layers=num_layers), cc)
            if reason is not None:
                out.append(dict(name=name, target=compiler.target, kind="stacked", ok=True, refused=reason))
                continue
            twin = _kernel_twin(records, twin_name)
            if twin is None and subset == "full" and ragged.unsupported_reason(impl, spec, cc) is None:
                records.append(compiler.compile(twin_name, twin_fn, twin_args, pool_shapes=twin_pools))
                twin = _kernel_twin(records, twin_name)
            pool = twin_args[1].shape
            args, donate, pools = _stacked_args(twin_args[0].shape, spec.q_dtype, pool, spec.cache_dtype,
                                                num_layers, twin_args[3:7], spec.quantized)
            call = functools.partial(modules[impl].ragged_paged_attention, scale=spec.head_dim ** -0.5,
                                     soft_cap=30.0, sliding_window=1024, **dispatch.kernel_options(impl, cc))
            fn = _stacked_loop(call, num_layers, 2, spec.quantized)
            rec = compiler.compile(name, fn, args, donate_argnums=donate, pool_shapes=pools)
            rec.update(kind="stacked", num_layers=num_layers)
            calls = rec.get("triton_calls" if impl == "triton" else "mosaic_calls", 0)
            if rec["ok"] and calls != 2:
                rec["ok"] = False
                rec["problems"].append(f"expected two {impl} kernel calls (ragged + decode, in the loop body), "
                                       f"found {calls}")
            _compare_twin(rec, twin)
            out.append(rec)
            log(record_line(rec) + _growth(rec))
    return out


def _growth(rec) -> str:
    g = rec.get("register_growth")
    return (" | registers vs per-layer: " + ", ".join(f"{k} {v:+d}" for k, v in g.items())) if g else ""


# ---- 4. What impl="auto" compiles for the target ----

def check_auto(compiler: Compiler, log=print) -> list:
    """The paged decode (`KernelConfig`'s serving batch: 64 sequences x 512 tokens, GQA 4, head_dim
    128, pages of 16) and the ragged op (RAGGED_CONFIGS[0]) with impl="auto" for the target: which
    kernels the program holds (`impls`: Mosaic and/or Triton calls), each kernel's resources."""
    out = []
    fn, args, kwargs, pools = kernel_call(KernelConfig("auto"))
    calls = [("decode", fn, args, kwargs, pools)]
    _, rfn, rargs, rpools = ragged_call("auto", *RAGGED_CONFIGS[0])
    calls.append(("ragged", rfn, rargs, {}, rpools))
    for op, f, a, kw, p in calls:
        rec = compiler.compile(f"auto {op}", f, a, kwargs=kw, pool_shapes=p)
        rec.update(kind="auto", op=op, impls={i: rec.get(f"{i}_calls", 0) for i in ("mosaic", "triton")})
        out.append(rec)
        log(record_line(rec) + f" | calls {rec['impls']}")
    return out
