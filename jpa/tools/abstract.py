"""Abstract quantized models for deviceless compiles: each weight format as jpa keeps a checkpoint of it on the
device, with nothing allocated (`abstract_model`). Read by `jpa.tools.traffic` and `jpa.tools.engine_checks`."""

# Abstract quantized models (no weights read): each format as jpa keeps a checkpoint of it on the
# device (jpa.core.quant, models.gpt.PackedWeight). format -> (group size, {array: (dtype, axis
# divisor of `in`)}) for the packed forms: codes u8 [in / 2, out], block scales d (and minimums m;
# K-quants: integer sub-block scales and minimums with f16 super-block ones, d2 / m2).
PACKED_FORMS = {
    "Q4_0": {"codes": ("uint8", 2), "d": ("float16", 32)},
    "Q4_1": {"codes": ("uint8", 2), "d": ("float16", 32), "m": ("float16", 32)},
    "Q4_K": {"codes": ("uint8", 2), "d": ("uint8", 32), "m": ("uint8", 32), "d2": ("float16", 256),
             "m2": ("float16", 256)},
    # AutoAWQ GEMM g128 (zero points: m = -z * s in f32) and GPTQ symmetric g128 (the Q4_0 form).
    "awq": {"codes": ("uint8", 2), "d": ("float16", 128), "m": ("float32", 128)},
    "gptq": {"codes": ("uint8", 2), "d": ("float16", 128)},
    # 8-bit codes with group scales along `in` (jpa.core.quant's Q8_0 form): GGUF Q8_0 (f16 scale per 32),
    # Q5_K (codes 0..31 in int8, uint8 sub-block scales / minimums per 32, f16 super-block ones per 256),
    # Q6_K (codes -32..31 in int8, int8 sub-block scales per 16, f16 super-block scales per 256) and
    # block-wise FP8 (e4m3 codes, the 128 x 128 blocks' f32 scale per 128 inputs of each output channel).
    "Q8_0": {"codes": ("int8", 1), "d": ("float16", 32)},
    "Q5_K": {"codes": ("int8", 1), "d": ("uint8", 32), "m": ("uint8", 32), "d2": ("float16", 256),
             "m2": ("float16", 256)},
    "Q6_K": {"codes": ("int8", 1), "d": ("int8", 16), "d2": ("float16", 256)},
    "fp8-block": {"codes": ("float8_e4m3fn", 1), "d": ("float32", 128)},
}
# The untied head's form where a checkpoint of that format quantizes it (GGUF files do: Q8_0 files in
# Q8_0, the K-quant files in Q6_K); the other formats keep a bfloat16 head.
HEAD_FORMS = {"Q8_0": "Q8_0", "Q5_K": "Q6_K", "Q6_K": "Q6_K"}
ABSTRACT_FORMATS = ("int8", "fp8", *PACKED_FORMS)


def abstract_model(config, quantization: str, embeddings_columns: bool | None = None):
    """An abstract (nnx.eval_shape) bfloat16 models.GPT of `config` whose layer linears are stored
    in `quantization`: "int8" / "fp8" (per output channel, embeddings and head too: what
    `--quantization` makes), or a packed 4-bit form of PACKED_FORMS (the layers only: GGUF
    Q4_0 / Q4_1 / Q4_K / Q8_0 / Q5_K / Q6_K, AWQ g128, GPTQ g128, block-wise FP8 128 x 128; embeddings
    stay bfloat16, and the head too except where HEAD_FORMS quantizes it as those files do). For
    deviceless compiles: nothing is allocated. A tied config's table is the head: int8 / fp8 as above, in
    the HEAD_FORMS form where the format has one (as SmolLM2's GGUF keeps its tied Q8_0 table), else
    bfloat16. embeddings_columns: keep a quantized tied table [d_model, vocab] (`models.gpt.
    set_embeddings_layout`: what the engine keeps on a GPU the Mosaic matmul serves); None: so for a
    tied quantized table. "FORMAT:HEAD" (e.g. "Q4_1:Q8_0", SmolLM2's GGUF: Q4_1 layers, a Q8_0 tied table)
    stores the layers in FORMAT and the head (or tied table) in HEAD, a packed form."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jpa.models import GPT
    from jpa.models.linear import QUANT_AXIS, Packed, format_of, formats, set_format

    quantization, _, head_form = quantization.partition(":")
    if quantization not in ABSTRACT_FORMATS or head_form and (head_form not in PACKED_FORMS
                                                              or quantization not in PACKED_FORMS):
        raise ValueError(f"quantization must be one of {list(ABSTRACT_FORMATS)}, or a packed one and a packed "
                         f"head form as 'Q4_1:Q8_0'; got {quantization + (':' + head_form if head_form else '')!r}")
    head_form = head_form or HEAD_FORMS.get(quantization)
    from jpa.models.gpt import set_embeddings_layout

    def layout(model):
        tied = config.tie_embeddings and bool(format_of(model, "tok_embeddings").kernel_parts)  # quantized
        return set_embeddings_layout(model, tied if embeddings_columns is None else embeddings_columns and tied)

    if quantization in ("int8", "fp8"):
        return layout(nnx.eval_shape(lambda: GPT(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0),
                                                 quantization=quantization)))
    model = nnx.eval_shape(lambda: GPT(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    form = PACKED_FORMS[quantization]
    suffix = {"codes": "", "d": "_bscale", "m": "_bmin", "d2": "_bscale2", "m2": "_bmin2"}
    for name in [n for n in formats(model.layers) if n in QUANT_AXIS]:  # the layers' linears, [layers, in, out]
        L, k, n = getattr(model.layers, name).get_value().shape  # [layers, in, out]
        for part, (dtype, div) in form.items():
            setattr(model.layers, name + suffix[part], nnx.Param(jax.ShapeDtypeStruct((L, k // div, n), dtype)))
        set_format(model.layers, name, Packed(tuple(suffix[part] for part in form)))
    if head_form and "output" in formats(model):
        k, n = model.output.get_value().shape  # [d_model, vocab]
        for part, (dtype, div) in PACKED_FORMS[head_form].items():
            setattr(model, "output" + suffix[part], nnx.Param(jax.ShapeDtypeStruct((k // div, n), dtype)))
        set_format(model, "output", Packed(tuple(suffix[part] for part in PACKED_FORMS[head_form])))
    if head_form and config.tie_embeddings:  # [vocab, d_model] rows, blocks along d_model
        n, k = model.tok_embeddings.get_value().shape
        for part, (dtype, div) in PACKED_FORMS[head_form].items():
            setattr(model, "tok_embeddings" + suffix[part], nnx.Param(jax.ShapeDtypeStruct((n, k // div), dtype)))
        set_format(model, "tok_embeddings", Packed(tuple(suffix[part] for part in PACKED_FORMS[head_form])))
    model.quantization = "gguf" if quantization.startswith("Q") else quantization
    return layout(model)
