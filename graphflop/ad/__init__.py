"""Automatic differentiation as graph transformations: the graph builder (:mod:`.builder`), the
JVP pass (:mod:`.jvp`, forward mode, linearize) and the transpose pass (:mod:`.vjp`, reverse mode
as the transpose of the linearized graph, ending with :mod:`.simplify`'s FLOP-preserving fold of
transposed matrix products). The ghost type and the argument trees they share with the rules
live in :mod:`graphflop.ops` (:mod:`graphflop.ops.ghost`, :mod:`graphflop.ops.tree`).
"""
