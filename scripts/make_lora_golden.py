"""Write tests/data/hf/llama_lora/: tiny random PEFT LoRA adapters over tests/data/hf/llama and what
transformers + peft compute with them.

Each adapter is made by the `peft` library itself (`get_peft_model` over the tiny Llama, its lora_A and
lora_B drawn at random: peft starts lora_B at zero, which would make every adapter the base model) and
saved with `save_pretrained` (adapter_config.json + adapter_model.safetensors). The set covers several
ranks, target sets and rsLoRA:

  qv_r4      r 4,  q_proj v_proj,                        alpha 8
  all_r8_rs  r 8,  all seven (q k v o gate up down),     alpha 16, use_rslora (scale alpha / sqrt(r))
  mlp_r2     r 2,  gate_proj up_proj down_proj,          alpha 4
  ko_r6      r 6,  k_proj o_proj,                        alpha 3

golden.json holds, for each adapter and for the base ("base"), the greedy continuation (GREEDY tokens)
of each prompt with each token's log-probability (log_softmax of transformers' float32 step logits).
jpa never depends on torch / transformers / peft: run this offline from a separate environment:

    HF_HUB_OFFLINE=1 /work/hfenv/bin/python scripts/make_lora_golden.py
"""

import json
import os
import pathlib
import shutil
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "data" / "hf"
BASE = ROOT / "llama"
OUT = ROOT / "llama_lora"
GREEDY = 8
PROMPTS = {"plain": "The capital of France is", "code": "def add(a, b):", "story": "Once upon a time, there"}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "qv_r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all_r8_rs": dict(r=8, lora_alpha=16, target_modules=ALL, use_rslora=True),
    "mlp_r2": dict(r=2, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "ko_r6": dict(r=6, lora_alpha=3, target_modules=["k_proj", "o_proj"]),
}


def base_model():
    model = transformers.AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def greedy(model, ids):
    """(GREEDY greedy tokens, their log-probabilities) of prompt ids."""
    with torch.no_grad():
        gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=GREEDY, do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    new = gen.sequences[0, len(ids):].tolist()
    lsm = torch.log_softmax(torch.stack(gen.logits)[:, 0].float(), dim=-1)  # [steps, vocab]
    top2 = torch.topk(lsm, 2, dim=-1).values
    return new, [float(lsm[i, t]) for i, t in enumerate(new)], float((top2[:, 0] - top2[:, 1]).min())


def main():
    tok = transformers.AutoTokenizer.from_pretrained(BASE)
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    prompts = {k: tok(t)["input_ids"] for k, t in PROMPTS.items()}
    data = {"prompts": {k: {"text": PROMPTS[k], "ids": ids} for k, ids in prompts.items()}, "adapters": {},
            "greedy": {}, "versions": {"transformers": transformers.__version__, "peft": peft.__version__,
                                       "torch": torch.__version__, "python": sys.version.split()[0]}}
    base = base_model()
    data["greedy"]["base"] = {k: dict(zip(("ids", "logprobs", "min_gap"), greedy(base, ids)))
                              for k, ids in prompts.items()}
    for i, (name, cfg) in enumerate(ADAPTERS.items()):
        torch.manual_seed(1000 + i)
        model = peft.get_peft_model(base_model(), peft.LoraConfig(lora_dropout=0.0, bias="none", **cfg))
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_A" in pname or "lora_B" in pname:
                    p.copy_(torch.randn_like(p) * (0.3 if "lora_A" in pname else 0.25))
        model.eval()
        model.save_pretrained(OUT / name)
        (OUT / name / "README.md").unlink(missing_ok=True)   # peft's model card template
        cfg_file = OUT / name / "adapter_config.json"    # the base named relative to the repository, not this machine
        cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()),
                                        "base_model_name_or_path": "tests/data/hf/llama"}, indent=2) + "\n")
        data["adapters"][name] = {**cfg}
        data["greedy"][name] = {k: dict(zip(("ids", "logprobs", "min_gap"), greedy(model, ids)))
                                for k, ids in prompts.items()}
        same = sum(data["greedy"][name][k]["ids"] == data["greedy"]["base"][k]["ids"] for k in prompts)
        size = sum(f.stat().st_size for f in (OUT / name).iterdir())
        print(f"{name}: {size} bytes; prompts whose greedy tokens equal the base's: {same} of {len(prompts)}; "
              f"min top-2 gap {min(v['min_gap'] for v in data['greedy'][name].values()):.4f}")
    (OUT / "golden.json").write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
