"""The KV cache: the stacked page pools and their writes (`cache`), page allocation as pure-functional
device state (`pages`) and the host-side prefix cache index (`prefix_cache`)."""

from jpa.kv import pages
from jpa.kv.cache import CacheConfig, KVCache, copy_pages, write_kv

__all__ = ["CacheConfig", "KVCache", "copy_pages", "pages", "write_kv"]
