"""impl="auto" picks a kernel for the device being compiled for, under jit as well as eagerly.

A GPU is simulated by patching `dispatch.current_target` and registering stand-in kernel modules
(the reference path wrapped in a jitted function whose name marks it in a jaxpr), so selection,
self-check and fallback run on CPU. AOT selection is tested with the real kernels and an abstract
H100/A100 (lowering only: nothing can run for a device that is not here).
"""

import contextlib
import sys
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

import jpa
from jpa.ops import dispatch
from jpa.ops.reference import paged_decode_xla

pytestmark = pytest.mark.xdist_group("engines_b")  # one worker compiles the group's programs once

H100 = dispatch.Target("gpu", "NVIDIA H100 80GB HBM3", 9.0, True)
A100 = dispatch.Target("gpu", "NVIDIA A100-SXM4-80GB", 8.0, True)
B200 = dispatch.Target("gpu", "NVIDIA B200", 10.0, True)
# sm_120 (RTX PRO 6000 / RTX 50xx): the mma.sync Mosaic kernels (TMA copies).
SM120 = dispatch.Target("gpu", "NVIDIA RTX PRO 6000 Blackwell Server Edition", 12.0, True)
# sm_110 (Jetson Thor): no Mosaic kernel serves it; only the Triton kernels.
SM110 = dispatch.Target("gpu", "NVIDIA Jetson AGX Thor", 11.0, True)
T4 = dispatch.Target("gpu", "Tesla T4", 7.5, True)


def fake_kernel(name, behaviour, calls):
    """A stand-in kernel module: the reference, jitted under the module's name (visible in jaxprs)."""
    mod = types.ModuleType(name)

    def paged_decode(q, k_pages, v_pages, block_tables, seq_lens, *, interpret=False,
                     compute_capability=None, **opts):
        # compute_capability: what the dispatch tells the Mosaic decode about its target.
        calls.append(name)
        if behaviour == "raise":
            raise RuntimeError("PTX compilation failed (simulated)")

        def kernel(q, k_pages, v_pages, block_tables, seq_lens):
            out = paged_decode_xla(q, k_pages, v_pages, block_tables, seq_lens, **opts)
            return out + 1.0 if behaviour == "wrong" else out
        kernel.__name__ = name
        return jax.jit(kernel)(q, k_pages, v_pages, block_tables, seq_lens)

    mod.paged_decode = paged_decode
    mod.unsupported_reason = lambda spec, cc=None: (
        "head_dim 48 unsupported (simulated)" if spec.head_dim == 48 else None)
    return mod


@pytest.fixture
def fake_gpu(monkeypatch):
    def install(target, triton="good", mosaic="good"):
        calls = []
        for impl, behaviour in (("triton", triton), ("mosaic", mosaic)):
            name = f"fake_{impl}_{behaviour}"
            monkeypatch.setitem(sys.modules, name, fake_kernel(name, behaviour, calls))
            monkeypatch.setitem(dispatch.KERNEL_MODULES, impl, name)
        if target is not None:
            monkeypatch.setattr(dispatch, "current_target", lambda: target)
        dispatch.self_check.cache_clear()
        dispatch._announce_fallback.cache_clear()
        return calls
    yield install
    dispatch.self_check.cache_clear()
    dispatch._announce_fallback.cache_clear()


def case(head_dim=32, num_seqs=2):
    rng = np.random.default_rng()
    q = jnp.asarray(rng.standard_normal((num_seqs, 4, head_dim)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 5, 8, head_dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 5, 8, head_dim)), jnp.float32)
    tables = jnp.asarray(rng.integers(0, 5, (num_seqs, 2)), jnp.int32)
    lens = jnp.asarray(rng.integers(0, 17, (num_seqs,)), jnp.int32)
    return q, k, v, tables, lens


def fresh_jit():
    """A new jitted paged_decode: jit caches traces per function, and these tests change the
    (simulated) device between traces of the same shapes."""
    return jax.jit(lambda *a: jpa.paged_decode(*a))


def want(args):
    return np.asarray(paged_decode_xla(*args, scale=args[0].shape[-1] ** -0.5))


def kernels_in(fn, *args):
    """Names of the stand-in kernels inside fn's jaxpr (what a compiled step would run)."""
    text = str(jax.make_jaxpr(fn)(*args))
    return {n for n in ("fake_triton_good", "fake_mosaic_good", "fake_triton_wrong", "fake_mosaic_wrong")
            if f"name={n}" in text}


def test_cpu_uses_reference(fake_gpu):
    calls = fake_gpu(None)  # the real target: this CPU
    assert dispatch.current_target().platform == "cpu"
    args = case()
    np.testing.assert_allclose(np.asarray(fresh_jit()(*args)), want(args), atol=1e-6)
    assert calls == []


@pytest.mark.parametrize("target,expected", [(A100, "fake_mosaic_good"), (H100, "fake_mosaic_good"),
                                             (B200, "fake_mosaic_good"), (SM120, "fake_mosaic_good"),
                                             (SM110, "fake_triton_good"), (T4, None)])
def test_auto_picks_kernel_eagerly_and_under_jit(fake_gpu, target, expected):
    calls = fake_gpu(target)
    args = case()
    jitted = fresh_jit()
    assert kernels_in(jitted, *args) == ({expected} if expected else set())
    np.testing.assert_allclose(np.asarray(jitted(*args)), want(args), atol=1e-6)
    np.testing.assert_allclose(np.asarray(jpa.paged_decode(*args)), want(args), atol=1e-6)
    if expected is not None:
        # The self-check traced the kernel twice (exact-shape compile, small run), once, under jit.
        n = len(calls)
        fresh_jit()(*case())  # a fresh trace of the same config: no new self-check
        assert len(calls) == n + 1


def test_nested_jit_picks_kernel(fake_gpu):
    fake_gpu(SM110)
    inner = jax.jit(lambda *a: jpa.paged_decode(*a) * 2.0)
    outer = jax.jit(lambda *a: inner(*a) + 1.0)
    args = case()
    assert kernels_in(outer, *args) == {"fake_triton_good"}
    np.testing.assert_allclose(np.asarray(outer(*args)), want(args) * 2.0 + 1.0, atol=1e-5)


def test_self_check_runs_outside_the_trace(fake_gpu):
    """The check's inputs are concrete even when the first call is traced: it passes under jit
    (before, a traced self-check hit TracerArrayConversionError and fell back)."""
    calls = fake_gpu(SM110)
    args = case()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed self-check would warn
        assert kernels_in(fresh_jit(), *args) == {"fake_triton_good"}
    spec = jpa.ops.decode.decode_spec(args[0], args[1], args[3], soft_cap=None, alibi_slopes=None,
                                  sliding_window=None)
    n = len(calls)
    assert dispatch.self_check("triton", spec, SM110, None) is None  # memoized: passed, not rerun
    assert len(calls) == n


@pytest.mark.parametrize("behaviour,reason", [("wrong", "differs from the reference"),
                                              ("raise", "PTX compilation failed")])
def test_failed_self_check_warns_once_and_falls_back(fake_gpu, behaviour, reason):
    calls = fake_gpu(SM110, triton=behaviour)
    args = case()
    with pytest.warns(RuntimeWarning, match=f"triton paged-decode kernel failed its self-check.*{reason}"):
        out = fresh_jit()(*args)
    np.testing.assert_allclose(np.asarray(out), want(args), atol=1e-6)
    n = len(calls)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, no second self-check
        assert kernels_in(fresh_jit(), *args) == set()
        np.testing.assert_allclose(np.asarray(jpa.paged_decode(*args)), want(args), atol=1e-6)
    assert len(calls) == n


def test_self_check_compiles_the_exact_shapes(fake_gpu, monkeypatch):
    """A kernel that fails only for the real (large) shapes is refused at selection, not at compile."""
    calls = fake_gpu(SM110)
    mod = sys.modules["fake_triton_good"]
    ok = mod.paged_decode

    def picky(q, k_pages, *a, **kw):
        if k_pages.shape[1] >= 100:  # the real pool; the self-check's small pool passes
            raise RuntimeError("RESOURCE_EXHAUSTED: Shared memory size limit exceeded (simulated)")
        return ok(q, k_pages, *a, **kw)
    monkeypatch.setattr(mod, "paged_decode", picky)
    rng = np.random.default_rng()
    big = jnp.asarray(rng.standard_normal((2, 128, 8, 32)), jnp.float32)
    q, _, _, tables, lens = case()
    with pytest.warns(RuntimeWarning, match="RESOURCE_EXHAUSTED"):
        out = fresh_jit()(q, big, big, tables, lens)
    np.testing.assert_allclose(np.asarray(out), want((q, big, big, tables, lens)), atol=1e-5)
    assert calls == []  # refused before the small case ran, and never traced into the step


def test_hopper_falls_back_from_mosaic_to_triton(fake_gpu):
    fake_gpu(H100, mosaic="wrong")
    args = case()
    with pytest.warns(RuntimeWarning, match="mosaic"):
        assert kernels_in(fresh_jit(), *args) == {"fake_triton_good"}


def test_hopper_tries_triton_when_mosaic_refuses_and_says_why(fake_gpu, monkeypatch):
    """A configuration the Mosaic kernel refuses (e.g. one that would spill registers) goes to
    the next kernel of AUTO_ORDER, Triton, after its self-check, with one warning naming the
    refusal; plain JAX is not used while a kernel can serve the call."""
    calls = fake_gpu(H100)
    monkeypatch.setattr(sys.modules["fake_mosaic_good"], "unsupported_reason",
                        lambda spec, cc=None: "it would spill registers (simulated)")
    args = case()
    with pytest.warns(RuntimeWarning, match="mosaic paged-decode kernel refuses this configuration: it "
                                            "would spill registers.*Using the triton kernel"):
        assert kernels_in(fresh_jit(), *args) == {"fake_triton_good"}
    assert "fake_mosaic_good" not in calls
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per configuration
        np.testing.assert_allclose(np.asarray(fresh_jit()(*args)), want(args), atol=1e-6)


@pytest.mark.parametrize("target", [A100, B200, SM120])
def test_mma_generations_fall_from_mosaic_to_reference_not_triton(fake_gpu, monkeypatch, target):
    """Where the mma.sync Mosaic kernels serve (8.x, 10.x, 12.x) Triton is not in auto's ladder:
    a configuration Mosaic refuses goes to plain JAX, with one warning giving the reason."""
    calls = fake_gpu(target)
    monkeypatch.setattr(sys.modules["fake_mosaic_good"], "unsupported_reason",
                        lambda spec, cc=None: "q dtype float32 is not supported (simulated)")
    args = case()
    with pytest.warns(RuntimeWarning, match="mosaic paged-decode kernel refuses this configuration: q dtype "
                                            "float32.*Using the reference path"):
        assert kernels_in(fresh_jit(), *args) == set()
    assert calls == []


def test_hopper_falls_back_to_reference_only_after_both_kernels_fail(fake_gpu):
    calls = fake_gpu(H100, mosaic="wrong", triton="raise")
    args = case()
    with pytest.warns(RuntimeWarning) as record:
        out = fresh_jit()(*args)
    np.testing.assert_allclose(np.asarray(out), want(args), atol=1e-6)
    messages = [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert ("mosaic paged-decode kernel failed its self-check: result differs" in messages[0]
            and "triton paged-decode kernel failed its self-check: RuntimeError: PTX" in messages[0]
            and "Using the reference path" in messages[0])
    assert {"fake_mosaic_wrong", "fake_triton_raise"} <= set(calls)


def test_unsupported_config_routes_to_reference_or_raises(fake_gpu):
    calls = fake_gpu(H100)
    args = case(head_dim=48)
    with pytest.warns(RuntimeWarning, match="mosaic paged-decode kernel refuses.*head_dim 48.*triton "
                                            "paged-decode kernel refuses.*Using the reference path"):
        out = fresh_jit()(*args)  # auto: both kernels say no -> reference, with one warning
    np.testing.assert_allclose(np.asarray(out), want(args), atol=1e-6)
    assert calls == []
    with pytest.raises(ValueError, match="impl='mosaic' cannot serve this call: head_dim 48 unsupported"):
        jpa.paged_decode(*args, impl="mosaic")


def test_engine_decode_loop_uses_the_kernel(fake_gpu, monkeypatch, engines):
    """The engine's compiled unified step (the ragged step and the decode loop, while_loops over
    the model, jitted with donated state) traces both kernels on a GPU, and its greedy outputs
    equal the reference engine's (conftest's `engines`: the context-dependent tiny-llama)."""
    from flax import nnx

    from jpa.ops import ragged
    from jpa.engine import EngineConfig, LLMEngine, SamplingParams

    gpt = nnx.merge(engines.model.graphdef, engines.model.params)
    cfg = dict(max_seqs=3, page_size=8, num_pages=48, steps_per_call=4, max_model_len=128)
    params = SamplingParams(max_new_tokens=12, greedy=True, ignore_eos=True)
    prompts = ["paged attention", "x", "a somewhat longer prompt for the cache"]
    want = [o.token_ids for o in engines.reference(prompts, [params] * len(prompts))]
    calls = fake_gpu(SM110)
    monkeypatch.setitem(sys.modules, "fake_ragged_good", fake_ragged("fake_ragged_good", "good", calls))
    monkeypatch.setattr(ragged, "RAGGED", ragged.RAGGED._replace(modules=(("triton", "fake_ragged_good"),)))
    eng = LLMEngine(engines.model, engines.tokenizer, EngineConfig(**cfg))
    got = [o.token_ids for o in eng.generate(prompts, params)]
    assert got == want
    # Each kernel is traced once by the self-check's compile, once by its small run, then once by
    # the scanned layer body of its pass (the ragged step, the decode loop): not once per layer.
    n = 2 + gpt.layer_period()
    assert gpt.layer_period() == 1 < gpt.config.num_layers
    assert sorted(calls) == ["fake_ragged_good"] * n + ["fake_triton_good"] * n
    s = eng.summary()
    assert s["step_compiles"] == 1


def test_resolve_decode_impl_with_shapes_only(fake_gpu):
    """The engine's set-up call: ShapeDtypeStructs of the real shapes, no arrays."""
    fake_gpu(H100)
    sds = jax.ShapeDtypeStruct
    q, k, tables = sds((64, 9, 64), jnp.float32), sds((3, 4096, 16, 64), jnp.float32), sds((64, 128), jnp.int32)
    assert jpa.resolve_decode_impl(q, k, tables) == "mosaic"
    assert jpa.resolve_decode_impl(q, k, tables, impl="xla") == "xla"
    assert jpa.resolve_decode_impl(q, sds((3, 4096, 16, 48), jnp.float32), tables) == "xla"


@pytest.mark.parametrize("kind,cc", [("NVIDIA H100 80GB HBM3", 9.0), ("NVIDIA H200", 9.0),
                                     ("NVIDIA A100-SXM4-80GB", 8.0), ("NVIDIA A10G", 8.6),
                                     ("NVIDIA L4", 8.9), ("NVIDIA L40S", 8.9), ("NVIDIA B200", 10.0),
                                     ("NVIDIA GeForce RTX 4090", 8.9), ("NVIDIA H20", 9.0),
                                     ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 12.0),
                                     ("NVIDIA GeForce RTX 5090", 12.0), ("Some Future GPU", None)])
def test_compute_capability_of_device_kinds(kind, cc):
    assert dispatch.compute_capability_of(kind) == cc


def abstract_mesh(kind, cores):
    dev = AbstractDevice(device_kind=kind, num_cores=cores, platform="cuda")
    return AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=dev)


@pytest.mark.parametrize("kind,cores,call", [("NVIDIA H100 80GB HBM3", 132, "mosaic_gpu"),
                                             ("NVIDIA A100-SXM4-80GB", 108, None),
                                             ("NVIDIA B200", 148, None)])
def test_aot_target_picks_its_kernel(kind, cores, call):
    """Under an AOT lowering for an absent GPU, auto uses the kernel for THAT GPU, and says so. An
    A100 / B200 from this host (Mosaic would lower for sm_90: `aot_unsupported_reason`) gets plain
    JAX, not Triton, saying why (the compile tier sets the arch: the next test)."""
    dispatch.self_check.cache_clear()
    dispatch._announce_aot.cache_clear()
    rng = np.random.default_rng()
    q = jnp.asarray(rng.standard_normal((4, 8, 64)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((2, 16, 64, 64)), jnp.bfloat16)
    tables = jnp.asarray(rng.integers(0, 16, (4, 4)), jnp.int32)
    lens = jnp.asarray(rng.integers(0, 257, (4,)), jnp.int32)
    with jax.sharding.use_abstract_mesh(abstract_mesh(kind, cores)):
        target = dispatch.current_target()
        assert (target.executable, target.is_nvidia_gpu) == (False, True)
        warning = ((UserWarning, f"compiling for {kind}.*cannot be self-checked") if call else
                   (RuntimeWarning, "Mosaic GPU would lower for sm_90.*Using the reference path"))
        with pytest.warns(warning[0], match=warning[1]):
            text = fresh_jit().trace(q, k, k, tables, lens).lower(
                lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" not in text
    assert ("mosaic_gpu" in text) == (call == "mosaic_gpu")


def test_aot_for_an_a100_uses_mosaic_only_when_it_lowers_for_sm_80():
    """Mosaic GPU infers sm_90 under an abstract device: an AOT compile for an A100 from this host
    would hold Hopper code, so auto passes Mosaic over (saying why) and uses plain JAX; under
    `deviceless.mosaic_arch` (as jpa's compile tier runs) Mosaic lowers for sm_80 and is used."""
    from jpa.tools.deviceless import mosaic_arch
    rng = np.random.default_rng()
    q = jnp.asarray(rng.standard_normal((4, 8, 64)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((2, 16, 64, 64)), jnp.bfloat16)
    tables = jnp.asarray(rng.integers(0, 16, (4, 4)), jnp.int32)
    lens = jnp.asarray(rng.integers(0, 257, (4,)), jnp.int32)
    for arch, call, match in ((None, None, "Mosaic GPU would lower for sm_90.*reference path"),
                              ((8, 0), "mosaic_gpu", "uses the mosaic paged-decode kernel")):
        dispatch._announce_aot.cache_clear()
        dispatch._announce_fallback.cache_clear()
        with contextlib.ExitStack() as stack:
            if arch:
                stack.enter_context(mosaic_arch(arch))
            stack.enter_context(jax.sharding.use_abstract_mesh(abstract_mesh("NVIDIA A100-SXM4-80GB", 108)))
            with pytest.warns(UserWarning if call else RuntimeWarning, match=match):
                text = fresh_jit().trace(q, k, k, tables, lens).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" not in text
        assert ("mosaic_gpu" in text) == (call == "mosaic_gpu")


def fake_ragged(name, behaviour, calls=None):
    mod = types.ModuleType(name)
    from jpa.ops.ragged import ragged_paged_attention_xla

    def ragged_paged_attention(*args, interpret=False, **opts):
        if calls is not None:
            calls.append(name)

        def kernel(*a):
            out = ragged_paged_attention_xla(*a, **opts)
            return out + 1.0 if behaviour == "wrong" else out
        kernel.__name__ = name
        return jax.jit(kernel)(*args)

    mod.ragged_paged_attention = ragged_paged_attention
    mod.unsupported_reason = lambda spec, cc=None: None
    return mod


@pytest.mark.parametrize("behaviour", ["good", pytest.param("wrong", marks=pytest.mark.bench)])
def test_ragged_auto_self_checks_like_decode(monkeypatch, behaviour):
    """ragged_paged_attention(impl="auto") goes through the same dispatch: under jit on a
    (simulated) sm_110 GPU it uses a kernel that passes its self-check, and falls back from one that
    does not, with one warning."""
    from jpa.ops import ragged
    name = f"fake_ragged_{behaviour}"
    monkeypatch.setitem(sys.modules, name, fake_ragged(name, behaviour))
    monkeypatch.setattr(ragged, "RAGGED", ragged.RAGGED._replace(modules=(("triton", name),)))
    monkeypatch.setattr(dispatch, "current_target", lambda: SM110)
    dispatch.self_check.cache_clear()
    dispatch._announce_fallback.cache_clear()
    rng = np.random.default_rng()
    q = jnp.asarray(rng.standard_normal((16, 4, 32)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 12, 8, 32)), jnp.float32)
    tables = jnp.asarray(rng.permutation(12)[:12].reshape(3, 4), jnp.int32)
    lens, cu = jnp.array([9, 20, 5], jnp.int32), jnp.array([0, 1, 9, 14], jnp.int32)
    args = (q, k, k, tables, lens, cu, jnp.int32(3))
    want = np.asarray(ragged.ragged_paged_attention_xla(*args, scale=32 ** -0.5))
    fn = jax.jit(lambda *a: jpa.ragged_paged_attention(*a))
    if behaviour == "good":
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            text = str(jax.make_jaxpr(fn)(*args))
        assert f"name={name}" in text
    else:
        with pytest.warns(RuntimeWarning, match="triton ragged kernel failed its self-check.*differs"):
            text = str(jax.make_jaxpr(fn)(*args))
        assert f"name={name}" not in text
    np.testing.assert_allclose(np.asarray(fn(*args)), want, atol=1e-5)
    dispatch.self_check.cache_clear()
