"""The paged KV cache: page pools per layer, cache writes (vLLM reshape_and_cache) and page copies.

Layout per layer: K and V each `[num_kv_heads, num_pages, page_size, head_dim]`, plus
`f32[num_kv_heads, num_pages, page_size]` scales for int8/float8 caches. Each layer is its own
buffer (a tuple entry, not a slice of one stacked array): a slice handed to a kernel would be
materialized as a copy of the whole pool every layer of every step.

The cache is immutable: every function returns new arrays. Jit the step that calls them with the
cache donated (`donate_argnums`) and XLA updates the buffers in place.
"""

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jpa.quant import is_quantized, quantize
from jpa.validate import CACHE_DTYPES, check_cache_pair, check_dtype, check_ndim, is_concrete


def _scatter_tokens(pages, x, slots):
    """pages [K, P, S_p, H] <- x [T, K, H] at flat slots i32[T] (out of range = skipped)."""
    num_kv_heads, num_pages, page_size, head_dim = pages.shape
    flat = pages.reshape(num_kv_heads, num_pages * page_size, head_dim)  # [K, P * S_p, H]
    flat = flat.at[:, slots].set(jnp.swapaxes(x, 0, 1).astype(pages.dtype), mode="drop",
                                 unique_indices=False)
    return flat.reshape(pages.shape)


def _scatter_scales(scales, s, slots):
    """scales f32[K, P, S_p] <- s f32[T, K] at flat slots i32[T]."""
    num_kv_heads, num_pages, page_size = scales.shape
    flat = scales.reshape(num_kv_heads, num_pages * page_size)
    return flat.at[:, slots].set(jnp.swapaxes(s, 0, 1), mode="drop").reshape(scales.shape)


def write_kv(k_pages, v_pages, k, v, slot_mapping, *, k_scales=None, v_scales=None):
    """Writes new tokens' keys and values into their cache slots (vLLM's reshape_and_cache).

    Args:
      k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim] page pools of one layer.
      k, v: [num_tokens, num_kv_heads, head_dim] float keys/values of the new tokens.
      slot_mapping: i32[num_tokens]; slot = page * page_size + offset. Negative slots are padding
        and are skipped. If two tokens name the same slot, which one lands is unspecified.
      k_scales, v_scales: f32[num_kv_heads, num_pages, page_size] for int8/float8 caches; the new
        values are quantized on write with one scale per token and head.

    Returns:
      (k_pages, v_pages) for float caches, (k_pages, v_pages, k_scales, v_scales) for quantized
      ones. Under `jax.jit` with the pools donated, the update happens in place.
    """
    num_kv_heads, num_pages, page_size, head_dim = check_cache_pair(k_pages, v_pages, k_scales, v_scales)
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
        return _scatter_tokens(k_pages, k, slots), _scatter_tokens(v_pages, v, slots)
    kq, ks = quantize(k, k_pages.dtype)  # [T, K, H], f32[T, K]
    vq, vs = quantize(v, v_pages.dtype)
    return (_scatter_tokens(k_pages, kq, slots), _scatter_tokens(v_pages, vq, slots),
            _scatter_scales(k_scales, ks, slots), _scatter_scales(v_scales, vs, slots))


def _copy(pages, src, dst):
    # Gather every source first, then scatter: overlapping src/dst pairs read the old contents.
    return pages.at[:, dst].set(jnp.take(pages, src, axis=1, mode="clip"), mode="drop")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Shape and dtype of a paged KV cache (hashable; usable as a static jit argument)."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    page_size: int = 16
    dtype: str = "float32"

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim", "num_pages", "page_size"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"CacheConfig.{name} must be an int >= 1; got {val!r}")
        try:
            dt = np.dtype(jnp.dtype(self.dtype))
        except TypeError:
            dt = None
        if dt not in CACHE_DTYPES:
            raise ValueError(f"CacheConfig.dtype must be one of "
                             f"({', '.join(d.name for d in CACHE_DTYPES)}); got {self.dtype!r}")
        object.__setattr__(self, "dtype", dt.name)

    @property
    def quantized(self) -> bool:
        return is_quantized(self.dtype)

    @property
    def bytes_per_page(self) -> int:
        """Bytes one page costs across all layers, K and V, scales included."""
        per_head = self.page_size * self.head_dim * np.dtype(self.dtype).itemsize
        if self.quantized:
            per_head += self.page_size * 4
        return 2 * self.num_layers * self.num_kv_heads * per_head

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.bytes_per_page

    @property
    def num_slots(self) -> int:
        """Tokens the pool can hold."""
        return self.num_pages * self.page_size

    @classmethod
    def from_memory(cls, memory_bytes: int, *, num_layers, num_kv_heads, head_dim, page_size=16,
                    dtype="float32") -> "CacheConfig":
        """The largest cache that fits in `memory_bytes`."""
        probe = cls(num_layers, num_kv_heads, head_dim, 1, page_size, dtype)
        num_pages = int(memory_bytes) // probe.bytes_per_page
        if num_pages < 1:
            raise ValueError(f"memory_bytes={memory_bytes} holds no page: one page costs "
                             f"{probe.bytes_per_page} bytes for this model and page_size")
        return dataclasses.replace(probe, num_pages=num_pages)

    def describe(self) -> str:
        return (f"{self.num_layers} layers x K,V [{self.num_kv_heads}, {self.num_pages}, {self.page_size}, "
                f"{self.head_dim}] {self.dtype} = {self.nbytes / 2**20:.1f} MiB "
                f"({self.num_slots} token slots, {self.bytes_per_page} B/page)")


@flax.struct.dataclass
class KVCache:
    """One K and one V page pool per layer (tuples, never a stacked array), plus scales if quantized.

    Attributes:
      k, v: tuples of num_layers arrays [num_kv_heads, num_pages, page_size, head_dim].
      k_scales, v_scales: tuples of f32[num_kv_heads, num_pages, page_size], or None for float caches.
    """
    k: tuple
    v: tuple
    k_scales: tuple | None = None
    v_scales: tuple | None = None

    @classmethod
    def create(cls, config: CacheConfig) -> "KVCache":
        shape = (config.num_kv_heads, config.num_pages, config.page_size, config.head_dim)
        zeros = lambda: tuple(jnp.zeros(shape, config.dtype) for _ in range(config.num_layers))
        if not config.quantized:
            return cls(zeros(), zeros())
        ones = lambda: tuple(jnp.ones(shape[:3], jnp.float32) for _ in range(config.num_layers))
        return cls(zeros(), zeros(), ones(), ones())

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def nbytes(self) -> int:
        """Device memory held by the cache."""
        return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))

    def layer(self, i: int):
        """(k_pages, v_pages, k_scales, v_scales) of layer i (scales None for float caches)."""
        if self.k_scales is None:
            return self.k[i], self.v[i], None, None
        return self.k[i], self.v[i], self.k_scales[i], self.v_scales[i]

    def write(self, i: int, k, v, slot_mapping) -> "KVCache":
        """Writes k, v [num_tokens, num_kv_heads, head_dim] into layer i at slot_mapping."""
        kp, vp, ks, vs = self.layer(i)
        return self.with_layer(i, *write_kv(kp, vp, k, v, slot_mapping, k_scales=ks, v_scales=vs))

    def with_layer(self, i: int, k_pages, v_pages, k_scales=None, v_scales=None) -> "KVCache":
        """The cache with layer i's buffers replaced (as `layer(i)` returns them)."""
        put = lambda t, x: t[:i] + (x,) + t[i + 1:]
        if self.k_scales is None:
            return self.replace(k=put(self.k, k_pages), v=put(self.v, v_pages))
        return self.replace(k=put(self.k, k_pages), v=put(self.v, v_pages),
                            k_scales=put(self.k_scales, k_scales), v_scales=put(self.v_scales, v_scales))


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
    num_pages = cache.k[0].shape[1]
    dst = jnp.where(dst >= 0, dst, num_pages)  # padding pairs land past the end and are dropped
    cp = lambda t: None if t is None else tuple(_copy(x, src, dst) for x in t)
    return KVCache(cp(cache.k), cp(cache.v), cp(cache.k_scales), cp(cache.v_scales))
