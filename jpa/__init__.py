"""jpa: PagedAttention for JAX.

The public face: `paged_decode` (decode attention over a paged KV cache), `ragged_paged_attention`
(prefill chunks and decode tokens of many sequences in one call), `paged_prefill` (causal attention
of dense prompt chunks over the same cache), `write_kv` (cache writes), `KVCache`/`CacheConfig` (the
cache pytree), `copy_pages` (copy-on-write support) and the `pages` module (page allocation as
pure-functional device state).

The package, one folder per layer (each imports only the layers below it):

    jpa.cli, jpa.llm, jpa.args   application: the `jpa` command, `LLM`, `EngineArgs`, `build_engine`
    jpa.server                   the OpenAI-compatible HTTP server
    jpa.engine                   continuous batching over any model that meets `jpa.engine.EngineModel`
    jpa.models                   Flax NNX models, checkpoint loading, tokenizers (the repository's `models/`)
    jpa.kv                       the page pool, cache writes, the page allocator, the prefix cache
    jpa.ops                      attention ops, validation, backend dispatch, the plain-JAX reference
    jpa.pallas                   Pallas GPU kernels: `mosaic/` (Mosaic GPU), `triton/` (deprecated by JAX)
    jpa.core                     leaf helpers: dtypes and quantization, sharding names, constants
    jpa.tools, jpa.testing       deviceless GPU compilation and HLO analysis; oracles and test models

`LLM` and `SamplingParams` are imported on first use, so `import jpa` loads neither the engine nor
the models layer.
"""

from jpa.kv import pages
from jpa.kv.cache import CacheConfig, KVCache, copy_pages, write_kv
from jpa.ops.decode import paged_decode, resolve_decode_impl
from jpa.ops.prefill import paged_prefill
from jpa.ops.ragged import ragged_paged_attention

__all__ = ["LLM", "CacheConfig", "EngineArgs", "KVCache", "LoRARequest", "SamplingParams", "copy_pages", "pages", "paged_decode",
           "paged_prefill", "ragged_paged_attention", "resolve_decode_impl", "write_kv"]
__version__ = "0.1.0"

_LAZY = {"LLM": "jpa.llm", "SamplingParams": "jpa.engine.sampling", "EngineArgs": "jpa.args",
         "LoRARequest": "jpa.engine.lora"}


def __getattr__(name):
    """`jpa.LLM`, `jpa.SamplingParams` and `jpa.EngineArgs`, imported when first asked for (PEP 562)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jpa' has no attribute {name!r}")
