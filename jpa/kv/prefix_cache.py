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
"""

import collections
import itertools


class PrefixCache:
    """Keys and LRU order of the device's cached pages.

    Args:
      page_size: tokens per page.
    """

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._ids: dict = {}                       # key -> int id (the chain's parent id); one per keyed page
        self._next_id = itertools.count()          # ids are never reused
        self.page_of: dict[int, int] = {}          # key id -> cached page holding it
        self.key_of: dict[int, int] = {}           # cached page -> key id (absent: an unkeyed duplicate)
        self._key_of_id: dict = {}                 # key id -> key (to drop it with its page)
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached pages, LRU first
        self.hit_tokens = 0                        # prompt tokens served from the cache
        self.query_tokens = 0                      # prompt tokens of admitted requests

    @property
    def cached(self):
        """The device's cached pages (a view)."""
        return self.lru.keys()

    def _key_ids(self, tokens, num_pages: int, *, create: bool) -> list:
        """Ids of the chained keys of tokens' first num_pages pages (up to the first unknown one
        unless create); returns (key, id) pairs."""
        ps, parent, out = self.page_size, -1, []
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
        """Keys in the table (at most the number of cached pages)."""
        return len(self._ids)

    def lookup(self, tokens) -> list[int]:
        """Pages holding the longest cached full-page prefix of tokens.

        At most (len(tokens) - 1) // page_size pages: the last prompt token is always computed
        (its logits start the completion), so a fully cached prompt recomputes its last page.
        """
        pages = []
        for _, kid in self._key_ids(tokens, (len(tokens) - 1) // self.page_size, create=False):
            page = self.page_of.get(kid)
            if page is None:
                break
            pages.append(page)
        return pages

    def touch(self, pages) -> None:
        """Marks pages as just used (they move to the most-recently-used end)."""
        for p in pages:
            self.lru.move_to_end(p)

    def record_query(self, num_tokens: int, hit_tokens: int) -> None:
        self.query_tokens += num_tokens
        self.hit_tokens += hit_tokens

    def register(self, tokens, pages) -> None:
        """The device cached `pages`, the first full pages of a sequence holding `tokens`.

        Pages already cached (hits) stay as they are; a page whose key is already held by another
        page (two requests computed the same prefix at once) is kept unkeyed, first in line for
        eviction.
        """
        keys = self._key_ids(tokens, len(pages), create=True)
        for (key, kid), page in zip(keys, pages):
            if page in self.lru:
                continue
            self.lru[page] = None
            if kid in self.page_of:
                self.lru.move_to_end(page, last=False)
            else:
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

    def forget(self, pages) -> None:
        """The device evicted pages: they hold nothing any more."""
        for page in pages:
            del self.lru[page]
            kid = self.key_of.pop(page, None)
            if kid is not None:
                del self.page_of[kid]
                del self._ids[self._key_of_id.pop(kid)]

    def num_idle(self, referenced) -> int:
        """Cached pages no running sequence holds (what eviction can free)."""
        return sum(1 for p in self.lru if p not in referenced)

    def clear(self) -> list[int]:
        """Forgets every page; returns them (the caller evicts them on the device)."""
        out = list(self.lru)
        self.lru.clear()
        self.page_of.clear()
        self.key_of.clear()
        self._ids.clear()
        self._key_of_id.clear()
        return out
