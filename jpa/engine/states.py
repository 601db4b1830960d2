"""Recurrent state slots beside the paged pool, for a model whose cache spec has a recurrent group.

A hybrid model (Qwen3.5 / Qwen3-Next: Gated DeltaNet layers beside gated attention) keeps, in each
recurrent layer, a fixed-size state per sequence (`jpa.kv.spec.RecurrentState`). The engine allocates
them as state slots, one per sequence slot (`CacheSpec.init_states(max_seqs)`:
{group: {state: [group layers, max_seqs, *shape]}}), and carries them beside the paged pool in one
donated pytree, `StateCache(pool, states)`, so they are updated in place wherever the pool is.

The model owns the update (the contract, `jpa.engine.model.EngineModel`): `call_model` hands it
`states` and `state_slots` (i32[entries]: the slot each sequence entry or decode row reads and
writes, -1 = padding) and takes the states back. A sequence entry whose first row is at position 0
starts from a zero state (the reset rule), so the engine never clears a slot: a fresh request and a
preempted one recomputed from its prompt need nothing here, and a prompt cut into chunks anywhere
continues from its slot. What the engine does itself:

- a parallel sample's slot gets its leader's states after the leader's final chunk (`fork_states`);
- the step-shape ladder's loop over gathered sub-slots passes the real slot ids (never a gathered
  copy of the states);
- n-gram speculation: a verify pass advances a slot's states through every draft row, so a slot that
  rejected some drafts gets its states from before the pass back and runs its kept rows again
  (`jpa.engine.verify.VerifyLoop.replay`: recompute, one more pass in steps with a rejection);
- KV offload: a preempted slot's states are swapped out and in with its pages (`ModelRunner.swap_out`,
  `swap_in`), and the swap-in brings back every token (`Scheduler.state_pages`);
- options it cannot serve with a recurrent group are refused at construction (`refuse_options`):
  prefix caching (a hit would need the state at the cached block's boundary), speculative decoding
  with a draft model (its passes carry no states), tensor parallelism (the states are not sharded yet).
"""

import flax.struct
import jax
import jax.numpy as jnp

from jpa.kv.cache import KVCache


@flax.struct.dataclass
class StateCache:
    """The engine's cache for a model with a recurrent group: the paged pool of its paged layers and
    the state slots of its recurrent groups.

    Attributes:
      pool: jpa.KVCache of the spec's `paged_layers()` (pool layer j = the j-th paged model layer).
      states: {group name: {state name: [len(group.layers), max_seqs, *shape]}}.
    """
    pool: KVCache
    states: dict


def call_model(fn, params, cache, *args, impl, state_slots, **kw):
    """(out, cache) of a model call `fn(params, cache, *args, impl=..., **kw)` (`ragged`, `ragged_hidden` or
    `decode`; kw: e.g. the LoRA adapters, `lora=`). With a StateCache the model gets the pool, `states` and
    `state_slots` (i32[entries], -1 = padding: neither read nor written) and returns (out, pool, states);
    otherwise it is called as a model without recurrent state is (state_slots unused)."""
    if isinstance(cache, StateCache):
        out, pool, states = fn(params, cache.pool, *args, impl=impl, states=cache.states, state_slots=state_slots,
                               **kw)
        return out, StateCache(pool, states)
    return fn(params, cache, *args, impl=impl, **kw)


def fork_states(cache, src, dst):
    """cache with each slot dst[i] >= 0 holding slot src[i]'s states (every group, every state; the
    pool untouched). src, dst: i32[n]. A cache without states is returned as it is."""
    if not isinstance(cache, StateCache):
        return cache
    return cache.replace(states=copy_slots(cache.states, cache.states, src, dst))


def copy_slots(states, source, src, dst):
    """states with each slot dst[i] >= 0 holding slot src[i] of `source` (a states pytree of the same
    structure; it may be `states` itself). src, dst: i32[n]."""
    num_slots = jax.tree_util.tree_leaves(states)[0].shape[1]
    to = jnp.where(dst >= 0, dst, num_slots)   # out of range: dropped
    frm = jnp.clip(src, 0, num_slots - 1)
    return jax.tree_util.tree_map(lambda a, b: a.at[:, to].set(b[:, frm], mode="drop"), states, source)


def recurrent_names(spec) -> str:
    """The recurrent groups of a spec for error messages: "group 'linear' (recurrent state (...) per sequence)"."""
    return ", ".join(f"group {g.name!r} ({g.layout.describe()})" for g in spec.recurrent_groups())


def refuse_options(spec, **options) -> None:
    """Raises ValueError naming the first option set (truthy) that the engine does not serve with the
    spec's recurrent group(s): prefix_caching, speculative (but method "ngram"), tensor_parallel (> 1)."""
    if not spec.has_recurrent:
        return
    why = {"prefix_caching": "a prefix-cache hit would need the recurrent state at the cached block's boundary, "
                             "which the engine does not keep (set prefix_caching=False, --no-prefix-caching)",
           "speculative": "a draft model's passes do not carry recurrent states (n-gram speculation, method "
                          "'ngram', is served: rejected drafts' rows are recomputed)",
           "tensor_parallel": "the recurrent states are not sharded over devices yet"}
    for name, value in options.items():
        served = (name == "tensor_parallel" and value == 1) or (name == "speculative" and value is not None
                                                                 and value.method == "ngram")
        if value and not served:
            raise ValueError(f"EngineConfig.{name}={value!r} is not served for a model whose cache has a "
                             f"recurrent {recurrent_names(spec)}: {why[name]}")
