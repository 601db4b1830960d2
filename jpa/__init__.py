"""jpa: PagedAttention for JAX.

The public face: `paged_decode` (decode attention over a paged KV cache), `write_kv` (cache
writes), `KVCache`/`CacheConfig` (the cache pytree) and `copy_pages` (copy-on-write support).
"""

from jpa.cache import CacheConfig, KVCache, copy_pages, write_kv
from jpa.decode import paged_decode

__all__ = ["CacheConfig", "KVCache", "copy_pages", "paged_decode", "write_kv"]
__version__ = "0.1.0"
