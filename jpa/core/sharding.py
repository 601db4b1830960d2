"""Tensor parallelism at the attention layer: each device runs the kernels on its own kv heads.

A tensor-parallel mesh has one axis, "tp", of N devices. The KV pools are sharded on their
kv-head axis (`jpa.KVCache`'s stacked `[num_layers, num_kv_heads, num_pages, page_size, head_dim]`
-> `STACKED_POOL = P(None, "tp")`; a single layer's `[num_kv_heads, ...]` pool -> `POOL`): device d
holds heads [d * K/N, (d + 1) * K/N) of EVERY page, so a page id means the same page on every
device and page allocation (`jpa.kv.pages`), block tables and slot mappings are replicated, one
decision for all shards.

`head_parallel` wraps one layer's cache write + attention (`jpa.write_kv` then `jpa.paged_decode`
or `jpa.paged_prefill`) in `jax.shard_map`: inside, each device sees its local heads and its local
pool shard and calls the unchanged single-device code (the Pallas kernels included). Nothing of
K, V or the pool crosses devices; the only communication of a tensor-parallel layer is the
all-reduce after its row-parallel matmuls (the model's business, see models/sharding.py).

Without a mesh every helper is the identity, so single-device code pays nothing.
"""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

TP = "tp"            # the mesh axis name of tensor parallelism
POOL = P(TP)         # [num_kv_heads, num_pages, page_size, head_dim] pools and f32[K, P, S_p] scales
STACKED_POOL = P(None, TP)  # jpa.KVCache's [num_layers, num_kv_heads, num_pages, page_size, head_dim] pools
HEADS = P(None, TP)  # [num_seqs or num_tokens, heads, head_dim]: q of a decode step, new k/v
HEADS_T = P(None, None, TP)  # [num_seqs, num_tokens, heads, head_dim]: q of a prefill chunk
REPLICATED = P()     # block tables, seq_lens, slot mappings, page state


def tp_mesh(tensor_parallel: int, devices=None) -> Mesh:
    """A 1-D mesh with axis "tp" over the first `tensor_parallel` devices (default: jax.devices()).

    Raises ValueError naming the devices there are when there are fewer than asked for.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not isinstance(tensor_parallel, int) or isinstance(tensor_parallel, bool) or tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be an int >= 1; got {tensor_parallel!r}")
    if tensor_parallel > len(devices):
        raise ValueError(f"tensor_parallel={tensor_parallel} needs {tensor_parallel} devices; this process "
                         f"sees {len(devices)} ({devices[0].platform if devices else 'none'}). On CPU, "
                         f"simulate more with XLA_FLAGS=--xla_force_host_platform_device_count=N "
                         f"set before JAX starts")
    return Mesh(np.asarray(devices[:tensor_parallel]), (TP,))


def check_mesh(mesh) -> None:
    if not isinstance(mesh, Mesh) or TP not in mesh.axis_names:
        raise ValueError(f"mesh must be a jax.sharding.Mesh with a {TP!r} axis; got {mesh!r}")


def named(mesh: Mesh, spec: P) -> NamedSharding:
    return NamedSharding(mesh, spec)


def head_parallel(fn, mesh: Mesh | None, in_specs, out_specs):
    """fn run per device on its heads (`jax.shard_map` over `mesh`), or fn itself when mesh is None.

    Args:
      fn: a function of one layer's attention step whose arrays are either split on their head
        axis (specs STACKED_POOL or POOL, HEADS, HEADS_T) or replicated (REPLICATED).
      mesh: a Mesh with a "tp" axis, or None.
      in_specs, out_specs: PartitionSpecs (pytree prefixes) of fn's arguments and results.

    The per-device function is the single-device code, so its checks see local head counts.
    check_vma is off: a Pallas call has no varying-axes rule, and every output is per-shard by
    construction (heads and pools) anyway.
    """
    if mesh is None:
        return fn
    check_mesh(mesh)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
