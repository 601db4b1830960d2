"""LoRA adapters under tensor parallelism on 2 simulated CPU devices, reported as JSON (run by
tests/test_lora_tp.py). JAX fixes its device count when it starts, so this runs in its own process:

    python tests/lora_tp_check.py OUT.json

(the script sets XLA_FLAGS=--xla_force_host_platform_device_count=2 and JAX_PLATFORMS=cpu itself). The tiny
Hugging Face Llama (tests/data/hf/llama) in float32 with the committed PEFT adapters (tests/data/hf/llama_lora)
is served by LLM(enable_lora=True) at tensor_parallel=1 and at tensor_parallel=2 (with --tp4: 4 devices, and
tensor_parallel=4 too, where the kv heads are replicated). One batch mixes every adapter and the base; reported: each request's greedy
tokens and logprobs at each size, the slots' partition specs, and (tp > 1) the backend compiles and step traces
while a new adapter is loaded, run beside another and unloaded (after a warm-up of the same shapes).
"""

import os
import sys

DEVICES = 4 if "--tp4" in sys.argv else 2
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={DEVICES}").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402

from jpa import LLM, LoRARequest  # noqa: E402
from lora_data import ADAPTERS, DATA, GOLDEN, GREEDY, LORAS, NAMES  # noqa: E402
COMPILES = [0]


def _on(event, _secs, **_):
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on)


def run(tp: int) -> dict:
    # two device slots for four adapters: the mixed batch swaps adapters in and out (LRU)
    llm = LLM(str(DATA / "llama"), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, max_seqs=8,
              max_num_batched_tokens=64, num_pages=96, page_size=8, steps_per_call=4, tensor_parallel=tp)
    prompts = [p["ids"] for p in GOLDEN["prompts"].values()]
    batch, who = [], []
    for name in [None] + NAMES:
        for ids in prompts:
            batch.append(ids)
            who.append(None if name is None else LORAS[name])
    outs = llm.generate(batch, GREEDY, lora_request=who)
    rec = {"tp": tp, "tokens": [list(map(int, o.token_ids)) for o in outs],
           "logprobs": [list(map(float, o.logprobs)) for o in outs],
           "specs": {n: {k: [None if e is None else str(e) for e in x.sharding.spec]
                         if isinstance(x.sharding, jax.sharding.NamedSharding) else None for k, x in ab.items()}
                     for n, ab in llm.engine.runner.lora.items()}}
    if tp > 1:
        with tempfile.TemporaryDirectory() as tmp:
            fresh = pathlib.Path(tmp) / "fresh"
            shutil.copytree(ADAPTERS / "all_r8_rs", fresh)
            # warm: the shapes the counted calls run (one prompt beside another adapter's)
            llm.generate([prompts[0], prompts[1]], GREEDY, lora_request=[LORAS["ko_r6"], LORAS["qv_r4"]])
            runner = llm.engine.runner
            before = (runner.step_traces, COMPILES[0])
            req = LoRARequest("fresh", 50, str(fresh))
            llm.engine.load_lora(req)
            again = llm.generate([prompts[0], prompts[1]], GREEDY, lora_request=[req, LORAS["qv_r4"]])
            llm.engine.unload_lora("fresh")
            rec["load_unload"] = {"traces": runner.step_traces - before[0], "compiles": COMPILES[0] - before[1],
                                  "fresh_tokens": list(map(int, again[0].token_ids)),
                                  "names_after": llm.engine.lora_names()}
    return rec


def main():
    out = pathlib.Path(sys.argv[1])
    sizes = (1, 2, 4) if DEVICES == 4 else (1, 2)
    out.write_text(json.dumps({"names": NAMES, "runs": [run(tp) for tp in sizes]}))


if __name__ == "__main__":
    main()
