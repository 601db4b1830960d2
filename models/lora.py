"""LoRA adapters: PEFT adapter directories read into stacked device slots, and the per-row LoRA matmuls.

A PEFT LoRA adapter directory holds `adapter_config.json` (r, lora_alpha, target_modules, use_rslora, ...)
and `adapter_model.safetensors` (per layer and target: `lora_A.weight` [r, in] and `lora_B.weight` [out, r]).
A target module y = x W (+ b) becomes y + scale * (x A^T) B^T with scale = lora_alpha / r, or
lora_alpha / sqrt(r) with rsLoRA (`use_rslora`).

jpa keeps the adapters it serves in stacked slots (`empty_slots`): for every linear `name` of
`TARGETS` (models.gpt's wq, wk, wv, wo, w_gate, w_up, w_down) a pair

    a: [max_loras, num_layers, in, max_lora_rank]     (A^T, in the x @ W convention)
    b: [max_loras, num_layers, max_lora_rank, out]    (B^T times the adapter's scale)

A and B are zero-padded to max_lora_rank (the padding's products are exact zeros) and a target the
adapter does not have is all zeros, so every adapter of any rank and target set fits the same arrays and
the same compiled program; loading one is a write of its slot (`read_adapter` gives the host arrays).
Each row of a step carries its adapter's slot index, -1 for none (the base model).

The LoRA matmuls for a per-row index (`lora_delta`) come in three forms, `LORA_METHODS`:
- "gather": each row's A and B gathered ([rows, in, r]) and multiplied row by row;
- "ragged": rows sorted by slot and `jax.lax.ragged_dot` over the groups (the Punica-style grouped form:
  each active adapter's weights read once), unsorted after;
- "dense": two GEMMs over every slot: x @ A_all ([rows, max_loras, r]), the other slots' columns zeroed,
  then @ B_all (each slot's A and B read once, no gather, sort or scatter; the extra multiply-adds,
  max_loras x r per row, are small beside the base linear's).
benchmarks/bench_lora.py measures them (BENCHMARKS.md); `DEFAULT_METHOD` is the cheapest on a CPU.
"""

import json
import math
import pathlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jpa.models.config import ModelConfig

# PEFT's module names -> models.gpt's linear weights.
TARGETS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "gate_proj": "w_gate",
           "up_proj": "w_up", "down_proj": "w_down"}
LORA_METHODS = ("gather", "ragged", "dense")
DEFAULT_METHOD = "dense"
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def target_shapes(config: ModelConfig) -> dict:
    """{weight name: (in, out)} of the linears a LoRA adapter may target in a model of `config` (a mixture of
    experts has no dense MLP: its targets are the attention's)."""
    d, q_dim, kv_dim = config.d_model, config.num_q_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"wq": (d, q_dim), "wk": (d, kv_dim), "wv": (d, kv_dim), "wo": (q_dim, d)}
    if not config.num_experts and config.family == "llama":
        shapes.update(w_gate=(d, config.ffn_dim), w_up=(d, config.ffn_dim), w_down=(config.ffn_dim, d))
    return shapes


def check_lora_sizes(max_loras, max_lora_rank) -> None:
    """ValueError unless max_loras and max_lora_rank are ints >= 1."""
    for name, v in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an int >= 1; got {v!r}")


def empty_slots(config: ModelConfig, max_loras: int, max_lora_rank: int, dtype) -> dict:
    """The stacked adapter slots of a model of `config`, all zeros (no adapter in any slot):
    {name: {"a": [max_loras, L, in, R], "b": [max_loras, L, R, out]}} in `dtype`."""
    check_lora_sizes(max_loras, max_lora_rank)
    n, layers, r = max_loras, config.num_layers, max_lora_rank
    return {name: {"a": jnp.zeros((n, layers, i, r), dtype), "b": jnp.zeros((n, layers, r, o), dtype)}
            for name, (i, o) in target_shapes(config).items()}


def _layer_module(key: str):
    """(layer, PEFT module name) of a tensor name `...layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`."""
    parts = key.split(".")
    try:
        at = parts.index("layers")
        return int(parts[at + 1]), parts[-3]
    except (ValueError, IndexError):
        return None, None


def read_adapter(path, config: ModelConfig, max_lora_rank: int, dtype=np.float32) -> dict:
    """One PEFT LoRA adapter directory as the host arrays of one slot (`empty_slots` without the leading
    max_loras axis): {name: {"a": [L, in, R], "b": [L, R, out]}} in `dtype`, zero-padded to R =
    max_lora_rank, the scale (lora_alpha / r, or / sqrt(r) with use_rslora) folded into b, zeros for the
    targets the adapter does not have.

    Raises ValueError naming the rule for: a missing directory or file, a config or safetensors file that
    cannot be read, a PEFT type other than LORA, DoRA, biases, fan_in_fan_out, modules_to_save, per-module
    rank or alpha patterns, a target module jpa does not serve or this model lacks, r above max_lora_rank,
    and tensors of the wrong shape or layer."""
    path = pathlib.Path(path)
    if not path.is_dir():
        raise ValueError(f"LoRA adapter path {str(path)!r} must be a directory holding {CONFIG_FILE} and "
                         f"{WEIGHTS_FILE}; it does not exist or is not a directory")
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / f).is_file():
            raise ValueError(f"LoRA adapter {str(path)!r} has no {f} (a PEFT adapter directory holds {CONFIG_FILE} "
                             f"and {WEIGHTS_FILE})")
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text())
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is not a valid JSON object ({e})") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {str(path)!r}: peft_type must be LORA; got {cfg.get('peft_type')!r}")
    for key, ok in (("use_dora", lambda v: not v), ("bias", lambda v: v in (None, "none")),
                    ("fan_in_fan_out", lambda v: not v), ("modules_to_save", lambda v: not v),
                    ("rank_pattern", lambda v: not v), ("alpha_pattern", lambda v: not v),
                    ("lora_bias", lambda v: not v)):
        if not ok(cfg.get(key)):
            raise ValueError(f"LoRA adapter {str(path)!r}: {key}={cfg.get(key)!r} is not supported (jpa serves plain "
                             f"LoRA: no DoRA, biases, fan_in_fan_out, modules_to_save or per-module rank/alpha)")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"LoRA adapter {str(path)!r}: r must be an int >= 1; got {r!r}")
    if r > max_lora_rank:
        raise ValueError(f"LoRA adapter {str(path)!r} has rank r={r}, above max_lora_rank={max_lora_rank}; "
                         f"serve it with max_lora_rank >= {r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"LoRA adapter {str(path)!r}: lora_alpha must be a number; got {alpha!r}")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        raise ValueError(f"LoRA adapter {str(path)!r}: target_modules as a pattern ({targets!r}) is not supported; "
                         f"list the modules (of {sorted(TARGETS)})")
    if not isinstance(targets, (list, tuple)) or not targets:
        raise ValueError(f"LoRA adapter {str(path)!r}: target_modules must be a non-empty list; got {targets!r}")
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise ValueError(f"LoRA adapter {str(path)!r} targets {unknown}: jpa serves LoRA on {sorted(TARGETS)}")
    shapes = target_shapes(config)
    lacking = sorted(t for t in targets if TARGETS[t] not in shapes)
    if lacking:
        raise ValueError(f"LoRA adapter {str(path)!r} targets {lacking}, which this model does not have (its LoRA "
                         f"targets: {sorted(t for t, n in TARGETS.items() if n in shapes)})")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    try:
        from safetensors import SafetensorError
        from safetensors.numpy import load_file
        tensors = load_file(str(path / WEIGHTS_FILE))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {str(path)!r}: {WEIGHTS_FILE} cannot be read as safetensors ({e})") from None
    L, R = config.num_layers, max_lora_rank
    out = {name: {"a": np.zeros((L, i, R), np.float32), "b": np.zeros((L, R, o), np.float32)}
           for name, (i, o) in shapes.items()}
    seen = set()
    for key, t in tensors.items():
        layer, module = _layer_module(key)
        kind = "a" if key.endswith("lora_A.weight") else "b" if key.endswith("lora_B.weight") else None
        if kind is None or module not in TARGETS:
            raise ValueError(f"LoRA adapter {str(path)!r}: tensor {key!r} is not a lora_A / lora_B weight of "
                             f"{sorted(TARGETS)}")
        if module not in targets:
            raise ValueError(f"LoRA adapter {str(path)!r}: tensor {key!r} is of module {module!r}, not in its "
                             f"target_modules {sorted(targets)}")
        if layer is None or not 0 <= layer < L:
            raise ValueError(f"LoRA adapter {str(path)!r}: tensor {key!r} names no layer of 0..{L - 1}")
        i, o = shapes[TARGETS[module]]
        want = (r, i) if kind == "a" else (o, r)
        if tuple(t.shape) != want:
            raise ValueError(f"LoRA adapter {str(path)!r}: tensor {key!r} must have shape {list(want)} (r={r}, "
                             f"the model's {module} is [{i} -> {o}]); got {list(t.shape)}")
        w = np.asarray(t, np.float32)
        if kind == "a":
            out[TARGETS[module]]["a"][layer, :, :r] = w.T
        else:
            out[TARGETS[module]]["b"][layer, :r, :] = w.T * np.float32(scale)
        seen.add((layer, module, kind))
    half = {(la, m) for la, m, _ in seen if sum((la, m, k) in seen for k in "ab") == 1}
    if half:
        la, m = sorted(half)[0]
        raise ValueError(f"LoRA adapter {str(path)!r}: layer {la}'s {m} has lora_A without lora_B or the reverse")
    if not seen:
        raise ValueError(f"LoRA adapter {str(path)!r}: {WEIGHTS_FILE} holds no lora_A / lora_B weights")
    return {n: {k: v.astype(dtype) for k, v in ab.items()} for n, ab in out.items()}


def layer_slots(slots: dict, layer) -> dict:
    """The slots of one layer: {name: {"a": [N, in, R], "b": [N, R, out]}} (layer a traced i32[] index)."""
    return jax.tree_util.tree_map(lambda w: jax.lax.dynamic_index_in_dim(w, layer, axis=1, keepdims=False), slots)


class LoraRows(NamedTuple):
    """Each row's adapter slot and what every linear of a pass shares about it (`lora_rows`: computed once
    per model pass, not per linear and layer)."""
    index: jax.Array      # i32[M]: each row's slot (-1: none)
    live: jax.Array       # bool[M]: the row has an adapter
    order: jax.Array      # i32[M]: rows sorted by slot, rows without an adapter last ("ragged")
    sizes: jax.Array      # i32[N]: rows per slot ("ragged")
    any: jax.Array        # bool[]: some row has an adapter (else the LoRA terms are skipped)


def lora_rows(index, max_loras: int) -> LoraRows:
    """The LoraRows of index i32[M] (each row's slot, -1: none) over `max_loras` slots."""
    index = index.reshape(-1)
    live = (index >= 0) & (index < max_loras)
    key = jnp.where(live, index, max_loras)               # rows without an adapter sort last, outside every group
    sizes = jnp.bincount(key, length=max_loras + 1)[:max_loras].astype(jnp.int32)
    return LoraRows(index, live, jnp.argsort(key, stable=True), sizes, jnp.any(live))


def lora_delta(x, rows, a, b, method: str = DEFAULT_METHOD, layer=None):
    """The LoRA term of a linear for each row: x [M, in] rows, rows their adapter slots (i32[M], -1: none, or
    their `LoraRows`), a [N, in, R] and b [N, R, out] the slots' (scaled) A and B -> f32[M, out] (zeros where
    a row has no adapter). layer: a [N, L, in, R] and b [N, L, R, out] hold every layer's and this is the
    traced layer index (its slice is taken inside the branch that runs). A pass where no row has an adapter
    skips all of it under a lax.cond."""
    if method not in LORA_METHODS:
        raise ValueError(f"method must be one of {LORA_METHODS}; got {method!r}")
    rows = rows if isinstance(rows, LoraRows) else lora_rows(rows, a.shape[0])
    safe = jnp.where(rows.live, rows.index, 0)

    def delta(x):
        a_, b_ = (a, b) if layer is None else layer_slots((a, b), layer)
        return _delta(x.astype(a_.dtype), rows, safe, a_, b_, method)

    return jax.lax.cond(rows.any, delta, lambda x: jnp.zeros((x.shape[0], b.shape[-1]), jnp.float32), x)


def _delta(x, rows, safe, a, b, method):
    """`lora_delta`'s matmuls for one layer's a [N, in, R], b [N, R, out]."""
    if method == "gather":
        h = jnp.einsum("Mi,Mir->Mr", x, a[safe], preferred_element_type=jnp.float32)
        y = jnp.einsum("Mr,Mro->Mo", h.astype(b.dtype), b[safe], preferred_element_type=jnp.float32)
    elif method == "dense":   # two GEMMs over every slot's A and B, each read once; other slots' terms masked
        h = jnp.einsum("Mi,Nir->MNr", x, a, preferred_element_type=jnp.float32)
        mine = rows.index[:, None] == jnp.arange(a.shape[0], dtype=rows.index.dtype)[None, :]   # bool[M, N]
        h = jnp.where(mine[:, :, None], h, 0.0).astype(b.dtype)
        return jnp.einsum("MNr,Nro->Mo", h, b, preferred_element_type=jnp.float32)   # rows with no slot: zeros
    else:
        # Under an explicit mesh (a deviceless compile's abstract one) ragged_dot has no sharding rule: its
        # output is whole (LoRA runs on one device).
        kw = {} if jax.sharding.get_abstract_mesh().empty else dict(out_sharding=jax.sharding.PartitionSpec())
        h = jax.lax.ragged_dot(x[rows.order], a, rows.sizes, preferred_element_type=jnp.float32, **kw)
        ys = jax.lax.ragged_dot(h.astype(b.dtype), b, rows.sizes, preferred_element_type=jnp.float32, **kw)
        y = jnp.zeros_like(ys).at[rows.order].set(ys)
    return jnp.where(rows.live[:, None], y, 0.0)
