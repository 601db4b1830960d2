"""`python -m jpa COMMAND [args]`: the same as the `jpa` command."""

import sys

from jpa.cli.main import main

sys.exit(main())
