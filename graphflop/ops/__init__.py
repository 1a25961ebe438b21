"""The rule table (``registry``) and one rule file per op family; importing this package fills
the table and the decomposition table (:func:`decomposition_table`).

To add an op, write in its family's file its cost (:func:`register`), its JVP and transpose
(:func:`def_jvp`, :func:`def_linear`, ...), or, for a composite op, its decomposition
(:func:`register_decomposition`); ``graphflop.testing.opdb`` then checks it everywhere.

Beside the table, the values rules see and what evaluating one costs: the ghost type
(:mod:`.ghost`), maps over argument trees (:mod:`.tree`) and :func:`.cost.op_cost`; they sit here,
in the lowest layer, so that the graph builder (:mod:`graphflop.ad`), the tracer and the passes
can all use them.
"""

from graphflop.ops import (  # noqa: F401  (imported for their registrations)
    attention,
    conv,
    creation,
    elementwise,
    embedding,
    linalg,
    loss,
    norm,
    pool,
    recurrent,
    reduction,
    scatter,
    shape,
    sorting,
    spectral,
)
from graphflop.ops.registry import (
    MissingRuleError,
    OpRule,
    all_rules,
    decomposition_table,
    def_bilinear,
    def_jvp,
    def_linear,
    def_transpose,
    def_zero,
    has_rule,
    is_strict,
    lookup,
    missing_kinds,
    op_name,
    register,
    register_decomposition,
    strict_rules,
    use_torch_decomposition,
)

__all__ = [
    "MissingRuleError",
    "OpRule",
    "all_rules",
    "decomposition_table",
    "def_bilinear",
    "def_jvp",
    "def_linear",
    "def_transpose",
    "def_zero",
    "has_rule",
    "is_strict",
    "lookup",
    "missing_kinds",
    "op_name",
    "register",
    "register_decomposition",
    "strict_rules",
    "use_torch_decomposition",
]
