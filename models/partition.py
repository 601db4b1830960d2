"""Tensor parallelism's placement of every parameter kind: `RULES` maps a parameter's name to its PartitionSpec
over the "tp" mesh axis (`models.sharding` explains the layout and applies it; `models.gpt` and `models.linear`
read it to run a quantized matmul on each device's shard). A leaf module: it imports nothing of the models
layer, so every module of it may read the table."""

from jax.sharding import PartitionSpec as P

from jpa.core.sharding import TP

COL = P(None, TP)  # [in, out] split on out
ROW = P(TP, None)  # [in, out] split on in
VEC = P(TP)        # a bias of a column-parallel matmul
REP = P()

RULES = {
    # attention: column-parallel q/k/v (heads), row-parallel output
    "wq": COL, "wk": COL, "wv": COL, "bq": VEC, "bk": VEC, "bv": VEC,
    "wo": ROW, "bo": REP,
    # MLP: column-parallel gate/up, row-parallel down
    "w_gate": COL, "w_up": COL, "b_up": VEC, "w_down": ROW, "b_down": REP,
    # embeddings: vocabulary-parallel ([vocab, d_model] and [d_model, vocab])
    "tok_embeddings": P(TP, None), "output": P(None, TP),
    # norms: replicated
    "attn_norm": REP, "attn_norm_bias": REP, "ffn_norm": REP, "ffn_norm_bias": REP,
    "norm": REP, "norm_bias": REP, "pos_embeddings": REP,
    # Qwen3's per-head q/k RMSNorm scales ([head_dim], the same for every head) and Gemma-2's
    # post-attention / post-MLP norms: replicated
    "q_norm": REP, "k_norm": REP, "post_attn_norm": REP, "post_ffn_norm": REP,
    # mixture of experts: the router replicated (the experts' rules depend on the layout: expert_rules)
    "router": REP, "router_bias": REP,
    # gpt-oss's attention sinks, one per q head: split with the q heads
    "sinks": VEC,
    # quantized weights' per-output-channel scales (models.gpt.QUANT_AXIS) go with their weights'
    # output axis: split for column-parallel weights, replicated for row-parallel ones (their
    # output, d_model, is whole on every device), split on the vocabulary with the embeddings
    "wq_scale": VEC, "wk_scale": VEC, "wv_scale": VEC, "wo_scale": REP,
    "w_gate_scale": VEC, "w_up_scale": VEC, "w_down_scale": REP,
    "tok_embeddings_scale": VEC, "output_scale": VEC,
}
# GGUF blocks kept packed (models.gpt.PackedWeight): the codes keep their weight's name and rule; the
# block scales / minimums ([in / 32, out], or [vocab, d_model / 32]) have the weight's rank and
# orientation, so they take its rule too (a row-parallel split of `in` keeps whole blocks when
# in / 32 divides by N; check_divisible says when not).
for _w in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "tok_embeddings", "output"):
    for _s in ("_bscale", "_bmin", "_bscale2", "_bmin2"):  # K-quants: super-block scales lie the same way
        RULES[_w + _s] = RULES[_w]
    RULES[_w + "_perm"] = REP  # an act-order GPTQ weight's input permutation: every device gathers its x
# embeddings="replicated" (and a vocabulary that does not divide by N).
REPLICATED_EMBEDDINGS = {name: REP for name in RULES if name.startswith(("tok_embeddings", "output"))}
