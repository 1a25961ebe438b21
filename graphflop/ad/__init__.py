"""Automatic differentiation as graph transformations: the graph builder (:mod:`.builder`), the
JVP pass (:mod:`.jvp`, forward mode, linearize) and the transpose pass (:mod:`.vjp`, reverse mode
as the transpose of the linearized graph).
"""
