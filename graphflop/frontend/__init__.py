"""Model → core-ATen ``torch.fx`` graph on fake tensors: tracing (:mod:`.trace`), module scopes,
outlining of repeated blocks (:mod:`.outline`) and the ``torch.export`` form (:func:`from_exported`).
"""
