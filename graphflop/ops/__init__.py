"""The rule table (``registry``) and one rule file per op family; importing this package fills
the table."""

from graphflop.ops import (  # noqa: F401  (imported for their registrations)
    conv,
    creation,
    elementwise,
    embedding,
    linalg,
    norm,
    pool,
    reduction,
    shape,
)
from graphflop.ops.registry import (
    MissingRuleError,
    OpRule,
    all_rules,
    def_bilinear,
    def_jvp,
    def_linear,
    def_transpose,
    def_zero,
    has_rule,
    lookup,
    op_name,
    register,
)

__all__ = [
    "MissingRuleError",
    "OpRule",
    "all_rules",
    "def_bilinear",
    "def_jvp",
    "def_linear",
    "def_transpose",
    "def_zero",
    "has_rule",
    "lookup",
    "op_name",
    "register",
]
