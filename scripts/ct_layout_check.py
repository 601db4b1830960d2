#!/usr/bin/env python3
"""Cross-checks jpa's reading of compressed-tensors checkpoints against the compressed-tensors library
itself (issue 35). jpa does not depend on it: `make` runs in a throwaway virtualenv that has it (and
torch), `check` in jpa's.

    python -m venv /tmp/ctenv && /tmp/ctenv/bin/pip install torch==2.13.0 compressed-tensors
    /tmp/ctenv/bin/python scripts/ct_layout_check.py make /tmp/ct_layout.safetensors
    .venv/bin/python scripts/ct_layout_check.py check /tmp/ct_layout.safetensors

`make` lets compressed-tensors quantize and compress random [48, 128] weights (pack-quantized int4
group 32 symmetric and asymmetric; float-quantized FP8 per channel and per tensor, bf16 scales) and
decompress them again, and writes the compressed tensors with its decompressed weights. `check`
dequantizes the compressed tensors with jpa (jpa.core.quant.pack_quantized_int4 + dequantize_blocks;
models.hf's FP8 layout) and compares them with compressed-tensors' weights, rounded to bf16 as its
decompression returns them. Run 2026-11-25 with compressed-tensors 0.20.0: every weight equal.
"""

import sys

from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)


def make(path):
    import torch
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import save_file

    torch.manual_seed(0)
    out = {}
    for tag in ("int4-sym", "int4-asym", "fp8-channel", "fp8-tensor"):
        w = torch.randn(48, 128)
        if tag.startswith("int4"):
            sym = tag == "int4-sym"
            args = QuantizationArgs(num_bits=4, type="int", symmetric=sym, strategy="group", group_size=32)
            g = w.reshape(48, 4, 32)
            if sym:
                scale, zp = (g.abs().amax(-1) / 7).to(torch.bfloat16), torch.zeros(48, 4, dtype=torch.int8)
            else:
                lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
                scale = ((hi - lo) / 15).to(torch.bfloat16)
                zp = (-8 - torch.round(lo / scale.float())).clamp(-8, 7).to(torch.int8)
            sd, comp = {"weight": w, "weight_scale": scale, "weight_zero_point": zp}, PackedQuantizationCompressor
        else:
            strategy = tag.split("-")[1]
            args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy)
            s = w.abs().amax(1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
            sd, comp = {"weight": w, "weight_scale": (s / 448).to(torch.bfloat16)}, FloatQuantizationCompressor
        scheme = QuantizationScheme(targets=["Linear"], weights=args)
        c = comp.compress(sd, scheme)
        out.update({f"{tag}.{k}": v.contiguous() for k, v in c.items()})
        out[f"{tag}.reference"] = comp.decompress(dict(c), scheme)["weight"].float().contiguous()
    save_file(out, path)


def check(path):
    import ml_dtypes
    import numpy as np

    from jpa.core.quant import dequantize_blocks, pack_quantized_int4
    from jpa.models.hf import QuantTensor, _read_quant, _read_raw

    t = lambda name: _read_raw(path, name)
    bad = 0
    for tag in ("int4-sym", "int4-asym", "fp8-channel", "fp8-tensor"):
        ref = t(f"{tag}.reference")
        if tag.startswith("int4"):
            zp = t(f"{tag}.weight_zero_point") if tag == "int4-asym" else None
            blocks = pack_quantized_int4(t(f"{tag}.weight_packed"), t(f"{tag}.weight_scale"), zp, name=tag)
            w = dequantize_blocks(*blocks, axis=-2, dtype=ml_dtypes.bfloat16).T  # jpa's [in, out] -> [out, in]
        else:  # models.hf's reader: q [in, out] and an f32 scale per output channel
            entry = QuantTensor(("scaled", {r: (path, f"{tag}.{r}") for r in ("weight", "weight_scale")}, 128, 48))
            _, q, scale = _read_quant(entry, None)
            w = (q.astype(np.float32) * scale).T.astype(ml_dtypes.bfloat16)
        n = int((w.astype(np.float32) != ref).sum())
        bad += n
        print(f"{tag}: {n} of {ref.size} weights differ from compressed-tensors' decompression")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("make", "check"):
        sys.exit(__doc__)
    sys.exit(make(sys.argv[2]) if sys.argv[1] == "make" else check(sys.argv[2]))
