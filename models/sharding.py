"""Tensor parallelism for models.GPT: Megatron-style partition specs, declared once per parameter kind.

On a mesh with a "tp" axis of N devices (`jpa.core.sharding.tp_mesh(N)`):

- column-parallel (output features split): wq, wk, wv (heads), w_gate, w_up (ffn), and their
  biases; each device computes its own heads / its slice of the MLP hidden layer;
- row-parallel (input features split): wo (heads), w_down (ffn); each device's partial product
  is summed by ONE all-reduce per matmul (GSPMD inserts it), so a layer has two all-reduces of
  [tokens, d_model] float32 and nothing else;
- vocabulary-parallel: the token embeddings and the output head are split on the vocabulary
  (see EMBEDDINGS below);
- replicated: norms, the biases added after a row-parallel sum (bo, b_down), position
  embeddings.

The rules table `RULES` maps a parameter's name to its PartitionSpec. A parameter without a rule
is an error that names it (a new parameter kind must be given a rule, not silently replicated).

Heads that do not divide N. Each device must hold whole kv heads and the q heads that read them.
`plan_heads` decides, per (num_q_heads N_q, num_kv_heads K, N):

- "split": K % N == 0: each device takes K/N kv heads and their q heads, nothing changes;
- "replicate": N % K == 0 and N_q % N == 0 (fewer kv heads than devices, e.g. K=2, N=4):
  each kv head is copied to the N/K devices that hold its q heads (vLLM's rule); the model is
  rebuilt with K' = N kv heads (wk/wv columns repeated), so the pool holds one head per device;
- "pad": anything else (SmolLM2: N_q=9, K=3 with N=2 or 4): zero heads are appended up to
  K' = ceil(K/N)*N kv heads and N_q' = K' * q_per_kv q heads (zero wq/wk/wv columns, zero wo
  rows). A zero head's query and values are zero, so its attention output is exactly zero and
  its zero wo rows add exactly nothing: the network computes the same function. The cost is
  (K'-K)/K more KV memory and attention work, reported by `HeadPlan.describe`.

The MLP hidden size is padded the same way (zero gate/up columns, zero down rows: silu(0)*0 = 0,
gelu(0) = 0) when it does not divide N.

MIXTURES OF EXPERTS (`plan_experts`): attention is tensor-parallel as above; the router (and its
bias) is replicated, every device routes every token; the experts are sharded in one of two layouts
(models.moe.expert_parallel runs them in one shard_map, then ONE psum of f32[tokens, d_model], the
collective of a dense MLP):

- "ffn": each expert's ffn width split (gate/up column-parallel, down row-parallel; MXFP4 codes and
  block scales with their weight, whole 32-value blocks per device), each device holds F/N of EVERY
  expert and computes 1/N of every routed pair;
- "experts" (expert parallelism): the expert axis split, device d holds experts [d*E/N, (d+1)*E/N)
  whole (MXFP4 codes, scales and biases with them) and computes the pairs routed to them.

"auto" takes "ffn" when F divides by N (MXFP4: F / 32 by N), else "experts" when E divides by N, else
it refuses. Why "ffn" first: the engine's step has static shapes, so a device of the "experts"
layout must provision rows for every pair (the routing is decided inside the step): it computes the
flops of the whole MoE MLP and materializes E/N + M*k/tile gathered expert tiles at full width,
where "ffn" computes 1/N of them; both read 1/N of the weights (a deviceless 8-H100 compile of a
Qwen3-30B-A3B-shaped model: BENCHMARKS.md, "Mixture of experts under tensor parallelism").
gpt-oss-120b's MXFP4 experts (F = 2880: 90 blocks) do not split over 8 devices, so they take
"experts" (128 experts: 16 per device).

EMBEDDINGS: split on the vocabulary, chosen by measurement (BENCHMARKS.md, a Llama-shaped 8B
on 8 H100s, compiled deviceless): against replicated embeddings it saves 1.7 GiB per device
(3.58 -> 1.87 GiB of weights) and 88 MiB of temporaries, for 3 small extra collectives per decode
step (the lookup's all-reduce of bf16[num_seqs, d_model], and GSPMD's distributed argmax/top-k
over the vocabulary shards: f32/s32[num_seqs] all-reduces and an s32[num_seqs, N] all-gather;
the f32[num_seqs, vocab] logits are never gathered). When vocab_size does not divide by N they
are replicated instead (`HeadPlan.embeddings`). `embeddings="replicated"` forces that.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jpa.core.sharding import TP, check_mesh, named
from jpa.models.config import ModelConfig
# The placement of every parameter kind (column-, row-parallel, replicated) is models.partition's RULES, a leaf
# module models.gpt and models.linear read too.
from jpa.models.partition import COL, REP, REPLICATED_EMBEDDINGS, ROW, RULES, VEC  # noqa: F401


def expert_rules(layout: str) -> dict:
    """The rules of a mixture of experts' expert parameters under expert layout "experts" or "ffn"
    (models.moe.expert_specs: the same specs, per layer)."""
    from jpa.models.moe import expert_specs

    rules = {}
    for mxfp4 in (False, True):
        sg, su, sd, (bg, bu, bd) = expert_specs(layout, mxfp4)
        for name, spec in (("experts_gate", sg), ("experts_up", su), ("experts_down", sd)):
            if mxfp4:
                rules[(name, True)], rules[(name + "_scales", True)] = spec
            else:
                rules[(name, False)] = spec
        for name, spec in (("experts_gate_bias", bg), ("experts_up_bias", bu), ("experts_down_bias", bd)):
            rules[(name, False)] = spec
    return rules


EXPERT_NAMES = {name for name, _ in expert_rules("experts")}
# The expert layout `shard` gives a mixture of experts: "auto" (plan_experts' rule), "experts" or "ffn".
EXPERT_LAYOUT = "auto"


def plan_experts(config: ModelConfig, tensor_parallel: int, layout: str = "auto"):
    """The expert layout ("experts" or "ffn", module docstring) of a mixture of experts on
    `tensor_parallel` devices; None for a dense model or one device. ValueError when neither fits."""
    n, e, f = tensor_parallel, config.num_experts, config.ffn_dim
    if layout not in ("auto", "experts", "ffn"):
        raise ValueError(f"expert layout must be 'auto', 'experts' or 'ffn'; got {layout!r}")
    if not e or n == 1:
        return None
    mxfp4 = config.expert_format == "mxfp4"
    ffn_fits = f % (32 * n if mxfp4 else n) == 0
    why_ffn = (f"ffn_dim={f} ({f // 32} MXFP4 blocks of 32) does not split into {n} whole-block parts" if mxfp4
               else f"ffn_dim={f} does not divide by {n}")
    if layout == "ffn" and not ffn_fits:
        raise ValueError(f"tensor_parallel={n}: expert layout 'ffn' needs each expert's width split evenly: {why_ffn}")
    if layout == "experts" and e % n:
        raise ValueError(f"tensor_parallel={n}: expert layout 'experts' needs num_experts={e} divisible by {n}")
    if layout != "auto":
        return layout
    if ffn_fits:
        return "ffn"
    if e % n == 0:
        return "experts"
    raise ValueError(f"tensor_parallel={n} does not fit this mixture of experts: num_experts={e} does not divide "
                     f"by {n} (expert layout 'experts') and {why_ffn} (layout 'ffn'); pick a tensor-parallel size "
                     f"that divides one of them")


# Parameters whose axes hold heads (q or kv) or the MLP hidden size, and which axis.
_Q_HEAD_AXIS = {"wq": 1, "bq": 0, "wo": 0, "wq_scale": 0, "sinks": 0}
_KV_HEAD_AXIS = {"wk": 1, "wv": 1, "bk": 0, "bv": 0, "wk_scale": 0, "wv_scale": 0}
_FFN_AXIS = {"w_gate": 1, "w_up": 1, "b_up": 0, "w_down": 0, "w_gate_scale": 0, "w_up_scale": 0}
# GGUF blocks kept packed: codes keep the weight's name; block scales / minimums lie like their weight.
for _axes in (_Q_HEAD_AXIS, _KV_HEAD_AXIS, _FFN_AXIS):
    for _w in [w for w in _axes if w.startswith("w") and not w.endswith("_scale")]:
        for _s in ("_bscale", "_bmin", "_bscale2", "_bmin2"):
            _axes[_w + _s] = _axes[_w]
# The packed weights whose head / ffn axis is their `in` axis, the one their blocks run along: there
# a feature is half a code byte (Q4) and 1/32 of a block scale.
_PACKED_IN_AXIS = ("wo", "w_down")


def _packed_base(name):
    """The weight a block-scale parameter belongs to (`wo_bscale2` -> `wo`), or name itself."""
    for suffix in ("_bscale2", "_bmin2", "_bscale", "_bmin"):
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def _features_per_entry(name, x, group: int = 32) -> float:
    """Input/output features one entry of parameter `name` (an np.ndarray) spans on its head / ffn axis
    (group: the weight's block size, 32 for GGUF, an int4 checkpoint's group size)."""
    base = _packed_base(name)
    if base not in _PACKED_IN_AXIS:
        return 1
    if base != name:
        return group  # a block scale / minimum
    return 2 if x.dtype == np.uint8 else 1  # Q4 codes hold two 4-bit values a byte
MODES = ("split", "replicate", "pad")


@dataclasses.dataclass(frozen=True)
class HeadPlan:
    """How N devices hold a model's heads (see the module docstring)."""
    tensor_parallel: int
    mode: str              # "split", "replicate" or "pad"
    num_q_heads: int       # after padding (N_q')
    num_kv_heads: int      # after replication or padding (K'); the pool's head axis
    ffn_dim: int           # after padding
    orig_q_heads: int
    orig_kv_heads: int
    orig_ffn_dim: int
    embeddings: str = "vocab"  # "vocab" (split on the vocabulary) or "replicated"
    experts: str | None = None  # a mixture of experts' layout ("experts" or "ffn", plan_experts); None if dense
    num_experts: int = 0

    def describe(self) -> str:
        n = self.tensor_parallel
        s = (f"tp={n} {self.mode}: {self.num_kv_heads // n} kv head(s) and {self.num_q_heads // n} q heads "
             f"per device")
        if self.mode == "replicate":
            s += f" (each of the {self.orig_kv_heads} kv heads held by {n // self.orig_kv_heads} devices)"
        if self.mode == "pad":
            s += (f" ({self.num_kv_heads - self.orig_kv_heads} zero kv heads and "
                  f"{self.num_q_heads - self.orig_q_heads} zero q heads added: "
                  f"+{100 * (self.num_kv_heads / self.orig_kv_heads - 1):.0f}% KV memory and attention work)")
        if self.ffn_dim != self.orig_ffn_dim:
            s += f"; ffn padded {self.orig_ffn_dim} -> {self.ffn_dim}"
        if self.experts == "experts":
            s += f"; experts {self.num_experts // n} of {self.num_experts} per device (expert-parallel)"
        elif self.experts == "ffn":
            s += f"; every expert's ffn {self.ffn_dim // n} of {self.ffn_dim} per device"
        return s + f"; embeddings {self.embeddings}"


def plan_heads(config: ModelConfig, tensor_parallel: int, embeddings: str = "vocab",
               experts: str | None = None) -> HeadPlan:
    """The HeadPlan of `config` on `tensor_parallel` devices (embeddings: "vocab" or "replicated";
    "vocab" falls back to "replicated" when vocab_size does not divide by tensor_parallel; experts: a
    mixture of experts' layout, `plan_experts`, default EXPERT_LAYOUT)."""
    n, nq, nk, g = tensor_parallel, config.num_q_heads, config.num_kv_heads, config.q_per_kv
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"tensor_parallel must be an int >= 1; got {n!r}")
    if embeddings not in ("vocab", "replicated"):
        raise ValueError(f"embeddings must be 'vocab' or 'replicated'; got {embeddings!r}")
    layout = plan_experts(config, n, EXPERT_LAYOUT if experts is None else experts)
    if config.vocab_size % n:
        embeddings = "replicated"
    if nk % n == 0:
        mode, q, k = "split", nq, nk
    elif n % nk == 0 and nq % n == 0:
        mode, q, k = "replicate", nq, n
    else:
        k = math.ceil(nk / n) * n
        mode, q = "pad", k * g
    # A dense MLP's hidden size is padded to whole parts (zero columns); the experts' never (plan_experts).
    ffn = config.ffn_dim if config.num_experts else math.ceil(config.ffn_dim / n) * n
    return HeadPlan(n, mode, q, k, ffn, nq, nk, config.ffn_dim, embeddings, layout, config.num_experts)


def _heads(x, axis, per_head, fn):
    """Applies fn to x viewed with its `axis` split into [heads, per_head]."""
    shape = x.shape
    x = x.reshape(shape[:axis] + (shape[axis] // per_head, per_head) + shape[axis + 1:])
    x = fn(x, axis)
    return x.reshape(shape[:axis] + (-1,) + shape[axis + 1:])


def _pad(x, axis, size):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return np.pad(x, pad)


def _transform(name, x, config: ModelConfig, plan: HeadPlan, packed: bool = False, group: int = 32):
    """Parameter `name` (an np.ndarray) of the original model -> its value in the planned model.
    packed: the model holds GGUF blocks (zero codes, scales and minimums make zero weights) of
    `group` values each."""
    per = _features_per_entry(name, x, group) if packed else 1
    h = config.head_dim / per
    moves_heads = (name in _KV_HEAD_AXIS and plan.mode in ("replicate", "pad")) or (
        name in _Q_HEAD_AXIS and plan.mode == "pad")
    if (moves_heads and h != int(h)) or (plan.ffn_dim != config.ffn_dim and name in _FFN_AXIS and (plan.ffn_dim % per
                                                                                or config.ffn_dim % per)):
        raise ValueError(f"{plan.describe()}: the blocks of {name} ({per} features each) cannot be split at this "
                         f"tensor-parallel size; load the weights dequantized (quantization 'none') or requantized "
                         f"('int8')")
    h = int(h) if moves_heads else None
    if name in _KV_HEAD_AXIS:
        axis = _KV_HEAD_AXIS[name]
        if plan.mode == "replicate":
            return _heads(x, axis, h, lambda a, ax: np.repeat(a, plan.num_kv_heads // config.num_kv_heads, ax))
        if plan.mode == "pad":
            return _heads(x, axis, h, lambda a, ax: _pad(a, ax, plan.num_kv_heads))
    if name in _Q_HEAD_AXIS and plan.mode == "pad":
        return _heads(x, _Q_HEAD_AXIS[name], h, lambda a, ax: _pad(a, ax, plan.num_q_heads))
    if name in _FFN_AXIS and plan.ffn_dim != config.ffn_dim:
        return _pad(x, _FFN_AXIS[name], plan.ffn_dim // per)
    return x


def _name(path) -> str:
    """The parameter name of a state path (its last string key, skipping nnx's "value")."""
    keys = [getattr(k, "key", getattr(k, "name", k)) for k in path]
    return next(k for k in reversed(keys) if isinstance(k, str) and k != "value")


def _stacked(path) -> bool:
    """Whether a state path is a layer parameter (stacked: a leading num_layers axis before the rule's axes)."""
    return any(getattr(k, "key", getattr(k, "name", k)) == "layers" for k in path)


def with_heads(model, plan: HeadPlan):
    """The model rebuilt with the plan's head counts and ffn size (itself when nothing changes)."""
    from jpa.models.gpt import GPT  # models.gpt imports jpa.core.sharding only; no cycle at import time
    from jpa.models.linear import SCALED, format_of, formats

    c = model.config
    if (plan.num_q_heads, plan.num_kv_heads, plan.ffn_dim) == (c.num_q_heads, c.num_kv_heads, c.ffn_dim):
        return model
    new_c = dataclasses.replace(c, num_q_heads=plan.num_q_heads, num_kv_heads=plan.num_kv_heads,
                                ffn_dim=plan.ffn_dim)
    # GGUF blocks, or a checkpoint stored quantized (models.hf: some weights quantized, the embeddings not):
    # attributes GPT(quantization=...) would not rebuild.
    packed = model.quantization is not None and not (model.quantization in ("int8", "fp8")
                                                     and format_of(model, "tok_embeddings") == SCALED)
    if packed:  # the same attributes as the model's (GGUF blocks), at the planned sizes
        new = _abstract_like(model, new_c)
    else:
        new = nnx.eval_shape(lambda: GPT(new_c, dtype=model.dtype, rngs=nnx.Rngs(0),
                                         quantization=model.quantization))
    for name, changes in (("wo", plan.num_q_heads != c.num_q_heads), ("w_down", plan.ffn_dim != c.ffn_dim)):
        if changes and "_perm" in getattr(formats(model.layers).get(name), "parts", ()):  # `in` is resized
            raise ValueError(f"{plan.describe()}: {name} is an act-order GPTQ weight (its inputs permuted), which "
                             f"jpa does not re-plan; load it with quantization 'none' or at a tensor-parallel size "
                             f"that divides the heads")
    old = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for path, var in nnx.to_flat_state(nnx.state(new, nnx.Param)):
        # The variable's value, not `[...]` of it: an abstract model's is a ShapeDtypeStruct,
        # which cannot be indexed.
        x = old[path].get_value()
        if isinstance(x, jax.ShapeDtypeStruct):  # an abstract model (deviceless compile): shapes only
            if packed:
                raise ValueError("an abstract model with GGUF blocks cannot be re-planned (build it at the planned "
                                 "head counts)")
            var.set_value(jax.ShapeDtypeStruct(var.shape, var.dtype))
            continue
        # Through float32 and back to the variable's own dtype: exact for int8 / float8 weights too
        # (padding adds zero weights; a padded channel's scale is 0, harmless on zero weights).
        x = np.asarray(x.astype(jnp.float32))
        x = x.astype(old[path].get_value().dtype)  # codes stay uint8 / int8 (the feature count depends on it)
        name, group = _name(path), 32
        if packed and _packed_base(name) != name:  # K / blocks: the weight's group size
            base = _packed_base(name)
            codes = old[tuple(base if getattr(k, "key", k) == name else k for k in path)].get_value()
            group = codes.shape[-2] * (2 if codes.dtype == np.uint8 else 1) // x.shape[-2]
        if _stacked(path):
            y = np.stack([_transform(name, layer, c, plan, packed, group) for layer in x])
        else:
            y = _transform(name, x, c, plan, packed, group)
        var.set_value(jnp.asarray(y, dtype=var.dtype))
    return new


def _abstract_like(model, new_c):
    """An abstract GPT at config new_c whose parameters are the model's (GGUF blocks included), each
    a placeholder to be set: a packed weight keeps its codes / scales / minimums."""
    from jpa.models.gpt import GPT

    new = nnx.eval_shape(lambda: GPT(new_c, dtype=model.dtype, rngs=nnx.Rngs(0)))
    for owner, dst in ((model, new), (model.layers, new.layers)):
        for name, var in vars(owner).items():
            if isinstance(var, nnx.Param):
                setattr(dst, name, nnx.Param(jax.ShapeDtypeStruct(var.shape, var.dtype)))
        dst.weight_formats = owner.weight_formats  # models.linear: the same formats
    new.quantization = model.quantization
    return new


def lora_specs(names) -> dict:
    """The PartitionSpecs of stacked LoRA slots (`models.lora.empty_slots`: {name: {"a": [max_loras, L, in, R],
    "b": [max_loras, L, R, out]}}) for the targets `names`, split as their base weights are (RULES): a
    column-parallel target's (wq, wk, wv, w_gate, w_up) A whole and B split on `out` with the base weight's
    columns, so each device adds the LoRA term of its own output columns; a row-parallel target's (wo, w_down) A
    split on `in` with the base weight's rows (x arrives split so) and B whole: each device's partial x A is
    summed over "tp" (an all-reduce of f32[rows, max_loras, R], GSPMD's, far smaller than the base's
    [rows, d_model]) before the whole B."""
    out = {}
    for name in names:
        if RULES[name] not in (COL, ROW):
            raise ValueError(f"LoRA target {name!r} is neither column- nor row-parallel in models.sharding.RULES")
        row = RULES[name] == ROW
        out[name] = {"a": P(None, None, TP, None) if row else P(), "b": P() if row else P(None, None, None, TP)}
    return out


def plan_lora(one: dict, config: ModelConfig, plan: HeadPlan) -> dict:
    """One adapter's host slot arrays (`models.lora.read_adapter` at the original model's shapes: {name: {"a":
    [L, in, R], "b": [L, R, out]}}) -> the planned model's: the head / ffn axis a base weight has padded or
    replicated (`with_heads`) is padded or replicated the same way in the LoRA matrix that carries it (B's `out`
    of a column-parallel target, A's `in` of a row-parallel one), zeros where the base has zero heads. The
    other matrix is unchanged. Itself when the plan changes nothing."""
    c = config
    if (plan.num_q_heads, plan.num_kv_heads, plan.ffn_dim) == (c.num_q_heads, c.num_kv_heads, c.ffn_dim):
        return one
    out = {}
    for name, ab in one.items():
        which = "a" if RULES[name] == ROW else "b"   # the matrix whose axis is the base weight's split axis
        moved = np.stack([_transform(name, layer, c, plan) for layer in ab[which]])
        out[name] = {**ab, which: moved.astype(ab[which].dtype)}
    return out


def param_specs(params, *, embeddings: str = "vocab", experts: str | None = None):
    """The PartitionSpec of every leaf of a GPT's param state, by RULES (a pytree like params); a mixture
    of experts' expert parameters by `expert_rules(experts)` (experts: "experts" or "ffn"; None: replicated,
    one device).

    Raises ValueError naming a parameter that has no rule.
    """
    ex_rules = expert_rules(experts) if experts is not None else {}
    if embeddings not in ("replicated", "vocab"):
        raise ValueError(f"embeddings must be 'replicated' or 'vocab'; got {embeddings!r}")
    rules = {**RULES, **(REPLICATED_EMBEDDINGS if embeddings == "replicated" else {})}

    def spec(path, leaf):
        name = _name(path)
        if name in EXPERT_NAMES:
            # MXFP4 codes / scales (uint8) lie [E, out, in / 2], unlike a float weight's [E, in, out].
            s = ex_rules.get((name, np.dtype(leaf.dtype) == np.uint8), REP)
            return P(None, *s) if _stacked(path) else s
        if name not in rules:
            raise ValueError(f"parameter {name!r} has no tensor-parallel rule; add one to "
                             f"models.sharding.RULES (column-, row-parallel or replicated)")
        # A layer parameter carries the stack's num_layers axis first, never split.
        return P(None, *rules[name]) if _stacked(path) else rules[name]

    return jax.tree_util.tree_map_with_path(spec, params)


def check_divisible(params, specs, tensor_parallel: int):
    """Raises ValueError naming a parameter whose sharded axis does not divide by tensor_parallel."""
    def check(path, leaf, spec):
        for axis, s in enumerate(spec):
            if s == TP and leaf.shape[axis] % tensor_parallel:
                raise ValueError(f"parameter {_name(path)!r} axis {axis} ({leaf.shape[axis]}) is not divisible "
                                 f"by tensor_parallel={tensor_parallel}")
    jax.tree_util.tree_map_with_path(check, params, specs)


def shard(model, mesh, *, embeddings: str = "vocab", experts: str | None = None):
    """(model with its heads planned for mesh's "tp" axis and params placed on the mesh, HeadPlan).
    experts: a mixture of experts' layout ("auto", "experts" or "ffn"; default EXPERT_LAYOUT).

    The returned GPT's config reports the planned head counts (the pool holds num_kv_heads
    heads). For an abstract model (nnx.eval_shape) the params become ShapeDtypeStructs carrying
    their NamedShardings (deviceless compiles).
    """
    from jpa.models.gpt import set_embeddings_layout

    check_mesh(mesh)
    tp = mesh.shape[TP]
    plan = plan_heads(model.config, tp, embeddings, experts)
    # the rules plan the embedding table's [vocab, d_model] rows (a table kept [d_model, vocab] for a GPU's
    # Mosaic head goes back to rows: the kernel does not serve under a mesh)
    model = with_heads(set_embeddings_layout(model, False), plan)
    graphdef, params = nnx.split(model)
    specs = param_specs(params, embeddings=plan.embeddings, experts=plan.experts)
    check_divisible(params, specs, tp)

    def place(x, spec):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=named(mesh, spec))
        return jax.device_put(x, named(mesh, spec))

    params = jax.tree_util.tree_map(place, params, specs)
    out = nnx.merge(graphdef, params)
    out.expert_layout = plan.experts  # how models.moe runs the experts under this mesh (None: dense)
    out.embeddings_layout = plan.embeddings  # "vocab": a quantized head runs the Mosaic matmul per device
    return out, plan
