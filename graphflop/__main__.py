"""``python -m graphflop``: the command line (the same as ``python -m graphflop.cli``), so that
``torchrun --nproc_per_node N -m graphflop train ...`` runs data-parallel training."""

from graphflop.cli import entry

entry()
