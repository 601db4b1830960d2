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

Prefix-cache spill. The tier also holds pages the device prefix cache evicted (`HostTier.spilled`,
one host page each, keyed by the prefix cache's key id): `Mover.spill` gathers a round's evicted
keyed pages into host memory before the round's step frees them, and a later prefix hit on such a
key is copied back (`Mover.restore`: fresh device pages, cached as if computed, shared into the
admitted slot, the host pages scattered into them; one program, dispatched before the step). The
key's page lives in exactly one place: on a device page (`PrefixCache.page_of`) or in the host tier,
never both (`PrefixCache.check`).

Capacity and eviction. One pool of host pages (`--kv-offload-memory`) serves both uses. Swapped
sequences come first: a swap-out that finds too few free host pages evicts spilled prefix pages,
least recently used first (a spill is only a cache; a swap block is the only copy of a preempted
sequence's KV until it resumes). A spill takes a free host page, else evicts the least recently
used spilled page; it never evicts a swap block, and is dropped (as without offload) when swap
blocks hold the whole tier. A host hit touches its pages (most recently used).

Cost rule (`SwapCost`, used for preemption swaps). For a sequence of n tokens:

    swap      = 2 * n * kv_bytes_per_token / host_link_bytes_per_s    (out, and back in)
    recompute = (2 * params * n + 2 * layers * q_heads * head_dim * n**2) / compute_flops_per_s

(a forward pass costs 2 FLOPs per weight per token; causal attention over n tokens sums 4 * L * H *
D * p over the positions p < n). The engine swaps a preempted sequence when swap < recompute and
the tier has room; else it recomputes. Evicted prefix pages are spilled only when the rule prefers
the copy for one page (n = page_size). Link and compute figures per platform are a table
(`HOST_LINKS`, tuning is data): a GPU's PCIe link against its bf16 FLOP/s at 50% MFU, a CPU's
memcpy against the prefill rate the engine sustains there. Per token (plus the attention term, which only favours the swap as sequences grow):
SmolLM2-135M (f32 KV on this CPU: 45 KiB, 0.27 GFLOP) swaps on a CPU (18 us against 2.7 ms at 100
GFLOP/s) and recomputes on an H100 (bf16: 1.8 us against 0.55 us, until ~18k tokens of context);
Llama-3-8B (bf16: 128 KiB, 16 GFLOP) swaps on both (10.5 us against 32 us on an H100). A tiny
model (a few KiB of KV per token, ~1 MFLOP) recomputes on a GPU.
"""

import collections
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


# Host link and compute rate per platform, for the cost rule: (bytes/s device<->host, FLOP/s of a
# prefill). GPU: PCIe 5 x16 in practice (~25 GB/s) against an H100's dense bf16 peak (989 TFLOP/s)
# at 50% MFU. CPU (this 2-core VM): a memcpy (~5 GB/s) against what the engine's prefill sustains
# here when the machine is idle (SmolLM2-135M: a 192-token prompt's first token in 0.4 s, ~450
# prompt tokens/s through the unified step, ~100 GFLOP/s; BENCHMARKS.md, prefix-cache spill).
HOST_LINKS = {"gpu": (25e9, 0.5 * 989e12), "cpu": (5e9, 100e9)}


@dataclasses.dataclass(frozen=True)
class SwapCost:
    """The swap-vs-recompute rule of one model on one platform (see the module doc).

    Attributes:
      kv_bytes_per_token: KV bytes one token holds (all layers, K and V, scales, a draft model's).
      params: the model's parameter count (2 FLOPs per weight per token).
      layers, q_heads, head_dim: the attention term (causal: 2 * L * H * D * n**2 FLOPs for n tokens).
      link_bytes_per_s, flops_per_s: the platform's host link and prefill compute rate.
      state_bytes: bytes of a sequence's recurrent states (a hybrid model's; 0 without), copied with its pages.
    """
    kv_bytes_per_token: int
    params: int
    layers: int
    q_heads: int
    head_dim: int
    link_bytes_per_s: float
    flops_per_s: float
    state_bytes: int = 0

    def __post_init__(self):
        for name in ("kv_bytes_per_token", "params", "layers", "q_heads", "head_dim", "link_bytes_per_s",
                     "flops_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SwapCost.{name} must be > 0; got {getattr(self, name)!r}")

    @classmethod
    def for_model(cls, config, params: int, kv_bytes_per_token: int, platform: str,
                  state_bytes: int = 0) -> "SwapCost":
        """The rule of a model (its config: num_layers, num_q_heads, head_dim) on `platform` ("cpu",
        "gpu", "cuda", "rocm"; others use the GPU figures); state_bytes: its recurrent states per sequence."""
        link, flops = HOST_LINKS["cpu" if platform == "cpu" else "gpu"]
        return cls(int(kv_bytes_per_token), int(params), config.num_layers, config.num_q_heads, config.head_dim,
                   link, flops, int(state_bytes))

    def swap_seconds(self, num_tokens: int) -> float:
        """Copying num_tokens tokens' KV (and the sequence's recurrent states) to the host and back."""
        return 2 * (num_tokens * self.kv_bytes_per_token + self.state_bytes) / self.link_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float:
        """Prefilling num_tokens tokens again (weights and causal attention)."""
        n = num_tokens
        return (2 * self.params * n + 2 * self.layers * self.q_heads * self.head_dim * n * n) / self.flops_per_s

    def prefers_swap(self, num_tokens: int) -> bool:
        return self.swap_seconds(num_tokens) < self.recompute_seconds(num_tokens)

    def describe(self) -> str:
        per = lambda f: f(1000) / 1000 * 1e6  # noqa: E731  (us per token at 1000 tokens)
        return (f"swap {per(self.swap_seconds):.2f} us/token vs recompute {per(self.recompute_seconds):.2f} us/token "
                f"(1000-token sequence): {'swap' if self.prefers_swap(1000) else 'recompute'}")


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


@dataclasses.dataclass
class SpilledPage:
    """One prefix-cache page in the host tier: its host page and its data (the cache pytree's leaves,
    each [.., .., 1, ...], page axis 2, in host memory)."""
    host_page: int
    data: object


class HostTier:
    """The host tier's bookkeeping: capacity, free host pages, the blocks of swapped sequences and
    the spilled prefix-cache pages (LRU order; see the module doc for the eviction policy).

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
        self.spilled: collections.OrderedDict = collections.OrderedDict()  # prefix key id -> SpilledPage, LRU first
        self.on_evict = None        # called with a spilled key id the tier evicts (the prefix cache drops the key)
        self.spill_evictions = 0    # spilled pages evicted for room (LRU)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_swap_pages(self) -> int:
        """Host pages held by swap blocks (what spills can never take)."""
        return sum(len(b.host_pages) for b in self.blocks.values())

    def __contains__(self, key) -> bool:
        return key in self.blocks

    def _evict_spilled(self, count: int) -> None:
        """Frees `count` host pages by evicting the least recently used spilled pages."""
        for _ in range(count):
            kid, page = self.spilled.popitem(last=False)
            self._free.append(page.host_page)
            self.spill_evictions += 1
            if self.on_evict is not None:
                self.on_evict(kid)

    def reserve(self, key, num_pages: int, num_tokens: int) -> bool:
        """Takes num_pages host pages for `key` (its data attached later), evicting spilled prefix
        pages (LRU) if the free ones do not suffice; False (nothing taken) when even that leaves too few."""
        if key in self.blocks:
            raise RuntimeError(f"{key!r} already holds a block in the host tier")
        if num_pages > len(self._free) + len(self.spilled):
            return False
        self._evict_spilled(max(0, num_pages - len(self._free)))
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

    def spill(self, kid, data) -> bool:
        """Keeps an evicted prefix-cache page (key id `kid`) in the tier: a free host page, else the
        least recently used spilled page's; False (nothing kept) when swap blocks hold every page."""
        if kid in self.spilled:
            raise RuntimeError(f"prefix key {kid} is already spilled")
        if not self._free:
            if not self.spilled:
                return False
            self._evict_spilled(1)
        self.spilled[kid] = SpilledPage(self._free.pop(), data)
        return True

    def unspill(self, kid) -> SpilledPage:
        """Removes a spilled page (restored to the device, or computed there again); its host page is free."""
        page = self.spilled.pop(kid)
        self._free.append(page.host_page)
        return page

    def touch(self, kids) -> None:
        """Marks spilled pages as just used (a host hit)."""
        for kid in kids:
            self.spilled.move_to_end(kid)

    def clear_spilled(self) -> list:
        """Drops every spilled page; returns their key ids."""
        kids = list(self.spilled)
        for kid in kids:
            self.unspill(kid)
        return kids

    def check(self) -> list[str]:
        """Disagreements in the bookkeeping (empty when consistent): every host page free, in exactly
        one block or holding exactly one spilled page."""
        held = [p for b in self.blocks.values() for p in b.host_pages] + [s.host_page for s in self.spilled.values()]
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


def _gather_pages(cache, ids):
    """Pages `ids` (i32[size]) of every leaf of the cache, one pytree per page (page axis 2 of size 1)."""
    return tuple(jax.tree_util.tree_map(lambda a: jax.lax.dynamic_slice_in_dim(a, ids[i], 1, axis=2), cache)
                 for i in range(ids.shape[0]))


def _restore_pages(page_state, evict, slot, table, host_mask, hit_tokens):
    """The page work of a prefix restore (see `Mover.restore`): (page_state, ok)."""
    ps = pages.uncache(page_state, evict)
    count = jnp.sum(host_mask, dtype=jnp.int32)
    ps, fresh, got = pages.alloc_cached(ps, count, width=table.shape[0])
    rank = jnp.cumsum(host_mask) - 1                                   # i32[pages_per_seq]
    table = jnp.where(host_mask, fresh[jnp.clip(rank, 0, table.shape[0] - 1)], table)
    ps, shared = pages.share(ps, slot[None], table[None], hit_tokens[None])
    ok = got & shared
    return jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), ps, page_state), ok


def _scatter_pages(cache, block_tables, data, ok, slot, positions):
    """data[i] (one page's leaves, in host memory) into the slot's page at logical position
    positions[i] (-1: padding, not written), where ok; every leaf of the cache (page axis 2)."""
    num_pages = jax.tree_util.tree_leaves(cache)[0].shape[2]
    dst = jnp.where(ok & (positions >= 0), block_tables[slot, jnp.maximum(positions, 0)], num_pages)  # i32[size]

    def put(pool, *pieces):
        pieces = [jax.device_put(p, jax.memory.Space.Device) if _has_memory_space() else p for p in pieces]
        return pool.at[:, :, dst].set(jnp.concatenate(pieces, axis=2).astype(pool.dtype), mode="drop")

    return jax.tree_util.tree_map(put, cache, *data)


def _put_states(states, data, ok, slot):
    """states (leaves [layers, slots, ...]) with slot `slot` set to data (leaves [layers, ...]) where ok."""
    def put(a, b):
        b = jax.device_put(b, jax.memory.Space.Device) if _has_memory_space() else b
        return a.at[:, slot].set(jnp.where(ok, b.astype(a.dtype), a[:, slot]))
    return jax.tree_util.tree_map(put, states, data)


def _has_memory_space() -> bool:
    return hasattr(jax, "memory") and hasattr(jax.memory, "Space")


def _to_host(tree):
    """The tree moved to host memory inside the program (`jax.memory.Space.Host`: memory kind
    pinned_host). Lowered, as an output sharding with that kind is, to XLA's
    annotate_device_placement and a pinned_host result; unlike an output sharding it survives a
    deviceless compile (compile-only devices have no memories, and drop a sharding's kind), so
    the compiled program shown there is the one that runs (`jpa tools compile-offload`)."""
    return jax.device_put(tree, jax.memory.Space.Host)


def swap_out_program(size: int, memory_kind: str | None):
    """The swap-out program of blocks of `size` pages (unjitted): the block in host memory when
    memory_kind is "pinned_host", else where the device keeps it."""
    host = memory_kind == "pinned_host" and _has_memory_space()
    def swap_out(cache, block_tables, slot):
        block = _gather(cache, block_tables, slot, size=size)
        return _to_host(block) if host else block
    return swap_out


def spill_program(memory_kind: str | None):
    """The prefix-cache spill program (unjitted): pages `ids` gathered, one pytree per page, in host
    memory when memory_kind is "pinned_host"."""
    host = memory_kind == "pinned_host" and _has_memory_space()
    def spill(cache, ids):
        data = _gather_pages(cache, ids)
        return _to_host(data) if host else data
    return spill


class Mover:
    """The compiled swap programs of one cache layout (jitted per block bucket).

    Args:
      memory_kind: where blocks live (`host_memory_kind()`; None = the device's default memory).
      device: the device of the pool.
    """

    def __init__(self, memory_kind: str | None, device=None):
        device = device or jax.devices()[0]
        self.memory_kind = memory_kind
        # Blocks reach host memory inside the gather programs (`_to_host`); the output sharding says
        # the same where a backend's device has the kind.
        host = None if memory_kind is None else jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)
        self._out = {} if host is None else dict(out_shardings=host)
        self._gathers = {}
        self._pages = jax.jit(_swap_in_pages, donate_argnums=(0,))
        # One scatter program per block bucket (small: it compiles fast); the page work is one program.
        self._scatter = jax.jit(_scatter_block, donate_argnums=(0,), static_argnames=("page_size",))
        self._restore = jax.jit(_restore_pages, donate_argnums=(0,))
        self._scatter_pages = jax.jit(_scatter_pages, donate_argnums=(0,))   # one program per bucket of pages
        self._put_states = jax.jit(_put_states, donate_argnums=(0,))

    def spill(self, cache, page_ids, size: int):
        """Prefix-cache spill: pages `page_ids` (len <= size, a bucket) copied to host memory, one
        pytree per page (padding gathers page 0 and is dropped). Dispatched asynchronously before
        the program that frees them (the pool is read before any later call writes it)."""
        if ("spill", size) not in self._gathers:
            self._gathers["spill", size] = jax.jit(spill_program(self.memory_kind), **self._out)
        ids = list(page_ids) + [0] * (size - len(page_ids))
        return self._gathers["spill", size](cache, jnp.asarray(ids, jnp.int32))[: len(page_ids)]

    def restore(self, cache, page_state, data, evict, slot: int, table, host_mask, hit_tokens: int):
        """(cache, page_state, ok): a prefix-cache hit partly in the host tier, into empty `slot`. The
        round's evictions (i32[num_pages], -1 padding) first; then fresh pages, cached, for the hit's
        host-resident positions (bool[pages_per_seq] host_mask); the hit's pages (table
        i32[pages_per_seq], device pages elsewhere) shared into the slot up to hit_tokens; then
        data (one page pytree per host position, in order; padded to a bucket by repeating the
        first, not written) copied in. All or nothing (ok bool[] on the device). cache and
        page_state are donated."""
        positions = [j for j, m in enumerate(host_mask) if m]   # host_mask: a host list / numpy array
        size = bucket(len(positions), table.shape[0])
        data = tuple(data) + (data[0],) * (size - len(data))
        pos = jnp.asarray(positions + [-1] * (size - len(positions)), jnp.int32)
        slot = jnp.int32(slot)
        page_state, ok = self._restore(page_state, jnp.asarray(evict, jnp.int32), slot, jnp.asarray(table, jnp.int32),
                                       jnp.asarray(host_mask, bool), jnp.int32(hit_tokens))
        cache = self._scatter_pages(cache, page_state.block_tables, data, ok, slot, pos)
        return cache, page_state, ok

    def swap_out(self, cache, page_state, slot: int, size: int):
        """The block of slot's first `size` pages (size: a bucket), placed in host memory. Dispatched
        asynchronously: nothing waits for the copy (the pool is read before any later call writes it)."""
        if size not in self._gathers:
            self._gathers[size] = jax.jit(swap_out_program(size, self.memory_kind), **self._out)
        return self._gathers[size](cache, page_state.block_tables, jnp.int32(slot))

    def swap_out_states(self, states, slot: int):
        """A hybrid model's recurrent states of `slot` ({group: {state: [layers, *shape]}}), placed in host
        memory beside its swapped block; dispatched asynchronously, as `swap_out`."""
        if "states" not in self._gathers:
            host = self.memory_kind == "pinned_host" and _has_memory_space()
            take = lambda st, s: jax.tree_util.tree_map(lambda a: a[:, s], st)  # noqa: E731
            self._gathers["states"] = jax.jit(lambda st, s: _to_host(take(st, s)) if host else take(st, s),
                                              **self._out)
        return self._gathers["states"](states, jnp.int32(slot))

    def swap_in_states(self, states, data, ok, slot: int):
        """states with `slot` holding `data` (what `swap_out_states` took) where ok (bool[], the swap-in's),
        else as they were. states are donated."""
        return self._put_states(states, data, ok, jnp.int32(slot))

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
