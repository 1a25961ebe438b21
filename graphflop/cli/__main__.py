"""``python -m graphflop.cli``: the command line."""

from graphflop.cli import entry

entry()
