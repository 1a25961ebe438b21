"""Test support importable by tests and tools.

* :mod:`.opdb`: the op database, one small module per op (or pattern) with hand-worked FLOPs.
* :mod:`.checks`: the generic per-op checks run over it (FLOPs, JVP, VJP, dot-product test,
  rules, ONNX round trip); ``tools/op_coverage.py`` and ``tests/test_ops*.py`` call them.
* :mod:`.rules`: context managers that change the rule table for one block and restore it.

``checks`` (and the op database) load torch tracing machinery: import them explicitly.
"""

from graphflop.testing.rules import restored_rules, temporary_rule, without_rule

__all__ = ["restored_rules", "temporary_rule", "without_rule"]
