"""``python -m graphflop.cli``: the command line."""

import sys

from graphflop.cli import main

sys.exit(main())
