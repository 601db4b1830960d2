"""KV offload: a host-memory tier of pages for preempted sequences (swap instead of recompute).

The device pool is the scarce memory. When the scheduler preempts a sequence, its pages can be
copied to host memory (swap out) instead of being thrown away, and copied back into freshly
allocated pages when it is admitted again (swap in), instead of prefilling its whole history
again (vLLM v0's `--swap-space` preemption mode; vLLM v1 and SGLang do it through their KV
offloading connectors / hierarchical cache).

Two halves, both here:

- `HostTier`: the host's bookkeeping of the tier (plain Python, managed on the host; the device
  pool's `PageState` is untouched by it). A capacity in pages, a free list of host page ids, and
  per swapped sequence a `SwapBlock`: which host pages it holds, how many tokens, and the data.
- `swap_out` / `swap_in`: the two device programs (jitted, one per block-size bucket).
  `swap_out` gathers one slot's pages from every leaf of the cache pytree (K, V, scales, a draft
  model's pools: the page axis is axis 2 of each) into a block placed in host memory
  (`memory_kind="pinned_host"` where the backend has it: XLA then does the device->host copy as
  part of the program, asynchronously to the host; this CPU backend has it too). `swap_in` does the
  slot's page work (evictions of the round, a prefix-cache hit shared, pages reserved for the
  restored tokens; all or nothing; one program) and then scatters the block's pages into the new
  pages, the pool donated (updated in place; the block is moved host->device inside the program).

Blocks are sized in power-of-two buckets of pages (one small gather and one small scatter program
per bucket, at most log2(pages_per_seq) + 1 of each), and the tier counts the bucket's pages: what
the host really holds.

Cost rule. Copying a sequence's KV moves `tokens x layers x 2 x kv_heads x head_dim x itemsize`
bytes each way; recomputing it costs about `2 x params x tokens` FLOPs (plus attention). Per token:
SmolLM2-135M in bf16: 23 KiB vs 0.27 GFLOP; Llama-3-8B in bf16: 128 KiB vs 16 GFLOP. Over a 25 GB/s
host link against 400 TFLOP/s of bf16 compute at 50% MFU the copy takes 0.9 us vs 1.35 us per token
(SmolLM2, the closest case) and 5 us vs 80 us (Llama-3-8B); on a CPU the copy is a memcpy and
the recompute a full forward pass. The copy is the cheaper one for every model this engine serves,
so the rule is: swap whenever the host tier has room for the sequence's block (else recompute).
"""

import dataclasses

import jax
import jax.numpy as jnp

from jpa.kv import pages
from jpa.kv.pages import pages_for_tokens


def bucket(num_pages: int, cap: int) -> int:
    """The block size (pages) a sequence of num_pages pages is swapped in: the next power of two, at most cap."""
    return min(cap, 1 << max(0, num_pages - 1).bit_length())


def host_memory_kind(device=None) -> str | None:
    """"pinned_host" where the device offers it (GPUs, this CPU backend), else None (its default memory)."""
    device = device or jax.devices()[0]
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # a backend without memories
        return None
    return "pinned_host" if "pinned_host" in kinds else None


@dataclasses.dataclass
class SwapBlock:
    """One swapped sequence in the host tier.

    Attributes:
      host_pages: the host page ids it holds (its bucket's worth).
      num_tokens: tokens of the sequence the block holds (its first ceil(num_tokens / page_size)
        pages are the sequence's pages 0, 1, ...).
      data: the cache pytree's leaves gathered, each [.., .., bucket, ...] (page axis 2), in host
        memory; None until the engine attaches the copy (`HostTier.attach`).
    """
    host_pages: tuple[int, ...]
    num_tokens: int
    data: object = None


class HostTier:
    """The host tier's bookkeeping: capacity, free host pages, the blocks of swapped sequences.

    Args:
      num_pages: host pages (capacity; a page costs what a device page costs).
      bytes_per_page: bytes of one page (all layers, K and V, scales; a draft model's too).
    """

    def __init__(self, num_pages: int, bytes_per_page: int):
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"HostTier.num_pages must be an int >= 1; got {num_pages!r}")
        self.num_pages, self.bytes_per_page = num_pages, bytes_per_page
        self._free = list(range(num_pages - 1, -1, -1))   # a stack: pop() takes the lowest id first
        self.blocks: dict = {}                              # key -> SwapBlock

    @property
    def num_free(self) -> int:
        return len(self._free)

    def __contains__(self, key) -> bool:
        return key in self.blocks

    def reserve(self, key, num_pages: int, num_tokens: int) -> bool:
        """Takes num_pages host pages for `key` (its data attached later); False (nothing taken) without room."""
        if key in self.blocks:
            raise RuntimeError(f"{key!r} already holds a block in the host tier")
        if num_pages > len(self._free):
            return False
        self.blocks[key] = SwapBlock(tuple(self._free.pop() for _ in range(num_pages)), num_tokens)
        return True

    def attach(self, key, data) -> None:
        self.blocks[key].data = data

    def take(self, key) -> SwapBlock:
        """Removes key's block (its host pages are free again) and returns it."""
        block = self.blocks.pop(key)
        self._free.extend(reversed(block.host_pages))
        return block

    def drop(self, key) -> None:
        """Frees key's block if it has one (an aborted or finished request, a copy not needed)."""
        if key in self.blocks:
            self.take(key)

    def check(self) -> list[str]:
        """Disagreements in the bookkeeping (empty when consistent): every host page free or in exactly one block."""
        held = [p for b in self.blocks.values() for p in b.host_pages]
        everything = sorted(held + self._free)
        problems = []
        if everything != list(range(self.num_pages)):
            problems.append(f"host tier: free {len(self._free)} + held {len(held)} pages != the {self.num_pages} "
                            f"pages once each")
        if any(b.data is None for b in self.blocks.values()):
            problems.append("host tier: a block without its data")
        return problems


def _gather(cache, block_tables, slot, *, size: int):
    """The first `size` pages of `slot`'s table, from every leaf of the cache (page axis 2)."""
    ids = jax.lax.dynamic_slice_in_dim(block_tables[slot], 0, size)   # i32[size]
    return jax.tree_util.tree_map(lambda a: jnp.take(a, ids, axis=2, mode="clip"), cache)


def _swap_in_pages(page_state, evict, slot, hit_table, hit_tokens, num_tokens):
    """The page work of a swap-in (see `Mover.swap_in`): (page_state, ok)."""
    ps = pages.uncache(page_state, evict)
    ps, shared = pages.share(ps, slot[None], hit_table[None], hit_tokens[None])
    ps, reserved = pages.reserve(ps, slot[None], num_tokens[None])
    ok = shared & reserved
    return jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), ps, page_state), ok


def _scatter_block(cache, block_tables, block, ok, slot, hit_tokens, num_tokens, *, page_size: int):
    """The block's pages hit_tokens // page_size .. ceil(num_tokens / page_size) - 1 into the slot's
    pages (where ok), every leaf of the cache (page axis 2); the block moved to the device first."""
    size = jax.tree_util.tree_leaves(block)[0].shape[2]
    num_pages, pages_per_seq = jax.tree_util.tree_leaves(cache)[0].shape[2], block_tables.shape[1]
    j = jnp.arange(size, dtype=jnp.int32)
    restore = ok & (j >= hit_tokens // page_size) & (j < pages_for_tokens(num_tokens, page_size))
    dst = jnp.where(restore, block_tables[slot, jnp.minimum(j, pages_per_seq - 1)], num_pages)  # i32[size]

    def put(pool, b):
        b = jax.device_put(b, jax.memory.Space.Device) if _has_memory_space() else b
        return pool.at[:, :, dst].set(b.astype(pool.dtype), mode="drop")

    return jax.tree_util.tree_map(put, cache, block)


def _has_memory_space() -> bool:
    return hasattr(jax, "memory") and hasattr(jax.memory, "Space")


class Mover:
    """The compiled swap programs of one cache layout (jitted per block bucket).

    Args:
      memory_kind: where blocks live (`host_memory_kind()`; None = the device's default memory).
      device: the device of the pool.
    """

    def __init__(self, memory_kind: str | None, device=None):
        device = device or jax.devices()[0]
        self.memory_kind = memory_kind
        host = None if memory_kind is None else jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)
        self._out = {} if host is None else dict(out_shardings=host)
        self._gathers = {}
        self._pages = jax.jit(_swap_in_pages, donate_argnums=(0,))
        # One scatter program per block bucket (small: it compiles fast); the page work is one program.
        self._scatter = jax.jit(_scatter_block, donate_argnums=(0,), static_argnames=("page_size",))

    def swap_out(self, cache, page_state, slot: int, size: int):
        """The block of slot's first `size` pages (size: a bucket), placed in host memory. Dispatched
        asynchronously: nothing waits for the copy (the pool is read before any later call writes it)."""
        if size not in self._gathers:
            self._gathers[size] = jax.jit(lambda c, t, s: _gather(c, t, s, size=size), **self._out)
        return self._gathers[size](cache, page_state.block_tables, jnp.int32(slot))

    def warm(self, cache, page_state, sizes):
        """Compiles the swap programs of every block size in `sizes` by running them on nothing (a
        gather of slot 0 that is thrown away, a scatter with ok False that writes nothing): the
        cache, unchanged, is returned (it is donated)."""
        for size in sizes:
            block = self.swap_out(cache, page_state, 0, size)
            cache = self._scatter(cache, page_state.block_tables, block, jnp.bool_(False), jnp.int32(0), jnp.int32(0),
                                  jnp.int32(0), page_size=page_state.page_size)
        return cache

    def swap_in(self, cache, page_state, block, evict, slot: int, hit_table, hit_tokens: int, num_tokens: int):
        """(cache, page_state, ok): in empty `slot`, the round's evictions (i32[num_pages], -1 padding)
        first, then `hit_table[:hit_tokens // page_size]` shared (a prefix-cache hit; full pages),
        then pages reserved up to num_tokens and the block's pages hit_tokens // page_size ..
        ceil(num_tokens / page_size) - 1 copied into them. All or nothing: ok (bool[], on the device)
        False leaves the state as it was. cache and page_state are donated."""
        slot, hit_tokens, num_tokens = jnp.int32(slot), jnp.int32(hit_tokens), jnp.int32(num_tokens)
        page_state, ok = self._pages(page_state, jnp.asarray(evict, jnp.int32), slot, jnp.asarray(hit_table, jnp.int32),
                                     hit_tokens, num_tokens)
        cache = self._scatter(cache, page_state.block_tables, block, ok, slot, hit_tokens, num_tokens,
                              page_size=page_state.page_size)
        return cache, page_state, ok
