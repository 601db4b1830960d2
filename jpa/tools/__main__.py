"""`python -m jpa.tools COMMAND [args]`: the same commands as `jpa tools` (jpa/tools/cli.py)."""

import sys

from jpa.tools.cli import main

sys.exit(main())
