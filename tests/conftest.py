"""Test-session setup: the tests run on the CPU.

With the `gpu` extra installed (CUDA compile-only packages, no driver), JAX would try to start a
CUDA backend and log a cuDNN error on every import; the deviceless compile tier does not need
one (it asks for a compile-only topology explicitly).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
