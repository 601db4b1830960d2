"""The four Pallas kernels over a STACKED page pool [L, K, P, S_p, H] read at a layer index.

What the layer-scanned model does: one buffer per K and V holds every layer, carried through a
`lax.scan` over layers, and each layer's attention passes the whole pool plus the (traced) layer
index to the kernel. Every kernel runs in interpret mode on CPU against the plain-JAX reference
run on that layer's slice `k_pages[layer]`:

- eagerly at one layer (a random one of L >= 3, fixed by a seed), bf16 and one quantized cache;
- under `jax.jit`, the layer a traced index of a `lax.scan` over all layers with the pools in the
  carry: one compiled kernel gives every layer's answer (a kernel that ignored `layer`, or read
  layer 0, fails: each layer's pool holds different values and the answers differ).

Every layer has the same poisoning as `kernel_cases` (NaN in slots no visible token uses, NaN
scales for quantized caches), so reading a wrong slot of any layer shows up too.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jpa.pallas.mosaic import decode as mosaic_decode
from jpa.pallas.mosaic import ragged as mosaic_ragged
from jpa.pallas.triton import decode as triton_decode
from jpa.pallas.triton import ragged as triton_ragged
from jpa.core.quant import is_quantized, quantize
from jpa.ops.ragged import ragged_paged_attention_xla
from jpa.ops.reference import paged_decode_xla
from jpa.testing.kernel_cases import Case, RaggedCase, make_inputs, make_ragged_inputs, tolerance
from marks import tiered

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

NUM_LAYERS = 3


def stack_layers(case, args, opts, num_layers=NUM_LAYERS):
    """Turns one call's inputs into a stacked pool of `num_layers` layers: layer 0 is the call's
    own pool, the others fresh random values with the same hidden (NaN) slots. Returns (args with
    k_pages, v_pages [L, K, P, S_p, H], opts with scales f32[L, K, P, S_p] or None)."""
    rng = np.random.default_rng(case.seed + 7919)
    k0, v0 = args[1], args[2]
    ks, vs = [k0], [v0]
    kss, vss = [opts["k_scales"]], [opts["v_scales"]]
    for _ in range(num_layers - 1):
        for pools, scales, p0, s0 in ((ks, kss, k0, opts["k_scales"]), (vs, vss, v0, opts["v_scales"])):
            x = rng.standard_normal(p0.shape).astype(np.float32)
            if is_quantized(case.cache_dtype):
                vals, s = quantize(jnp.asarray(x), case.cache_dtype)
                pools.append(vals)
                scales.append(jnp.where(jnp.isnan(s0), jnp.nan, s))
            else:
                pools.append(jnp.where(jnp.isnan(p0.astype(jnp.float32)), jnp.nan, x).astype(p0.dtype))
                scales.append(None)
    quantized = opts["k_scales"] is not None
    args = (args[0], jnp.stack(ks), jnp.stack(vs), *args[3:])
    opts = dict(opts, k_scales=jnp.stack(kss) if quantized else None,
                v_scales=jnp.stack(vss) if quantized else None)
    return args, opts


def layer_slice(args, opts, layer):
    """The per-layer call of `layer`: pools [K, P, S_p, H] and scales [K, P, S_p] sliced out."""
    sl = lambda x: None if x is None else x[layer]  # noqa: E731
    return ((args[0], args[1][layer], args[2][layer], *args[3:]),
            dict(opts, k_scales=sl(opts["k_scales"]), v_scales=sl(opts["v_scales"])))


def references(ref_fn, args, opts):
    """The reference's answer for every layer, f32[L, ...]; checks the layers' answers differ
    (else a kernel reading the wrong layer could pass)."""
    num_layers = args[1].shape[0]
    outs = np.stack([np.asarray(ref_fn(*layer_slice(args, opts, l)[0], **layer_slice(args, opts, l)[1])
                                .astype(jnp.float32)) for l in range(num_layers)])
    assert np.isfinite(outs).all()
    for l in range(1, num_layers):
        if np.abs(outs[0]).max() > 0:
            assert np.abs(outs[l] - outs[0]).max() > 0.1, "layers must give different answers"
    return outs


def check_layer(case, got, want, layer):
    got = np.asarray(got.astype(jnp.float32))
    assert np.isfinite(got).all(), (case, layer)
    np.testing.assert_allclose(got, want, atol=tolerance(case), rtol=0, err_msg=f"{case} layer {layer}")


# (kernel module entry, reference, case, extra static options). Small shapes: interpret mode is slow.
DECODE = [
    Case((0, 17, 40, 9), num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=8, pages_per_seq=5,
         q_dtype="bfloat16", cache_dtype="bfloat16", seed=31),
    Case((1, 33, 64), num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=32, pages_per_seq=2,
         q_dtype="bfloat16", cache_dtype="int8", soft_cap=10.0, seed=32),
]
RAGGED = [
    RaggedCase((1, 20, 9), q_lens=(1, 12, 9), num_tokens=24, max_num_seqs=4, num_q_heads=4,
               num_kv_heads=2, head_dim=64, page_size=8, pages_per_seq=3, q_dtype="bfloat16",
               cache_dtype="bfloat16", seed=33),
    RaggedCase((1, 40), q_lens=(1, 20), num_tokens=24, num_q_heads=4, num_kv_heads=2, head_dim=64,
               page_size=32, pages_per_seq=2, q_dtype="bfloat16", cache_dtype="int8", seed=34),
]
KERNELS = {
    "triton_decode": (triton_decode.paged_decode, paged_decode_xla, make_inputs, DECODE),
    "mosaic_decode": (mosaic_decode.paged_decode, paged_decode_xla, make_inputs, DECODE),
    "triton_ragged": (triton_ragged.ragged_paged_attention, ragged_paged_attention_xla,
                      make_ragged_inputs, RAGGED),
    "mosaic_ragged": (mosaic_ragged.ragged_paged_attention, ragged_paged_attention_xla,
                      make_ragged_inputs, RAGGED),
}
PARAMS = [(name, i) for name in KERNELS for i in range(2)]


def _ids(p):
    name, i = p
    return f"{name}-{KERNELS[name][3][i].cache_dtype}"


def _setup(name, i):
    fn, ref_fn, make, cases = KERNELS[name]
    case = cases[i]
    args, opts = stack_layers(case, *make(case))
    return fn, ref_fn, case, args, opts


@pytest.mark.parametrize("param", tiered(PARAMS, bench=(6, 7), soak=(0, 1, 4, 5)), ids=_ids)
def test_one_layer_matches_reference_on_its_slice(param):
    fn, ref_fn, case, args, opts = _setup(*param)
    want = references(ref_fn, args, opts)
    layer = int(np.random.default_rng(case.seed).integers(1, NUM_LAYERS))  # not layer 0
    got = fn(*args, **opts, interpret=True, layer=layer)
    check_layer(case, got, want[layer], layer)


@pytest.mark.parametrize("param", tiered(PARAMS, bench=(2,), soak=(1, 3, 5, 7)), ids=_ids)
def test_scan_over_layers_with_traced_layer(param):
    """The model's loop: lax.scan over layers, the pools carried, the layer a traced i32[]; one
    kernel in the jitted program answers for every layer."""
    fn, ref_fn, case, args, opts = _setup(*param)
    want = references(ref_fn, args, opts)
    q, k_pages, v_pages, *rest = args
    arrays = {k: v for k, v in opts.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in opts.items() if not isinstance(v, jax.Array)}
    traces, calls = [], []

    @jax.jit
    def all_layers(q, k_pages, v_pages, rest, arrays):
        traces.append(1)

        def body(carry, layer):
            k, v = carry
            calls.append(1)
            out = fn(q, k, v, *rest, **arrays, **static, interpret=True, layer=layer)
            return (k, v), out

        _, outs = lax.scan(body, (k_pages, v_pages), jnp.arange(NUM_LAYERS, dtype=jnp.int32))
        return outs  # [L, ...]

    outs = all_layers(q, k_pages, v_pages, rest, arrays)
    assert len(traces) == 1
    for layer in range(NUM_LAYERS):
        check_layer(case, outs[layer], want[layer], layer)
    # The kernel sits once in the scan's body: one call, traced once, serves every layer.
    assert len(calls) == 1


def test_layer_out_of_range_is_clamped():
    """The public API validates the layer; the kernels clamp it into [0, L) (a layer past the
    pool must never read outside it)."""
    case = DECODE[0]
    args, opts = stack_layers(case, *make_inputs(case))
    want = references(paged_decode_xla, args, opts)
    got = triton_decode.paged_decode(*args, **opts, interpret=True, layer=NUM_LAYERS + 4)
    check_layer(case, got, want[NUM_LAYERS - 1], NUM_LAYERS - 1)
    got = triton_decode.paged_decode(*args, **opts, interpret=True, layer=-2)
    check_layer(case, got, want[0], 0)


@pytest.mark.parametrize("fn", [triton_decode.paged_decode, mosaic_decode.paged_decode])
def test_pool_rank_must_match_layer(fn):
    case = dataclasses.replace(DECODE[0], seq_lens=(3,))
    args, opts = make_inputs(case)
    with pytest.raises(ValueError, match="stacked"):
        fn(*args, **opts, interpret=True, layer=0)  # 4-D pool with a layer
    stacked, sopts = stack_layers(case, args, opts)
    with pytest.raises(ValueError, match="needs `layer`"):
        fn(*stacked, **sopts, interpret=True)  # 5-D pool without one
