"""Write tests/data/hf/: tiny random Hugging Face checkpoints and what transformers computes on them.

One directory per family (llama, mistral, qwen2, qwen3, gemma2, mixtral, qwen3_moe, gpt_oss, gpt_oss_mxfp4,
qwen3_5, qwen3_next, qwen3_5_moe, deepseek_v3, deepseek_v3_noqlora, deepseek_v2; tests/test_deepseek.py reads the
last three),
each a complete checkpoint in the Hugging Face layout saved by transformers itself (config.json,
*.safetensors, tokenizer.json, tokenizer_config.json, chat template, generation_config.json; the
MXFP4 one converted here from gpt_oss's), plus golden.json (prompts, token
ids, greedy continuations, chat template renderings) and golden.npz (float32 prefill logits).
tests/test_hf_models.py loads the checkpoints with models.load and compares. The data is committed;
rerun this only when it must change. It needs torch + transformers, which jpa does not depend on,
so run it from a separate virtualenv (not in CI), offline:

    /root/.pyenv/versions/3.11.7/bin/python -m venv /tmp/hfenv        # any Python >= 3.10
    /tmp/hfenv/bin/pip install torch==2.13.0 transformers safetensors tokenizers jinja2
    HF_HUB_OFFLINE=1 /tmp/hfenv/bin/python scripts/make_hf_golden.py

(torch==2.13.0 resolves to a CPU build here; a plain `pip install torch` may pull a CUDA one.)

The tokenizer is a byte-level BPE trained here with `tokenizers` on a small built-in corpus (vocab
~300 plus each family's special tokens), so the checkpoints stay small. Every parameter is drawn at
random (norms and biases too, so a wrong offset or a dropped bias shows), with scales that give
well-separated logits. The configs switch on what each family's loader must get right:
  llama:   Llama-3 rope_scaling (all three frequency bands hit), untied head, sharded with an index.
  mistral: sliding window (every layer) smaller than the prompts, tied head.
  qwen2:   q/k/v biases, tied head, vocab padded past the tokenizer, chat template inside
           tokenizer_config.json (the older layout).
  qwen3:   q/k RMSNorm, head_dim != hidden/heads, bf16 weights.
  gpt_oss: 8 experts, top-4 (softmax over the chosen), router and expert biases, gate/up interleaved in
           gate_up_proj, a small swiglu_limit (1.2, so the clamps bite) and non-default swiglu_alpha,
           q/k/v/o biases, attention sinks, sliding window 6 on layer 0 and full attention on layer 1,
           YaRN RoPE (all three bands: extrapolated, ramp, interpolated; attention factor 1.21),
           head_dim != hidden/heads, untied head, bf16 weights; a harmony-style chat template.
  gpt_oss_mxfp4: the same checkpoint with its experts quantized to MXFP4 here (quantize_mxfp4:
           `*_blocks` / `*_scales` and quantization_config, openai/gpt-oss-20b's layout); its golden
           data is what transformers computes from the MXFP4 checkpoint (dequantized on the CPU).
  mixtral: 8 experts, top-2 (softmax over the chosen), untied head, sharded with an index (experts
           of one layer across files); Mistral's chat template.
  qwen3_moe: 16 experts, top-4 without norm_topk_prob (the weights are the plain softmax
           probabilities), q/k RMSNorm, head_dim != hidden/heads, tied head; Qwen3's template.
           The router weights get a larger scale so that tokens spread over the experts.
  deepseek_v3: MLA (q LoRA rank 48 with its norm, kv LoRA rank 32, an 8-wide interleaved-RoPE key, nope 16,
           v 12), YaRN with mscale 0.707 / mscale_all_dim 1.0 (the softmax scale and cos/sin both scaled), a dense
           first layer then MoE layers of 8 experts in 4 groups (top-2 groups, top-2 experts, sigmoid scores with
           a random e_score_correction_bias, norm_topk_prob, routed_scaling_factor 2.5) and a shared expert, bf16
           weights; golden.npz also holds the greedy steps' logits. deepseek_v3_noqlora: the same with
           q_lora_rank None (q_proj), default RoPE, 2 groups (top-1), no norm_topk_prob, 2 layers.
  deepseek_v2: DeepSeek-V2 (V2-Lite's q_proj form): softmax router, group_limited_greedy over 4 groups (top 2),
           routed_scaling_factor 1.5, YaRN with mscale = mscale_all_dim = 0.707, 2 layers.
  gemma2:  embedding scale, GeGLU, (1 + w) norms, post-norms, query_pre_attn_scalar != head_dim,
           small attention/final soft caps (so they bend the logits), sliding window 8 on even layers.
  qwen3_5: Qwen3.5 text (qwen3_5_text, Qwen3_5ForCausalLM): 8 layers, 3 Gated DeltaNet to 1 gated full
           attention, linear key dim != value dim, 4 value heads on 2 key heads, partial RoPE (25%), mrope
           sections (text positions: plain RoPE), tied head; a "long" prompt of more than two 64-token chunks.
  qwen3_next: Qwen3-Next: grouped in_proj_qkvz / in_proj_ba, 8 experts top-2 (norm_topk_prob) with a
           sigmoid-gated shared expert, layer 1 a dense MLP (mlp_only_layers), untied head; the "long" prompt.
  qwen3_5_moe: Qwen3.5-MoE text (qwen3_5_moe_text): Qwen3.5's projections, every layer 8 experts top-2 plus the
           gated shared expert; the "long" prompt.
The chat templates are written here in each family's format (Llama-3 headers, ChatML with a default
system prompt, Qwen3's think blocks with a namespace, Gemma's turns with raise_exception).
--out can point the big variant (--big) elsewhere: a few-hundred-MB float32 llama checkpoint for
measuring the loader's memory (no golden data).
"""

import argparse
import json
import os
import pathlib
import shutil
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

CORPUS = [
    "A paged KV cache keeps keys and values in fixed-size pages; each sequence owns a block table.",
    "Decode attention reads a sequence's pages through its table with an online softmax.",
    "The capital of France is Paris. The capital of Italy is Rome. Rivers run to the sea.",
    "Once upon a time, there was a little robot who wanted to learn how to paint the sky.",
    "def add(a, b):\n    return a + b  # the sum of two numbers\n",
    "What is 12 times 12? It is 144. Name three colors: red, green and blue.",
    "Write a haiku about the sea: waves fold into foam, the tide keeps its own slow time.",
    "You are a helpful assistant. Answer briefly and clearly, in plain words.",
    "Café naïve — 日本語 costs $1,234.56 in 2024! Tabs\tand  double  spaces.",
]
VOCAB = 320

FAMILIES = {
    "llama": dict(
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>"],
        bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None, gen_eos=["<|end_of_text|>", "<|eot_id|>"],
        add_bos=True,
        template=(
            "{{- bos_token }}\n"
            "{%- if messages[0]['role'] == 'system' %}\n"
            "    {%- set system_message = messages[0]['content'] | trim %}\n"
            "    {%- set messages = messages[1:] %}\n"
            "{%- else %}\n"
            "    {%- set system_message = '' %}\n"
            "{%- endif %}\n"
            "{%- if system_message %}\n"
            "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message + '<|eot_id|>' }}\n"
            "{%- endif %}\n"
            "{%- for message in messages %}\n"
            "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
            " + '<|eot_id|>' }}\n"
            "{%- endfor %}\n"
            "{%- if add_generation_prompt %}\n"
            "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
            "{%- endif %}\n"),
        config=dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    rms_norm_eps=1e-5, tie_word_embeddings=False,
                    rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                                         high_freq_factor=4.0, original_max_position_embeddings=64)),
        dtype=torch.float32, shard="100KB"),
    "mistral": dict(
        specials=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
        bos="<s>", eos="</s>", pad=None, unk="<unk>", gen_eos=["</s>"], add_bos=True,
        template=(
            "{%- if messages[0]['role'] == 'system' %}\n"
            "    {%- set system_message = messages[0]['content'] %}\n"
            "    {%- set loop_messages = messages[1:] %}\n"
            "{%- else %}\n"
            "    {%- set loop_messages = messages %}\n"
            "{%- endif %}\n"
            "{{- bos_token }}\n"
            "{%- for message in loop_messages %}\n"
            "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
            "        {{- raise_exception('After the optional system message, conversation roles must alternate "
            "user/assistant/user/assistant...') }}\n"
            "    {%- endif %}\n"
            "    {%- if message['role'] == 'user' %}\n"
            "        {%- if loop.last and system_message is defined %}\n"
            "            {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}\n"
            "        {%- else %}\n"
            "            {{- '[INST] ' + message['content'] + '[/INST]' }}\n"
            "        {%- endif %}\n"
            "    {%- else %}\n"
            "        {{- ' ' + message['content'] + eos_token }}\n"
            "    {%- endif %}\n"
            "{%- endfor %}\n"),
        config=dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                    rms_norm_eps=1e-5, tie_word_embeddings=True, sliding_window=6, rope_theta=10000.0),
        dtype=torch.float32, shard=None),
    "qwen2": dict(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos=None, eos="<|im_end|>", pad="<|endoftext|>", gen_eos=["<|im_end|>", "<|endoftext|>"], add_bos=False,
        template=(
            "{%- for message in messages %}\n"
            "    {%- if loop.first and messages[0]['role'] != 'system' %}\n"
            "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
            "    {%- endif %}\n"
            "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
            "{%- endfor %}\n"
            "{%- if add_generation_prompt %}\n"
            "    {{- '<|im_start|>assistant\\n' }}\n"
            "{%- endif %}\n"),
        config=dict(model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1000000.0, use_sliding_window=False),
        vocab_pad=16, dtype=torch.float32, shard=None, template_in_config=True),
    "qwen3": dict(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
        bos=None, eos="<|im_end|>", pad="<|endoftext|>", gen_eos=["<|im_end|>", "<|endoftext|>"], add_bos=False,
        template=(
            "{%- set ns = namespace(last_user=-1) %}\n"
            "{%- for message in messages %}\n"
            "    {%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}\n"
            "{%- endfor %}\n"
            "{%- for message in messages %}\n"
            "    {%- set content = message.content if message.content is string else '' %}\n"
            "    {%- if message.role == 'assistant' %}\n"
            "        {%- if '</think>' in content %}\n"
            "            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
            "        {%- endif %}\n"
            "        {{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}\n"
            "    {%- else %}\n"
            "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}\n"
            "    {%- endif %}\n"
            "{%- endfor %}\n"
            "{%- if add_generation_prompt %}\n"
            "    {{- '<|im_start|>assistant\\n' }}\n"
            "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
            "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
            "    {%- endif %}\n"
            "{%- endif %}\n"),
        config=dict(model_type="qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1000000.0, use_sliding_window=False),
        dtype=torch.bfloat16, shard=None),
    "gemma2": dict(
        specials=["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
        bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>", gen_eos=["<eos>", "<end_of_turn>"], add_bos=True,
        template=(
            "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
            "{{ raise_exception('System role not supported') }}{% endif %}"
            "{% for message in messages %}"
            "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
            "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
            "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
            "{% else %}{% set role = message['role'] %}{% endif %}"
            "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
            "{% endfor %}"
            "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"),
        config=dict(model_type="gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                    rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=10000.0, query_pre_attn_scalar=24,
                    attn_logit_softcapping=2.0, final_logit_softcapping=5.0, sliding_window=8,
                    hidden_activation="gelu_pytorch_tanh"),
        dtype=torch.float32, shard=None),
    "mixtral": dict(
        specials=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
        bos="<s>", eos="</s>", pad=None, unk="<unk>", gen_eos=["</s>"], add_bos=True,
        template=None,  # the mistral template (filled in below)
        config=dict(model_type="mixtral", hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None, rope_theta=1000000.0,
                    num_local_experts=8, num_experts_per_tok=2),
        dtype=torch.float32, shard="150KB"),
    "qwen3_moe": dict(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
        bos=None, eos="<|im_end|>", pad="<|endoftext|>", gen_eos=["<|im_end|>", "<|endoftext|>"], add_bos=False,
        template=None,  # the qwen3 template (filled in below)
        config=dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
                    rope_theta=1000000.0, use_sliding_window=False, num_experts=16, num_experts_per_tok=4,
                    norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[]),
        dtype=torch.float32, shard=None),
}
FAMILIES["gpt_oss"] = dict(
    specials=["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|message|>", "<|end|>", "<|return|>",
              "<|channel|>", "<|call|>"],
    bos="<|startoftext|>", eos="<|return|>", pad="<|endoftext|>", gen_eos=["<|return|>", "<|endoftext|>", "<|call|>"],
    add_bos=False,
    template=(  # the harmony turn format, without channels or tools
        "{%- if messages[0]['role'] != 'system' %}\n"
        "    {{- '<|start|>system<|message|>You are a helpful assistant.<|end|>' }}\n"
        "{%- endif %}\n"
        "{%- for message in messages %}\n"
        "    {%- if message['role'] == 'assistant' %}\n"
        "        {{- '<|start|>assistant<|channel|>final<|message|>' + message['content'] + '<|end|>' }}\n"
        "    {%- else %}\n"
        "        {{- '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}\n"
        "    {%- endif %}\n"
        "{%- endfor %}\n"
        "{%- if add_generation_prompt %}\n"
        "    {{- '<|start|>assistant' }}\n"
        "{%- endif %}\n"),
    config=dict(model_type="gpt_oss", hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=6,
                layer_types=["sliding_attention", "full_attention"], attention_bias=True,
                num_local_experts=8, num_experts_per_tok=4, swiglu_alpha=1.5, swiglu_limit=1.2,
                rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, beta_fast=4.0, beta_slow=1.0,
                                     truncate=False, original_max_position_embeddings=64)),
    dtype=torch.bfloat16, shard=None)
# The hybrids (Gated DeltaNet + gated full attention): a prompt longer than two 64-token GDN chunks (and many
# pages), for the families whose recurrent state must carry across chunk boundaries.
HYBRID = dict(
    specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
    bos=None, eos="<|im_end|>", pad="<|endoftext|>", gen_eos=["<|im_end|>", "<|endoftext|>"], add_bos=False,
    template=None, dtype=torch.float32, shard=None, long_prompt=True,
    # The golden data is computed in float64: on these random weights float32 itself is off by up to 4e-3 in
    # logprob at some positions (with rms_norm_eps 1e-6; 7e-4 with 1e-4), too close to the 2e-3 the tests hold.
    oracle_dtype=torch.float64)
FAMILIES["qwen3_5"] = dict(  # Qwen3_5ForCausalLM (qwen3_5_text): separate in_proj_qkv / z / b / a, dense MLP
    HYBRID, config=dict(model_type="qwen3_5_text", hidden_size=32, intermediate_size=48, num_hidden_layers=8,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                        rms_norm_eps=1e-4, tie_word_embeddings=True, linear_conv_kernel_dim=4,
                        linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=2,
                        linear_num_value_heads=4,
                        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                             mrope_section=[2, 1, 1], mrope_interleaved=True)))
FAMILIES["qwen3_next"] = dict(  # grouped in_proj_qkvz / in_proj_ba, sparse MoE + gated shared expert, a dense layer
    HYBRID, config=dict(model_type="qwen3_next", hidden_size=32, intermediate_size=40, num_hidden_layers=4,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                        rms_norm_eps=1e-4, tie_word_embeddings=False, linear_conv_kernel_dim=4,
                        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                        linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                        shared_expert_intermediate_size=24, norm_topk_prob=True, decoder_sparse_step=1,
                        mlp_only_layers=[1],
                        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)))
FAMILIES["qwen3_5_moe"] = dict(  # Qwen3_5MoeForCausalLM: Qwen3.5's GDN projections, every layer MoE + shared expert
    HYBRID, config=dict(model_type="qwen3_5_moe_text", hidden_size=32, num_hidden_layers=4,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                        rms_norm_eps=1e-4, tie_word_embeddings=False, linear_conv_kernel_dim=4,
                        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                        linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                        shared_expert_intermediate_size=24,
                        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)))
FAMILIES["mixtral"]["template"] = FAMILIES["mistral"]["template"]
FAMILIES["qwen3_moe"]["template"] = FAMILIES["qwen3"]["template"]
for _f in ("qwen3_5", "qwen3_next", "qwen3_5_moe"):
    FAMILIES[_f]["template"] = FAMILIES["qwen3"]["template"]

PLAIN_PROMPTS = {
    "paged": "A paged KV cache keeps keys and values in pages; decode attention reads them",
    "robot": "Once upon a time, there was a little robot who",
}
CHAT_PROMPT = ("What is the capital of France?", "You are a helpful assistant. Answer briefly.")
CONVERSATIONS = {
    "user": [{"role": "user", "content": "Name three colors."}],
    "system_user": [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "What is 12 times 12?"}],
    "multi_turn": [{"role": "system", "content": "You are terse."},
                   {"role": "user", "content": "  Hi there!  "},
                   {"role": "assistant", "content": "<think>\nplan\n</think>\n\nHello."},
                   {"role": "user", "content": "Write a haiku about the sea."}],
    "no_system_multi_turn": [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
                             {"role": "user", "content": "Bye."}],
    "bad_order": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
}
TOKENIZE_TEXTS = ["The capital of France is", "Café naïve — 日本語 🐱 costs $1,234.56!\n\tTabs  x",
                  "<|im_start|>user\nhi<|im_end|>"]
GREEDY_TOKENS = 32


def train_tokenizer(specials, bos, add_bos) -> Tokenizer:
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(CORPUS * 4, trainer=trainer)
    if add_bos:
        bos_id = tk.token_to_id(bos)
        tk.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                          special_tokens=[(bos, bos_id)])
    else:
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
    return tk


# Seeds of the random weights: the first seven families' as before gpt_oss joined (sorted order), then the
# families added later, in the order they joined (so adding one never changes another's weights).
LATER = ["gpt_oss", "qwen3_5", "qwen3_next", "qwen3_5_moe"]
SEEDS = {f: i + 1 for i, f in enumerate(sorted(set(FAMILIES) - set(LATER)) + LATER)}

# DeepSeek-V3 (MLA, models.deepseek), added after the seeds above so that theirs stay as they were.
FAMILIES["deepseek_v3"] = dict(
    specials=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
    bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", pad=None, gen_eos=["<｜end▁of▁sentence｜>"],
    add_bos=True,
    template=(
        "{{- bos_token }}\n"
        "{%- for message in messages %}\n"
        "    {%- if message['role'] == 'system' %}{{- message['content'] }}\n"
        "    {%- elif message['role'] == 'user' %}{{- '<｜User｜>' + message['content'] }}\n"
        "    {%- else %}{{- '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}{%- endif %}\n"
        "{%- endfor %}\n"
        "{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}\n"),
    config=dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
                num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
                max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=4.0, beta_slow=1.0,
                                     mscale=0.707, mscale_all_dim=1.0, original_max_position_embeddings=64)),
    dtype=torch.bfloat16, shard=None)
SEEDS["deepseek_v3"] = 100
# The same model with q_lora_rank None (q_proj, DeepSeek-V2-Lite's form), plain interleaved RoPE, no norm_topk_prob.
FAMILIES["deepseek_v3_noqlora"] = dict(FAMILIES["deepseek_v3"], config=dict(
    FAMILIES["deepseek_v3"]["config"], q_lora_rank=None, norm_topk_prob=False, n_group=2, topk_group=1,
    num_hidden_layers=2,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0)))
SEEDS["deepseek_v3_noqlora"] = 101
# DeepSeek-V2 (V2-Lite's form: q_proj): softmax router, group_limited_greedy, YaRN with mscale_all_dim.
FAMILIES["deepseek_v2"] = dict(FAMILIES["deepseek_v3"], config=dict(
    {k: v for k, v in FAMILIES["deepseek_v3"]["config"].items() if k not in ("rope_interleave", "norm_topk_prob")},
    model_type="deepseek_v2", q_lora_rank=None, num_hidden_layers=2, topk_method="group_limited_greedy",
    routed_scaling_factor=1.5, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                     original_max_position_embeddings=64, mscale=0.707,
                                                     mscale_all_dim=0.707)))
SEEDS["deepseek_v2"] = 102


def randomize(model, family):
    """Every parameter random: weights ~ N(0, gain / fan_in), norms around their identity, biases."""
    g = torch.Generator().manual_seed(SEEDS[family])
    gemma = family == "gemma2"
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                val = 0.3 * r + (0.0 if gemma else 1.0)
            elif name.endswith("bias"):
                val = 0.5 * r
            elif "embed_tokens" in name:
                val = (0.15 if gemma else 1.0 if not model.config.tie_word_embeddings else 0.3) * r
            elif name.endswith(("gate.weight", "router.weight")) and "experts" not in name:  # MoE router
                val = 3.0 * r / p.shape[-1] ** 0.5
            elif name.endswith("sinks"):  # gpt-oss: logits of the size of the attention logits
                val = 1.0 + 1.5 * r
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # gpt-oss: stored [E, in, out]
                val = r / p.shape[-1 if family.startswith("deepseek") else -2] ** 0.5  # deepseek: [E, out, in]
            else:
                gain = 2.5 if ("q_proj" in name or "k_proj" in name or "lm_head" in name) else 1.0
                val = gain * r / p.shape[-1] ** 0.5
            p.copy_(val.to(p.dtype))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's router bias (a buffer): spread, to bite
                b.copy_(0.3 * torch.randn(b.shape, generator=g, dtype=torch.float32))


def build(family, spec, out: pathlib.Path, hidden=None, layers=None, ffn=None, vocab=None):
    tk = train_tokenizer(spec["specials"], spec["bos"], spec["add_bos"])
    kw = {k: spec[k] for k in ("bos", "eos", "pad", "unk") if spec.get(k)}
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, **{f"{k}_token": v for k, v in kw.items()})
    tok.chat_template = spec["template"]
    cfg = dict(spec["config"])
    vocab_size = tk.get_vocab_size() + spec.get("vocab_pad", 0) if vocab is None else vocab
    ids = lambda t: tk.token_to_id(t)
    cfg.update(vocab_size=vocab_size, eos_token_id=ids(spec["gen_eos"][0]),
               bos_token_id=ids(spec["bos"]) if spec["bos"] else None,
               pad_token_id=ids(spec["pad"]) if spec["pad"] else None)
    if hidden:
        cfg.update(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=ffn,
                   num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128)
    config = transformers.AutoConfig.for_model(**cfg)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          dtype=torch.float32)
    randomize(model, family)
    model = model.to(spec["dtype"])
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=cfg["bos_token_id"], eos_token_id=[ids(t) for t in spec["gen_eos"]],
        pad_token_id=cfg["pad_token_id"])
    if out.exists():
        shutil.rmtree(out)
    shard = spec["shard"] if hidden is None else None
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    tok.save_pretrained(out)
    # transformers picks a tokenizer class from config.json's model_type, and some classes rebuild the
    # pipeline (Qwen2Tokenizer: NFC and Qwen's split regex). Store what transformers runs, as the
    # real checkpoints' tokenizer.json files do.
    used = transformers.AutoTokenizer.from_pretrained(out).backend_tokenizer
    used.save(str(out / "tokenizer.json"))
    if spec.get("template_in_config"):  # the older layout: template inside tokenizer_config.json
        tc = json.loads((out / "tokenizer_config.json").read_text())
        tc["chat_template"] = spec["template"]
        (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")
        (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


def quantize_mxfp4(w):
    """MXFP4 of w f32[E, out, in] as transformers' checkpoints hold it: (blocks u8[E, out, in / 32, 16],
    scales u8[E, out, in / 32]). Each block of 32 values gets the power of two 2^e that brings its
    largest magnitude within FP4's 6 (scale byte e + 127); each value the nearest e2m1 code."""
    from transformers.integrations.mxfp4 import FP4_VALUES

    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    e_, o_, i_ = w.shape
    blk = w.reshape(e_, o_, i_ // 32, 32)
    amax = blk.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -100)
    e = torch.ceil(torch.log2(amax / 6.0))
    idx = (blk / torch.exp2(e))[..., None].sub(lut).abs().argmin(-1).to(torch.uint8)  # [E, O, I/32, 32]
    blocks = idx[..., 0::2] | (idx[..., 1::2] << 4)
    return blocks.contiguous(), (e[..., 0] + 127).to(torch.uint8).contiguous()


def mxfp4_variant(src: pathlib.Path, out: pathlib.Path):
    """gpt_oss_mxfp4: the gpt_oss checkpoint with its experts' weights in MXFP4 (`*_blocks` / `*_scales`,
    quantization_config {"quant_method": "mxfp4"}), the layout of openai/gpt-oss-20b and -120b."""
    from safetensors.torch import load_file, save_file

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "golden.json", "golden.npz", "config.json"):
            shutil.copy(f, out / f.name)
    sd = load_file(src / "model.safetensors")
    for key in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = sd.pop(key).float().transpose(1, 2)  # [E, in, out] -> [E, out, in]
        sd[key + "_blocks"], sd[key + "_scales"] = quantize_mxfp4(w)
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def yarn_reference(out: pathlib.Path):
    """yarn.json: transformers' YaRN inverse frequencies and attention factor for a few rope_parameters
    (truncate on and off, DeepSeek-style mscale / mscale_all_dim, another factor and beta_fast)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cases = []
    for extra in ({"truncate": True}, {"truncate": False}, {"mscale": 0.707, "mscale_all_dim": 1.0},
                  {"factor": 4.0, "beta_fast": 32.0, "truncate": False}):
        params = {**dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, beta_fast=4.0, beta_slow=1.0,
                         original_max_position_embeddings=64), **extra}
        cfg = dict(model_type="gpt_oss", hidden_size=64, num_attention_heads=4, head_dim=32,
                   max_position_embeddings=1024, rope_parameters=params)
        inv, factor = ROPE_INIT_FUNCTIONS["yarn"](transformers.GptOssConfig(**cfg), "cpu")
        cases.append({"config": cfg, "inv_freq": inv.tolist(), "attention_factor": float(factor)})
    (out / "yarn.json").write_text(json.dumps(cases, indent=1) + "\n")


def golden(family, spec, out: pathlib.Path):
    tok = transformers.AutoTokenizer.from_pretrained(out)
    # MXFP4 on a CPU: transformers' dequantizing loader (Mxfp4Config(dequantize=True), which needs no accelerate).
    quant = {"quantization_config": transformers.Mxfp4Config(dequantize=True)} if family.endswith("mxfp4") else {}
    oracle = spec.get("oracle_dtype", torch.float32)
    if oracle == torch.float64:  # torch's grouped_mm has no float64: the experts' eager loop
        quant["experts_implementation"] = "eager"
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=oracle, attn_implementation="eager",
                                                              **quant)
    model.eval()
    assert tok.chat_template == spec["template"], "the template did not survive save/load"
    stored = json.loads((out / "tokenizer.json").read_text())
    assert json.loads(tok.backend_tokenizer.to_str()) == stored, "transformers does not run tokenizer.json"
    data, arrays = {"family": family, "prompts": {}, "chats": {}, "tokenize": {}}, {}
    user, system = CHAT_PROMPT
    prompts = dict(PLAIN_PROMPTS)
    if spec.get("long_prompt"):
        prompts["long"] = " ".join(CORPUS[:3])
    msgs = ([] if family == "gemma2" else [{"role": "system", "content": system}]) + [{"role": "user", "content": user}]
    prompts["chat"] = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    for key, text in prompts.items():
        chat = key == "chat"
        ids = (tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
               if chat else tok(text)["input_ids"])
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float().numpy()  # [T, vocab]
            gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=GREEDY_TOKENS, do_sample=False, num_beams=1, eos_token_id=None,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        new = gen.sequences[0, len(ids):].tolist()
        step_logits = torch.stack(gen.logits)[:, 0].float().numpy()  # [steps, vocab]
        top2 = np.sort(step_logits, axis=-1)[:, -2:]
        data["prompts"][key] = {"text": text, "chat": chat, "ids": ids, "greedy_ids": new,
                                "greedy_text": tok.decode(new), "min_greedy_gap": float((top2[:, 1] - top2[:, 0]).min())}
        if chat:
            data["prompts"][key].update(user=user, system=None if family == "gemma2" else system)
        arrays[f"{key}_logits"] = logits
        if family.startswith("deepseek"):  # the greedy steps' logits too (per-token logprobs of the continuation)
            arrays[f"{key}_step_logits"] = step_logits
    for key, conv in CONVERSATIONS.items():
        for gen_prompt in (True, False):
            name = f"{key}/{'gen' if gen_prompt else 'nogen'}"
            try:
                text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen_prompt)
                ids = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen_prompt, return_dict=False)
                data["chats"][name] = {"messages": conv, "add_generation_prompt": gen_prompt, "text": text, "ids": ids}
            except Exception as e:  # the template's raise_exception
                data["chats"][name] = {"messages": conv, "add_generation_prompt": gen_prompt,
                                       "error": f"{type(e).__name__}: {e}"}
    for text in TOKENIZE_TEXTS:
        ids = tok(text)["input_ids"]
        data["tokenize"][text] = {"ids": ids, "decoded": tok.decode(ids),
                                  "decoded_skip_special": tok.decode(ids, skip_special_tokens=True)}
    data["special"] = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                       "generation_eos": model.generation_config.eos_token_id, "vocab": len(tok)}
    data["versions"] = {"transformers": transformers.__version__, "torch": torch.__version__,
                        "python": sys.version.split()[0]}
    (out / "golden.json").write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    np.savez_compressed(out / "golden.npz", **arrays)
    gaps = {k: round(v["min_greedy_gap"], 4) for k, v in data["prompts"].items()}
    print(f"{family}: {sum(f.stat().st_size for f in out.iterdir())} bytes; min greedy top-2 gaps {gaps}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path,
                    default=pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "hf")
    ap.add_argument("--families", nargs="*", default=sorted(FAMILIES))
    ap.add_argument("--big", type=int, default=0, metavar="MB",
                    help="instead: one float32 llama checkpoint of about MB megabytes in --out (no golden data)")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if args.big:
        hidden, ffn = 1024, 2816
        per_layer = 4 * (3 * hidden * hidden + 3 * hidden * ffn)  # bytes: q, o + k, v (GQA 2) + 3 MLP
        layers = max(1, round((args.big * 2 ** 20 - 2 * 4 * 8192 * hidden) / per_layer))
        out = build("llama", {**FAMILIES["llama"], "shard": None}, args.out, hidden=hidden, layers=layers,
                    ffn=ffn, vocab=8192)
        size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        print(f"wrote {out}: {layers} layers, {size} bytes of safetensors")
        return
    for family in args.families:
        out = build(family, FAMILIES[family], args.out / family)
        golden(family, FAMILIES[family], out)
        if family == "gpt_oss":  # transformers dequantizes MXFP4 on a CPU (exact: FP4 values times 2^k)
            golden("gpt_oss_mxfp4", FAMILIES[family], mxfp4_variant(out, args.out / "gpt_oss_mxfp4"))
            yarn_reference(out)


if __name__ == "__main__":
    main()
