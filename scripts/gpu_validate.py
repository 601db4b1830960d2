"""Everything only a GPU can show, in one command: run it the day an NVIDIA GPU is attached.

    pip install -e ".[cuda12,test,model]"      # JAX's CUDA runtime instead of the compile-only extra
    python scripts/gpu_validate.py [--out results/gpu_validate.json] [--quick]

1. Kernels, natively (`interpret=False`): every case of the kernel test grids
   (tests/test_triton_decode.py, tests/test_mosaic_decode.py) that the kernel's
   `unsupported_reason` accepts on this GPU, against the float64 NumPy oracle with the tests'
   tolerances. Also `impl="auto"` under jit: which kernel the dispatch picks and whether its
   self-check passed.
2. `scripts/bench_kernels.py`: achieved GB/s and % of peak HBM bandwidth per kernel.
3. The real model: SmolLM2-135M-Instruct through the engine with impl="auto" on this GPU,
   (a) float32, greedy: completions must equal the CPU reference path's token for token;
   (b) bfloat16, greedy: the auto-chosen kernel against impl="xla" on the same GPU (bf16
   rounding may flip near-tied tokens, so the token agreement is reported, and must be high).

Writes one JSON report and exits non-zero if any check failed. On a machine without a GPU it
refuses at once (exit 2): nothing here can pass on a CPU. Budget: under 10 minutes on one H100.
"""

import argparse
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import jpa  # noqa: E402
from jpa import dispatch  # noqa: E402

PROMPTS = ["What is a paged KV cache?", "Name three rivers in Europe.", "Write a haiku about the sea.",
           "Explain gradient descent in one sentence.", "What is 17 * 23?", "Give me a fun fact about owls.",
           "Translate 'good morning' into French.", "List the planets of the solar system."]


def _load_test_module(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def check_kernels(target, quick: bool) -> dict:
    """The kernel test grids, natively, against the float64 oracle."""
    from kernel_cases import make_inputs, np_reference, tolerance
    from jpa.decode import decode_spec
    rows = []
    for impl, test_file in (("triton", "test_triton_decode"), ("mosaic", "test_mosaic_decode")):
        cases = _load_test_module(test_file).CASES
        for case in cases[: 4 if quick else None]:
            args, opts = make_inputs(case)
            spec = decode_spec(args[0], args[1], args[3], soft_cap=opts.get("soft_cap"),
                               alibi_slopes=opts.get("alibi_slopes"), sliding_window=opts.get("sliding_window"))
            row = dict(impl=impl, case=str(case))
            reason = dispatch.unsupported_reason(impl, spec, target.compute_capability)
            if reason is not None:
                rows.append({**row, "refused": reason, "ok": True})
                continue
            try:
                got = np.asarray(jpa.paged_decode(*args, **opts, impl=impl, interpret=False), np.float64)
                err = float(np.max(np.abs(got - np_reference(*args, **opts)))) if got.size else 0.0
                rows.append({**row, "max_abs_err": err, "tolerance": tolerance(case),
                             "ok": bool(np.isfinite(got).all() and err <= tolerance(case))})
            except Exception as e:  # report every failing case, not only the first
                rows.append({**row, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                             "ok": False})
            print(f"  {'ok ' if rows[-1]['ok'] else 'FAIL'} {impl} {case}")
    return dict(ok=all(r["ok"] for r in rows), cases=rows,
                ran=sum("refused" not in r for r in rows), refused=sum("refused" in r for r in rows))


def check_auto_under_jit() -> dict:
    """Which kernel a jitted impl="auto" call uses, per common serving dtype, and its self-check."""
    out = {}
    rng = np.random.default_rng(0)
    for dtype in ("bfloat16", "float16", "float32"):
        q = jnp.asarray(rng.standard_normal((8, 32, 128)), dtype)
        k = jnp.asarray(rng.standard_normal((8, 64, 16, 128)), dtype)
        tables = jnp.asarray(rng.integers(0, 64, (8, 8)), jnp.int32)
        lens = jnp.asarray(rng.integers(1, 129, (8,)), jnp.int32)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            chosen = jpa.resolve_decode_impl(q, k, tables)
            text = jax.jit(lambda *a: jpa.paged_decode(*a)).lower(q, k, k, tables, lens).as_text()
        in_hlo = ("mosaic" if "mosaic_gpu" in text else "triton" if "__gpu$xla.gpu.triton" in text else "xla")
        out[dtype] = dict(chosen=chosen, in_jitted_hlo=in_hlo, warnings=[str(x.message)[:300] for x in w],
                          ok=chosen != "xla" and in_hlo == chosen)
    return dict(ok=all(v["ok"] for v in out.values()), by_dtype=out)


def run_bench(out_dir: pathlib.Path, quick: bool) -> dict:
    path = out_dir / "bench_kernels.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_kernels.py"), "--out", str(path)]
    if quick:
        cmd += ["--batch-sizes", "8,64", "--context-lens", "512,4096", "--q-per-kv", "4"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    res = dict(ok=proc.returncode == 0, seconds=round(time.perf_counter() - t0, 1), stdout_tail=proc.stdout[-4000:])
    if path.exists():
        res["report"] = json.loads(path.read_text())
    if proc.returncode:
        res["stderr_tail"] = proc.stderr[-4000:]
    return res


def engine_outputs(dtype, attention_impl, device, max_new_tokens):
    """Greedy SmolLM2 completions of PROMPTS through the engine on `device`."""
    import models
    from jpa.engine import EngineConfig, LLMEngine, SamplingParams
    from models.engine_model import GPTForEngine
    with jax.default_device(device):
        gpt, tokenizer = models.load("smollm2-135m", dtype=dtype)
        engine = LLMEngine(GPTForEngine(gpt), tokenizer,
                           EngineConfig(max_seqs=8, page_size=16, num_pages=512, attention_impl=attention_impl))
        chats = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
        outs = engine.generate(chats, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens))
        return [list(o.token_ids) for o in outs], engine.summary()


def check_engine(quick: bool) -> dict:
    n = 16 if quick else 48
    gpu, cpu = jax.devices()[0], jax.devices("cpu")[0]
    res = {}
    want, _ = engine_outputs(jnp.float32, "xla", cpu, n)
    got, summ = engine_outputs(jnp.float32, "auto", gpu, n)
    res["float32_vs_cpu"] = dict(attention=summ.get("attention"), identical=got == want,
                                 mismatched_requests=[i for i, (a, b) in enumerate(zip(got, want)) if a != b])
    ref, _ = engine_outputs(jnp.bfloat16, "xla", gpu, n)
    got16, summ16 = engine_outputs(jnp.bfloat16, "auto", gpu, n)
    same = sum(a == b for g, r in zip(got16, ref) for a, b in zip(g, r))
    total = sum(max(len(g), len(r)) for g, r in zip(got16, ref))
    res["bfloat16_vs_xla_on_gpu"] = dict(attention=summ16.get("attention"), token_agreement=same / max(total, 1),
                                         decode_tok_s=summ16.get("decode_tok_s"),
                                         xla_identical=got16 == ref)
    res["ok"] = bool(res["float32_vs_cpu"]["identical"] and res["bfloat16_vs_xla_on_gpu"]["token_agreement"] >= 0.9)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "results" / "gpu_validate.json")
    p.add_argument("--quick", action="store_true", help="a smaller grid and shorter generations")
    args = p.parse_args(argv)
    target = dispatch.current_target()
    if not (target.is_nvidia_gpu and target.executable):
        print(f"gpu_validate: needs an NVIDIA GPU, and JAX sees {target.platform} ({target.device_kind}). "
              f"Nothing here can pass without one. Install JAX's CUDA runtime (pip install -e '.[cuda12]') "
              f"on a GPU machine; deviceless compile checks are scripts/gpu_compile_check.py.", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    report = dict(device_kind=target.device_kind, compute_capability=target.compute_capability,
                  jax=jax.__version__, started=time.strftime("%Y-%m-%d %H:%M:%S"))
    for name, fn in (("kernels", lambda: check_kernels(target, args.quick)),
                     ("auto_under_jit", check_auto_under_jit),
                     ("bench_kernels", lambda: run_bench(args.out.parent, args.quick)),
                     ("engine", lambda: check_engine(args.quick))):
        print(f"== {name}", flush=True)
        t = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as e:  # record and go on: one report with every section
            report[name] = dict(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        report[name]["seconds"] = round(time.perf_counter() - t, 1)
        print(f"   {'ok' if report[name]['ok'] else 'FAILED'} ({report[name]['seconds']} s)", flush=True)
        args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")  # partial results survive
    report["seconds"] = round(time.perf_counter() - t0, 1)
    report["ok"] = all(report[k]["ok"] for k in ("kernels", "auto_under_jit", "bench_kernels", "engine"))
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"gpu_validate: {'PASSED' if report['ok'] else 'FAILED'} in {report['seconds']} s; report {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    sys.exit(main())
