"""Pallas Triton kernels (deprecated by JAX 0.11; kept while JAX ships the backend): paged decode and
ragged paged attention."""
