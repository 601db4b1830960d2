"""The formats a linear weight is stored in, one object per format (as vLLM's `LinearMethodBase`).

A format object knows, for a weight `name` of an nnx module (a `models.gpt.GPT`, or its stacked `Block`):
the arrays it is stored in (`parts`: parameter `name + suffix`), x @ W from them (`apply`: XLA's dot on the
weight as stored, or, where the caller chose the kernel, the Mosaic dequantizing matmul `jpa.ops.qmatmul`
through `tp_matmul`), the float weight they hold (`dequantize`), an embedding table's rows (`embed`) and why
the kernel does not serve them (`unsupported_reason`, None where it does).

- `Dense`: `name`, a float [in, out] weight.
- `Scaled`: `name` int8 / float8_e4m3fn values and `name_scale` f32 scales, one per output channel
  (jpa.core.quant.quantize_weight; the FP8 checkpoints of models.hf).
- `Packed`: blocks in jpa's layout (models.gpt.PackedWeight: GGUF Q8_0 / Q4_0 / Q4_1 / K-quants, AWQ / GPTQ /
  compressed-tensors int4, block FP8): `name` the codes, `name_bscale` the block scales, and where the format
  has them `name_bmin` (minimums), `name_bscale2` / `name_bmin2` (K-quants' super-blocks) and `name_perm`
  (act-order GPTQ: the stored rows are W[perm], so x[..., perm] is what multiplies them).
- `Mxfp4`: a mixture of experts' weight in MXFP4 (gpt-oss): `name` u8[E, out, in / 2] e2m1 codes and
  `name_scales` u8[E, out, in / 32] e8m0 exponents; models.moe routes x to the experts, reading `operand`.

The module records each weight's format once, where the weight is set (`set_format`: models.gpt's
constructors, `set_packed`, `set_scaled`): its attribute `weight_formats`, a tuple of (name, format) pairs.
It is no nnx.Variable, so it lives in the module's graphdef: it survives nnx.split / merge, stacking,
nnx.eval_shape and models.sharding.shard, and a jitted function sees it as static. The compute paths ask
`format_of(owner, name)`, never the parameters' names.

Parameter names and layouts are models.sharding's RULES and the loaders' (models.hf, models.smollm2).
"""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpa.core.quant import dequantize_blocks, dequantize_weight
from jpa.core.sharding import TP
from jpa.models.moe import dequantize_mxfp4
from jpa.models.partition import RULES
from jpa.ops.qmatmul import packed_matmul, scaled_matmul, scaled_unsupported_reason, unsupported_reason

# The weights a model may store quantized, each with the axis its scales are shared along (-2: one scale per
# output channel, or the blocks along `in`, of an [in, out] weight; -1: per row of the embedding table, which
# is also the tied head's output channel).
QUANT_AXIS = {"wq": -2, "wk": -2, "wv": -2, "wo": -2, "w_gate": -2, "w_up": -2, "w_down": -2,
              "output": -2, "tok_embeddings": -1}
# The arrays of a packed weight the kernel reads (codes, block scales, minimums, K-quants' super-block ones).
PACKED_PARTS = ("", "_bscale", "_bmin", "_bscale2", "_bmin2")


def _v(p):
    """The array held by an nnx.Variable (or p itself)."""
    return p[...] if isinstance(p, nnx.Variable) else p


def dense(x, w, b=None, scale=None, compute_dtype=None, out_dtype=jnp.float32):
    """x [..., in] @ w [in, out] with an f32 result: inputs in w's dtype, or, for a quantized w
    (int8 / float8 with scale f32[out]), (x @ w.astype(compute_dtype)) * scale: the dot reads the
    stored weight (XLA fuses the convert into the gemm's operand) and the per-channel scale
    multiplies the f32 result, never a dense float copy of w. out_dtype: the dtype the dot (of an
    unquantized w) writes (models.gpt.matmul_out_dtype), widened to f32 where it is read."""
    w, b = _v(w), None if b is None else _v(b)
    if scale is None:
        y = jnp.dot(x.astype(w.dtype), w, preferred_element_type=out_dtype).astype(jnp.float32)
    else:
        y = jnp.dot(x.astype(compute_dtype), w.astype(compute_dtype), preferred_element_type=jnp.float32)
        y = y * _v(scale)
    return y if b is None else y + b.astype(jnp.float32)


class Format:
    """The base of the formats: `parts` the suffixes of the arrays a weight is stored in."""
    key: ClassVar[str]
    parts: tuple

    @property
    def kernel_parts(self) -> tuple:
        """The parts the Mosaic matmul reads (in its argument order); () where no kernel reads this format."""
        return ()

    def arrays(self, owner, name, parts=None) -> dict:
        """{suffix: array} of weight `name` of `owner` (`parts`, default all of them)."""
        return {sx: getattr(owner, name + sx)[...] for sx in (self.parts if parts is None else parts)}

    def apply(self, owner, name, x, bias=None, *, dtype, out_dtype=jnp.float32, transpose=False, kernel=False,
              layer=None, mesh=None, stacked=True):
        """x [..., in] @ W (+ bias, an f32-added [out] vector or nnx.Variable) -> f32[..., out].

        dtype: the compute dtype; out_dtype: the dot's output dtype of a float weight (`dense`). transpose: the
        weight is stored [out, in] (the tied head's embedding rows). kernel: through `tp_matmul` and the Mosaic
        matmul (`jpa.ops.qmatmul`), layer `layer` of the stacked arrays (stacked True: a leading layer axis)
        on each device's shard under tensor-parallel `mesh` (or one device with mesh None); else XLA's dot on
        the weight as stored (a packed weight dequantized in `dtype` where the dot reads it)."""
        if not kernel:
            w, scale = self.weight(owner, name, dtype)
            w = _v(w).T if transpose else w
            return dense(self._input(owner, name, x), w, bias, scale, dtype, self._out_dtype(out_dtype))
        if not self.kernel_parts:
            raise ValueError(f"kernel=True for weight {name}: {Format.unsupported_reason(self, 0, {}, dtype)}")
        lead = x.shape[:-1]
        x2 = self._input(owner, name, x).reshape(-1, x.shape[-1])  # [M, in]
        parts = self.arrays(owner, name, self.kernel_parts)
        y = tp_matmul(self._matmul(dtype, tuple(parts)), x2, layer, name, parts, mesh, stacked).reshape(*lead, -1)
        return y if bias is None else y + _v(bias).astype(jnp.float32)

    def dequantize(self, owner, name, axis=None):
        """The float32 weight `name` as stored (axis: that of its scales, default QUANT_AXIS[name]); a dense
        weight as it is."""
        return getattr(owner, name)[...]

    def operand(self, owner, name):
        """What models.moe's expert matmuls take for the experts' weight `name`: the array as stored."""
        return getattr(owner, name)[...]

    def embed(self, owner, name, tokens, columns=False):
        """f32[B, T, d_model] rows of the embedding table `name` for tokens i32[B, T] (clipped to the table):
        columns: the table is kept [d_model, vocab] (models.gpt.set_embeddings_layout)."""
        return self._take(owner, name, "", tokens, columns).astype(jnp.float32)

    def unsupported_reason(self, rows, local, compute_dtype, full=None, tp=1):
        """Why the Mosaic dequantizing matmul does not serve this weight for `rows` tokens on the device being
        compiled for, or None. local: {suffix: jax.ShapeDtypeStruct} of the `kernel_parts` as the kernel reads
        them ([..., K(/ 2), N]: one device's shard); full: the whole arrays under a tensor-parallel mesh of
        `tp` devices (the shard must hold whole groups), or None."""
        return f"a {self.key} weight: no dequantizing kernel reads it"

    @staticmethod
    def _take(owner, name, suffix, tokens, columns):
        a = getattr(owner, name + suffix)[...]
        if columns:  # [d_model(/ 2), vocab]: gather the tokens' columns
            return jnp.moveaxis(jnp.take(a, tokens, axis=1, mode="clip"), 0, -1)
        return jnp.take(a, tokens, axis=0, mode="clip")

    def _input(self, owner, name, x):
        return x

    def _out_dtype(self, out_dtype):
        return out_dtype

    def weight(self, owner, name, dtype):
        """(the weight the non-kernel dot reads, as stored: a float or 8-bit array or its nnx.Variable, a packed
        one dequantized in `dtype`; the f32 per-output-channel scale multiplying the dot's result, or None)."""
        return getattr(owner, name), None


@dataclasses.dataclass(frozen=True)
class Dense(Format):
    """A float weight: `name`."""
    key: ClassVar[str] = "dense"
    parts: tuple = ("",)


@dataclasses.dataclass(frozen=True)
class Scaled(Format):
    """int8 / float8_e4m3fn values `name` and their f32 per-output-channel scales `name_scale`."""
    key: ClassVar[str] = "scaled"
    parts: tuple = ("", "_scale")

    @property
    def kernel_parts(self) -> tuple:
        return self.parts

    def dequantize(self, owner, name, axis=None):
        a = self.arrays(owner, name)
        return dequantize_weight(a[""], a["_scale"], QUANT_AXIS[name] if axis is None else axis)

    def embed(self, owner, name, tokens, columns=False):  # a row's values times its scale (f32[vocab] as stored)
        x = self._take(owner, name, "", tokens, columns).astype(jnp.float32)
        return x * jnp.take(getattr(owner, name + "_scale")[...], tokens, axis=0, mode="clip")[..., None]

    def unsupported_reason(self, rows, local, compute_dtype, full=None, tp=1):
        codes = local[""]
        return scaled_unsupported_reason(rows, codes.shape[-2], codes.shape[-1], codes.dtype, compute_dtype)

    def weight(self, owner, name, dtype):
        return getattr(owner, name), getattr(owner, name + "_scale")

    @staticmethod
    def _matmul(dtype, present):
        return lambda x2, i, q, scale: scaled_matmul(x2, q, scale, layer=i, compute_dtype=dtype)


_PACKED_ORDER = PACKED_PARTS + ("_perm",)


@dataclasses.dataclass(frozen=True)
class Packed(Format):
    """Blocks: codes `name`, block scales `name_bscale`, and the optional parts this format has of
    `name_bmin`, `name_bscale2`, `name_bmin2`, `name_perm` (`parts`, in that order)."""
    key: ClassVar[str] = "packed"
    parts: tuple = ("", "_bscale")

    def __post_init__(self):
        parts = tuple(sx for sx in _PACKED_ORDER if sx in self.parts)
        if set(parts) != set(self.parts) or parts[:2] != ("", "_bscale"):
            raise ValueError(f"Packed.parts must hold '' and '_bscale' and only parts of {_PACKED_ORDER}; "
                             f"got {self.parts}")
        object.__setattr__(self, "parts", parts)

    @classmethod
    def of(cls, w) -> "Packed":
        """The format of a models.gpt.PackedWeight: the parts it has."""
        present = (w.m, w.d2, w.m2, w.perm)
        return cls(("", "_bscale") + tuple(sx for sx, a in zip(_PACKED_ORDER[2:], present) if a is not None))

    @property
    def kernel_parts(self) -> tuple:
        return tuple(sx for sx in self.parts if sx != "_perm")  # the perm gathers x before the kernel

    def dequantize(self, owner, name, axis=None):
        w = self._blocks(owner, name, jnp.float32, QUANT_AXIS[name] if axis is None else axis)
        return w if "_perm" not in self.parts else unpermute_rows(w, getattr(owner, name + "_perm")[...])

    def embed(self, owner, name, tokens, columns=False):  # the rows' blocks
        t = {sx: self._take(owner, name, sx, tokens, columns) for sx in self.kernel_parts}
        return dequantize_blocks(t[""], t["_bscale"], t.get("_bmin"), -1, jnp.float32, t.get("_bscale2"),
                                 t.get("_bmin2"))

    def unsupported_reason(self, rows, local, compute_dtype, full=None, tp=1):
        codes, d, m = local[""], local["_bscale"], local.get("_bmin")
        per = 2 if codes.dtype == jnp.uint8 else 1  # uint8: two 4-bit codes a byte
        k, n = codes.shape[-2] * per, codes.shape[-1]
        group = k // d.shape[-2]
        if full is not None:  # the shard must hold whole groups (and K-quants' whole super-blocks)
            full_k = full[""].shape[-2] * per
            full_group = full_k // full["_bscale"].shape[-2]
            if group != full_group or k % d.shape[-2]:
                return f"K / {tp} = {k} is not whole groups of {full_group}"
            if "_bscale2" in full and local["_bscale2"].shape[-2] * (
                    super_group := full_k // full["_bscale2"].shape[-2]) != k:
                return f"K / {tp} = {k} is not whole super-blocks of {super_group}"
        return unsupported_reason(rows, k, n, group, codes.dtype, compute_dtype, d2=local.get("_bscale2"),
                                  sub_dtypes=(d.dtype, None if m is None else m.dtype))

    def _input(self, owner, name, x):  # act order: the stored rows are W[perm]
        return x if "_perm" not in self.parts else jnp.take(x, getattr(owner, name + "_perm")[...], axis=-1)

    def _out_dtype(self, out_dtype):
        return jnp.float32  # the dequantized weight's dot writes f32 (as it always has)

    def weight(self, owner, name, dtype):  # dequantized in the compute dtype where the dot reads it
        return self._blocks(owner, name, dtype, QUANT_AXIS[name]), None

    def _blocks(self, owner, name, dtype, axis):
        a = self.arrays(owner, name, self.kernel_parts)
        return dequantize_blocks(a[""], a["_bscale"], a.get("_bmin"), axis, dtype, a.get("_bscale2"), a.get("_bmin2"))

    @staticmethod
    def _matmul(dtype, present):
        def matmul(x2, layer, *arrays):
            a = dict(zip(present, arrays))
            return packed_matmul(x2, a[""], a["_bscale"], a.get("_bmin"), a.get("_bscale2"), a.get("_bmin2"),
                                 layer=layer, compute_dtype=dtype)
        return matmul


@dataclasses.dataclass(frozen=True)
class Mxfp4(Format):
    """MXFP4 experts (models.moe): codes `name` u8[E, out, in / 2] and block exponents `name_scales`."""
    key: ClassVar[str] = "mxfp4"
    parts: tuple = ("", "_scales")

    def apply(self, owner, name, x, bias=None, **options):
        raise ValueError(f"weight {name} holds MXFP4 experts: models.moe.moe_ffn routes x to them (`operand`), "
                         f"there is no one x @ W")

    def dequantize(self, owner, name, axis=None):  # f32[E, in, out]
        return dequantize_mxfp4(*self.operand(owner, name), jnp.float32)

    def operand(self, owner, name):  # (codes, scales), models.moe's MXFP4 form
        return tuple(self.arrays(owner, name).values())


DENSE, SCALED, MXFP4 = Dense(), Scaled(), Mxfp4()


def unpermute_rows(w, perm):
    """W from the act-order rows W[perm] ([..., in, out], perm [..., in]; NumPy or jnp)."""
    xp = np if isinstance(w, np.ndarray) else jnp
    inv = xp.argsort(perm, axis=-1)
    return xp.take_along_axis(w, inv[..., None], axis=-2)


def formats(owner) -> dict:
    """{name: format} of the weights `owner` records (`weight_formats`; {} where it records none)."""
    return dict(getattr(owner, "weight_formats", ()))


def format_of(owner, name) -> Format:
    """The format `owner` recorded for its weight `name` (`set_format`)."""
    fmt = formats(owner).get(name)
    if fmt is None:
        raise ValueError(f"{type(owner).__name__} records no format for weight {name!r} (recorded: "
                       f"{sorted(formats(owner))}); set the weight through models.gpt's set_* functions")
    return fmt


def set_format(owner, name, fmt: Format):
    """Records `fmt` as the format of weight `name` of `owner` (in place of any recorded before)."""
    if not isinstance(fmt, Format):
        raise ValueError(f"fmt must be a models.linear format (Dense, Scaled, Packed); got {type(fmt).__name__}")
    recorded = formats(owner)
    recorded[name] = fmt
    owner.weight_formats = tuple(recorded.items())


def tp_matmul(matmul, x2, layer, name: str, parts: dict, mesh, stacked: bool = True):
    """matmul(x2 [M, K], layer, *parts.values()) -> f32[M, N] for a stacked quantized layer weight `name` whose
    arrays are parts {suffix: array} (a format's `kernel_parts`), or (stacked False, layer None) a model's
    head ("output": column-parallel on the vocabulary): on one device (mesh None) the call itself;
    under a tensor-parallel mesh one `jax.shard_map` in which every device runs it on its own shard, the arrays
    split as models.sharding's RULES place them (no resharding of a weight): a column-parallel weight (wq, wk,
    wv, w_gate, w_up) takes x whole and gives the device's output columns (f32[M, N] split on N); a row-parallel
    one (wo, w_down) takes x's columns matching its K rows (x arrives split so: the heads, the MLP's hidden
    units) and the partial products are summed by ONE psum of f32[M, N] over "tp", the all-reduce the GSPMD path
    makes after those matmuls. check_vma is off: a Pallas call has no varying-axes rule."""
    if mesh is None:
        return matmul(x2, layer, *parts.values())
    P = jax.sharding.PartitionSpec
    row = RULES[name] == RULES["wo"]  # split on `in` (K)

    def local(x, *rest):  # one device: x [M, K / tp] (row) or [M, K]; (the layer,) its shard of every array
        y = matmul(x, *rest) if layer is not None else matmul(x, None, *rest)
        return jax.lax.psum(y, TP) if row else y

    # stacked: the layer axis first, never split
    specs = tuple(P(None, *RULES[name + sx]) if stacked else RULES[name + sx] for sx in parts)
    lead = (layer,) if layer is not None else ()
    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(None, TP) if row else P(), *(P() for _ in lead), *specs),
                       out_specs=P() if row else P(None, TP), check_vma=False)
    return fn(x2, *lead, *parts.values())
