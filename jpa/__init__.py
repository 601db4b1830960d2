"""jpa: PagedAttention for JAX.

The public face: `paged_decode` (decode attention over a paged KV cache), `paged_prefill`
(causal attention of prompt chunks over the same cache), `ragged_paged_attention` (prefill
chunks and decode tokens of many sequences in one call), `write_kv` (cache writes),
`KVCache`/`CacheConfig` (the cache pytree), `copy_pages` (copy-on-write support) and the
`pages` module (page allocation as pure-functional device state). The continuous-batching
engine lives in `jpa.engine` (imported on its own; it runs any model that meets
`jpa.engine.EngineModel`).
"""

from jpa import pages
from jpa.cache import CacheConfig, KVCache, copy_pages, write_kv
from jpa.decode import paged_decode, resolve_decode_impl
from jpa.prefill import paged_prefill
from jpa.ragged import ragged_paged_attention

__all__ = ["CacheConfig", "KVCache", "copy_pages", "pages", "paged_decode", "paged_prefill",
           "ragged_paged_attention", "resolve_decode_impl", "write_kv"]
__version__ = "0.1.0"
