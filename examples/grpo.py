"""GRPO with jpa as the rollout engine, in one process: a Flax NNX policy trained with optax.

    python examples/grpo.py --steps 30            # tiny-llama (random init, byte tokenizer), CPU: minutes

The task is verifiable: a prompt is a few random letters; the reward of a completion is the fraction
of its bytes that are decimal digits. Each step:

  1. rollouts: `--groups` prompts x `--n` samples each from jpa (`LLM.generate`, SamplingParams(n=...)),
  2. group-relative advantages: each sample's reward minus its group's mean, over the group's std,
  3. a policy-gradient step through the model's own forward (`jpa.models.forward_dense`: the loss is
     -advantage x the completion's log-likelihood), with optax (Adam),
  4. `llm.update_weights(params)`: the new weights are served from the next round on, no compile.

Shapes are fixed (prompt and completion lengths, ignore_eos), so the training step compiles once and the
engine's step once (`summary()["step_compiles"]` stays 1). Prints one line per step (mean reward) and, with
--out, writes the curve as JSON.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jpa import LLM, SamplingParams, models

DIGITS = np.arange(ord("0"), ord("9") + 1)


def reward(token_ids) -> float:
    """The verifiable reward: the fraction of the completion's bytes that are digits."""
    return float(np.isin(np.asarray(token_ids), DIGITS).mean())


def make_train_step(graphdef, optimizer, prompt_len: int):
    """(params, opt_state, tokens i32[R, L], advantages f32[R]) -> (params, opt_state, loss), jitted once."""

    def loss_fn(params, tokens, adv):
        logits = models.forward_dense(nnx.merge(graphdef, params), tokens[:, :-1])   # [R, L - 1, vocab]
        logp = jax.nn.log_softmax(logits, axis=-1)
        token_lp = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]   # [R, L - 1]
        completion = token_lp[:, prompt_len - 1:]                                     # the sampled tokens
        return -jnp.mean(adv * completion.sum(axis=-1)) / completion.shape[1]

    @jax.jit
    def step(params, opt_state, tokens, adv):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, adv)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama", help="a preset (tiny-llama) or a Hugging Face checkpoint dir")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--groups", type=int, default=8, help="prompts per step")
    ap.add_argument("--n", type=int, default=8, help="rollouts per prompt (the group)")
    ap.add_argument("--prompt-len", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-invariant", action="store_true", help="rollouts in jpa's batch-invariant mode")
    ap.add_argument("--out", help="write the reward curve here (JSON)")
    ap.add_argument("--plot", help="draw the reward curve here (PNG; needs matplotlib, the bench extra)")
    args = ap.parse_args(argv)

    gpt, tok = models.load(args.model, seed=args.seed, quantization="none" if args.model != "tiny-llama" else None)
    graphdef, params = nnx.split(gpt)
    llm = LLM.from_model(gpt, tok, max_seqs=args.groups * args.n, num_pages=args.groups * args.n * 2 + 8,
                         page_size=8, max_num_batched_tokens=max(64, args.groups * args.n),
                         batch_invariant=args.batch_invariant)
    optimizer = optax.adam(args.lr)
    opt_state = optimizer.init(params)
    train = make_train_step(graphdef, optimizer, args.prompt_len)
    rng = np.random.default_rng(args.seed)
    curve = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        prompts = [rng.integers(ord("a"), ord("z") + 1, args.prompt_len).tolist() for _ in range(args.groups)]
        sp = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True,
                            seed=int(rng.integers(1 << 30)))
        t_roll = time.perf_counter()
        outs = llm.generate(prompts, sp)                                     # 1. rollouts
        t_roll = time.perf_counter() - t_roll
        tokens, rewards = [], []
        for p, out in zip(prompts, outs):
            for sample in out.outputs:
                tokens.append(p + list(sample.token_ids))
                rewards.append(reward(sample.token_ids))
        r = np.asarray(rewards, np.float32).reshape(args.groups, args.n)
        adv = (r - r.mean(axis=1, keepdims=True)) / (r.std(axis=1, keepdims=True) + 1e-4)  # 2. group-relative
        params, opt_state, loss = train(params, opt_state, jnp.asarray(tokens, jnp.int32),  # 3. policy gradient
                                        jnp.asarray(adv.reshape(-1)))
        version = llm.update_weights(params)                                 # 4. served from the next round
        curve.append({"step": step, "reward": float(r.mean()), "loss": float(loss), "version": version,
                      "rollout_s": t_roll, "elapsed_s": time.perf_counter() - t0})
        print(f"step {step:3d}  reward {r.mean():.3f}  loss {float(loss):+.4f}  rollout {t_roll:.2f} s  "
              f"elapsed {time.perf_counter() - t0:.1f} s", flush=True)
    summary = llm.engine.summary()
    print(f"engine step compiles: {summary['step_compiles']}; train step compiles: {train._cache_size()}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "curve": curve, "step_compiles": summary["step_compiles"]}, f, indent=1)
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot([c["elapsed_s"] for c in curve], [c["reward"] for c in curve], marker=".")
        ax.set_xlabel("seconds (compiles included)")
        ax.set_ylabel("mean reward")
        ax.set_title(f"examples/grpo.py: {args.model}, {args.groups} x {args.n} rollouts a step, CPU")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
    return curve


if __name__ == "__main__":
    main()
