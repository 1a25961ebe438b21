"""Model → core-ATen ``torch.fx`` graph on fake tensors.

* :mod:`.trace`: the :func:`~.trace.trace` entry point and its ``make_fx`` driver;
* :mod:`.scopes`: module paths of traced nodes (global forward hooks);
* :mod:`.composite`: composite ops routed to graphflop's decompositions while tracing;
* :mod:`.outline`: repeated blocks traced once;
* :mod:`.export_form`: graphflop's form of a traced graph, and :func:`~.export_form.from_exported`
  for a ``torch.export`` program;
* :mod:`.loss`: the losses a traced graph ends in;
* :mod:`.errors`: :class:`~.errors.TraceError`.

The decompositions themselves live beside their rules in :mod:`graphflop.ops`.
"""
