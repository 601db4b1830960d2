"""Attention ops over the paged KV cache: `paged_decode`, `ragged_paged_attention`, their argument
validation (`validate`), the backend dispatch that picks and self-checks a Pallas kernel for the GPU
being compiled for (`dispatch`), and the plain-JAX reference (`reference`), the oracle for the kernels.
The kernels themselves live below, in `jpa.pallas`."""

from jpa.ops.decode import paged_decode, resolve_decode_impl
from jpa.ops.ragged import ragged_paged_attention

__all__ = ["paged_decode", "ragged_paged_attention", "resolve_decode_impl"]
