"""The paged KV cache: stacked page pools, cache writes (vLLM reshape_and_cache) and page copies.

Layout: K and V each one array `[num_layers, num_kv_heads, num_pages, page_size, head_dim]`, plus
`f32[num_layers, num_kv_heads, num_pages, page_size]` scales for int8/float8 caches. One layer is
`[num_kv_heads, num_pages, page_size, head_dim]` (the per-layer form the attention functions also
take). The stack is what a model's scan over layers carries: every layer's write and attention
get the WHOLE stacked pool plus the layer index (`layer=`), never a per-layer slice, which XLA
would materialize as a copy of the pool every layer of every step.

The cache is immutable: every function returns new arrays. Jit the step that calls them with the
cache donated (`donate_argnums`) and XLA updates the buffers in place.
"""

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jpa.core.quant import is_quantized, quantize
from jpa.ops.validate import CACHE_DTYPES, check_cache_pair, check_dtype, check_layer, check_ndim, is_concrete


def _scatter(pages, x, slots, layer):
    """pages [K, P, S_p, ...] (or [L, K, P, S_p, ...] at i32[] layer) <- x [T, K, ...] at flat
    slots i32[T] (out of range = skipped)."""
    if layer is None:
        num_kv_heads, num_pages, page_size = pages.shape[:3]
        flat = pages.reshape(num_kv_heads, num_pages * page_size, *pages.shape[3:])  # [K, P * S_p, ...]
        flat = flat.at[:, slots].set(jnp.swapaxes(x, 0, 1).astype(pages.dtype), mode="drop",
                                     unique_indices=False)
        return flat.reshape(pages.shape)
    num_layers, num_kv_heads, num_pages, page_size = pages.shape[:4]
    flat = pages.reshape(num_layers, num_kv_heads, num_pages * page_size, *pages.shape[4:])  # [L, K, P * S_p, ...]
    # A scalar and an index array split by a slice: the update is indexed [T, K, ...], x's own order.
    flat = flat.at[layer, :, slots].set(x.astype(pages.dtype), mode="drop", unique_indices=False)
    return flat.reshape(pages.shape)


def write_kv(k_pages, v_pages, k, v, slot_mapping, *, k_scales=None, v_scales=None, layer=None):
    """Writes new tokens' keys and values into their cache slots (vLLM's reshape_and_cache).

    Args:
      k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim] page pools of one layer.
      k, v: [num_tokens, num_kv_heads, head_dim] float keys/values of the new tokens.
      slot_mapping: i32[num_tokens]; slot = page * page_size + offset. Negative slots are padding
        and are skipped. If two tokens name the same slot, which one lands is unspecified.
      k_scales, v_scales: f32[num_kv_heads, num_pages, page_size] for int8/float8 caches; the new
        values are quantized on write with one scale per token and head.
      layer: with stacked pools `[num_layers, num_kv_heads, num_pages, page_size, head_dim]` (scales
        `f32[num_layers, ...]`), the layer to write: an int or an i32[] (traced inside a scan over
        layers: clamped to [0, num_layers)). The stacked pools are updated in place as a whole.
        None with per-layer pools.

    Returns:
      (k_pages, v_pages) for float caches, (k_pages, v_pages, k_scales, v_scales) for quantized
      ones. Under `jax.jit` with the pools donated, the update happens in place.
    """
    num_kv_heads, num_pages, page_size, head_dim = check_cache_pair(k_pages, v_pages, k_scales, v_scales,
                                                                    layer)
    if layer is not None:
        layer = check_layer(layer, k_pages.shape[0])
    for name, x in (("k", k), ("v", v)):
        check_ndim(name, x, 3, "[num_tokens, num_kv_heads, head_dim]")
        check_dtype(name, x, (np.float32, jnp.bfloat16, np.float16))
        if x.shape[1:] != (num_kv_heads, head_dim):
            raise ValueError(f"{name} must have shape [num_tokens, num_kv_heads = {num_kv_heads}, "
                             f"head_dim = {head_dim}]; got {list(x.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {list(k.shape)}; got {list(v.shape)}")
    check_ndim("slot_mapping", slot_mapping, 1, "i32[num_tokens]")
    check_dtype("slot_mapping", slot_mapping, (np.int32,))
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping must have num_tokens = {k.shape[0]} entries; "
                         f"got {slot_mapping.shape[0]}")
    num_slots = num_pages * page_size
    if is_concrete(slot_mapping) and slot_mapping.size:
        top = int(np.max(np.asarray(slot_mapping)))
        if top >= num_slots:
            raise ValueError(f"slot_mapping entries must be < num_pages * page_size = {num_slots} "
                             f"(negative = padding); got {top}")
    # Negative slots must be skipped, not wrapped around as numpy indexing would: send them past the end.
    slots = jnp.where(slot_mapping >= 0, slot_mapping, num_slots)
    if not is_quantized(k_pages.dtype):
        return _scatter(k_pages, k, slots, layer), _scatter(v_pages, v, slots, layer)
    kq, ks = quantize(k, k_pages.dtype)  # [T, K, H], f32[T, K]
    vq, vs = quantize(v, v_pages.dtype)
    return (_scatter(k_pages, kq, slots, layer), _scatter(v_pages, vq, slots, layer),
            _scatter(k_scales, ks, slots, layer), _scatter(v_scales, vs, slots, layer))


def _copy(pages, src, dst):
    """Pages src -> dst of a stacked [L, K, P, ...] array, every layer at once. Every source is
    gathered first, then scattered: overlapping src/dst pairs read the old contents."""
    return pages.at[:, :, dst].set(jnp.take(pages, src, axis=2, mode="clip"), mode="drop")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Shape and dtype of a paged KV cache (hashable; usable as a static jit argument).

    v_head_dim: None (the default: V as wide as K), or 0 for a latent cache (MLA, `jpa.kv.spec.LatentAttention`):
    the K pool holds one latent per token (one kv head of latent_dim) and attention reads its values out of it,
    so the V pool is zero wide and costs nothing (`latent`)."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    page_size: int = 16
    dtype: str = "float32"
    v_head_dim: int | None = None

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim", "num_pages", "page_size"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"CacheConfig.{name} must be an int >= 1; got {val!r}")
        if self.v_head_dim is not None and (self.v_head_dim != 0 or isinstance(self.v_head_dim, bool)):
            raise ValueError(f"CacheConfig.v_head_dim must be None (V as wide as K) or 0 (a latent cache); got "
                             f"{self.v_head_dim!r}")
        try:
            dt = np.dtype(jnp.dtype(self.dtype))
        except TypeError:
            dt = None
        if dt not in CACHE_DTYPES:
            raise ValueError(f"CacheConfig.dtype must be one of "
                             f"({', '.join(d.name for d in CACHE_DTYPES)}); got {self.dtype!r}")
        object.__setattr__(self, "dtype", dt.name)
        if self.latent and self.quantized:
            raise ValueError(f"CacheConfig: a latent cache (v_head_dim=0) is kept in a float dtype; got {self.dtype}")

    @property
    def quantized(self) -> bool:
        return is_quantized(self.dtype)

    @property
    def latent(self) -> bool:
        """A latent cache (v_head_dim 0): K holds the latents, V is zero wide."""
        return self.v_head_dim == 0

    @property
    def bytes_per_page(self) -> int:
        """Bytes one page costs across all layers, K and V, scales included."""
        v_width = 0 if self.latent else self.head_dim
        per_head = self.page_size * (self.head_dim + v_width) * np.dtype(self.dtype).itemsize
        if self.quantized:
            per_head += 2 * self.page_size * 4
        return self.num_layers * self.num_kv_heads * per_head

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.bytes_per_page

    @property
    def num_slots(self) -> int:
        """Tokens the pool can hold."""
        return self.num_pages * self.page_size

    @classmethod
    def from_memory(cls, memory_bytes: int, *, num_layers, num_kv_heads, head_dim, page_size=16,
                    dtype="float32", v_head_dim=None) -> "CacheConfig":
        """The largest cache that fits in `memory_bytes`."""
        probe = cls(num_layers, num_kv_heads, head_dim, 1, page_size, dtype, v_head_dim)
        num_pages = int(memory_bytes) // probe.bytes_per_page
        if num_pages < 1:
            raise ValueError(f"memory_bytes={memory_bytes} holds no page: one page costs "
                             f"{probe.bytes_per_page} bytes for this model and page_size")
        return dataclasses.replace(probe, num_pages=num_pages)

    def describe(self) -> str:
        if self.latent:
            return (f"{self.num_layers} layers x latent [{self.num_pages}, {self.page_size}, {self.head_dim}] "
                    f"{self.dtype} = {self.nbytes / 2**20:.1f} MiB ({self.num_slots} token slots, "
                    f"{self.bytes_per_page} B/page)")
        return (f"{self.num_layers} layers x K,V [{self.num_kv_heads}, {self.num_pages}, {self.page_size}, "
                f"{self.head_dim}] {self.dtype} = {self.nbytes / 2**20:.1f} MiB "
                f"({self.num_slots} token slots, {self.bytes_per_page} B/page)")


@flax.struct.dataclass
class KVCache:
    """The K and V page pools of every layer, stacked, plus scales if quantized.

    Attributes:
      k, v: [num_layers, num_kv_heads, num_pages, page_size, head_dim].
      k_scales, v_scales: f32[num_layers, num_kv_heads, num_pages, page_size], or None for float caches.
    """
    k: jax.Array
    v: jax.Array
    k_scales: jax.Array | None = None
    v_scales: jax.Array | None = None

    def __post_init__(self):
        if getattr(self.k, "ndim", 5) != 5 or getattr(self.v, "ndim", 5) != 5:
            raise ValueError(f"KVCache.k and .v must be stacked pools [num_layers, num_kv_heads, num_pages, "
                             f"page_size, head_dim]; got shapes {getattr(self.k, 'shape', type(self.k).__name__)} "
                             f"and {getattr(self.v, 'shape', type(self.v).__name__)} (stack per-layer pools "
                             f"with jnp.stack)")

    @classmethod
    def create(cls, config: CacheConfig) -> "KVCache":
        shape = (config.num_layers, config.num_kv_heads, config.num_pages, config.page_size, config.head_dim)
        zeros = lambda: jnp.zeros(shape, config.dtype)
        if config.latent:   # a latent cache: the values are read out of the K pool's latents
            return cls(zeros(), jnp.zeros(shape[:4] + (0,), config.dtype))
        if not config.quantized:
            return cls(zeros(), zeros())
        ones = lambda: jnp.ones(shape[:4], jnp.float32)
        return cls(zeros(), zeros(), ones(), ones())

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def nbytes(self) -> int:
        """Device memory held by the cache."""
        return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))

    def pools(self):
        """(k, v, k_scales, v_scales): the stacked arrays the attention functions take with `layer=`."""
        return self.k, self.v, self.k_scales, self.v_scales

    def layer(self, i: int):
        """(k_pages, v_pages, k_scales, v_scales) of layer i as per-layer arrays (scales None for float
        caches). These are slices (copies under jit): for inspection and tests; a jitted step passes
        the stacked pools and `layer=i` instead."""
        if self.k_scales is None:
            return self.k[i], self.v[i], None, None
        return self.k[i], self.v[i], self.k_scales[i], self.v_scales[i]

    def write(self, i, k, v, slot_mapping) -> "KVCache":
        """Writes k, v [num_tokens, num_kv_heads, head_dim] into layer i (an int or i32[]) at slot_mapping."""
        return self.replace_pools(*write_kv(self.k, self.v, k, v, slot_mapping, k_scales=self.k_scales,
                                            v_scales=self.v_scales, layer=i))

    def write_latent(self, i, latent, slot_mapping) -> "KVCache":
        """Writes latent [num_tokens, latent_dim] (MLA: one per token for all heads) into layer i (an int or
        i32[]) of a latent cache (one kv head of latent_dim, `CacheConfig.v_head_dim` 0) at slot_mapping
        (negative = padding, skipped)."""
        if self.k.shape[1] != 1 or self.v.shape[-1] != 0 or self.k_scales is not None:
            raise ValueError(f"write_latent needs a latent cache (K pool [num_layers, 1, num_pages, page_size, "
                             f"latent_dim], zero-wide V, no scales); got K {list(self.k.shape)}, "
                             f"V {list(self.v.shape)}")
        check_ndim("latent", latent, 2, "[num_tokens, latent_dim]")
        if latent.shape[1] != self.k.shape[-1] or slot_mapping.shape != latent.shape[:1]:
            raise ValueError(f"latent must be [num_tokens, latent_dim = {self.k.shape[-1]}] with slot_mapping "
                             f"i32[num_tokens]; got {list(latent.shape)} and {list(slot_mapping.shape)}")
        num_slots = self.k.shape[2] * self.k.shape[3]
        slots = jnp.where(slot_mapping >= 0, slot_mapping, num_slots)  # padding lands past the end: dropped
        return self.replace(k=_scatter(self.k, latent[:, None, :], slots, check_layer(i, self.k.shape[0])))

    def replace_pools(self, k, v, k_scales=None, v_scales=None) -> "KVCache":
        """The cache with its stacked pools replaced (as `pools()` / `write_kv(..., layer=)` return them)."""
        return self.replace(k=k, v=v, k_scales=k_scales, v_scales=v_scales)


def copy_pages(cache: KVCache, src, dst) -> KVCache:
    """Copies physical pages src[i] -> dst[i] in every layer (vLLM copy_blocks; copy-on-write).

    Args:
      cache: the KV cache.
      src, dst: i32[num_copies]; pairs with dst < 0 are padding and are skipped.

    Returns:
      The updated cache; in place under `jax.jit` with the cache donated.
    """
    check_ndim("src", src, 1, "i32[num_copies]")
    check_ndim("dst", dst, 1, "i32[num_copies]")
    check_dtype("src", src, (np.int32,))
    check_dtype("dst", dst, (np.int32,))
    if src.shape != dst.shape:
        raise ValueError(f"src and dst must have the same shape; got {src.shape} and {dst.shape}")
    num_pages = cache.k.shape[2]
    dst = jnp.where(dst >= 0, dst, num_pages)  # padding pairs land past the end and are dropped
    cp = lambda x: None if x is None else _copy(x, src, dst)
    return KVCache(cp(cache.k), cp(cache.v), cp(cache.k_scales), cp(cache.v_scales))
