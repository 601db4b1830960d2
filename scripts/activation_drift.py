"""What bfloat16 matmul outputs (the GPU's `models.gpt.matmul_out_dtype`) change in a model's logprobs.

Runs `models.gpt.forward_dense` over prompts twice on this CPU, the model's weights in bfloat16:
with float32 matmul results (the CPU program) and with the GPU's formulation forced (the layers'
matmuls write bfloat16; the head, norms, RoPE, softmax and residual stream float32), and prints
the drift of the log-probabilities (log_softmax of the logits over the whole vocabulary) and of
the greedy tokens.

    python scripts/activation_drift.py                       # SmolLM2-135M-Instruct (bf16), 4 prompts
    python scripts/activation_drift.py --model tiny-llama    # a random tiny Llama
    python scripts/activation_drift.py --reference           # for scale: bf16 against f32 weights
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


def logprobs(model, token_lists, bf16_outputs: bool) -> np.ndarray:
    """log_softmax of forward_dense's logits at every position of token_lists, with the GPU's bf16
    matmul outputs forced (bf16_outputs) or the CPU's float32 ones."""
    orig = gpt.matmul_out_dtype
    if bf16_outputs:
        gpt.matmul_out_dtype = lambda d: jnp.bfloat16 if jnp.dtype(d) == jnp.bfloat16 else jnp.float32
    try:
        return np.concatenate([np.asarray(jax.nn.log_softmax(
            gpt.forward_dense(model, jnp.asarray([t], jnp.int32))[0], -1)) for t in token_lists])
    finally:
        gpt.matmul_out_dtype = orig


def drift(model, token_lists, reference=None) -> dict:
    """Log-probability drift between float32 and bfloat16 matmul results over token_lists; with
    reference (the same model with float32 weights), between it and the model (float32 outputs)."""
    if reference is None:
        a, b = logprobs(model, token_lists, False), logprobs(model, token_lists, True)
    else:
        a, b = logprobs(reference, token_lists, False), logprobs(model, token_lists, False)
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
    p.add_argument("--reference", action="store_true",
                   help="instead: the drift of bf16 weights against float32 weights (float32 outputs both), "
                        "for scale")
    args = p.parse_args(argv)
    kw = dict(quantization="none") if args.model == "smollm2-135m" else {}
    model, tok = models.load(args.model, dtype=jnp.bfloat16, **kw)
    if args.model == "smollm2-135m":
        token_lists = [tok.encode(s) for s in PROMPTS]
    else:
        token_lists = [list(np.random.default_rng(i).integers(0, model.config.vocab_size, 24)) for i in range(4)]
    reference = models.load(args.model, dtype=jnp.float32, **kw)[0] if args.reference else None
    d = drift(model, token_lists, reference)
    what = "f32 - bf16 weights" if args.reference else "f32 - bf16 matmul outputs"
    print(f"{args.model} (bf16 weights), {d['positions']} positions: |logprob {what}| "
          f"at the top token max {d['max_abs_top']:.2e} mean {d['mean_abs_top']:.2e}; over tokens with logprob > -20 "
          f"max {d['max_abs_live']:.2e} mean {d['mean_abs_live']:.2e}; greedy tokens equal at "
          f"{d['greedy_agree']:.1%} of positions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
