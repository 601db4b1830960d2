"""The committed tiny PEFT adapters over the tiny Hugging Face Llama (tests/data/hf/llama_lora, made by
scripts/make_lora_golden.py) as the engine's LoRA tests use them: their golden outputs (transformers + peft),
one LoRARequest each and greedy sampling of the golden length."""

import json
import pathlib

from jpa import LoRARequest, SamplingParams

DATA = pathlib.Path(__file__).parent / "data" / "hf"
ADAPTERS = DATA / "llama_lora"
GOLDEN = json.loads((ADAPTERS / "golden.json").read_text())
NAMES = sorted(GOLDEN["adapters"])
LORAS = {name: LoRARequest(name, i + 1, str(ADAPTERS / name)) for i, name in enumerate(NAMES)}
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
