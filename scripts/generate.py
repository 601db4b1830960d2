#!/usr/bin/env python3
"""The Flax generation script: continuous batching over a paged KV cache with a real model
(SmolLM2-135M-Instruct by default). A thin caller of `jpa generate` (jpa/cli/generate.py), which
has the flags: `python scripts/generate.py --help`."""

import sys

from jpa.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
