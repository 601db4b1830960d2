"""Mosaic GPU kernels (`jax.experimental.pallas.mosaic_gpu`): paged decode and ragged paged attention, and the
quantized-weight matmul (`qmatmul`)."""
