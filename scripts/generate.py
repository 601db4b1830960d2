#!/usr/bin/env python3
"""The Flax generation script: continuous batching over a paged KV cache with a real model
(SmolLM2-135M-Instruct by default). A thin caller of `jpa generate` (jpa/cli/generate.py), which
has the flags: `python scripts/generate.py --help`."""

import sys

from jpa.cli.generate import main
from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)

if __name__ == "__main__":
    sys.exit(main())
