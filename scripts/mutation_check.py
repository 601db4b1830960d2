#!/usr/bin/env python3
"""Shows that the test suite catches deliberate faults in the engine (mutation testing, by hand).

The machinery and the list of faults are jpa/tools/mutation.py (its docstring explains the outcomes).

  python scripts/mutation_check.py --dry-run
  python scripts/mutation_check.py --json results/mutation_check.json
  python scripts/mutation_check.py --only skipped-copy-on-write --all-failures
"""

import sys

from jpa.tools.mutation import main

if __name__ == "__main__":
    sys.exit(main())
