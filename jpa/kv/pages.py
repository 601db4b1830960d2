"""Page allocation as pure-functional device state (vLLM's block manager, inside `jax.jit`).

`PageState` is a pytree of fixed-shape arrays: a stack of free page ids, per-page reference
counts, the block tables and the sequence lengths. Every operation is a pure function
`(state, ...) -> (state, ...)` that runs on the device with no host sync, so the engine can
allocate inside its jitted decode step with the state donated (`donate_argnums`).

Conventions shared by every operation:

- A sequence holds `ceil(seq_lens[b] / page_size)` pages: `block_tables[b, :that]`. Entries past
  them are 0 (a valid page index, so kernels that load whole chunks of a table never go out of
  bounds) and are not references.
- `refcounts[p]` is the number of live block-table entries naming page p, plus 1 when the page
  is held by the prefix cache (`cached[p]`, see `cache`/`uncache`/`share`); a page is free
  exactly when its refcount is 0, and then it sits in `free_pages[:num_free]`. A cached page that
  no table names is "cached-idle": not free until `uncache` evicts it.
- All or nothing: when an operation cannot complete (pages run out, or a traced argument is
  invalid) it returns `ok = False` and the state unchanged, bit for bit. This is done by masking
  every scatter with `ok` (so a donated state is still updated in place), not by a select over
  whole arrays.
- Vectorized: one call is one pass of prefix sums, scatters and (for copy-on-write after a fork)
  one sort over max_seqs; never a loop over sequences or pages. Work per call: append
  O(max_seqs log max_seqs), independent of num_pages (it touches only the pages it allocates or
  copies, in place when the state is donated); reserve and fork O(max_seqs * pages_per_seq);
  release O(max_seqs * pages_per_seq + num_pages).
- `seq_ids` arguments are Python ints/lists or i32[n] arrays; -1 entries are padding and are
  ignored (keep n fixed inside jit). Concrete arguments are validated on the host (ValueError);
  traced ones cannot be, and what an invalid traced value does is stated per function.
- Allocation pops from the top of the free stack (lowest sequence id first, logical pages in
  order); release pushes freed pages in ascending page-id order. This order is part of the
  tested behaviour, not a promise callers should rely on.
"""

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jpa.ops.validate import is_concrete

_I32 = jnp.int32


@flax.struct.dataclass
class PageState:
    """The allocator: which pages are free, who references which page, and each sequence's table.

    Attributes:
      free_pages: i32[num_pages]; `free_pages[:num_free]` are the free page ids (a stack, top at
        `num_free - 1`). Entries at and above num_free are stale and meaningless.
      num_free: i32[]; number of free pages.
      refcounts: i32[num_pages]; live block-table entries naming each page (0 = free).
      block_tables: i32[max_seqs, pages_per_seq]; logical page j of sequence b is physical page
        `block_tables[b, j]` for j < ceil(seq_lens[b] / page_size); 0 elsewhere.
      seq_lens: i32[max_seqs]; tokens each sequence holds (0 = empty slot).
      cached: bool[num_pages]; the page is held by the prefix cache (one reference of its refcount).
      page_size: tokens per page (static).
    """
    free_pages: jax.Array  # i32[num_pages]
    num_free: jax.Array  # i32[]
    refcounts: jax.Array  # i32[num_pages]
    block_tables: jax.Array  # i32[max_seqs, pages_per_seq]
    seq_lens: jax.Array  # i32[max_seqs]
    cached: jax.Array  # bool[num_pages]
    page_size: int = flax.struct.field(pytree_node=False)

    @property
    def num_pages(self) -> int:
        return self.refcounts.shape[0]

    @property
    def max_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def pages_per_seq(self) -> int:
        return self.block_tables.shape[1]

    @property
    def max_seq_len(self) -> int:
        """Most tokens one sequence may hold: pages_per_seq * page_size."""
        return self.pages_per_seq * self.page_size


@flax.struct.dataclass
class CopyOnWrite:
    """Page copies the cache must apply: `jpa.copy_pages(cache, cow.src, cow.dst)`.

    Apply them before writing the new tokens' K/V. Entry b belongs to sequence b; -1 = no copy.

    Attributes:
      src: i32[max_seqs]; the shared page sequence b was writing into.
      dst: i32[max_seqs]; its fresh private copy (now in sequence b's block table).
    """
    src: jax.Array  # i32[max_seqs]
    dst: jax.Array  # i32[max_seqs]


def init(num_pages: int, max_seqs: int, pages_per_seq: int, page_size: int) -> PageState:
    """An allocator with every page free and every sequence empty.

    Args:
      num_pages: pages in the pool (>= 1).
      max_seqs: sequence slots (rows of block_tables, >= 1).
      pages_per_seq: most pages one sequence may hold (>= 1).
      page_size: tokens per page (>= 1).

    Returns:
      The initial PageState.
    """
    for name, val in (("num_pages", num_pages), ("max_seqs", max_seqs),
                      ("pages_per_seq", pages_per_seq), ("page_size", page_size)):
        if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{name} must be an int >= 1; got {val!r}")
    if num_pages >= 2**31 - 1 or num_pages * page_size >= 2**31:
        raise ValueError(f"num_pages * page_size must fit in int32 slot ids; got num_pages="
                         f"{num_pages}, page_size={page_size}")
    return PageState(
        # Reversed so the first pops hand out pages 0, 1, 2, ... (easier to read in a debugger).
        free_pages=jnp.arange(num_pages - 1, -1, -1, dtype=_I32),  # i32[num_pages]
        num_free=jnp.asarray(num_pages, _I32),
        refcounts=jnp.zeros((num_pages,), _I32),
        block_tables=jnp.zeros((max_seqs, pages_per_seq), _I32),
        seq_lens=jnp.zeros((max_seqs,), _I32),
        cached=jnp.zeros((num_pages,), bool),
        page_size=int(page_size))


# ----------------------------------------------------------------------------- host-side checks


def _check_state(state):
    if not isinstance(state, PageState):
        raise ValueError(f"state must be a jpa.kv.pages.PageState; got {type(state).__name__}")


def _as_ids(name, ids, max_seqs, *, unique):
    """seq ids (int, list or i32[n]) -> i32[n]; validated when concrete."""
    if isinstance(ids, (bool, np.bool_)):
        raise ValueError(f"{name} must be sequence ids (ints); got {ids!r}")
    if isinstance(ids, (int, np.integer)):
        ids = [int(ids)]
    if isinstance(ids, (list, tuple)):
        if not all(isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_))
                   for i in ids):
            raise ValueError(f"{name} must be an int or a 1-D i32[n] array of sequence ids; got {ids!r}")
        ids = np.asarray(ids, dtype=np.int64) if len(ids) else np.zeros(0, np.int64)
    if getattr(ids, "ndim", None) != 1:
        raise ValueError(f"{name} must be an int or a 1-D i32[n] array of sequence ids; got shape "
                         f"{getattr(ids, 'shape', type(ids).__name__)}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name} must have an integer dtype; got {np.dtype(ids.dtype).name}")
    if is_concrete(ids):
        v = np.asarray(ids).astype(np.int64)
        bad = v[(v < -1) | (v >= max_seqs)]
        if bad.size:
            raise ValueError(f"{name} entries must be sequence ids in [0, max_seqs = {max_seqs}) "
                             f"or -1 (padding); got {int(bad[0])}")
        real = v[v >= 0]
        if unique and np.unique(real).size != real.size:
            raise ValueError(f"{name} must not repeat a sequence id (-1 padding may repeat); "
                             f"got {v.tolist()}")
    return jnp.asarray(ids, _I32)


def _as_counts(name, x, n, cap):
    """Token counts (scalar or i32[n]) -> i32[n]; validated when concrete."""
    if isinstance(x, (bool, np.bool_)):
        raise ValueError(f"{name} must be an int or i32[n]; got {x!r}")
    if isinstance(x, (int, np.integer, list, tuple)):
        x = np.asarray(x, dtype=np.int64)
    if getattr(x, "ndim", None) not in (0, 1) or (x.ndim == 1 and x.shape[0] != n):
        raise ValueError(f"{name} must be a scalar or i32[{n}] (one per seq id); got shape "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must have an integer dtype; got {np.dtype(x.dtype).name}")
    if is_concrete(x):
        v = np.asarray(x).astype(np.int64).reshape(-1)
        bad = v[(v < 0) | (v > cap)]
        if bad.size:
            raise ValueError(f"{name} must be in [0, pages_per_seq * page_size = {cap}]; "
                             f"got {int(bad[0])}")
    return jnp.broadcast_to(jnp.asarray(x, _I32), (n,))


# ----------------------------------------------------------------------------- device-side core


def pages_for_tokens(num_tokens, page_size):
    """Pages a sequence of `num_tokens` tokens holds: ceil(num_tokens / page_size).

    The one rule behind every page count: the device operations below use it on traced arrays, and
    a host scheduler uses it on Python ints (it is plain integer arithmetic, no JAX needed), so the
    two can never disagree.

    Args:
      num_tokens: int, NumPy or JAX integer array (>= 0).
      page_size: tokens per page (>= 1).

    Returns:
      The page count, of the same kind as num_tokens.
    """
    return (num_tokens + page_size - 1) // page_size


def _select(ids, max_seqs):
    """i32[n] ids -> (safe ids with padding/out-of-range sent to max_seqs, bad, duplicated)."""
    bad = jnp.any((ids < -1) | (ids >= max_seqs))
    safe = jnp.where((ids >= 0) & (ids < max_seqs), ids, max_seqs)  # scatter with mode="drop" skips
    counts = jnp.zeros((max_seqs,), _I32).at[safe].add(1, mode="drop")  # i32[max_seqs]
    return safe, bad, jnp.any(counts > 1)


def _plan(state, grow, target):
    """What growing the sequences in `grow` to `target` tokens costs.

    A sequence whose last page is partly filled writes into it; if that page is shared (refcount
    > 1) it must copy on write. When every holder of a shared page grows in the same call, the
    lowest-id holder keeps the page and the others copy (vLLM, done sequentially, also ends with
    refcount - 1 copies), so no page is left behind unreferenced.

    Returns (old_np, new_np, last, cow, n_new), each [max_seqs]: pages held before and after,
    the current last page, whether it copies on write, and pages to allocate.
    """
    ps, num_pages = state.page_size, state.num_pages
    max_seqs = state.max_seqs
    lens = state.seq_lens  # i32[max_seqs]
    seq = jnp.arange(max_seqs, dtype=_I32)
    old_np = pages_for_tokens(lens, ps)
    new_np = jnp.where(grow, pages_for_tokens(target, ps), old_np)
    last = jnp.take_along_axis(state.block_tables, jnp.maximum(old_np - 1, 0)[:, None], axis=1)[:, 0]
    partial = grow & (lens % ps != 0)
    ref_last = state.refcounts[last]  # i32[max_seqs]
    shared = partial & (ref_last > 1)

    def keepers(_):
        # Group the sequences by the page they write into with a sort over max_seqs (not a
        # scatter into a num_pages-sized scratch array, which would make every step
        # O(num_pages)). Sequences not writing into a partial page get distinct keys.
        key = jnp.where(partial, last, num_pages + seq)  # i32[max_seqs]
        order = jnp.argsort(key, stable=True)  # equal keys keep ascending sequence ids
        sorted_key = key[order]
        starts = jnp.concatenate([jnp.ones((1,), bool), sorted_key[1:] != sorted_key[:-1]])
        group = jnp.cumsum(starts) - 1  # i32[max_seqs]: group of each sorted position
        size = jnp.zeros((max_seqs,), _I32).at[group].add(1)  # i32[max_seqs] (groups <= max_seqs)
        # Sorted position i holds sequence order[i]: send (group size, is first) back to it.
        packed = jnp.zeros((max_seqs,), _I32).at[order].set(size[group] * 2 + starts)
        return shared & (packed // 2 == ref_last) & (packed % 2 == 1)

    # Shared partial pages exist only right after a fork: skip the sort in ordinary steps.
    keep = jax.lax.cond(jnp.any(shared), keepers, lambda _: jnp.zeros_like(shared), None)
    cow = shared & ~keep
    n_new = new_np - old_np + cow.astype(_I32)
    return old_np, new_np, last, cow, n_new


@jax.jit
def _reserve(state, ids, num_tokens, allow_cow):
    max_seqs, pages_per_seq = state.block_tables.shape
    safe, bad, dup = _select(ids, max_seqs)
    sel = jnp.zeros((max_seqs,), bool).at[safe].set(True, mode="drop")  # bool[max_seqs]
    target = state.seq_lens.at[safe].set(num_tokens, mode="drop")  # i32[max_seqs]
    lens = state.seq_lens
    valid = ~bad & ~dup & jnp.all(~sel | ((target >= lens) & (target <= state.max_seq_len)))
    grow = sel & (target > lens)
    old_np, new_np, last, cow, n_new = _plan(state, grow, target)
    total = jnp.sum(n_new)
    ok = valid & (total <= state.num_free) & (allow_cow | ~jnp.any(cow))
    return _apply_grow(state, ok, grow, target, old_np, new_np, last, cow, n_new, total) + (ok,)


def _apply_grow(state, ok, grow, target, old_np, new_np, last, cow, n_new, total):
    """Pops `total` pages and writes them into the tables (all masked by ok)."""
    num_pages, pages_per_seq = state.num_pages, state.pages_per_seq
    first_j = old_np - cow.astype(_I32)  # first logical page that gets a fresh page
    offs = jnp.cumsum(n_new) - n_new  # i32[max_seqs]: exclusive prefix sum = rank of first pop
    j = jnp.arange(pages_per_seq, dtype=_I32)[None, :]
    fresh = ok & (j >= first_j[:, None]) & (j < new_np[:, None])  # bool[max_seqs, pages_per_seq]
    k = offs[:, None] + j - first_j[:, None]  # pop rank of each fresh entry
    page = state.free_pages[jnp.clip(state.num_free - 1 - k, 0, num_pages - 1)]
    tables = jnp.where(fresh, page, state.block_tables)
    refcounts = state.refcounts.at[jnp.where(fresh, page, num_pages).ravel()].set(1, mode="drop")
    do_cow = ok & cow
    refcounts = refcounts.at[jnp.where(do_cow, last, num_pages)].add(-1, mode="drop")
    cow_dst = jnp.take_along_axis(tables, jnp.maximum(old_np - 1, 0)[:, None], axis=1)[:, 0]
    copies = CopyOnWrite(src=jnp.where(do_cow, last, -1), dst=jnp.where(do_cow, cow_dst, -1))
    state = state.replace(
        num_free=state.num_free - jnp.where(ok, total, 0), refcounts=refcounts,
        block_tables=tables, seq_lens=jnp.where(ok & grow, target, state.seq_lens))
    return state, copies


@jax.jit
def _append(state, active):
    ps, num_pages = state.page_size, state.num_pages
    max_seqs = state.max_seqs
    lens = state.seq_lens  # i32[max_seqs]
    seq = jnp.arange(max_seqs, dtype=_I32)
    valid = jnp.all(~active | (lens < state.max_seq_len))
    old_np, new_np, last, cow, n_new = _plan(state, active, lens + 1)
    total = jnp.sum(n_new)
    ok = valid & (total <= state.num_free)
    # At most one fresh page per sequence: a scatter of max_seqs entries, not a pass over the table.
    fresh = ok & (n_new > 0)
    rank = jnp.cumsum(n_new) - n_new
    page = state.free_pages[jnp.clip(state.num_free - 1 - rank, 0, num_pages - 1)]  # i32[max_seqs]
    j_new = jnp.where(cow, old_np - 1, old_np)  # logical index of the fresh page
    tables = state.block_tables.at[jnp.where(fresh, seq, max_seqs), j_new].set(page, mode="drop")
    do_cow = ok & cow
    # One scatter: fresh pages 0 -> 1 (a free page's refcount is 0), copied-from pages - 1.
    refcounts = state.refcounts.at[jnp.concatenate([jnp.where(fresh, page, num_pages),
                                                    jnp.where(do_cow, last, num_pages)])].add(
        jnp.concatenate([jnp.ones_like(page), -jnp.ones_like(last)]), mode="drop")
    copies = CopyOnWrite(src=jnp.where(do_cow, last, -1), dst=jnp.where(do_cow, page, -1))
    write = ok & active
    slot_page = jnp.take_along_axis(tables, (lens // ps)[:, None], axis=1, mode="clip")[:, 0]
    slot_mapping = jnp.where(write, slot_page * ps + lens % ps, -1)  # i32[max_seqs]
    state = state.replace(num_free=state.num_free - jnp.where(ok, total, 0), refcounts=refcounts,
                          block_tables=tables, seq_lens=lens + write.astype(_I32))
    return state, slot_mapping, ok, copies


@jax.jit
def _truncate(state, ids, num_tokens):
    num_pages, (max_seqs, pages_per_seq) = state.num_pages, state.block_tables.shape
    safe, _, _ = _select(ids, max_seqs)
    # Per sequence the new length: min(current, asked) where selected (truncate never grows).
    target = state.seq_lens.at[safe].min(num_tokens, mode="drop")  # i32[max_seqs]
    j = jnp.arange(pages_per_seq, dtype=_I32)[None, :]
    held = pages_for_tokens(state.seq_lens, state.page_size)[:, None]
    keep = pages_for_tokens(target, state.page_size)[:, None]
    gone = (j >= keep) & (j < held)  # bool[max_seqs, pages_per_seq]
    drop = jnp.zeros((num_pages,), _I32).at[jnp.where(gone, state.block_tables, num_pages).ravel()].add(
        1, mode="drop")
    refcounts = state.refcounts - drop
    free_pages, num_free = _push_free(state, refcounts, drop > 0)
    return state.replace(free_pages=free_pages, num_free=num_free, refcounts=refcounts,
                         block_tables=jnp.where(gone, 0, state.block_tables), seq_lens=target)


def _release(state, ids):
    return _truncate(state, ids, jnp.zeros(ids.shape, _I32))   # a release is a truncation to nothing


@jax.jit
def _fork(state, src, dst):
    num_pages, (max_seqs, pages_per_seq) = state.num_pages, state.block_tables.shape
    pair = dst >= 0
    safe_dst, bad_dst, dup = _select(dst, max_seqs)
    bad_src = jnp.any(pair & ((src < 0) | (src >= max_seqs)))
    src_of = jnp.full((max_seqs,), -1, _I32).at[safe_dst].set(src, mode="drop")  # i32[max_seqs]
    sel = src_of >= 0
    ok = ~bad_dst & ~dup & ~bad_src & jnp.all(~sel | (state.seq_lens == 0))
    take = ok & sel
    src_c = jnp.clip(src_of, 0, max_seqs - 1)
    rows = state.block_tables[src_c]  # i32[max_seqs, pages_per_seq], read before any write
    lens = state.seq_lens[src_c]  # i32[max_seqs]
    j = jnp.arange(pages_per_seq, dtype=_I32)[None, :]
    live = take[:, None] & (j < pages_for_tokens(lens, state.page_size)[:, None])
    add = jnp.zeros((num_pages,), _I32).at[jnp.where(live, rows, num_pages).ravel()].add(
        1, mode="drop")
    state = state.replace(
        refcounts=state.refcounts + add,
        block_tables=jnp.where(take[:, None], rows, state.block_tables),
        seq_lens=jnp.where(take, lens, state.seq_lens))
    return state, ok


# ----------------------------------------------------------------------------- public operations


def reserve(state: PageState, seq_ids, num_tokens, *, return_cow: bool = False):
    """Grows sequences to hold `num_tokens` tokens each (prompt admission, chunked prefill).

    Pages are allocated for the new tokens; seq_lens becomes num_tokens. Reserve never shrinks:
    num_tokens below a sequence's current length fails (release and reserve again instead), and
    num_tokens equal to it is a no-op for that sequence. Write the tokens' K/V at
    `slot_mapping_for(state, seq_ids, start, count, width=...)`.

    Growing into a partly filled page that is shared after `fork` needs a copy-on-write. With
    return_cow=False such a call fails (ok False); with return_cow=True it copies and the copies
    are returned for `jpa.copy_pages`.

    Args:
      state: the PageState.
      seq_ids: int, list or i32[n]; -1 = padding. Concrete: ids must be in [0, max_seqs) or -1,
        non-padding ids distinct, else ValueError. Traced: any violation makes ok False.
      num_tokens: int or i32[n], in [0, pages_per_seq * page_size] (ValueError when concrete; a
        traced value out of range makes ok False).
      return_cow: static; also return the CopyOnWrite pairs (see above).

    Returns:
      (state, ok) or (state, ok, cow) with return_cow. ok: bool[]; when False (pages ran out,
      shrink, or an invalid traced argument) the state is returned unchanged and cow is all -1.
    """
    _check_state(state)
    ids = _as_ids("seq_ids", seq_ids, state.max_seqs, unique=True)
    counts = _as_counts("num_tokens", num_tokens, ids.shape[0], state.max_seq_len)
    new_state, cow, ok = _reserve(state, ids, counts, bool(return_cow))
    return (new_state, ok, cow) if return_cow else (new_state, ok)


def append(state: PageState, active):
    """Adds one token to every active sequence (a decode step), allocating and copying on write.

    A sequence crossing a page boundary (seq_len % page_size == 0, including an empty one) gets a
    fresh page. A sequence whose partly filled last page is shared (refcount > 1, after `fork`)
    gets a fresh page too, plus a copy the caller must apply: `jpa.copy_pages(cache, cow.src,
    cow.dst)` before writing the new K/V at slot_mapping.

    Args:
      state: the PageState.
      active: bool[max_seqs]; sequences that receive a token.

    Returns:
      (state, slot_mapping, ok, cow):
        slot_mapping: i32[max_seqs], the slot of each active sequence's new token (position
          seq_len - 1 after the call); -1 for inactive sequences and everywhere when not ok.
        ok: bool[]; False when pages run out or an active sequence already holds
          pages_per_seq * page_size tokens. Then the state is unchanged.
        cow: CopyOnWrite with i32[max_seqs] src/dst, -1 where no copy.
    """
    _check_state(state)
    if getattr(active, "shape", None) != (state.max_seqs,) or np.dtype(active.dtype) != np.bool_:
        raise ValueError(f"active must be bool[max_seqs = {state.max_seqs}]; got "
                         f"{getattr(active, 'dtype', type(active).__name__)}"
                         f"{list(getattr(active, 'shape', ()))}")
    return _append(state, jnp.asarray(active))


def release(state: PageState, seq_ids) -> PageState:
    """Frees sequences: drops their page references and empties them (seq_lens -> 0).

    A page whose refcount reaches 0 returns to the free pool; pages still shared with a forked
    sequence stay. Releasing an empty sequence or the same id twice is harmless.

    Args:
      state: the PageState.
      seq_ids: int, list or i32[n]; -1 = padding. Concrete ids outside [0, max_seqs) raise
        ValueError; traced ones are ignored.

    Returns:
      The new state.
    """
    _check_state(state)
    ids = _as_ids("seq_ids", seq_ids, state.max_seqs, unique=False)
    return _release(state, ids)


def truncate(state: PageState, seq_ids, num_tokens) -> PageState:
    """Shrinks sequences to `num_tokens` tokens (speculative decoding's rollback of rejected drafts).

    seq_lens becomes min(seq_len, num_tokens); the pages past `pages_for_tokens(num_tokens)` are
    dropped from the table (refcount - 1; back to the free pool at 0, ascending page ids). The
    pages kept are untouched, so a partly filled last page keeps its refcount (shared or not).
    num_tokens >= seq_len changes nothing for that sequence; a repeated id truncates to the
    smaller count.

    Args:
      state: the PageState.
      seq_ids: int, list or i32[n]; -1 = padding. Concrete ids outside [0, max_seqs) raise
        ValueError; traced ones are ignored.
      num_tokens: int or i32[n] in [0, pages_per_seq * page_size].

    Returns:
      The new state.
    """
    _check_state(state)
    ids = _as_ids("seq_ids", seq_ids, state.max_seqs, unique=False)
    counts = _as_counts("num_tokens", num_tokens, ids.shape[0], state.max_seq_len)
    return _truncate(state, ids, counts)


def fork(state: PageState, src_ids, dst_ids):
    """Makes each dst sequence share all of its src's pages (beam search, parallel sampling).

    Refcounts go up, dst gets src's block table and length; nothing is copied until one of them
    writes into a shared page (see `append`). All pairs read the state before the call.

    Args:
      state: the PageState.
      src_ids, dst_ids: int, list or i32[n] of the same length; a pair with dst = -1 is padding.
        dst ids must be distinct and every dst must be empty (seq_len 0; `release` it first).
        Concrete ids out of range, a repeated dst, or src = -1 with a real dst raise ValueError;
        traced, they (and a non-empty dst) make ok False.

    Returns:
      (state, ok); the state is unchanged when ok is False.
    """
    _check_state(state)
    src = _as_ids("src_ids", src_ids, state.max_seqs, unique=False)
    dst = _as_ids("dst_ids", dst_ids, state.max_seqs, unique=True)
    if src.shape != dst.shape:
        raise ValueError(f"src_ids and dst_ids must have the same length; got {src.shape[0]} "
                         f"and {dst.shape[0]}")
    if is_concrete(src) and is_concrete(dst):
        s, d = np.asarray(src), np.asarray(dst)
        if np.any((s < 0) & (d >= 0)):
            raise ValueError(f"src_ids must be a sequence id wherever dst_ids is not -1; got "
                             f"src_ids={s.tolist()}, dst_ids={d.tolist()}")
    return _fork(state, src, dst)


def _push_free(state, refcounts, candidates):
    """Pushes the pages where candidates & (refcounts == 0) onto the free stack (ascending ids)."""
    num_pages = state.num_pages
    freed = candidates & (refcounts == 0)  # bool[num_pages]
    rank = jnp.cumsum(freed) - 1
    free_pages = state.free_pages.at[jnp.where(freed, state.num_free + rank, num_pages)].set(
        jnp.arange(num_pages, dtype=_I32), mode="drop")
    return free_pages, state.num_free + jnp.sum(freed, dtype=_I32)


@jax.jit
def _cache(state, ids, num_full):
    num_pages, (max_seqs, pages_per_seq) = state.num_pages, state.block_tables.shape
    safe, _, _ = _select(ids, max_seqs)
    n = jnp.zeros((max_seqs,), _I32).at[safe].max(num_full, mode="drop")  # i32[max_seqs]
    held = pages_for_tokens(state.seq_lens, state.page_size)
    full = state.seq_lens // state.page_size
    j = jnp.arange(pages_per_seq, dtype=_I32)[None, :]
    take = (j < jnp.minimum(n, jnp.minimum(full, held))[:, None])  # bool[max_seqs, pages_per_seq]
    mark = jnp.zeros((num_pages,), bool).at[jnp.where(take, state.block_tables, num_pages).ravel()].set(
        True, mode="drop")
    new = mark & ~state.cached
    return state.replace(refcounts=state.refcounts + new.astype(_I32), cached=state.cached | new)


@jax.jit
def _uncache(state, page_ids):
    num_pages = state.num_pages
    sel = jnp.zeros((num_pages,), bool).at[jnp.where(page_ids >= 0, page_ids, num_pages)].set(
        True, mode="drop")
    drop = sel & state.cached
    refcounts = state.refcounts - drop.astype(_I32)
    free_pages, num_free = _push_free(state, refcounts, drop)
    return state.replace(free_pages=free_pages, num_free=num_free, refcounts=refcounts,
                         cached=state.cached & ~drop)


@jax.jit
def _share(state, ids, tables, num_tokens):
    num_pages, (max_seqs, pages_per_seq) = state.num_pages, state.block_tables.shape
    ps = state.page_size
    safe, bad, dup = _select(ids, max_seqs)
    live = (ids >= 0) & (num_tokens > 0)
    n = num_tokens // ps  # i32[n]
    j = jnp.arange(pages_per_seq, dtype=_I32)[None, :]
    use = live[:, None] & (j < n[:, None])  # bool[n, pages_per_seq]
    pages_ok = jnp.all(~use | ((tables >= 0) & (tables < num_pages)))
    safe_pages = jnp.clip(tables, 0, num_pages - 1)
    held = jnp.all(~use | state.cached[safe_pages])
    empty = jnp.all(~live | (state.seq_lens[jnp.clip(ids, 0, max_seqs - 1)] == 0))
    whole = jnp.all(~live | ((num_tokens % ps == 0) & (num_tokens <= state.max_seq_len)))
    ok = ~bad & ~dup & pages_ok & held & empty & whole
    use = use & ok
    refcounts = state.refcounts.at[jnp.where(use, safe_pages, num_pages).ravel()].add(1, mode="drop")
    rows = jnp.where(use, safe_pages, 0)
    dst = jnp.where(live & ok, safe, max_seqs)
    return state.replace(refcounts=refcounts,
                         block_tables=state.block_tables.at[dst].set(rows, mode="drop"),
                         seq_lens=state.seq_lens.at[dst].set(num_tokens, mode="drop")), ok


@jax.jit
def _alloc_cached(state, count, slots):
    num_pages, width = state.num_pages, slots.shape[0]
    k = jnp.arange(width, dtype=_I32)
    ok = (count >= 0) & (count <= width) & (count <= state.num_free)
    take = ok & (k < count)
    page = state.free_pages[jnp.clip(state.num_free - 1 - k, 0, num_pages - 1)]  # i32[width]
    idx = jnp.where(take, page, num_pages)
    return state.replace(num_free=state.num_free - jnp.where(ok, count, 0),
                         refcounts=state.refcounts.at[idx].set(1, mode="drop"),
                         cached=state.cached.at[idx].set(True, mode="drop")), jnp.where(take, page, -1), ok


def alloc_cached(state: PageState, count, *, width: int):
    """Takes `count` free pages straight into the prefix cache (cached-idle: refcount 1, the cache's
    reference), for KV restored from a host tier (`jpa.kv.offload`); `share` then maps them into a
    sequence like any cached page.

    Args:
      state: the PageState.
      count: int or i32[] in [0, width]; pages to take (from the top of the free stack).
      width: static length of the returned ids.

    Returns:
      (state, page_ids i32[width] (-1 past count), ok); ok False (state unchanged) when fewer than
      count pages are free or count is out of range.
    """
    _check_state(state)
    if not isinstance(width, (int, np.integer)) or isinstance(width, bool) or width < 1:
        raise ValueError(f"width must be an int >= 1; got {width!r}")
    return _alloc_cached(state, jnp.asarray(count, _I32), jnp.zeros((width,), _I32))


def cache(state: PageState, seq_ids, num_full_pages) -> PageState:
    """Puts the first full pages of sequences into the prefix cache (automatic prefix caching).

    Each of the first `num_full_pages[i]` pages of sequence seq_ids[i] that is full (all
    page_size tokens written) and not cached yet becomes cached: `cached[p]` is set and the cache
    takes one reference (refcount + 1), so the page outlives the sequence's `release` as a
    cached-idle page until `uncache` evicts it. Pages already cached are left as they are; partly
    filled pages are never cached (a page is shared read-only only when full).

    Args:
      state: the PageState.
      seq_ids: int, list or i32[n]; -1 = padding (ids as `release`).
      num_full_pages: int or i32[n] (>= 0); capped at each sequence's full pages.

    Returns:
      The new state.
    """
    _check_state(state)
    ids = _as_ids("seq_ids", seq_ids, state.max_seqs, unique=False)
    counts = _as_counts("num_full_pages", num_full_pages, ids.shape[0], state.pages_per_seq)
    return _cache(state, ids, counts)


def uncache(state: PageState, page_ids) -> PageState:
    """Evicts pages from the prefix cache: the cache's reference is dropped, and a page no table
    names any more (cached-idle) returns to the free pool. Pages not cached are ignored.

    Args:
      state: the PageState.
      page_ids: int, list or i32[m]; -1 = padding.

    Returns:
      The new state.
    """
    _check_state(state)
    ids = jnp.atleast_1d(jnp.asarray(page_ids, _I32))
    if ids.ndim != 1:
        raise ValueError(f"page_ids must be an int or a 1-D list of page ids; got shape {ids.shape}")
    if is_concrete(ids) and np.any((np.asarray(ids) < -1) | (np.asarray(ids) >= state.num_pages)):
        raise ValueError(f"page_ids must be in [0, num_pages = {state.num_pages}) or -1; got "
                         f"{np.asarray(ids).tolist()}")
    return _uncache(state, ids)


def share(state: PageState, seq_ids, tables, num_tokens):
    """Maps cached pages into empty sequences: a prefix-cache hit.

    Sequence seq_ids[i] (empty: seq_len 0) gets `tables[i, :num_tokens[i] // page_size]` as its
    first pages, each page's refcount + 1, and seq_len num_tokens[i]. The pages must be cached
    (`cached[p]`) and num_tokens a multiple of page_size: only full pages are shared, so a
    sequence never writes into a shared page (its next token starts a fresh page). Grow it with
    `reserve` afterwards to prefill the rest of its prompt.

    Args:
      state: the PageState.
      seq_ids: int, list or i32[n]; -1 = padding; distinct.
      tables: i32[n, pages_per_seq] page ids (entries past the shared pages are ignored).
      num_tokens: int or i32[n]; tokens shared (0 = nothing for that sequence).

    Returns:
      (state, ok); ok False (and the state unchanged) when an id repeats, a sequence is not
      empty, a page is not cached, or num_tokens is not a multiple of page_size.
    """
    _check_state(state)
    ids = _as_ids("seq_ids", seq_ids, state.max_seqs, unique=True)
    n = ids.shape[0]
    counts = _as_counts("num_tokens", num_tokens, n, state.max_seq_len)
    tables = jnp.asarray(tables, _I32)
    if tables.shape != (n, state.pages_per_seq):
        raise ValueError(f"tables must be i32[{n}, pages_per_seq = {state.pages_per_seq}]; got {tables.shape}")
    return _share(state, ids, tables, counts)


# ----------------------------------------------------------------------------- helpers


def num_free_pages(state: PageState):
    """i32[]: pages in the free pool."""
    return state.num_free


@jax.jit
def _pages_needed(state, ids, num_tokens):
    safe, _, _ = _select(ids, state.max_seqs)
    sel = jnp.zeros((state.max_seqs,), bool).at[safe].set(True, mode="drop")
    target = state.seq_lens.at[safe].set(num_tokens, mode="drop")
    *_, n_new = _plan(state, sel & (target > state.seq_lens), target)
    return jnp.sum(n_new)


def pages_needed(state: PageState, seq_ids, num_tokens):
    """i32[]: pages `reserve(state, seq_ids, num_tokens, return_cow=True)` would allocate.

    Copy-on-write pages are included. For the next decode step of sequences `ids`, pass
    `num_tokens = state.seq_lens[ids] + 1`: that is exactly what `append` needs. Arguments as
    `reserve` (num_tokens below the current length count 0).
    """
    _check_state(state)
    ids = _as_ids("seq_ids", seq_ids, state.max_seqs, unique=True)
    counts = _as_counts("num_tokens", num_tokens, ids.shape[0], state.max_seq_len)
    return _pages_needed(state, ids, counts)


@jax.jit
def _slot_mapping_for(state, ids, start, count, positions):
    ps = state.page_size
    safe = jnp.where((ids >= 0) & (ids < state.max_seqs), ids, 0)
    t = start[:, None] + positions[None, :]  # i32[n, width]: token positions
    visible = ((ids >= 0) & (ids < state.max_seqs))[:, None] & (positions[None, :] < count[:, None])
    visible &= t < state.seq_lens[safe][:, None]  # only tokens the sequence has reserved
    rows = state.block_tables[safe]  # i32[n, pages_per_seq]
    page = jnp.take_along_axis(rows, t // ps, axis=1, mode="clip")
    return jnp.where(visible, page * ps + t % ps, -1)


def slot_mapping_for(state: PageState, seq_ids, start, num_tokens, *, width: int | None = None):
    """Cache slots of tokens [start, start + num_tokens) of each sequence (prefill writes).

    Args:
      state: the PageState (after `reserve`).
      seq_ids: int, list or i32[n]; -1 = padding (a row of -1).
      start: int or i32[n]; first token position.
      num_tokens: int or i32[n]; tokens in the row (<= width).
      width: static row length T; required when num_tokens is traced, else max(num_tokens).

    Returns:
      i32[n, width]; slot of token start + i of sequence seq_ids[r] at [r, i], or -1 where i >=
      num_tokens or the position is not reserved (>= seq_lens). Flatten it together with K/V
      [n, width, K, H] for `jpa.write_kv`.
    """
    _check_state(state)
    ids = _as_ids("seq_ids", seq_ids, state.max_seqs, unique=False)
    n, cap = ids.shape[0], state.max_seq_len
    start = _as_counts("start", start, n, cap)
    counts = _as_counts("num_tokens", num_tokens, n, cap)
    if width is None:
        if not is_concrete(counts):
            raise ValueError("width (the static row length) is required when num_tokens is traced")
        width = int(np.max(np.asarray(counts), initial=0))
    if not isinstance(width, (int, np.integer)) or isinstance(width, bool) or width < 0:
        raise ValueError(f"width must be an int >= 0; got {width!r}")
    if is_concrete(counts) and int(np.max(np.asarray(counts), initial=0)) > width:
        raise ValueError(f"num_tokens must be <= width = {width}; got {np.asarray(counts).tolist()}")
    return _slot_mapping_for(state, ids, start, counts, jnp.arange(width, dtype=_I32))
