"""The cache a model declares: groups of layers, each with what it keeps per token or per sequence.

A model's layers need not keep the same thing. vLLM calls this the KV cache spec (`KVCacheSpec`, one per
group of layers, and a hybrid allocator that splits the memory between groups); jpa's engine reads the same
idea from `EngineModel.cache_spec()`:

- `FullAttention(num_kv_heads, head_dim)`: K and V of every token, in pages (`jpa.KVCache`).
- `SlidingWindow(num_kv_heads, head_dim, window)`: K and V in pages, of which a token reads only the last
  `window` positions (Gemma-2, gpt-oss, Mistral).
- `LatentAttention(latent_dim)`: one compressed latent per token shared by every head (DeepSeek's MLA:
  kv_lora_rank + the RoPE key's width), in pages.
- `RecurrentState(shapes)`: a fixed-size state per sequence, whatever its length (Gated DeltaNet, Mamba):
  `shapes` is ((name, shape, dtype), ...) per layer of the group.

A `CacheGroup` names the layers that keep one kind, and a `CacheSpec` is the model's groups, covering every
layer once. The spec is data (frozen, hashable): the engine sizes the pool from it, reports it at start-up
(`CacheSpec.describe`) and refuses a model whose groups it cannot allocate, naming the group.

What the engine allocates today: every paged attention group (full and sliding window) of one head shape
shares one stacked pool `[num_layers, num_kv_heads, num_pages, page_size, head_dim]` (`jpa.KVCache`), one
block table per sequence for all of them. A sliding-window group therefore keeps every page of a sequence
although it reads at most the window: `bytes_per_sequence(..., freed=False)` is what it costs as served,
`freed=True` what it would cost if the pages that fell out of every window were released (the figure a
per-group pool would reach). Recurrent groups are allocated beside the pool as state slots, one per engine
sequence slot (`CacheSpec.init_states`; the pool then holds `paged_layers()` only). Latent groups are declared
here for the models that need them; the engine refuses them until it allocates them (`CacheSpec.check_served`).
"""

import dataclasses
import math

import numpy as np

KINDS = ("full", "sliding", "latent", "recurrent")


def _check_int(owner: str, name: str, val, low: int = 1):
    if not isinstance(val, int) or isinstance(val, bool) or val < low:
        raise ValueError(f"{owner}.{name} must be an int >= {low}; got {val!r}")


@dataclasses.dataclass(frozen=True)
class FullAttention:
    """K and V of every token of every sequence, in pages."""
    num_kv_heads: int
    head_dim: int
    kind = "full"

    def __post_init__(self):
        _check_int("FullAttention", "num_kv_heads", self.num_kv_heads)
        _check_int("FullAttention", "head_dim", self.head_dim)

    def bytes_per_token(self, itemsize: float) -> float:
        """Bytes one token costs in one layer (K and V)."""
        return 2 * self.num_kv_heads * self.head_dim * itemsize

    def describe(self) -> str:
        return f"full attention, K,V [{self.num_kv_heads} heads x {self.head_dim}]"


@dataclasses.dataclass(frozen=True)
class SlidingWindow(FullAttention):
    """K and V in pages, of which a token reads the last `window` positions (its own included)."""
    window: int = 0
    kind = "sliding"

    def __post_init__(self):
        super().__post_init__()
        _check_int("SlidingWindow", "window", self.window)

    def describe(self) -> str:
        return f"sliding window {self.window}, K,V [{self.num_kv_heads} heads x {self.head_dim}]"


@dataclasses.dataclass(frozen=True)
class LatentAttention:
    """One latent of `latent_dim` values per token, shared by all heads (MLA: kv_lora_rank + rope dim)."""
    latent_dim: int
    kind = "latent"

    def __post_init__(self):
        _check_int("LatentAttention", "latent_dim", self.latent_dim)

    def bytes_per_token(self, itemsize: float) -> float:
        return self.latent_dim * itemsize

    def describe(self) -> str:
        return f"latent [{self.latent_dim}]"


@dataclasses.dataclass(frozen=True)
class RecurrentState:
    """A fixed-size state per sequence in each layer of the group: ((name, shape, dtype name), ...)."""
    shapes: tuple
    kind = "recurrent"

    def __post_init__(self):
        if not isinstance(self.shapes, tuple) or not self.shapes:
            raise ValueError(f"RecurrentState.shapes must be a non-empty tuple of (name, shape, dtype); "
                             f"got {self.shapes!r}")
        for entry in self.shapes:
            ok = (isinstance(entry, tuple) and len(entry) == 3 and isinstance(entry[0], str)
                  and isinstance(entry[1], tuple) and all(isinstance(n, int) and n >= 1 for n in entry[1]))
            if ok:
                try:
                    np.dtype(entry[2])
                except TypeError:
                    ok = False
            if not ok:
                raise ValueError(f"RecurrentState.shapes entries must be (name, shape tuple of ints >= 1, "
                                 f"dtype name); got {entry!r}")

    def bytes_per_sequence(self) -> int:
        """Bytes one sequence's state costs in one layer."""
        return sum(math.prod(shape) * np.dtype(dtype).itemsize for _, shape, dtype in self.shapes)

    def describe(self) -> str:
        parts = ", ".join(f"{n} {list(s)} {np.dtype(d).name}" for n, s, d in self.shapes)
        return f"recurrent state ({parts}) per sequence"


LAYOUTS = (FullAttention, SlidingWindow, LatentAttention, RecurrentState)


@dataclasses.dataclass(frozen=True)
class CacheGroup:
    """The layers (model layer indices) that keep one `layout`."""
    name: str
    layers: tuple
    layout: object

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"CacheGroup.name must be a non-empty str; got {self.name!r}")
        if (not isinstance(self.layers, tuple) or not self.layers
                or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in self.layers)):
            raise ValueError(f"CacheGroup {self.name!r}: layers must be a non-empty tuple of layer indices >= 0; "
                             f"got {self.layers!r}")
        if not isinstance(self.layout, LAYOUTS):
            raise ValueError(f"CacheGroup {self.name!r}: layout must be one of "
                             f"{[t.__name__ for t in LAYOUTS]}; got {type(self.layout).__name__}")

    @property
    def paged(self) -> bool:
        """Whether the group keeps tokens in pages (every kind but a recurrent state)."""
        return self.layout.kind != "recurrent"


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """A model's cache: its groups, which cover layers 0..num_layers-1 once each."""
    groups: tuple

    def __post_init__(self):
        if not isinstance(self.groups, tuple) or not self.groups or any(
                not isinstance(g, CacheGroup) for g in self.groups):
            raise ValueError(f"CacheSpec.groups must be a non-empty tuple of CacheGroup; got {self.groups!r}")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"CacheSpec: group names must be distinct; got {names}")
        layers = sorted(i for g in self.groups for i in g.layers)
        if layers != list(range(len(layers))):
            raise ValueError(f"CacheSpec: the groups' layers must cover 0..num_layers-1 once each; got "
                             f"{ {g.name: g.layers for g in self.groups} }")

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    @classmethod
    def attention(cls, num_layers: int, num_kv_heads: int, head_dim: int, *, window: int | None = None,
                  window_layers: tuple = ()) -> "CacheSpec":
        """The spec of a stack of attention layers: one full group, plus a sliding group for `window_layers`."""
        full = tuple(i for i in range(num_layers) if i not in window_layers)
        groups = []
        if full:
            groups.append(CacheGroup("full", full, FullAttention(num_kv_heads, head_dim)))
        if window_layers:
            groups.append(CacheGroup("sliding", tuple(window_layers), SlidingWindow(num_kv_heads, head_dim, window)))
        return cls(tuple(groups))

    def bytes_per_token(self, dtype) -> float:
        """Bytes one cached token costs over every paged group's layers (recurrent states not counted; an
        8-bit cache's f32 scale per token and head counted)."""
        itemsize = np.dtype(dtype).itemsize
        out = 0.0
        for g in self.groups:
            if g.paged:
                out += len(g.layers) * g.layout.bytes_per_token(itemsize)
                if itemsize == 1 and g.layout.kind in ("full", "sliding"):
                    out += len(g.layers) * 2 * g.layout.num_kv_heads * 4
        return out

    def bytes_per_sequence(self, context: int, dtype, page_size: int = 16, *, freed: bool = False) -> int:
        """Bytes one sequence of `context` tokens holds: whole pages of every paged group plus the recurrent
        states. freed: a sliding group keeps only the pages its window can still read (the last `window`
        positions span at most ceil((window - 1) / page_size) + 1 pages); else every page, as served today."""
        itemsize = np.dtype(dtype).itemsize
        total = 0
        for g in self.groups:
            if not g.paged:
                total += len(g.layers) * g.layout.bytes_per_sequence()
                continue
            pages = -(-context // page_size)
            if freed and g.layout.kind == "sliding":
                pages = min(pages, -(-(g.layout.window - 1) // page_size) + 1)
            per_token = g.layout.bytes_per_token(itemsize)
            if itemsize == 1 and g.layout.kind in ("full", "sliding"):
                per_token += 2 * g.layout.num_kv_heads * 4
            total += int(len(g.layers) * pages * page_size * per_token)
        return total

    @property
    def has_recurrent(self) -> bool:
        """Whether a group keeps a recurrent state per sequence (the engine then allocates state slots)."""
        return any(not g.paged for g in self.groups)

    def paged_layers(self) -> tuple:
        """The model layer indices of every paged group, increasing: pool layer j is model layer
        `paged_layers()[j]` (the engine's pool holds these layers only)."""
        return tuple(sorted(i for g in self.groups if g.paged for i in g.layers))

    def recurrent_groups(self) -> tuple:
        """The groups that keep a recurrent state, in declaration order."""
        return tuple(g for g in self.groups if not g.paged)

    def init_states(self, num_slots: int) -> dict:
        """Zeroed state slots of every recurrent group: {group name: {state name: zeros([len(group.layers),
        num_slots, *shape], dtype)}}; group layer i is the group's i-th layer in increasing model-layer order."""
        import jax.numpy as jnp   # the spec is plain data; only this builds arrays

        _check_int("CacheSpec.init_states", "num_slots", num_slots)
        return {g.name: {name: jnp.zeros((len(g.layers), num_slots) + shape, np.dtype(dtype))
                         for name, shape, dtype in g.layout.shapes} for g in self.recurrent_groups()}

    def state_bytes_per_sequence(self) -> int:
        """Bytes of one sequence's recurrent states over every recurrent group's layers (0 without one)."""
        return sum(len(g.layers) * g.layout.bytes_per_sequence() for g in self.recurrent_groups())

    def check_served(self) -> tuple:
        """(num_kv_heads, head_dim) of the one stacked pool the engine allocates for this spec's paged layers
        (`paged_layers()`), or None when the spec has no paged group (only recurrent states: the engine then
        keeps a one-layer placeholder pool of one head of width 1, for the page state's token bookkeeping).
        Recurrent groups are allocated as state slots beside the pool (`init_states`). Raises ValueError naming
        a group the engine cannot allocate yet (a latent group, or attention groups of different head shapes,
        which one pool cannot hold)."""
        shapes = set()
        for g in self.groups:
            if g.layout.kind == "recurrent":
                continue
            if g.layout.kind not in ("full", "sliding"):
                raise ValueError(f"cache group {g.name!r} keeps a {g.layout.describe()}: the engine allocates paged "
                                 f"attention groups (full and sliding window) in one pool and recurrent groups as "
                                 f"state slots, and cannot serve a {g.layout.kind} group yet")
            shapes.add((g.layout.num_kv_heads, g.layout.head_dim))
        if not shapes:
            return None
        if len(shapes) != 1:
            raise ValueError(f"the cache groups have different head shapes {sorted(shapes)}: the engine's one "
                             f"stacked pool holds one [num_kv_heads, head_dim]")
        return shapes.pop()

    def describe(self, dtype=None, page_size: int = 16) -> str:
        """One line per group: its layers, what it keeps, and (with dtype) bytes per token and per sequence."""
        lines = []
        for g in self.groups:
            line = f"{g.name}: {len(g.layers)} layers ({_ranges(g.layers)}), {g.layout.describe()}"
            if dtype is not None:
                one = CacheSpec((CacheGroup(g.name, tuple(range(len(g.layers))), g.layout),))
                if g.paged:
                    line += f", {one.bytes_per_token(dtype):,.0f} B/token"
                else:
                    line += f", {one.bytes_per_sequence(0, dtype):,} B/sequence"
            lines.append(line)
        return "; ".join(lines)


def _ranges(layers) -> str:
    """'0-3, 8, 10-11' for (0, 1, 2, 3, 8, 10, 11)."""
    out, start, prev = [], None, None
    for i in sorted(layers):
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = prev = i
    out.append(f"{start}-{prev}" if prev > start else f"{start}")
    return ", ".join(out)
