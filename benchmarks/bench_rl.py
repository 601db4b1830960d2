"""What the RL rollout features cost (issue 53), printed as JSON lines:

  update   `LLM.update_weights` on SmolLM2-135M (float32, dense): ms and peak RSS over the served weights, for
           the model's own pytree (NumPy leaves) and for Hugging Face names (transposed, cast, stacked).
  invariant  the throughput of `batch_invariant=True` against the default on one workload (tokens/s).
  model    bytes an update moves for Llama-3-8B's shapes (bfloat16 served) on an H100, by where the new
           weights come from: arithmetic over the parameter shapes (`models.gpt.expected_shapes`), with the
           H100's HBM bandwidth (3.35 TB/s) and a PCIe Gen5 x16 host link taken as 50 GB/s. Modelled, not measured.

    python benchmarks/bench_rl.py [--skip-update] [--model tiny-llama]
"""

import argparse
import json
import threading
import time

from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jpa import LLM, SamplingParams  # noqa: E402


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class PeakRSS:
    """The largest RSS seen while the block runs (sampled every millisecond)."""

    def __enter__(self):
        self.peak, self._stop = rss(), False
        self._t = threading.Thread(target=self._watch, daemon=True)
        self._t.start()
        return self

    def _watch(self):
        while not self._stop:
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop = True
        self._t.join()


def hf_tensors(llm) -> dict:
    """The served weights under their Hugging Face names (NumPy, torch's [out, in] layout)."""
    from jpa.models import hf

    model = llm.engine.model
    params = jax.tree.map(np.asarray, model.params)
    out = {}
    for ours, (name, transpose, *_) in hf.hf_names(model.config, "llama").items():
        if ours.startswith("layers."):
            _, i, p = ours.split(".")
            a = params["layers"][p][...][int(i)]
        else:
            a = params[ours][...]
        out[name] = np.ascontiguousarray(a.T if transpose else a)
    return out


def bench_update(model: str, reps: int = 3) -> None:
    llm = LLM(model, quantization="none", max_seqs=4, num_pages=64)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    weights = sum(a.nbytes for a in jax.tree.leaves(llm.engine.model.params))
    tree = jax.tree.map(lambda a: np.array(a), llm.engine.model.params)
    names = hf_tensors(llm)
    for kind, w in (("pytree", tree), ("hf_names", names)):
        times, peaks = [], []
        for _ in range(reps):
            base = rss()
            with PeakRSS() as p:
                t = time.perf_counter()
                llm.update_weights(w)
                times.append(time.perf_counter() - t)
            peaks.append(p.peak - base)
        print(json.dumps({"bench": "update", "model": model, "kind": kind, "weight_bytes": weights,
                          "ms": [round(x * 1e3, 1) for x in times],
                          "peak_rss_over_before_bytes": max(peaks),
                          "step_compiles": llm.engine.summary()["step_compiles"]}), flush=True)


def bench_invariant(model: str, requests: int = 32, max_tokens: int = 32) -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, int(rng.integers(8, 64))).tolist() for _ in range(requests)]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for inv in (False, True):
        llm = LLM(model, max_seqs=16, num_pages=512, page_size=16, max_num_batched_tokens=128, batch_invariant=inv)
        llm.generate(prompts[:2], sp)   # compile
        t = time.perf_counter()
        outs = llm.generate(prompts, sp)
        dt = time.perf_counter() - t
        toks = sum(len(o.token_ids) for o in outs)
        print(json.dumps({"bench": "batch_invariant", "model": model, "batch_invariant": inv, "requests": requests,
                          "tokens": toks, "seconds": round(dt, 2), "tok_s": round(toks / dt, 1),
                          "device_calls": llm.engine.stats.decode_calls}), flush=True)


LLAMA3_8B = dict(family="llama", vocab_size=128256, d_model=4096, num_layers=32, num_q_heads=32, num_kv_heads=8,
                 head_dim=128, ffn_dim=14336, max_seq_len=8192, rope_base=500000.0, tie_embeddings=False)


def model_llama8b() -> None:
    from jpa.models import ModelConfig
    from jpa.models.gpt import expected_shapes

    shapes = expected_shapes(ModelConfig(**LLAMA3_8B))
    layers = shapes.pop("layers")
    n = sum(int(np.prod(s)) for s in shapes.values()) + LLAMA3_8B["num_layers"] * sum(
        int(np.prod(s)) for s in layers.values())
    hbm, pcie = 3.35e12, 50e9
    for source, moved, bw in (("trainer's bf16 arrays, same device and sharding (used in place)", 0, hbm),
                              ("trainer's f32 arrays on the device (one cast: read 4 B, write 2 B)", 6 * n, hbm),
                              ("host arrays or a safetensors file (bf16 over PCIe)", 2 * n, pcie)):
        print(json.dumps({"bench": "update_model", "model": "llama-3-8b shapes", "params": n, "served_bytes": 2 * n,
                          "source": source, "bytes_moved": moved, "ms_at_bandwidth": round(moved / bw * 1e3, 1)}),
              flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--update-model", default="smollm2-135m")
    ap.add_argument("--model", default="tiny-llama", help="the batch-invariant throughput's model")
    ap.add_argument("--skip-update", action="store_true")
    ap.add_argument("--skip-invariant", action="store_true")
    args = ap.parse_args()
    model_llama8b()
    if not args.skip_invariant:
        bench_invariant(args.model)
    if not args.skip_update:
        bench_update(args.update_model)


if __name__ == "__main__":
    main()
