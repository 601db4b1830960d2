"""The Ampere/Ada Mosaic GPU decode kernel (`jpa.pallas.mosaic.decode_ampere`, cp.async + mma.sync):
GPU interpret mode against the float64 oracle and the XLA path, what it refuses, how the dispatch
routes to it, and (when the compile-only GPU packages are installed) one deviceless sm_80 compile.

Interpret mode runs the kernel body (block walk through the block table, masking, online softmax,
split-K, the stacked pool's layer index) with three stand-ins for primitives GPU interpret mode
does not model: cp.async copies without a barrier, `mma`, and the accumulator -> lhs relayout
(`decode_ampere._Ops`); the deviceless compile covers those. Hidden cache slots hold NaN and
unused block-table entries garbage (`kernel_cases`), so reading what a sequence cannot see shows.
The grid (head dims, dtypes, page sizes, generations) is tests/test_bench_mosaic_ampere.py.
"""

import importlib.util
import os
import pathlib
import subprocess
import sys

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from jpa.ops import dispatch
from jpa.ops.reference import paged_decode_xla
from jpa.pallas.mosaic import decode as mosaic_decode
from jpa.pallas.mosaic import decode_ampere
from jpa.pallas.spec import DecodeSpec
from jpa.testing.kernel_cases import Case, make_inputs, np_reference, tolerance
from jpa.tools.deviceless import mosaic_arch

ROOT = pathlib.Path(__file__).resolve().parents[1]
A100, L4, H100, B200 = 8.0, 8.9, 9.0, 10.0


def check(case, got, args, opts):
    want = np_reference(*args, **opts)
    chex.assert_shape(got, want.shape)
    assert got.dtype == args[0].dtype
    got = np.asarray(got.astype(jnp.float32), np.float64)
    assert np.isfinite(got).all(), case
    np.testing.assert_allclose(got, want, atol=tolerance(case), rtol=0, err_msg=str(case))
    xla = np.asarray(paged_decode_xla(*args, **opts).astype(jnp.float32), np.float64)
    np.testing.assert_allclose(got, xla, atol=tolerance(case), rtol=0, err_msg=str(case))


def test_matches_reference_with_every_option_and_split_k():
    # GQA 3, pages of 16 (4 per 64-token block), lengths 0 / 1 / 3 blocks (the last partial);
    # soft cap, ALiBi and a window that starts mid-block. Two blocks per partition: the longest
    # sequence has a full partition (2 blocks through the 3-slot cp.async ring) and a partial one
    # (split-K merge); the window's partition skips its first block.
    case = Case((0, 1, 150), num_q_heads=6, num_kv_heads=2, head_dim=64, page_size=16,
                pages_per_seq=10, soft_cap=10.0, alibi=True, sliding_window=100, share_page=True,
                seed=31, q_dtype="bfloat16", cache_dtype="bfloat16")
    args, opts = make_inputs(case)
    # Both copy paths: cp.async (Ampere/Ada) and TMA + mbarriers (Blackwell; the interpreter models
    # these barriers, so only mma and the relayout have stand-ins there).
    for tma in (False, True):
        got = decode_ampere.paged_decode(*args[:5], scale=opts["scale"], soft_cap=10.0,
                                         alibi_slopes=opts["alibi_slopes"], sliding_window=100,
                                         interpret=True, blocks_per_part=2, tma=tma)
        check(case, got, args, opts)
        assert not np.asarray(got[0].astype(jnp.float32)).any()  # length 0: exactly zero


def test_refusals_are_reasons_and_routing_follows_the_compute_capability():
    base = DecodeSpec("bfloat16", "bfloat16", 32, 8, 128, 16, 32, False, False, False, False, 64, 8192)
    assert mosaic_decode.unsupported_reason(base, A100) is None
    assert mosaic_decode.unsupported_reason(base, L4) is None
    assert mosaic_decode.unsupported_reason(base, H100) is None
    assert mosaic_decode.unsupported_reason(base, B200) is None
    assert "Blackwell (10.x, TMA)" in mosaic_decode.unsupported_reason(base, 12.0)
    refused = {
        "8-bit caches": base._replace(cache_dtype="int8", quantized=True, page_size=32),
        "mma.sync has no exact float32": base._replace(q_dtype="float32", cache_dtype="float32"),
        "must be 64, 128, 192 or 256": base._replace(head_dim=80),
    }
    for words, spec in refused.items():
        reason = mosaic_decode.unsupported_reason(spec, A100)
        assert reason and words in reason, (words, reason)
    # Only the WGMMA kernel knows 8-bit caches: Hopper still accepts the int8 spec.
    assert mosaic_decode.unsupported_reason(refused["8-bit caches"], H100) is None


def test_auto_picks_mosaic_on_ampere_and_ada_decode():
    spec = DecodeSpec("bfloat16", "bfloat16", 32, 8, 128, 16, 32, False, False, False, False, 64, 8192)
    # Ahead of time (no such GPU here), with Mosaic told the target's arch as the compile tier
    # does (`mosaic_arch`); test_dispatch.py covers the AOT case without it (Triton, with why).
    for kind, cc, want in (("NVIDIA A100-SXM4-80GB", A100, "mosaic"), ("NVIDIA L4", L4, "mosaic"),
                           ("NVIDIA H100 80GB HBM3", H100, "mosaic"), ("NVIDIA B200", B200, "mosaic"),
                           ("NVIDIA RTX PRO 6000", 12.0, "triton")):
        target = dispatch.Target("gpu", kind, cc, executable=False)
        with mosaic_arch((int(cc), int(round(cc * 10)) % 10)), pytest.warns(UserWarning, match="not attached"):
            assert dispatch.choose_impl("auto", spec, target) == want, kind
    # A configuration the Ampere kernel refuses falls back to Triton there.
    q8 = spec._replace(cache_dtype="int8", quantized=True)
    a100 = dispatch.Target("gpu", "NVIDIA A100-SXM4-80GB", A100, executable=False)
    with mosaic_arch((8, 0)), pytest.warns(UserWarning, match="8-bit caches"):
        assert dispatch.choose_impl("auto", q8, a100) == "triton"
    assert dispatch.kernel_options("mosaic", A100) == {"compute_capability": A100}
    assert dispatch.kernel_options("triton", A100) == {}


@pytest.mark.skipif(importlib.util.find_spec("jax_plugins.xla_cuda12") is None,
                    reason="the compile-only GPU packages are not installed (pip install -e '.[gpu]')")
def test_compiles_for_an_a100_without_spills():
    # A fresh process: XLA's log must be configured before XLA starts to read ptxas's report.
    code = """
from jpa.tools import deviceless
deviceless.configure_environment()
from jpa.tools.kernel_checks import KernelConfig, kernel_call
cfg = KernelConfig("mosaic", head_dim=64, page_size=16, num_kv_heads=2, q_per_kv=4, soft_cap=True,
                   num_pages=256)
fn, args, kwargs, pools = kernel_call(cfg)
rec = deviceless.Compiler("a100").compile(cfg.name, fn, args, kwargs=kwargs, pool_shapes=pools)
k = rec.get("kernels", {}).get("jpa_mosaic_decode_ampere", {})
print("RESULT", rec["ok"], rec.get("mosaic_calls"), k.get("ptx_targets"), k.get("registers"),
      k.get("spill_stores"), k.get("ptxas_reports"), rec.get("error") or rec.get("problems"))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_CPP_VMODULE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=env, cwd=ROOT)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), proc.stderr[-3000:])
    ok, calls, targets, regs, spills, reports, problems = line.split(" ", 1)[1].split(" ", 6)
    assert ok == "True" and calls == "1", line
    assert targets == "['sm_80']", line  # built for the A100, not Mosaic's sm_90a default
    assert 0 < int(regs) <= 255 and spills == "0" and int(reports) >= 1, line
