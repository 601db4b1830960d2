"""Everything only a GPU can show, in one command, on a bare GPU image, within a time budget.

    PYTHONPATH=. python3 scripts/gpu_validate.py --out DIR [--budget-s 420] [--quick]
    PYTHONPATH=. python3 scripts/gpu_validate.py --plan            # the sections, what each needs and costs
    PYTHONPATH=. python3 scripts/gpu_validate.py --dry-run         # on a CPU: everything but the device
    PYTHONPATH=. python3 scripts/gpu_validate.py --profile decode:mosaic:bfloat16:bfloat16:64:4096:8:4:128:16

Needs only JAX with its CUDA plugin (0.11.2 or 0.12), flax, chex and numpy: no pip install, no
download, no tokenizer package. Models are random weights at real shapes (SmolLM2-135M and a
4-layer Llama-3-8B-shaped model). A short GPU rental is the common case, so the sections run in the
order of what they prove, each in its own subprocess (a crash, even an abort in a compiler, is
recorded and the others still run), and the whole run keeps to `--budget-s` (default 420 s, start to
report): a section stops taking new cases when the budget is spent and reports what it ran and what it
left; DIR/report.json and DIR/report.md are complete after every case, so a run cut short still leaves
a report. Every section states its own time.

1. kernels    each case of a covering grid (page sizes, GQA ratios, head dims incl. 80/96/192/256,
              16-bit, int8 and fp8 caches, soft cap, ALiBi, window, NaN-poisoned unused slots)
              through the kernel `impl="auto"` picks for it on this GPU, against the float64 NumPy
              oracle, float32 dots at HIGHEST precision (no TF32).
2. auto       `impl="auto"` under jax.jit for decode and ragged, per q dtype: which kernel the
              compiled program holds, and each candidate kernel's self-check result.
3. engine     the engine (public API) with SmolLM2-shaped and 8B-shaped random models: greedy float32
              token ids with impl="auto" equal to the plain-JAX path's.
4. bandwidth  decode and ragged GB/s per kernel and % of the roofline, the roofline being a
              device-to-device copy of the same number of bytes measured in the same run.
5. peers      on the same GPU and shapes: JAX's `jax.experimental.pallas.ops.gpu.paged_attention`
              and dense XLA attention over a contiguous cache, next to jpa's kernels.
6. throughput the engine's tokens/s (bf16 and f32) with the same models at 64 x 2k.
7. kernels_rest  the kernel grid through the kernels auto passes over on this GPU.
8. invariant  `batch_invariant=True` on the GPU (issue 53): a request's tokens and logprobs bitwise the
              same alone and among random neighbours (slots, chunking, prefix hits), scoring parity
              (prompt logprobs = the greedy sampler's), and `update_weights` with no compile.

On a machine without an NVIDIA GPU it refuses (exit 2), except `--dry-run`, which builds every
section's cases, shapes and models (abstractly) on the CPU and prints each section's estimate against
the budget, proving nothing about a GPU. Exit 1 if any section failed.

Not included: a model-output comparison against transformers (the GPU image has transformers and torch).
The tiny checkpoints of tests/data/hf would fit the 64 MiB tree, but the CPU tests already compare every
family with transformers; on the GPU the engine section's auto-vs-plain-JAX equality covers the kernels.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time
import traceback
import warnings

from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)

ROOT = pathlib.Path(__file__).resolve().parents[1]

SECTIONS = {
    "kernels": "GPU; jpa, numpy. Each case through the kernel impl='auto' picks for it on this GPU, natively "
               "vs the float64 oracle (f32 dots at HIGHEST precision). ~6 s a case (one compile each).",
    "auto": "GPU. impl='auto' under jit (decode, ragged) per q dtype: kernel in the compiled program, "
            "each candidate's self-check. ~1 min.",
    "engine": "GPU, ~4 GiB free; flax. jpa.engine.LLMEngine with random SmolLM2-shaped and 4-layer "
              "Llama-3-8B-shaped models: greedy f32 token ids with impl='auto' equal to impl='xla''s "
              "(8 seqs x 512 context, 32 new tokens). ~30 s a run.",
    "bandwidth": "GPU, ~4 GiB free. Decode and ragged GB/s per kernel, % of a same-size device-to-device "
                 "copy (the roofline). ~5 s a row.",
    "peers": "GPU, ~4 GiB free; jax.experimental.pallas.ops.gpu.paged_attention (JAX's deprecated "
             "Triton op; recorded as unavailable if it does not import). Same shapes as jpa. ~5 s a row.",
    "throughput": "GPU, ~20 GiB free; flax. The engine's tokens/s with the same models, bf16 and f32, 64 seqs x "
                  "2k context (--quick: 8 x 512). ~90 s a run.",
    "kernels_rest": "GPU; jpa, numpy. The same grid through the kernels auto passes over on this GPU (the "
                    "deprecated Triton ones on Hopper, for float32 q only in auto). ~6 s a case.",
    "invariant": "GPU; flax. batch_invariant=True with a random SmolLM2-shaped bf16 model: one request's "
                 "bits alone vs among neighbours, scoring parity, update_weights without a compile. ~1-2 min.",
}
# Seconds one item of each section takes on an H100 (a kernel case's compile and run, an engine run, a timed
# row) and the section's fixed start-up (a process importing JAX and initializing the GPU): the estimates
# --plan and --dry-run print against the budget. From the sections' descriptions; to be replaced by the
# first GPU run's own figures (each section reports its seconds).
ITEM_SECONDS = {"kernels": 6, "auto": 10, "engine": 30, "bandwidth": 5, "peers": 5, "throughput": 90,
                "kernels_rest": 6, "invariant": 90}
DRY_RUN_CC = 9.0
START_SECONDS = 15
DEFAULT_BUDGET_S = 420
# A section is not started with less than this left: its process start alone would use it.
MIN_SECTION_S = 30


# ---------------------------------------------------------------- helpers (run in the child)

def _jax():
    import jax
    return jax


def _err(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:500]


def _time(fn, *args, iters: int):
    """Median-free steady-state time per call: one warm-up, then `iters` calls back to back with
    one sync at the end (async dispatch hides host overhead behind the previous call)."""
    jax = _jax()
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    out = None
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


def _copy_seconds(nbytes: int, iters: int) -> float:
    """Seconds of a device-to-device copy of nbytes (read nbytes + write nbytes)."""
    jax = _jax()
    import jax.numpy as jnp
    x = jnp.zeros((max(1, nbytes // 4),), jnp.uint32)
    return _time(jax.jit(lambda a: jnp.copy(a) + jnp.uint32(1)), x, iters=iters)


class Progress:
    """A section's budget and its partial result, in the child: `allows()` says whether another item
    (a case, a run, a timed row) fits in what is left of the run's budget; `save(res)` rewrites the
    section's file with what it has so far (marked partial), so a section killed at the budget still
    leaves its finished items in the report."""

    def __init__(self, out_file: pathlib.Path, deadline: float, item_seconds: float):
        self.out_file, self.deadline, self.item_seconds = out_file, deadline, item_seconds
        self.left = 0   # items not run for the budget
        self.t0 = time.perf_counter()

    def allows(self) -> bool:
        if time.time() + self.item_seconds <= self.deadline:
            return True
        self.left += 1
        return False

    def save(self, res: dict):
        partial = dict(res, partial=True, not_run_for_budget=self.left,
                       seconds=round(time.perf_counter() - self.t0, 1))
        self.out_file.write_text(json.dumps(partial, indent=1, default=str) + "\n")


def _auto_pick(op: str, spec, cc, impls=("mosaic", "triton")) -> str | None:
    """The kernel impl='auto' prefers for this configuration on compute capability cc, before its
    self-check (the first of AUTO_ORDER serving cc that accepts the configuration); None: plain JAX."""
    from jpa.ops import dispatch
    from jpa.ops import ragged
    for name, lo, hi in dispatch.AUTO_ORDER:
        if cc is None or not lo <= cc < hi or name not in impls:
            continue
        reason = (dispatch.unsupported_reason(name, spec, cc) if op == "decode"
                  else ragged.unsupported_reason(name, spec, cc))
        if reason is None:
            return name
    return None


@contextlib.contextmanager
def _highest_precision():
    jax = _jax()
    with jax.default_matmul_precision("highest"):
        yield


# ---------------------------------------------------------------- 1. kernels

def decode_grid(quick: bool):
    from jpa.testing.kernel_cases import Case
    f32, bf16 = dict(q_dtype="float32", cache_dtype="float32"), dict(q_dtype="bfloat16", cache_dtype="bfloat16")
    cases = [
        Case((1, 17, 64, 0), num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, pages_per_seq=4, **bf16),
        Case((300, 1, 129), num_q_heads=9, num_kv_heads=3, head_dim=64, page_size=16, pages_per_seq=20,
             share_page=True, **bf16),
        Case((1000, 4), num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, pages_per_seq=64, **bf16),
        Case((257, 31), num_q_heads=16, num_kv_heads=8, head_dim=256, page_size=32, pages_per_seq=9,
             soft_cap=50.0, **bf16),
        Case((200, 65), num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=128, pages_per_seq=2,
             q_dtype="float16", cache_dtype="float16"),
        Case((450, 9), num_q_heads=8, num_kv_heads=1, head_dim=64, page_size=32, pages_per_seq=15,
             alibi=True, sliding_window=400, q_dtype="float16", cache_dtype="int8"),
        Case((333, 64), num_q_heads=16, num_kv_heads=4, head_dim=128, page_size=64, pages_per_seq=6,
             q_dtype="bfloat16", cache_dtype="float8_e4m3fn"),
        Case((70, 3), num_q_heads=4, num_kv_heads=2, head_dim=192, page_size=64, pages_per_seq=2,
             q_dtype="bfloat16", cache_dtype="int8", sliding_window=50),
        Case((100, 40), num_q_heads=4, num_kv_heads=2, head_dim=80, page_size=8, pages_per_seq=13, **f32),
        Case((96, 33), num_q_heads=12, num_kv_heads=4, head_dim=96, page_size=32, pages_per_seq=3,
             soft_cap=30.0, alibi=True, **f32),
        Case((4000,), num_q_heads=8, num_kv_heads=8, head_dim=128, page_size=16, pages_per_seq=256, **bf16),
        Case((120, 7), num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=256, pages_per_seq=1,
             q_dtype="float16", cache_dtype="float8_e5m2"),
    ]
    return cases[:4] if quick else cases


def ragged_grid(quick: bool):
    from jpa.testing.kernel_cases import RaggedCase
    bf16 = dict(q_dtype="bfloat16", cache_dtype="bfloat16")
    cases = [
        RaggedCase((1, 300, 140), q_lens=(1, 20, 70), num_tokens=96, max_num_seqs=4, num_q_heads=4,
                   num_kv_heads=2, head_dim=64, page_size=16, pages_per_seq=19, alibi=True,
                   sliding_window=200, **bf16),
        RaggedCase((513, 1, 90, 5), q_lens=(64, 1, 90, 5), num_tokens=192, max_num_seqs=6,
                   num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, pages_per_seq=33, **bf16),
        RaggedCase((200, 77), q_lens=(120, 1), num_tokens=128, max_num_seqs=2, num_q_heads=8,
                   num_kv_heads=2, head_dim=256, page_size=128, pages_per_seq=2, q_dtype="bfloat16",
                   cache_dtype="int8", soft_cap=30.0),
        RaggedCase((60, 33, 47), q_lens=(30, 1, 2), num_tokens=40, max_num_seqs=4, num_q_heads=8,
                   num_kv_heads=2, head_dim=80, page_size=8, pages_per_seq=8),
    ]
    return cases[:2] if quick else cases


def _spec_of(op, args, opts):
    if op == "decode":
        from jpa.ops.decode import decode_spec
        return decode_spec(args[0], args[1], args[3], soft_cap=opts.get("soft_cap"),
                           alibi_slopes=opts.get("alibi_slopes"), sliding_window=opts.get("sliding_window"))
    from jpa.ops.ragged import ragged_spec
    return ragged_spec(args[0], args[1], args[3], soft_cap=opts.get("soft_cap"),
                       alibi_slopes=opts.get("alibi_slopes"), sliding_window=opts.get("sliding_window"))


def section_kernels(ctx) -> dict:
    return _kernels_section(ctx, auto_picks=True)


def section_kernels_rest(ctx) -> dict:
    return _kernels_section(ctx, auto_picks=False)


def _kernels_section(ctx, auto_picks: bool) -> dict:
    """The kernel grid against the float64 oracle, through the kernels auto picks (auto_picks) or the others."""
    import numpy as np

    import jpa
    from jpa.ops import dispatch
    from jpa.ops import ragged
    from jpa.testing.kernel_cases import make_inputs, make_ragged_inputs, np_ragged_reference, np_reference, tolerance
    cc, interpret, progress = ctx["cc"], ctx["interpret"], ctx["progress"]
    rows = []
    plan = [("decode", impl, c) for impl in ("triton", "mosaic") for c in decode_grid(ctx["quick"])]
    plan += [("ragged", impl, c) for impl in ("triton", "mosaic") for c in ragged_grid(ctx["quick"])]
    if interpret:  # --debug-cpu-interpret: the report machinery on a CPU, one small case per op
        plan = [("decode", "triton", decode_grid(True)[0]), ("ragged", "triton", ragged_grid(True)[0])]
    # What proves most first (the "kernels" section): every case through the kernel auto picks for it on this
    # GPU; "kernels_rest", at the end of the run, the kernels auto passes over.
    picks = {}
    for op, _, case in plan:
        if (op, str(case)) not in picks:
            args, opts = (make_inputs if op == "decode" else make_ragged_inputs)(case)
            picks[(op, str(case))] = _auto_pick(op, _spec_of(op, args, opts), cc)
    picked = {(op, impl, str(c)): picks[(op, str(c))] == impl for op, impl, c in plan}
    if not interpret:
        plan = [p for p in plan if picked[(p[0], p[1], str(p[2]))] == auto_picks]
    if ctx["dry_run"]:
        return dict(ok=True, dry_run=True, items=len(plan), auto_picked=sum(picked.values()),
                    plan=[f"{op} {impl}{' (auto picks)' if picked[(op, impl, str(c))] else ''} {c}"
                          for op, impl, c in plan])
    for op, impl, case in plan:
        if not progress.allows():
            continue
        row = dict(op=op, impl=impl, case=str(case), auto_picks=picked[(op, impl, str(case))])
        try:
            if op == "decode":
                args, opts = make_inputs(case)
                reason = dispatch.unsupported_reason(impl, _spec_of(op, args, opts), cc)
                call = lambda: jpa.paged_decode(*args, **opts, impl=impl, interpret=interpret)  # noqa: E731
                want = lambda: np_reference(*args, **opts)  # noqa: E731
            else:
                args, opts = make_ragged_inputs(case)
                reason = ragged.unsupported_reason(impl, _spec_of(op, args, opts), cc)
                call = lambda: jpa.ragged_paged_attention(*args, **opts, impl=impl, interpret=interpret)  # noqa: E731
                want = lambda: np_ragged_reference(*args, **opts)  # noqa: E731
            if reason is not None:
                rows.append({**row, "refused": reason, "ok": True})
                continue
            with _highest_precision():
                got = np.asarray(call(), np.float64)
            ref = want()
            live = np.isfinite(ref)
            err = float(np.max(np.abs(got - ref)[live])) if live.any() else 0.0
            tol = tolerance(case)
            rows.append({**row, "max_abs_err": err, "tolerance": tol,
                         "ok": bool(np.isfinite(got[live]).all() and err <= tol)})
        except Exception as e:  # every failing case is reported, not only the first
            rows.append({**row, "error": _err(e), "ok": False})
        print(f"  {'ok  ' if rows[-1]['ok'] else 'FAIL'} {op} {impl} {case}", flush=True)
        progress.save(_kernels_result(rows, progress))
    return _kernels_result(rows, progress)


def _kernels_result(rows, progress) -> dict:
    return dict(ok=all(r["ok"] for r in rows), cases=rows, ran=sum("refused" not in r for r in rows),
                refused=sum("refused" in r for r in rows), failed=sum(not r["ok"] for r in rows),
                not_run_for_budget=progress.left)


# ---------------------------------------------------------------- 2. auto

def section_auto(ctx) -> dict:
    jax = _jax()
    import jax.numpy as jnp
    import numpy as np

    import jpa
    from jpa.ops import dispatch
    from jpa.ops import ragged
    if ctx["dry_run"]:
        return dict(ok=True, dry_run=True, items=6, plan=[f"{op} {d}" for d in ("bfloat16", "float16", "float32")
                                                           for op in ("decode", "ragged")])
    target = dispatch.current_target()
    out = {}
    rng = np.random.default_rng(0)
    progress = ctx["progress"]
    for dtype in ("bfloat16", "float16", "float32"):
        q = jnp.asarray(rng.standard_normal((16, 32, 128)), dtype)
        k = jnp.asarray(rng.standard_normal((8, 256, 16, 128)), dtype)
        tables = jnp.asarray(rng.permutation(256)[:16 * 16].reshape(16, 16), jnp.int32)
        lens = jnp.asarray(rng.integers(1, 257, (16,)), jnp.int32)
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(rng.integers(1, 5, 16))]), jnp.int32)
        rq = jnp.asarray(rng.standard_normal((64, 32, 128)), dtype)
        for op in ("decode", "ragged"):
            if not progress.allows():
                continue
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                if op == "decode":
                    fn = jax.jit(lambda *a: jpa.paged_decode(*a))
                    args = (q, k, k, tables, lens)
                    spec = _spec_of(op, args, {})
                    modules = dispatch.KERNEL_MODULES
                    check = lambda impl: dispatch.self_check(impl, spec, target)  # noqa: E731
                else:
                    fn = jax.jit(lambda *a: jpa.ragged_paged_attention(*a))
                    args = (rq, k, k, tables, jnp.maximum(lens, cu[1:] - cu[:-1]), cu, jnp.int32(16))
                    spec = _spec_of(op, args, {})
                    modules = dict(ragged.RAGGED.modules)
                    check = lambda impl: dispatch.self_check(impl, spec, target, ragged.RAGGED)  # noqa: E731
                text = fn.lower(*args).compile().as_text()
                in_hlo = ("mosaic" if 'custom_call_target="mosaic_gpu' in text else
                          "triton" if "__gpu$xla.gpu.triton" in text else "xla")
                checks = {}
                for impl in modules:
                    reason = dispatch.unsupported_reason(impl, spec, target.compute_capability,
                                                         None if op == "decode" else ragged.RAGGED)
                    checks[impl] = ("refused: " + reason) if reason else (check(impl) or "passed")
            out[f"{op} {dtype}"] = dict(in_compiled_program=in_hlo, self_checks=checks,
                                        warnings=[str(x.message)[:400] for x in w],
                                        ok=in_hlo != "xla" and checks.get(in_hlo) == "passed")
            progress.save(dict(ok=all(v["ok"] for v in out.values()), by_op_dtype=out))
    return dict(ok=all(v["ok"] for v in out.values()), by_op_dtype=out, not_run_for_budget=progress.left)


# ---------------------------------------------------------------- 3. bandwidth and 4. peers

# (name, num_seqs, context, num_kv_heads, q_per_kv, head_dim, page_size, dtype)
DECODE_SHAPES = [("smollm2 B64 ctx2048", 64, 2048, 3, 3, 64, 16, "bfloat16"),
                 ("llama8b B64 ctx2048", 64, 2048, 8, 4, 128, 16, "bfloat16"),
                 ("llama8b B8 ctx16384", 8, 16384, 8, 4, 128, 16, "bfloat16"),
                 ("llama8b B256 ctx1024", 256, 1024, 8, 4, 128, 16, "bfloat16"),
                 ("gemma hd256 B32 ctx4096", 32, 4096, 8, 2, 256, 16, "bfloat16"),
                 ("llama8b int8 B64 ctx2048", 64, 2048, 8, 4, 128, 32, "int8")]


def decode_problem(shape, seed=0):
    """(args, opts, bytes read) of a decode call with every sequence at `context` tokens."""
    import jax.numpy as jnp
    import numpy as np

    from jpa.core.quant import quantize
    _, b, ctx, kh, g, h, ps, dtype = shape
    rng = np.random.default_rng(seed)
    pps = ctx // ps
    num_pages = b * pps
    q_dtype = "bfloat16" if dtype in ("int8", "float8_e4m3fn") else dtype
    q = jnp.asarray(rng.standard_normal((b, kh * g, h)), q_dtype)
    opts = dict(scale=h ** -0.5)
    pools = []
    for _ in range(2):
        x = jnp.asarray(rng.standard_normal((kh, num_pages, ps, h)), jnp.float32)
        if dtype in ("int8", "float8_e4m3fn"):
            vals, scales = quantize(x, dtype)
            pools.append(vals)
            opts["k_scales" if len(pools) == 1 else "v_scales"] = scales
        else:
            pools.append(x.astype(dtype))
    tables = jnp.asarray(rng.permutation(num_pages).reshape(b, pps), jnp.int32)
    lens = jnp.full((b,), ctx, jnp.int32)
    return (q, pools[0], pools[1], tables, lens), opts, decode_bytes(shape)


def decode_bytes(shape) -> int:
    """Bytes a decode call of `shape` must read: every sequence's K and V (and an 8-bit cache's f32 scales)."""
    _, b, ctx, kh, _, h, _, dtype = shape
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "float8_e4m3fn": 1}[dtype]
    scales = 2 * kh * b * ctx * 4 if itemsize == 1 else 0
    return 2 * kh * b * ctx * h * itemsize + scales


def section_bandwidth(ctx) -> dict:
    jax = _jax()
    import jpa
    from jpa.ops import dispatch
    rows = []
    iters = 10 if ctx["quick"] else 30
    shapes = DECODE_SHAPES[:2] if ctx["quick"] else DECODE_SHAPES
    if ctx["dry_run"]:
        plan = [f"decode {shape[0]} {impl}" for shape in shapes for impl in ("mosaic", "triton", "xla")]
        plan += [f"ragged {impl}" for impl in ("mosaic", "triton", "xla")]
        return dict(ok=True, dry_run=True, items=len(plan), plan=plan,
                    bytes={shape[0]: decode_bytes(shape) for shape in shapes})
    progress = ctx["progress"]
    for shape in shapes:
        if not progress.allows():
            continue
        args, opts, nbytes = decode_problem(shape)
        copy_s = _copy_seconds(nbytes, iters)
        copy_gbps = 2 * nbytes / copy_s / 1e9
        spec = _spec_of("decode", args, opts)
        for impl in ("mosaic", "triton", "xla"):
            row = dict(op="decode", shape=shape[0], impl=impl, bytes=nbytes, copy_gbps_read_write=round(copy_gbps, 1))
            reason = None if impl == "xla" else dispatch.unsupported_reason(impl, spec, ctx["cc"])
            if reason:
                rows.append({**row, "refused": reason})
                continue
            rows.append(_timed_row(row, jax.jit(lambda *a, impl=impl: jpa.paged_decode(*a, **opts, impl=impl)), args,
                                   iters, nbytes, copy_gbps))
            print(f"  {row['shape']} {impl}: {rows[-1].get('gbps', rows[-1].get('error', rows[-1].get('refused')))}",
                  flush=True)
        progress.save(dict(ok=all("error" not in r for r in rows), rows=rows))
    if progress.allows():
        rows += _ragged_bandwidth(ctx, iters)
    ok = all("error" not in r for r in rows) and any("gbps" in r for r in rows)
    return dict(ok=ok, rows=rows, not_run_for_budget=progress.left,
                roofline="a device-to-device copy of the same bytes in this run: "
                "copy GB/s counts read + write; a kernel's GB/s counts the K/V (+ scales) it must read")


def _ragged_bandwidth(ctx, iters):
    """A prefill-heavy mixed batch: 4 chunks of 448 tokens after 1536 cached tokens + 64 decodes."""
    jax = _jax()
    import jax.numpy as jnp
    import numpy as np

    import jpa
    from jpa.ops import ragged
    rng = np.random.default_rng(1)
    kh, g, h, ps, ctx_len = 8, 4, 128, 16, 2048
    chunks, decodes = 4, 64
    b = chunks + decodes
    pps = ctx_len // ps
    q_lens = np.array([448] * chunks + [1] * decodes)
    t = int(q_lens.sum())
    k = jnp.asarray(rng.standard_normal((kh, b * pps, ps, h)), jnp.bfloat16)
    args = (jnp.asarray(rng.standard_normal((t, kh * g, h)), jnp.bfloat16), k, k,
            jnp.asarray(rng.permutation(b * pps).reshape(b, pps), jnp.int32),
            jnp.asarray([1984] * chunks + [ctx_len] * decodes, jnp.int32),
            jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32), jnp.int32(b))
    # Bytes a kernel must read: each sequence's visible K/V once (a prefill tile re-reads them).
    nbytes = 2 * kh * h * 2 * int(1984 * chunks + ctx_len * decodes)
    copy_gbps = 2 * nbytes / _copy_seconds(nbytes, iters) / 1e9
    spec = _spec_of("ragged", args, {})
    rows = []
    for impl in ("mosaic", "triton", "xla"):
        row = dict(op="ragged", shape=f"{chunks}x448-token chunks + {decodes} decodes, ctx 2048, K8 G4 H128",
                   impl=impl, bytes=nbytes, copy_gbps_read_write=round(copy_gbps, 1))
        reason = None if impl == "xla" else ragged.unsupported_reason(impl, spec, ctx["cc"])
        if reason:
            rows.append({**row, "refused": reason})
            continue
        rows.append(_timed_row(row, jax.jit(lambda *a, impl=impl: jpa.ragged_paged_attention(*a, impl=impl)), args,
                               iters, nbytes, copy_gbps))
    return rows


def _timed_row(row, fn, args, iters, nbytes, copy_gbps) -> dict:
    """row + the kernel's time, GB/s and % of the copy roofline (or the error it raised)."""
    try:
        s = _time(fn, *args, iters=iters)
    except Exception as e:
        return {**row, "error": _err(e)}
    gbps = nbytes / s / 1e9
    return {**row, "us": round(s * 1e6, 1), "gbps": round(gbps, 1), "pct_of_copy_roofline": round(100 * gbps / copy_gbps, 1)}


def dense_attention(q, k, v, lens, scale):
    """Dense XLA attention over a contiguous cache: q [B, N, H], k/v [B, K, T, H], lens i32[B]."""
    import jax
    import jax.numpy as jnp
    b, n, h = q.shape
    kh, t = k.shape[1], k.shape[2]
    qg = q.reshape(b, kh, n // kh, h)  # [B, K, G, H]
    s = jnp.einsum("BKGH,BKSH->BKGS", qg, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(jnp.arange(t)[None, None, None, :] < lens[:, None, None, None], s, -1e30)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("BKGS,BKSH->BKGH", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, n, h).astype(q.dtype)


def section_peers(ctx) -> dict:
    jax = _jax()
    import jax.numpy as jnp

    import jpa
    rows = []
    iters = 10 if ctx["quick"] else 30
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa
        peer_error = None
    except Exception as e:
        jax_pa, peer_error = None, _err(e)
    shapes = [s for s in DECODE_SHAPES if s[7] in ("bfloat16", "float16")]
    shapes = shapes[:2] if ctx["quick"] else shapes
    if ctx["dry_run"]:
        plan = [f"{shape[0]} {name}" for shape in shapes
                for name in ("jpa auto", "dense XLA", "jax.experimental paged_attention")]
        return dict(ok=True, dry_run=True, items=len(plan), plan=plan, jax_paged_attention_import_error=peer_error)
    progress = ctx["progress"]
    for shape in shapes:
        if not progress.allows():
            continue
        args, opts, nbytes = decode_problem(shape)
        q, kp, vp, tables, lens = args
        b, ctx_len, kh, _, h = shape[1], shape[2], shape[3], shape[4], shape[5]
        copy_gbps = 2 * nbytes / _copy_seconds(nbytes, iters) / 1e9
        # The contiguous cache the dense path reads: [B, K, T, H], the same tokens.
        gather = jax.jit(lambda p, t: jnp.swapaxes(p[:, t].reshape(kh, b, ctx_len, h), 0, 1))
        kc, vc = gather(kp, tables), gather(vp, tables)
        cands = [("jpa auto", jax.jit(lambda *a: jpa.paged_decode(*a, **opts)), args),
                 ("dense XLA (contiguous cache)",
                  jax.jit(lambda q, k, v, l: dense_attention(q, k, v, l, opts["scale"])), (q, kc, vc, lens))]
        if jax_pa is not None:
            cands.append(("jax.experimental paged_attention", jax.jit(
                lambda q, k, v, t, l: jax_pa.paged_attention(q * opts["scale"], k, v, t, l)), args))
        for name, fn, a in cands:
            row = dict(shape=shape[0], impl=name, bytes=nbytes, copy_gbps_read_write=round(copy_gbps, 1))
            try:
                s = _time(fn, *a, iters=iters)
                gbps = nbytes / s / 1e9
                rows.append({**row, "us": round(s * 1e6, 1), "gbps": round(gbps, 1),
                             "pct_of_copy_roofline": round(100 * gbps / copy_gbps, 1)})
            except Exception as e:
                rows.append({**row, "error": _err(e)})
            print(f"  {shape[0]} {name}: {rows[-1].get('gbps', rows[-1].get('error'))}", flush=True)
        del kc, vc
        progress.save(dict(ok=True, rows=rows, jax_paged_attention_import_error=peer_error))
    return dict(ok=any(r["impl"] == "jpa auto" and "gbps" in r for r in rows) or not rows, rows=rows,
                jax_paged_attention_import_error=peer_error, not_run_for_budget=progress.left)


# ---------------------------------------------------------------- 5. engine

LLAMA8B_4L = dict(family="llama", vocab_size=128256, d_model=4096, num_layers=4, num_q_heads=32,
                  num_kv_heads=8, head_dim=128, ffn_dim=14336, max_seq_len=8192, rope_base=500000.0,
                  tie_embeddings=False, bos_token_id=0, eos_token_id=1)


class IdTokenizer:
    """A tokenizer for random-weight models: prompts are token ids; decode prints the ids."""

    def __init__(self, vocab_size: int, eos_token_id: int, bos_token_id: int = 0):
        self.vocab_size, self.eos_token_id, self.bos_token_id = vocab_size, eos_token_id, bos_token_id
        self.stop_token_ids = (eos_token_id,)

    def encode(self, text: str) -> list:
        return [int(t) % self.vocab_size for t in text.split()]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(f" {int(i)}" for i in ids)


def _engine_config(**want):
    """jpa.engine.EngineConfig with the fields it has (the engine's config may gain or lose
    fields; the dropped ones are reported)."""
    from jpa.engine import EngineConfig
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in want.items() if k in names}), sorted(set(want) - names)


def _engine_run(model_name, config, dtype, impl, prompts, max_new, max_model_len):
    import jax.numpy as jnp
    from flax import nnx

    from jpa import models
    from jpa.engine import LLMEngine, SamplingParams
    gpt = models.GPT(config, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))
    tok = IdTokenizer(config.vocab_size, config.eos_token_id, config.bos_token_id)
    page_size = 16
    num_pages = len(prompts) * (-(-max_model_len // page_size)) + 64
    cfg, dropped = _engine_config(max_seqs=len(prompts), page_size=page_size, num_pages=num_pages,
                                  max_model_len=max_model_len, attention_impl=impl)
    engine = LLMEngine(models.GPTForEngine(gpt), tok, cfg)
    params = SamplingParams(max_new_tokens=max_new, greedy=True, ignore_eos=True)
    t0 = time.perf_counter()
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, greedy=True, ignore_eos=True))  # compile
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    secs = time.perf_counter() - t0
    ids = [list(o.token_ids) for o in outs]
    summary = engine.summary() if hasattr(engine, "summary") else {}
    generated = sum(len(x) for x in ids)
    return ids, dict(model=model_name, dtype=dtype, impl=impl, seqs=len(prompts), prompt_tokens=len(prompts[0]),
                     generated_tokens=generated, seconds=round(secs, 2), warmup_seconds=round(warm, 1),
                     tokens_per_s=round(generated / secs, 1),
                     prompt_and_generated_tokens_per_s=round((generated + sum(map(len, prompts))) / secs, 1),
                     attention=summary.get("attention"), dropped_config_fields=dropped)


def section_engine(ctx) -> dict:
    """The greedy equality: float32 token ids with impl='auto' equal to the plain-JAX path's, both models."""
    return _engine_section(ctx, (8, 512, 32), [(m, "float32", impl) for m in (0, 1) for impl in ("auto", "xla")])


def section_throughput(ctx) -> dict:
    """The engine's tokens/s: bfloat16 and float32 with impl='auto', both models."""
    sizes = (8, 512, 32) if ctx["quick"] else (64, 2048, 128)
    return _engine_section(ctx, sizes, [(m, dtype, "auto") for dtype in ("bfloat16", "float32") for m in (0, 1)])


def _engine_section(ctx, sizes, runs_wanted) -> dict:
    import numpy as np

    from jpa import models
    from jpa.models import ModelConfig
    seqs, ctx_len, gen = sizes
    shapes = (("smollm2-135m shape", models.PRESETS["smollm2-135m"]),
              ("llama-3-8b shape, 4 layers", ModelConfig(**LLAMA8B_4L)))
    plan = [(*shapes[m], dtype, impl) for m, dtype, impl in runs_wanted]
    if ctx["dry_run"]:
        import jax.numpy as jnp
        from flax import nnx
        sizes = {name: sum(int(np.prod(x.shape)) for x in jax_leaves(nnx.state(nnx.eval_shape(
            lambda c=config: models.GPT(c, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))))) for name, config in shapes}
        cfg, dropped = _engine_config(max_seqs=seqs, page_size=16, num_pages=seqs * ctx_len // 16 + 64,
                                      max_model_len=ctx_len, attention_impl="auto")
        return dict(ok=True, dry_run=True, items=len(plan), parameters=sizes, dropped_config_fields=dropped,
                    plan=[f"{name} {dtype} {impl}: {seqs} seqs x {ctx_len}" for name, _, dtype, impl in plan])
    progress = ctx["progress"]
    runs, got = [], {}
    for name, config, dtype, impl in plan:
        if not progress.allows():
            continue
        rng = np.random.default_rng(0)
        prompts = [[int(t) for t in rng.integers(2, config.vocab_size, ctx_len - gen)] for _ in range(seqs)]
        try:
            ids, run = _engine_run(name, config, dtype, impl, prompts, gen, ctx_len)
            got[(name, dtype, impl)] = ids
        except Exception as e:
            run = dict(model=name, dtype=dtype, impl=impl, error=_err(e), trace=traceback.format_exc()[-2000:])
        runs.append(run)
        print(f"  {name} {dtype} {impl}: {run.get('tokens_per_s', run.get('error'))} tok/s", flush=True)
        progress.save(_engine_result(shapes, got, runs))
    return dict(_engine_result(shapes, got, runs), not_run_for_budget=progress.left)


def jax_leaves(tree):
    import jax
    return jax.tree_util.tree_leaves(tree)


def _engine_result(shapes, got, runs) -> dict:
    """The section's result from the runs so far: greedy f32 equality per model where both runs finished."""
    equal = {}
    for name, _ in shapes:
        a, x = got.get((name, "float32", "auto")), got.get((name, "float32", "xla"))
        if a is None or x is None:
            continue
        diverged = [dict(seq=i, first_token=next(j for j, (p, q) in enumerate(zip(u, v)) if p != q)
                         if any(p != q for p, q in zip(u, v)) else min(len(u), len(v)))
                    for i, (u, v) in enumerate(zip(a, x)) if u != v]
        equal[name] = dict(identical=not diverged, diverged=diverged[:8])
    ok = all(v["identical"] for v in equal.values()) and all("error" not in r for r in runs)
    return dict(ok=ok, greedy_f32_auto_vs_xla=equal, runs=runs)


def section_invariant(ctx) -> dict:
    """batch_invariant=True on this GPU: what the CPU tests prove (tests/test_batch_invariant.py), checked
    where XLA's GPU GEMMs and reductions run: one request's tokens and logprobs alone vs among random
    neighbours in random order (other slots, chunking, prefix-cache hits), scoring parity, and an
    update_weights round trip with the step compiled once."""
    if ctx["dry_run"]:
        return dict(ok=True, dry_run=True, items=1, plan=["smollm2-135m shape, bfloat16, batch_invariant=True"])
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jpa import models
    from jpa.engine import LLMEngine, SamplingParams
    config = models.PRESETS["smollm2-135m"]
    gpt = models.GPT(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    tok = IdTokenizer(config.vocab_size, config.eos_token_id, config.bos_token_id)
    cfg, _ = _engine_config(max_seqs=8, page_size=16, num_pages=512, max_num_batched_tokens=256, batch_invariant=True)
    eng = LLMEngine(models.GPTForEngine(gpt), tok, cfg)
    rng = np.random.default_rng(0)
    target = [int(t) for t in rng.integers(2, config.vocab_size, 200)]
    sp = SamplingParams(max_tokens=32, temperature=0.0, logprobs=1, ignore_eos=True)
    bits = lambda o: (list(o.token_ids), np.asarray(o.logprobs, np.float32).tobytes())  # noqa: E731
    alone = eng.generate([target], sp)[0]
    eng.flush_prefix_cache()
    mixed_ok = []
    for trial in range(3):   # the 2nd and 3rd see prefix-cache hits
        others = [[int(t) for t in rng.integers(2, config.vocab_size, int(rng.integers(10, 400)))] for _ in range(10)]
        reqs = others[:4] + [target] + others[4:]
        order = rng.permutation(len(reqs))
        outs = eng.generate([reqs[k] for k in order], [sp] * len(reqs))
        got = outs[int(np.flatnonzero(order == 4)[0])]
        mixed_ok.append(bits(got) == bits(alone))
    eng.flush_prefix_cache()
    scored = eng.generate([target + list(alone.token_ids)], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    parity = [scored.prompt_logprobs[len(target) + i].logprob for i in range(len(alone.token_ids))]
    parity_ok = np.asarray(parity, np.float32).tobytes() == np.asarray(alone.logprobs, np.float32).tobytes()
    params = eng.model.params
    eng.update_weights(jax.tree.map(lambda a: a * 2, params))
    eng.update_weights(params)
    back = eng.generate([target], sp)[0]
    compiles = eng.summary()["step_compiles"]
    ok = all(mixed_ok) and parity_ok and bits(back) == bits(alone) and compiles == 1
    return dict(ok=ok, mixed_bitwise_equal=mixed_ok, scoring_parity=parity_ok,
                update_back_equal=bits(back) == bits(alone), step_compiles=compiles,
                attention=eng.summary().get("attention"))


SECTION_FNS = dict(kernels=section_kernels, auto=section_auto, engine=section_engine, bandwidth=section_bandwidth,
                   peers=section_peers, throughput=section_throughput, kernels_rest=section_kernels_rest,
                   invariant=section_invariant)


# ---------------------------------------------------------------- profile (Nsight Compute)

def profile(config: str, iters: int) -> int:
    """`decode:IMPL:DTYPE:B:CTX:K:G:H:PS`: runs one decode call `iters` times, e.g. under
    `ncu --set full -k regex:jpa -c 3 python3 scripts/gpu_validate.py --profile ...`."""
    jax = _jax()
    import jpa
    parts = config.split(":")
    if len(parts) != 9 or parts[0] != "decode":
        print(f"gpu_validate: --profile expects decode:IMPL:DTYPE:B:CTX:K:G:H:PS (e.g. "
              f"decode:mosaic:bfloat16:64:4096:8:4:128:16); got {config!r}", file=sys.stderr)
        return 2
    _, impl, dtype, *nums = parts
    b, ctx_len, kh, g, h, ps = map(int, nums)
    args, opts, nbytes = decode_problem(("profile", b, ctx_len, kh, g, h, ps, dtype))
    fn = jax.jit(lambda *a: jpa.paged_decode(*a, **opts, impl=impl))
    s = _time(fn, *args, iters=iters)
    print(f"{config}: {s * 1e6:.1f} us/call, {nbytes / s / 1e9:.1f} GB/s over {iters} calls")
    return 0


# ---------------------------------------------------------------- the parent: report

def markdown(report: dict) -> str:
    dry = " (DRY RUN on a CPU: nothing here is a GPU result)" if report.get("dry_run") else ""
    lines = [f"# gpu_validate: {report.get('device_kind')} (cc {report.get('compute_capability')}), "
             f"JAX {report.get('jax')}{dry}", "",
             f"Budget {report.get('budget_s')} s; took {report.get('seconds', '(running)')} s.", "",
             "| section | result | seconds | estimate s | items | not run (budget) | note |",
             "|---|---|---|---|---|---|---|"]
    for name in report.get("sections", {}):
        r = report["sections"][name]
        note = r.get("error", "")[:200] if isinstance(r.get("error"), str) else ""
        note = note or r.get("cut", "")
        lines.append(f"| {name} | {section_status(r)} | {r.get('seconds', '')} | {r.get('estimate_s', '')} | "
                     f"{r.get('items', '')} | {r.get('not_run_for_budget', '')} | {note} |")
    for name in ("bandwidth", "peers"):
        rows = report.get("sections", {}).get(name, {}).get("rows", [])
        if rows:
            lines += ["", f"## {name}", "", "| shape | impl | us | GB/s | % of copy roofline | note |",
                      "|---|---|---|---|---|---|"]
            for r in rows:
                lines.append(f"| {r.get('shape')} | {r.get('impl')} | {r.get('us', '')} | {r.get('gbps', '')} | "
                             f"{r.get('pct_of_copy_roofline', '')} | {(r.get('error') or r.get('refused') or '')[:120]} |")
    eng = report.get("sections", {}).get("engine", {})
    runs = eng.get("runs", []) + report.get("sections", {}).get("throughput", {}).get("runs", [])
    if runs:
        lines += ["", "## engine", "", "| model | dtype | impl | attention | tokens/s | note |", "|---|---|---|---|---|---|"]
        for r in runs:
            lines.append(f"| {r.get('model')} | {r.get('dtype')} | {r.get('impl')} | {r.get('attention', '')} | "
                         f"{r.get('tokens_per_s', '')} | {r.get('error', '')[:120]} |")
        for m, v in eng.get("greedy_f32_auto_vs_xla", {}).items():
            lines.append(f"\ngreedy f32 auto == xla for {m}: {v['identical']}")
    kern = report.get("sections", {}).get("kernels", {})
    bad = [c for c in kern.get("cases", []) if not c.get("ok")]
    if bad:
        lines += ["", "## failing kernel cases", ""] + [f"- {c['op']} {c['impl']} {c['case']}: "
                                                       f"{c.get('error') or c.get('max_abs_err')}" for c in bad]
    return "\n".join(lines) + "\n"


def section_status(r: dict) -> str:
    """ok / FAILED / planned (dry run) / skipped (no budget left) / partial (cut by the budget), for the report."""
    if r.get("skipped"):
        return "skipped"
    if r.get("dry_run") and r.get("ok"):
        return "planned"
    if not r.get("ok"):
        return "FAILED"
    return "partial" if r.get("not_run_for_budget") or r.get("cut") else "ok"


def write_report(out: pathlib.Path, report: dict):
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "report.md").write_text(markdown(report))


def run_child(args) -> int:
    """One section in this process: writes DIR/section-NAME.json."""
    jax = _jax()
    from jpa.ops import dispatch
    target = dispatch.current_target()
    if args.debug_crash == args.section:
        os.abort()  # the isolation test: a crash the parent must record
    out_file = args.out / f"section-{args.section}.json"
    # A dry run plans for an H100 (compute capability 9.0): which kernel auto would pick for each case.
    cc = DRY_RUN_CC if args.dry_run else target.compute_capability if target.is_nvidia_gpu else None
    ctx = dict(quick=args.quick, cc=cc, interpret=args.debug_cpu_interpret, dry_run=args.dry_run,
               progress=Progress(out_file, args.deadline or float("inf"), ITEM_SECONDS[args.section]))
    t0 = time.perf_counter()
    try:
        res = SECTION_FNS[args.section](ctx)
    except Exception as e:  # recorded; the parent goes on with the next section
        res = dict(ok=False, error=_err(e), trace=traceback.format_exc()[-4000:])
    res["seconds"] = round(time.perf_counter() - t0, 1)
    res["jax"] = jax.__version__
    out_file.write_text(json.dumps(res, indent=1, default=str) + "\n")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "results" / "gpu_validate")
    p.add_argument("--quick", action="store_true", help="smaller grids, shapes and generations")
    p.add_argument("--plan", action="store_true", help="list the sections and what each needs, then exit")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of the sections")
    p.add_argument("--profile", metavar="CONFIG", help="decode:IMPL:DTYPE:B:CTX:K:G:H:PS in a loop (Nsight Compute)")
    p.add_argument("--iters", type=int, default=20, help="--profile: calls")
    p.add_argument("--section", help=argparse.SUPPRESS)  # internal: run one section in this process
    p.add_argument("--debug-cpu-interpret", action="store_true",
                   help="debug: run on a CPU, kernels in interpret mode (tests the report machinery; "
                        "proves nothing about a GPU)")
    p.add_argument("--debug-crash", metavar="SECTION", help="debug: abort the process of this section")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help=f"seconds for the whole run, start to report (default {DEFAULT_BUDGET_S}); sections past it are "
                        f"cut, with what they ran reported")
    p.add_argument("--dry-run", action="store_true",
                   help="on a CPU: build every section's cases, shapes and models (abstractly) and print the "
                        "estimates against the budget; nothing runs on a device")
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)  # internal: the child's absolute deadline
    args = p.parse_args(argv)
    if args.plan:
        for name, need in SECTIONS.items():
            print(f"{name:10s} {need}")
        print(f"\nIn this order, each in its own subprocess, within --budget-s (default {DEFAULT_BUDGET_S} s); "
              f"DIR/report.json and DIR/report.md after each case.")
        return 0
    unknown = [s for s in args.sections.split(",") if s not in SECTIONS]
    if unknown:
        p.error(f"--sections: unknown {unknown}; the sections are {list(SECTIONS)}")
    if not args.budget_s > 0:
        p.error(f"--budget-s must be > 0; got {args.budget_s}")
    jax = _jax()
    from jpa.ops import dispatch
    target = dispatch.current_target()
    if not (target.is_nvidia_gpu and target.executable) and not (args.debug_cpu_interpret or args.dry_run):
        print(f"gpu_validate: needs an NVIDIA GPU, and JAX sees {target.platform} ({target.device_kind}). "
              f"Nothing here can pass without one. On a GPU machine JAX needs its CUDA plugin "
              f"(jax[cuda12] or jax[cuda13]); deviceless compile checks are `jpa tools compile`; "
              f"--dry-run plans the run on a CPU.", file=sys.stderr)
        return 2
    if args.section:
        return run_child(args)
    if args.profile:
        return profile(args.profile, args.iters)
    return run_sections(args, target, jax.__version__)


def run_sections(args, target, jax_version) -> int:
    """The parent: each section in its own subprocess, in order, within the budget; the report after each."""
    report = dict(device_kind=target.device_kind, compute_capability=target.compute_capability,
                  jax=jax_version, quick=args.quick, started=time.strftime("%Y-%m-%d %H:%M:%S"),
                  budget_s=args.budget_s, dry_run=args.dry_run, sections={})
    t0 = time.perf_counter()
    deadline = time.time() + args.budget_s
    planned = 0.0   # a dry run: the estimates' running sum
    for name in args.sections.split(","):
        print(f"== {name}", flush=True)
        out_file = args.out / f"section-{name}.json"
        args.out.mkdir(parents=True, exist_ok=True)
        out_file.unlink(missing_ok=True)
        left = deadline - time.time()
        if not args.dry_run and left < MIN_SECTION_S:
            report["sections"][name] = dict(ok=True, skipped=True, seconds=0,
                                            cut=f"not started: {left:.0f} s of the budget left")
            print(f"   skipped ({left:.0f} s left)", flush=True)
            write_report(args.out, report)
            continue
        cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--section", name, "--out", str(args.out),
               "--deadline", str(deadline)]
        cmd += ["--quick"] * args.quick + ["--debug-cpu-interpret"] * args.debug_cpu_interpret
        cmd += ["--dry-run"] * args.dry_run
        cmd += ["--debug-crash", args.debug_crash] if args.debug_crash else []
        t = time.perf_counter()
        cut = None
        try:
            # The child stops taking items at the deadline; past it (one item ran long) it is killed, and what it
            # saved so far is the section's result.
            proc = subprocess.run(cmd, stdout=None, stderr=subprocess.PIPE, text=True,
                                  timeout=None if args.dry_run else max(5.0, left + 20))
            returncode, stderr = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as e:
            returncode, stderr = None, (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) \
                else (e.stderr or "")
            cut = f"killed {time.perf_counter() - t:.0f} s in, at the end of the budget"
        if out_file.exists():
            res = json.loads(out_file.read_text())
            if cut:
                res["cut"] = cut
        else:  # the child died (abort, segfault, out of memory, the budget): recorded, the next section runs
            why = cut or f"section process exited with {returncode} and no result"
            res = dict(ok=False, error=why, stderr_tail=stderr[-4000:], seconds=round(time.perf_counter() - t, 1))
        if args.dry_run and "items" in res:
            # The items that fit in what the sections before left of the budget (the run's order).
            left = args.budget_s - planned - START_SECONDS
            res["items_within_budget"] = max(0, min(res["items"], int(left // ITEM_SECONDS[name])))
            res["estimate_s"] = START_SECONDS + res["items"] * ITEM_SECONDS[name]
            res["not_run_for_budget"] = res["items"] - res["items_within_budget"]
            planned += START_SECONDS + res["items_within_budget"] * ITEM_SECONDS[name] if left > 0 else 0
        report["sections"][name] = res
        print(f"   {section_status(res)} ({res.get('seconds')} s"
              + (f"; on a GPU: estimate {res.get('estimate_s')} s for {res.get('items')} items, "
                 f"{res.get('items_within_budget')} within the budget, {planned:.0f} s of it used" if args.dry_run else "")
              + ")", flush=True)
        write_report(args.out, report)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    report["ok"] = all(r.get("ok") for r in report["sections"].values())
    if args.dry_run:
        report["estimate_s"] = planned
    write_report(args.out, report)
    what = "DRY RUN (planned; nothing ran on a GPU)" if args.dry_run else "PASSED" if report["ok"] else "FAILED"
    print(f"gpu_validate: {what} in {report['seconds']} s (budget {args.budget_s:.0f} s); "
          f"{args.out / 'report.json'}, {args.out / 'report.md'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    sys.exit(main())
