"""Automatic prefix caching, the host half: which cached page holds which token prefix.

A full page of a sequence is identified by its tokens and everything before them, as in vLLM v1
and nano-vllm: the key of page j is (id of page j-1's key, the page's page_size token ids), an
exact key (dict equality, no hash collision can map a prompt to another's page). A key lives as
long as the page it names: evicting the page drops the key, so the table never holds more keys
than cached pages. Key ids are never reused, so a key whose parent was dropped can never be
matched by a new chain (its page just ages out of the LRU order). The device half
is `jpa.kv.pages` (`cache`, `share`, `uncache`): a cached page carries one reference of the cache in
its refcount, so it survives its sequence's release as a cached-idle page, and is evicted only
when the host says so.

One source of truth: the device decides which pages get cached (the full prompt pages of every
sequence whose prompt completes) and reports their ids with the step's results; this class
mirrors that set (`cached`) and only adds the keys and the least-recently-used order. The
scheduler asks it for hits at admission and for eviction victims when the free pool cannot hold
the next call's allocations, so the device never runs out of pages while cached-idle ones exist.

Spill (KV offload, `jpa.kv.offload.HostTier`): with a host tier, an evicted keyed page whose data the
engine copied out (`forget(pages, spilled=...)`) keeps its key, now naming a host-tier page
(`HostTier.spilled`, by key id) instead of a device page; `lookup_tiers` follows a chain across both
tiers, and when the device caches the key again (`register`: restored or computed anew) the host
copy is dropped. A key names a page in exactly one place (`check`). The host tier evicts its
spilled pages least recently used first and tells this cache (`HostTier.on_evict`), which drops
the key.
"""

import collections
import itertools


class PrefixCache:
    """Keys and LRU order of the device's cached pages.

    Args:
      page_size: tokens per page.
      host: KV offload's `jpa.kv.offload.HostTier` to spill evicted pages into (None: they are lost).
    """

    def __init__(self, page_size: int, host=None):
        self.page_size = page_size
        self.host = host                           # KV offload's HostTier (spilled pages), or None
        if host is not None:
            host.on_evict = self._drop_key
        self._ids: dict = {}                       # key -> int id (the chain's parent id); one per keyed page
        self._next_id = itertools.count()          # ids are never reused
        self.page_of: dict[int, int] = {}          # key id -> cached page holding it
        self.key_of: dict[int, int] = {}           # cached page -> key id (absent: an unkeyed duplicate)
        self._key_of_id: dict = {}                 # key id -> key (to drop it with its page)
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached pages, LRU first
        self.hit_tokens = 0                        # prompt tokens served from the cache
        self.query_tokens = 0                      # prompt tokens of admitted requests
        self.host_query_tokens = 0                 # of them, looked up past the device's hit (host tier)
        self.host_hit_tokens = 0                   # prompt tokens served from the host tier (restored)
        # The weights the cached KV was computed with (`LLMEngine.update_weights` advances it): the
        # root of every key chain, so pages of older weights are never found again (LRU evicts them).
        self.epoch = 0

    @property
    def cached(self):
        """The device's cached pages (a view)."""
        return self.lru.keys()

    def _key_ids(self, tokens, num_pages: int, *, create: bool, epoch: int | None = None, salt=None) -> list:
        """Ids of the chained keys of tokens' first num_pages pages (up to the first unknown one
        unless create), rooted in the weights' `epoch` (default: the current one) and `salt` (a LoRA
        adapter's id: KV computed with an adapter is found only by requests with that adapter; None: the
        base model); returns (key, id) pairs."""
        root = -1 - (self.epoch if epoch is None else epoch)
        ps, parent, out = self.page_size, root if salt is None else (root, salt), []
        for j in range(num_pages):
            key = (parent, tuple(tokens[j * ps:(j + 1) * ps]))
            kid = self._ids.get(key)
            if kid is None:
                if not create:
                    break
                kid = next(self._next_id)
            out.append((key, kid))
            parent = kid
        return out

    @property
    def num_keys(self) -> int:
        """Keys in the table (at most the number of cached and spilled pages)."""
        return len(self._ids)

    def _spilled(self, kid) -> bool:
        return self.host is not None and kid in self.host.spilled

    def lookup_tiers(self, tokens, salt=None) -> tuple[list[int], list[int]]:
        """The longest cached full-page prefix of tokens over both tiers, as `lookup`: (pages, host
        key ids), pages[j] the device page of the prefix's page j or -1 where it is in the host tier
        (whose key ids are the second list, in order)."""
        pages, kids = [], []
        for _, kid in self._key_ids(tokens, (len(tokens) - 1) // self.page_size, create=False, salt=salt):
            page = self.page_of.get(kid)
            if page is None and not self._spilled(kid):
                break
            pages.append(-1 if page is None else page)
            if page is None:
                kids.append(kid)
        return pages, kids

    def lookup(self, tokens, salt=None) -> list[int]:
        """Pages holding the longest cached full-page prefix of tokens (computed under `salt`: a LoRA
        adapter's id, None for the base model).

        At most (len(tokens) - 1) // page_size pages: the last prompt token is always computed
        (its logits start the completion), so a fully cached prompt recomputes its last page.
        """
        pages = []
        for _, kid in self._key_ids(tokens, (len(tokens) - 1) // self.page_size, create=False, salt=salt):
            page = self.page_of.get(kid)
            if page is None:
                break
            pages.append(page)
        return pages

    def touch(self, pages) -> None:
        """Marks pages as just used (they move to the most-recently-used end)."""
        for p in pages:
            self.lru.move_to_end(p)

    def record_query(self, num_tokens: int, hit_tokens: int, host_query: int = 0, host_hit: int = 0) -> None:
        """An admission: its prompt tokens, those the cache served (both tiers), and with a host tier
        those looked up there (past the device's hit) and served from it."""
        self.query_tokens += num_tokens
        self.hit_tokens += hit_tokens
        self.host_query_tokens += host_query
        self.host_hit_tokens += host_hit

    def register(self, tokens, pages, epoch: int | None = None, salt=None) -> None:
        """The device cached `pages`, the first full pages of a sequence holding `tokens` (their KV
        computed from the weights of `epoch`, default the current one: a request admitted before a
        weight update registers under the old epoch, where no lookup finds it).

        Pages already cached (hits) stay as they are; a page whose key is already held by another
        page (two requests computed the same prefix at once) is kept unkeyed, first in line for
        eviction.
        """
        keys = self._key_ids(tokens, len(pages), create=True, epoch=epoch, salt=salt)
        for (key, kid), page in zip(keys, pages):
            if page in self.lru:
                continue
            self.lru[page] = None
            if kid in self.page_of:
                self.lru.move_to_end(page, last=False)
            else:
                if self._spilled(kid):   # restored (or computed again): the device page is now its one place
                    self.host.unspill(kid)
                self._ids[key] = kid
                self._key_of_id[kid] = key
                self.page_of[kid], self.key_of[page] = page, kid

    def victims(self, count: int, referenced) -> list[int]:
        """Up to count cached-idle pages (not in `referenced`) to evict, least recently used first.
        The caller evicts them on the device, then calls `forget`."""
        out = []
        for page in self.lru:
            if len(out) == count:
                break
            if page not in referenced:
                out.append(page)
        return out

    def forget(self, pages, spilled=None) -> None:
        """The device evicted pages: they hold nothing any more. spilled: {page: its data in host
        memory} for the pages copied out (KV offload): their keys move to the host tier if it takes
        them (`HostTier.spill`), else are dropped as the others'."""
        spilled = spilled or {}
        for page in pages:
            del self.lru[page]
            kid = self.key_of.pop(page, None)
            if kid is not None:
                del self.page_of[kid]
                if page not in spilled or not self.host.spill(kid, spilled[page]):
                    self._drop_key(kid)

    def _drop_key(self, kid) -> None:
        """A key whose page is gone from both tiers."""
        del self._ids[self._key_of_id.pop(kid)]

    def spillable(self, pages) -> list[int]:
        """Of the pages about to be evicted, those worth copying to the host tier: keyed ones (an
        unkeyed duplicate can never be hit), as many as spills may hold (the host pages swap
        blocks do not hold)."""
        if self.host is None:
            return []
        room = self.host.num_pages - self.host.num_swap_pages
        return [p for p in pages if p in self.key_of][:room]

    def check(self) -> list[str]:
        """Disagreements in the key table (empty when consistent): each key names exactly one page,
        on the device or in the host tier, never both."""
        problems = []
        spilled = set(self.host.spilled) if self.host is not None else set()
        both = set(self.page_of) & spilled
        if both:
            problems.append(f"prefix keys on a device page and in the host tier at once: {sorted(both)[:4]}")
        if set(self._key_of_id) != set(self.page_of) | spilled:
            problems.append(f"prefix keys without a page, or pages without a key: "
                            f"{sorted(set(self._key_of_id) ^ (set(self.page_of) | spilled))[:4]}")
        if len(self._ids) != len(self._key_of_id):
            problems.append(f"prefix key table: {len(self._ids)} keys != {len(self._key_of_id)} key ids")
        return problems

    def num_idle(self, referenced) -> int:
        """Cached pages no running sequence holds (what eviction can free)."""
        return sum(1 for p in self.lru if p not in referenced)

    def clear(self) -> list[int]:
        """Forgets every page, the host tier's spilled ones too; returns the device's (the caller
        evicts them on the device)."""
        if self.host is not None:
            self.host.clear_spilled()
        out = list(self.lru)
        self.lru.clear()
        self.page_of.clear()
        self.key_of.clear()
        self._ids.clear()
        self._key_of_id.clear()
        return out
