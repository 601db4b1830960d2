"""What bfloat16 matmul outputs (the GPU's `models.gpt.matmul_out_dtype`) change in a model's logprobs.

Runs `models.gpt.forward_dense` over prompts twice on this CPU, the model's weights in bfloat16:
with float32 matmul results (the CPU program) and with the GPU's formulation forced (the layers'
matmuls write bfloat16; the head, norms, RoPE, softmax and residual stream float32), and prints
the drift of the log-probabilities (log_softmax of the logits over the whole vocabulary) and of
the greedy tokens.

    python scripts/activation_drift.py                       # SmolLM2-135M-Instruct (bf16), 4 prompts
    python scripts/activation_drift.py --model tiny-llama    # a random tiny Llama
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jpa import models  # noqa: E402
from jpa.models import gpt  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,",
           "The three laws of thermodynamics state that"]


def drift(model, token_lists) -> dict:
    """Log-probability drift between float32 and bfloat16 matmul results over token_lists."""
    out = {}
    for name, dtype in (("f32", None), ("bf16", jnp.bfloat16)):
        orig = gpt.matmul_out_dtype
        if dtype is not None:
            gpt.matmul_out_dtype = lambda d: jnp.bfloat16 if jnp.dtype(d) == jnp.bfloat16 else jnp.float32
        try:
            out[name] = [np.asarray(jax.nn.log_softmax(gpt.forward_dense(model, jnp.asarray([t], jnp.int32))[0], -1))
                         for t in token_lists]
        finally:
            gpt.matmul_out_dtype = orig
    a, b = np.concatenate(out["f32"]), np.concatenate(out["bf16"])
    top = a.argmax(-1)
    rows = np.arange(len(top))
    live = a > -20   # the tokens with a probability worth reporting (> 2e-9)
    return dict(positions=len(top), max_abs_top=float(np.abs(a[rows, top] - b[rows, top]).max()),
                mean_abs_top=float(np.abs(a[rows, top] - b[rows, top]).mean()),
                max_abs_live=float(np.abs(a - b)[live].max()), mean_abs_live=float(np.abs(a - b)[live].mean()),
                greedy_agree=float((a.argmax(-1) == b.argmax(-1)).mean()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="a preset of jpa.models (default smollm2-135m)")
    args = p.parse_args(argv)
    if args.model == "smollm2-135m":
        model, tok = models.load(args.model, dtype=jnp.bfloat16, quantization="none")
        token_lists = [tok.encode(s) for s in PROMPTS]
    else:
        model, tok = models.load(args.model, dtype=jnp.bfloat16)
        token_lists = [list(np.random.default_rng(i).integers(0, model.config.vocab_size, 24)) for i in range(4)]
    d = drift(model, token_lists)
    print(f"{args.model} (bf16 weights), {d['positions']} positions: |logprob f32 - bf16 matmul outputs| "
          f"at the top token max {d['max_abs_top']:.2e} mean {d['mean_abs_top']:.2e}; over tokens with logprob > -20 "
          f"max {d['max_abs_live']:.2e} mean {d['mean_abs_live']:.2e}; greedy tokens equal at "
          f"{d['greedy_agree']:.1%} of positions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
