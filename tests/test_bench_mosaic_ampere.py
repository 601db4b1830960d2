"""The mma.sync Mosaic GPU kernels' grids (CI's bench tier; the fast cases are
tests/test_mosaic_ampere.py): GPU interpret mode against the float64 oracle over head dims
64-256, bf16/f16, every page size and the stacked pool, for the decode kernel and the ragged op
(tile kernel + decode kernel of the last rows) on both copy paths; and the deviceless compile
tier's fast kernel and ragged subsets for sm_80 (A100), sm_86 (RTX A6000), sm_89 (L4), sm_100
(B200) and sm_120 (RTX PRO 6000): every configuration the Mosaic `unsupported_reason` accepts there compiles as the mma.sync
kernels (cp.async copies on 8.x, TMA on 10.x), PTX for that SM, without spills."""


import jax.numpy as jnp
import numpy as np
import pytest

from jpa.pallas.mosaic import decode as mosaic_decode
from jpa.pallas.mosaic import decode_ampere
from jpa.pallas.mosaic import ragged as mosaic_ragged
from jpa.tools import deviceless
from test_gpu_compile import compiled, run_check
from test_mosaic_ampere import RAGGED_CASE, check, ragged_check, ragged_opts
from jpa.testing.kernel_cases import Case, RaggedCase, make_inputs, make_ragged_inputs

pytestmark = pytest.mark.bench   # CI's bench tier (.ci/run), not ./run test

BF16 = dict(q_dtype="bfloat16", cache_dtype="bfloat16")
F16 = dict(q_dtype="float16", cache_dtype="float16")

GRID = [
    # page_size 8 (8 pages per block), MHA, lengths 0, 1, page multiple, +1.
    Case((0, 1, 8, 9, 40), num_q_heads=2, num_kv_heads=2, head_dim=64, page_size=8,
         pages_per_seq=5, **BF16),
    # page_size 16, GQA 4, head_dim 128, shared page, a block exactly full (64) and one past it.
    Case((16, 17, 64, 65), num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
         pages_per_seq=6, share_page=True, seed=1, **F16),
    # head_dim 192 (32-token blocks), page 32 = one block, q_per_kv 8, soft cap.
    Case((33, 64, 1), num_q_heads=8, num_kv_heads=1, head_dim=192, page_size=32, pages_per_seq=3,
         soft_cap=20.0, seed=2, **BF16),
    # head_dim 256, pages of 64 and 128 tokens read in 32-token slices, ALiBi and a window.
    Case((64, 65, 127), num_q_heads=4, num_kv_heads=2, head_dim=256, page_size=64,
         pages_per_seq=2, alibi=True, sliding_window=50, seed=3, **F16),
    Case((128, 129, 255), num_q_heads=2, num_kv_heads=1, head_dim=256, page_size=128,
         pages_per_seq=2, seed=4, **BF16),
    # head_dim 96 (mma chunks 64 + 32) with pages of 16, head_dim 160 (32-token blocks) with 32.
    Case((16, 17, 64, 65), num_q_heads=8, num_kv_heads=2, head_dim=96, page_size=16,
         pages_per_seq=6, soft_cap=15.0, seed=6, **BF16),
    Case((33, 64, 1), num_q_heads=4, num_kv_heads=2, head_dim=160, page_size=32, pages_per_seq=3,
         alibi=True, seed=7, **F16),
    # page 256 with head_dim 64 (64-token slices), q_per_kv 16, window crossing blocks.
    Case((256, 3, 200), num_q_heads=16, num_kv_heads=1, head_dim=64, page_size=256,
         pages_per_seq=1, sliding_window=130, seed=5, **BF16),
    # An 8-bit cache with per-token scales: e5m2 at head_dim 112 (untiled rows, K and V widened
    # into SMEM, outputs padded to 128 columns).
    Case((31, 32, 70), num_q_heads=4, num_kv_heads=2, head_dim=112, page_size=32, pages_per_seq=3,
         alibi=True, seed=8, q_dtype="float16", cache_dtype="float8_e5m2"),
]


@pytest.mark.soak
@pytest.mark.parametrize("case", GRID, ids=str)
def test_grid_matches_reference(case):
    # Default partitions with cp.async copies (Ampere/Ada), one block per partition with TMA
    # copies (Blackwell).
    args, opts = make_inputs(case)
    assert mosaic_decode.unsupported_reason(case_spec(case), 8.0) is None, case
    assert mosaic_decode.unsupported_reason(case_spec(case), 10.0) is None, case
    # float8 through the bit manipulation of sm_80/86 on the cp.async path, converted on TMA's.
    for blocks_per_part, tma in ((None, False), (1, True)):
        got = decode_ampere.paged_decode(*args[:5], scale=opts["scale"], soft_cap=opts["soft_cap"],
                                         alibi_slopes=opts["alibi_slopes"],
                                         sliding_window=opts["sliding_window"], interpret=True,
                                         blocks_per_part=blocks_per_part, tma=tma, fp8_cvt=tma,
                                         k_scales=opts["k_scales"], v_scales=opts["v_scales"])
        check(case, got, args, opts)


def case_spec(case):
    from jpa.ops.decode import decode_spec
    args, opts = make_inputs(case)
    return decode_spec(args[0], args[1], args[3], soft_cap=opts["soft_cap"],
                       alibi_slopes=opts["alibi_slopes"], sliding_window=opts["sliding_window"])


def test_stacked_pool_reads_the_given_layer():
    # Three layers of f16 pages through the public Mosaic entry as impl="mosaic" calls it on an
    # sm_80 GPU; the kernel must read layer 2 (a kernel ignoring the index fails).
    case = Case((40, 9), num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=32,
                pages_per_seq=2, seed=32, **F16)
    args, opts = make_inputs(case)
    q, k, v, tables, lens = args
    rng = np.random.default_rng(5)
    noise = lambda x: jnp.asarray(rng.standard_normal((2,) + x.shape), x.dtype)  # noqa: E731
    k3, v3 = jnp.concatenate([noise(k), k[None]]), jnp.concatenate([noise(v), v[None]])
    got = mosaic_decode.paged_decode(q, k3, v3, tables, lens, scale=opts["scale"], interpret=True,
                                     compute_capability=8.0, layer=jnp.int32(2))
    check(case, got, args, opts)


@pytest.mark.soak
@pytest.mark.skipif(deviceless.missing_packages() is not None, reason=str(deviceless.missing_packages()))
@pytest.mark.parametrize("target,sm", [("a100", "sm_80"), ("a6000", "sm_86"), ("l4", "sm_89"),
                                       ("b200", "sm_100a"), ("rtx6000pro", "sm_120a")])
def test_kernel_subset_compiles_for_ampere_ada_and_blackwell(tmp_path, target, sm):
    from jpa.tools.deviceless import TARGETS
    proc, report = run_check(tmp_path, "--target", target, "--subset", "fast", "--only", "kernels")
    failed = [(r["name"], r.get("error") or r.get("problems")) for r in report["records"] if not r["ok"]]
    if target in ("a6000", "rtx6000pro"):
        # Pallas Triton cannot lower for an abstract "NVIDIA RTX A6000" (nor, presumably, an RTX PRO
        # 6000): its GPU registry (jax/_src/pallas/triton/gpu_info.py) does not know the kind. Only
        # Triton fails so.
        failed = [(n, e) for n, e in failed
                  if not (n.startswith("triton") and "No supported GPU devices found" in str(e))]
    else:
        assert proc.returncode == 0, failed
    assert not failed, failed
    mosaic = [r for r in compiled(report) if r["name"].startswith("mosaic")]
    assert mosaic, "no Mosaic configuration was accepted"
    for r in mosaic:
        k = r["kernels"]["jpa_mosaic_decode_ampere"]
        assert k["ptx_targets"] == [sm] and k["spill_stores"] == 0 and 0 < k["registers"] <= 255, r["name"]
        assert k["threads"][0] == 128
        assert 0 < k["shared_memory"] <= TARGETS[target]["shared_memory_per_block_optin"], r["name"]


RAGGED_GRID = [
    RAGGED_CASE,
    # MHA, pages of 8 (8 per block), chunks of exactly a tile (64 tokens at q_per_kv 1) and one past.
    RaggedCase((64, 70, 1), q_lens=(64, 65, 1), num_tokens=136, max_num_seqs=3, num_q_heads=2,
               num_kv_heads=2, head_dim=64, page_size=8, pages_per_seq=10, seed=51, **BF16),
    # GQA 8 (8 tokens per tile), head_dim 128, f16, pages of 32, a window.
    RaggedCase((1, 50, 33), q_lens=(1, 17, 33), num_tokens=56, num_q_heads=8, num_kv_heads=1,
               head_dim=128, page_size=32, pages_per_seq=2, sliding_window=24, seed=52, **F16),
    # head_dim 256 (32-token blocks), pages of 64 read in 32-token slices, q_per_kv 3, soft cap.
    RaggedCase((70, 9), q_lens=(40, 9), num_tokens=52, num_q_heads=6, num_kv_heads=2, head_dim=256,
               page_size=64, pages_per_seq=2, soft_cap=20.0, seed=53, **BF16),
    # head_dim 224 (32-token blocks, chunks 64 x 3 + 32), pages of 32, a window.
    RaggedCase((50, 3), q_lens=(20, 3), num_tokens=24, num_q_heads=2, num_kv_heads=2, head_dim=224,
               page_size=32, pages_per_seq=2, sliding_window=30, seed=56, **BF16),
    # head_dim 192, pages of 128 (32-token slices), ALiBi.
    RaggedCase((130, 2), q_lens=(30, 2), num_tokens=32, num_q_heads=2, num_kv_heads=1, head_dim=192,
               page_size=128, pages_per_seq=2, alibi=True, seed=54, **F16),
]


@pytest.mark.soak
@pytest.mark.parametrize("cc", [8.0, 10.0], ids=["cp.async", "tma"])
@pytest.mark.parametrize("case", RAGGED_GRID, ids=str)
def test_ragged_grid_matches_reference(case, cc):
    args, opts = make_ragged_inputs(case)
    opts = ragged_opts(case, opts, np.random.default_rng(case.seed))
    from jpa.ops.ragged import ragged_spec
    spec = ragged_spec(args[0], args[1], args[3], soft_cap=opts.get("soft_cap"),
                       alibi_slopes=opts.get("alibi_slopes"), sliding_window=opts.get("sliding_window"),
                       sinks=opts["sinks"])
    assert mosaic_ragged.unsupported_reason(spec, cc) is None, case
    got = mosaic_ragged.ragged_paged_attention(*args, **opts, interpret=True, compute_capability=cc)
    ragged_check(case, got, args, opts)


def test_ragged_stacked_pool_reads_the_given_layer():
    # Three layers; the kernels (tile and decode) must read layer 2.
    case = RaggedCase((40, 20), q_lens=(1, 20), num_tokens=24, num_q_heads=4, num_kv_heads=2,
                      head_dim=64, page_size=16, pages_per_seq=3, seed=55, **F16)
    args, opts = make_ragged_inputs(case)
    opts = ragged_opts(case, opts, np.random.default_rng(55))
    q, k, v = args[:3]
    rng = np.random.default_rng(6)
    noise = lambda x: jnp.asarray(rng.standard_normal((2,) + x.shape), x.dtype)  # noqa: E731
    k3, v3 = jnp.concatenate([noise(k), k[None]]), jnp.concatenate([noise(v), v[None]])
    for cc in (8.0, 10.0):
        got = mosaic_ragged.ragged_paged_attention(q, k3, v3, *args[3:], **opts, interpret=True,
                                                   compute_capability=cc, layer=jnp.int32(2))
        ragged_check(case, got, args, opts)


@pytest.mark.soak
@pytest.mark.skipif(deviceless.missing_packages() is not None, reason=str(deviceless.missing_packages()))
@pytest.mark.parametrize("target,sm", [("a100", "sm_80"), ("a6000", "sm_86"), ("l4", "sm_89"),
                                       ("b200", "sm_100a"), ("rtx6000pro", "sm_120a")])
def test_ragged_subset_compiles_for_ampere_ada_and_blackwell(tmp_path, target, sm):
    from jpa.tools.deviceless import TARGETS
    proc, report = run_check(tmp_path, "--target", target, "--subset", "fast", "--only", "ragged")
    failed = [(r["name"], r.get("error") or r.get("problems")) for r in report["records"] if not r["ok"]]
    if target in ("a6000", "rtx6000pro"):  # Pallas Triton does not know the abstract kind (see above)
        failed = [(n, e) for n, e in failed
                  if not (n.split()[1] == "triton" and "No supported GPU devices found" in str(e))]
    else:
        assert proc.returncode == 0, failed
    assert not failed, failed
    mosaic = [r for r in compiled(report) if r["name"].split()[1] == "mosaic"]
    assert len(mosaic) >= 3, "too few Mosaic ragged configurations were accepted"
    for r in mosaic:
        assert set(r["kernels"]) == {"jpa_mosaic_ragged_ampere", "jpa_mosaic_decode_ampere"}, r["name"]
        for k in r["kernels"].values():
            assert k["ptx_targets"] == [sm] and k["spill_stores"] == 0 and 0 < k["registers"] <= 255, r["name"]
            assert 0 < k["shared_memory"] <= TARGETS[target]["shared_memory_per_block_optin"], r["name"]
        assert r["pool_copies"] == [], r["name"]


@pytest.mark.skipif(deviceless.missing_packages() is not None, reason=str(deviceless.missing_packages()))
def test_hopper_mma_route_compiles_for_an_h100(tmp_path):
    """The first covering-grid decode configuration the WGMMA kernel refuses on an H100 (an int8
    cache in pages of 8), compiled deviceless for the H100 as `auto` routes it: the mma.sync kernel
    with TMA copies, PTX sm_90a, no spills (`jpa tools compile-hopper-mma` runs them all)."""
    import json
    import subprocess
    import sys
    from test_gpu_compile import ROOT, fresh_env
    out = tmp_path / "hop.json"
    env = {k: v for k, v in fresh_env().items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_CPP_VMODULE")}
    proc = subprocess.run([sys.executable, "-m", "jpa.tools", "compile-hopper-mma", "h100",
                           "--max", "1", "--ops", "decode", "--json", str(out)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    (rec,) = json.loads(out.read_text())
    assert rec["ok"] and "refused" not in rec and rec["mosaic_calls"] == 1 and rec["triton_calls"] == 0, rec
    k = rec["kernels"]["jpa_mosaic_decode_ampere"]
    assert k["ptx_targets"] == ["sm_90a"] and k["spill_stores"] == 0 and 0 < k["registers"] <= 255, k
