"""Write tests/data/smollm2_golden.json: what Hugging Face transformers computes on SmolLM2-135M-Instruct.

The golden file pins jpa's tokenizer, GGUF reader and model to an independent implementation. It is
committed; this script is only rerun when the prompts change. It needs torch + transformers, which
jpa does not depend on, so run it from a separate virtualenv (not in CI):

    /root/.pyenv/versions/3.11.7/bin/python -m venv /tmp/golden-venv     # any Python >= 3.10
    /tmp/golden-venv/bin/pip install torch==2.13.0 transformers gguf tokenizers sentencepiece
    /work/main/.venv/bin/python -c "import jpa.models.smollm2 as s; print(s.fetch_gguf())"  # the .gguf path
    HF_HUB_OFFLINE=1 /tmp/golden-venv/bin/python scripts/make_golden.py --gguf <that path>

(Pin torch to a CPU build: a plain `pip install torch` pulls a multi-GB CUDA build.) Everything is
read from the local GGUF file; nothing is fetched from the Hugging Face hub (HF_HUB_OFFLINE=1).

Per prompt the file holds: token ids; the last-token logits' top-20 ids and values; the logits at
a fixed set of ids (`probe_ids`); the argmax at every position. For the chat prompts it also holds
the chat-template string; for every prompt, a greedy continuation of GREEDY_TOKENS tokens (repeated
under "greedy" for "The capital of France is").
"""

import argparse
import json
import os
import pathlib
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

PLAIN_PROMPTS = {
    "capital": "The capital of France is",
    "unicode_code": (
        "Café naïve — 日本語 🐱🚀 costs $1,234.56 (≈ 12%) in 2024!\n\n"
        "def add(a, b):\n    return a + b  # sum\n\tTabs\tand  double  spaces  \n"
    ),
    "story": "Once upon a time, there was a little robot who",
}
CHAT_PROMPTS = {
    # (user message, system message or None for the template's default system prompt)
    "chat": ("What is the capital of France?", None),
    "chat_system": ("Name three colors.", "You are a terse assistant."),
}
GREEDY_PROMPT, GREEDY_TOKENS = "capital", 10
TOP_K = 20
NUM_PROBES = 50


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", required=True, type=pathlib.Path, help="path to SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--out", type=pathlib.Path,
                        default=pathlib.Path(__file__).resolve().parent.parent / "tests/data/smollm2_golden.json")
    args = parser.parse_args()
    folder, name = str(args.gguf.parent), args.gguf.name

    torch.manual_seed(0)
    torch.set_num_threads(1)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    vocab = model.config.vocab_size

    # Probe ids: the specials plus a fixed pseudo-random spread over the vocabulary.
    rng = np.random.default_rng(0)
    probe_ids = sorted({0, 1, 2, *rng.choice(np.arange(3, vocab), NUM_PROBES - 3, replace=False).tolist()})

    prompts = {}
    for key, text in PLAIN_PROMPTS.items():
        prompts[key] = {"text": text, "chat": False}
    for key, (user, system) in CHAT_PROMPTS.items():
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": user}]
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts[key] = {"text": rendered, "chat": True, "user": user, "system": system}

    for key, entry in prompts.items():
        ids = tok(entry["text"], add_special_tokens=True)["input_ids"]
        entry["ids"] = ids
        entry["decoded"] = tok.decode(ids, skip_special_tokens=False)
        entry["decoded_skip_special"] = tok.decode(ids, skip_special_tokens=True)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float().numpy()  # [T, vocab]
        last = logits[-1]
        top = np.argsort(-last)[:TOP_K]
        entry["top_ids"] = top.tolist()
        entry["top_logits"] = [round(float(v), 4) for v in last[top]]
        entry["probe_logits"] = [round(float(v), 4) for v in last[probe_ids]]
        entry["argmax_per_position"] = logits.argmax(-1).tolist()
        entry["logit_std"] = round(float(last.std()), 4)

    for entry in prompts.values():  # greedy continuations, not stopping at eos
        ids = torch.tensor([entry["ids"]])
        # The attention mask must be explicit: pad_token_id is <|im_end|> (2), so without one
        # generate() infers `ids != pad` and masks every <|im_end|> of a chat prompt as padding.
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY_TOKENS,
                                 do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=tok.pad_token_id)
        entry["greedy_ids"] = out[0, len(entry["ids"]):].tolist()
        entry["greedy_text"] = tok.decode(entry["greedy_ids"])
    new = prompts[GREEDY_PROMPT]["greedy_ids"]
    golden = {
        "about": "Produced by scripts/make_golden.py with Hugging Face transformers from the GGUF file alone "
                 "(no hub). Logits are float32, rounded to 4 decimals; last-token logits unless named otherwise.",
        "gguf": {"file": name, "bytes": args.gguf.stat().st_size},
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "python": sys.version.split()[0]},
        "tokenizer": {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                      "pad_token_id": tok.pad_token_id, "add_bos_token": bool(getattr(tok, "add_bos_token", False)),
                      "vocab_size": len(tok)},
        "probe_ids": probe_ids,
        "prompts": prompts,
        "greedy": {"prompt": GREEDY_PROMPT, "max_new_tokens": GREEDY_TOKENS, "ids": new, "text": tok.decode(new)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes); greedy: {golden['greedy']['text']!r}")


if __name__ == "__main__":
    main()
