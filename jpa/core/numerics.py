"""Numeric constants shared by the reference attention and every kernel."""

# Finite, so that a fully masked row gives exp(MASK - MASK) = 1 rather than NaN; the masked
# probabilities are then zeroed explicitly. Kernels and the reference use this one value, so their
# masked rows agree bit for bit.
MASK_VALUE = -1e30
