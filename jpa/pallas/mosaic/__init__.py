"""Mosaic GPU kernels (`jax.experimental.pallas.mosaic_gpu`): paged decode and ragged paged attention."""
