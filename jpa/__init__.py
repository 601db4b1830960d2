"""jpa: PagedAttention for JAX.

The public face: `paged_decode` (decode attention over a paged KV cache), `paged_prefill`
(causal attention of prompt chunks over the same cache), `ragged_paged_attention` (prefill
chunks and decode tokens of many sequences in one call), `write_kv` (cache writes),
`KVCache`/`CacheConfig` (the cache pytree), `copy_pages` (copy-on-write support) and the
`pages` module (page allocation as pure-functional device state). The continuous-batching
engine lives in `jpa.engine` (imported on its own; it runs any model that meets
`jpa.engine.EngineModel`).

`LLM` and `SamplingParams` (`jpa.llm`: a model name or checkpoint directory -> generations) are
imported on first use, so `import jpa` loads neither the engine nor the models layer.
"""

from jpa import pages
from jpa.cache import CacheConfig, KVCache, copy_pages, write_kv
from jpa.decode import paged_decode, resolve_decode_impl
from jpa.prefill import paged_prefill
from jpa.ragged import ragged_paged_attention

__all__ = ["LLM", "CacheConfig", "KVCache", "SamplingParams", "copy_pages", "pages", "paged_decode",
           "paged_prefill", "ragged_paged_attention", "resolve_decode_impl", "write_kv"]
__version__ = "0.1.0"

_LAZY = {"LLM": "jpa.llm", "SamplingParams": "jpa.engine.sampling"}


def __getattr__(name):
    """`jpa.LLM` and `jpa.SamplingParams`, imported when first asked for (PEP 562)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jpa' has no attribute {name!r}")
