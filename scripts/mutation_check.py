#!/usr/bin/env python3
"""Shows that the test suite catches deliberate faults in the engine (mutation testing, by hand).

The machinery and the list of faults are jpa/tools/mutation.py (its docstring explains the outcomes).

  python scripts/mutation_check.py --dry-run
  python scripts/mutation_check.py --json results/mutation_check.json
  python scripts/mutation_check.py --only skipped-copy-on-write --all-failures
"""

import sys

from jpa.tools.mutation import main
from jpa.core.platform import cpu_without_gpu

cpu_without_gpu()   # no NVIDIA driver, JAX_PLATFORMS unset: JAX on the CPU (as ./run does)

if __name__ == "__main__":
    sys.exit(main())
