"""impl="auto": kernels are used on a GPU only after a one-time self-check; failures fall back.

A GPU is simulated by patching the compute-capability probe and registering fake kernel modules,
so the selection and fallback logic is exercised on CPU.
"""

import sys
import types
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import jpa
from jpa import dispatch
from jpa.reference import paged_decode_xla


def fake_kernel(name, behaviour, calls):
    mod = types.ModuleType(name)

    def paged_decode(q, k_pages, v_pages, block_tables, seq_lens, *, interpret=False, **opts):
        calls.append(name)
        if behaviour == "raise":
            raise RuntimeError("PTX compilation failed (simulated)")
        out = paged_decode_xla(q, k_pages, v_pages, block_tables, seq_lens, **opts)
        return out + 1.0 if behaviour == "wrong" else out

    mod.paged_decode = paged_decode
    mod.unsupported_reason = lambda spec: "head_dim 48 unsupported (simulated)" if spec.head_dim == 48 else None
    return mod


@pytest.fixture
def fake_gpu(monkeypatch):
    def install(cc, triton="good", mosaic="good"):
        calls = []
        for impl, behaviour in (("triton", triton), ("mosaic", mosaic)):
            name = f"_fake_{impl}_{behaviour}"
            monkeypatch.setitem(sys.modules, name, fake_kernel(name, behaviour, calls))
            monkeypatch.setitem(dispatch.KERNEL_MODULES, impl, name)
        monkeypatch.setattr(dispatch, "gpu_compute_capability", lambda: cc)
        dispatch.self_check.cache_clear()
        return calls
    yield install
    dispatch.self_check.cache_clear()


def case(head_dim=32):
    rng = np.random.default_rng()
    q = jnp.asarray(rng.standard_normal((2, 4, head_dim)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 5, 8, head_dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 5, 8, head_dim)), jnp.float32)
    return q, k, v, jnp.array([[0, 1], [3, 2]], jnp.int32), jnp.array([9, 3], jnp.int32)


def test_cpu_uses_reference(fake_gpu):
    calls = fake_gpu(None)
    out = jpa.paged_decode(*case())
    assert out.shape == (2, 4, 32)
    assert calls == []


@pytest.mark.parametrize("cc,expected", [(8.0, "_fake_triton_good"), (8.9, "_fake_triton_good"),
                                         (9.0, "_fake_mosaic_good"), (7.5, None)])
def test_auto_picks_kernel_by_compute_capability(fake_gpu, cc, expected):
    calls = fake_gpu(cc)
    args = case()
    out = jpa.paged_decode(*args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(paged_decode_xla(*args, scale=32 ** -0.5)),
                               atol=1e-6)
    if expected is None:
        assert calls == []
    else:
        # One self-check call, then the real call; a second call does not check again.
        assert calls == [expected, expected]
        jpa.paged_decode(*args)
        assert calls == [expected] * 3


@pytest.mark.parametrize("behaviour,reason", [("wrong", "differs from the reference"),
                                              ("raise", "PTX compilation failed")])
def test_failed_self_check_warns_once_and_falls_back(fake_gpu, behaviour, reason):
    calls = fake_gpu(8.0, triton=behaviour)
    args = case()
    want = np.asarray(paged_decode_xla(*args, scale=32 ** -0.5))
    with pytest.warns(RuntimeWarning, match=f"triton paged-decode kernel failed its self-check.*{reason}"):
        out = jpa.paged_decode(*args)
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, no second self-check
        out = jpa.paged_decode(*args)
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-6)
    assert len(calls) == 1


def test_hopper_falls_back_from_mosaic_to_triton(fake_gpu):
    calls = fake_gpu(9.0, mosaic="wrong")
    with pytest.warns(RuntimeWarning, match="mosaic"):
        jpa.paged_decode(*case())
    assert calls == ["_fake_mosaic_wrong", "_fake_triton_good", "_fake_triton_good"]


def test_unsupported_config_routes_to_reference_or_raises(fake_gpu):
    calls = fake_gpu(9.0)
    args = case(head_dim=48)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = jpa.paged_decode(*args)  # auto: both kernels say no -> reference, silently
    np.testing.assert_allclose(np.asarray(out), np.asarray(paged_decode_xla(*args, scale=48 ** -0.5)),
                               atol=1e-6)
    assert calls == []
    with pytest.raises(ValueError, match="impl='mosaic' cannot serve this call: head_dim 48 unsupported"):
        jpa.paged_decode(*args, impl="mosaic")
