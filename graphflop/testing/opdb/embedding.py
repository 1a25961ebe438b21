"""Op-database cases: EmbeddingBag (``aten._embedding_bag``). A 6×3 table ``w`` (the parameter),
n = 7 indices ``[1, 2, 4, 5, 4, 0, 3]`` into B = 4 bags ``[1, 2]``, ``[]``, ``[4, 5, 4]``,
``[0, 3]`` (an empty bag, a repeated index), the (4, 3) output multiplied by the model's input
``x`` (the readout, differentiated too). Sum and mean are decomposed while tracing
(``graphflop/ops/embedding.py``): bag ids from the offsets (``index_add`` of B − 1 = 3 ones and a
``cumsum`` of n + 1 = 8), rows looked up (0), summed into bags with ``index_add`` (n·d = 21;
traced as ``index_put`` with accumulation);
max mode is traced whole (n·d = 21 comparisons). FLOPs by hand in each comment.

PyTorch has no forward-mode derivative for ``_embedding_bag``, so ``torch.func.jvp`` cannot run
the reference model: the ``jvp`` check is a documented gap of the reference, and the JVP is
checked by finite differences and the dot-product test instead."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphflop.testing.opdb.core import OpCase, module_of

IDX = [1, 2, 4, 5, 4, 0, 3]
OFFSETS = [0, 2, 2, 5]
_NO_FWD_AD = "torch.func.jvp: PyTorch has no forward-mode derivative for aten._embedding_bag"


def _bag(**kw):
    return module_of(
        lambda s, x: F.embedding_bag(s.idx, s.w, s.off, **kw) * x,
        {"w": (6, 3), **({"psw": (7,)} if kw.get("per_sample_weights") == "psw" else {})},
        {
            "idx": torch.tensor(IDX),
            "off": torch.tensor(OFFSETS + ([7] if kw.get("include_last_offset") else [])),
        },
    )


def _bag_psw():
    return module_of(
        lambda s, x: (
            F.embedding_bag(s.idx, s.w, s.off, mode="sum", per_sample_weights=s.psw, padding_idx=4)
            * x
        ),
        {"w": (6, 3), "psw": (7,)},
        {"idx": torch.tensor(IDX), "off": torch.tensor(OFFSETS)},
    )


EMBEDDING_BAG = [
    OpCase(
        "embedding_bag_sum",
        _bag(mode="sum"),
        ((4, 3),),
        flops=3 + 8 + 21 + 12,  # bag ids 3 + 8; index_add 7·3; readout 4·3
        aten=("aten.index_put.default", "aten.embedding.default", "aten.cumsum.default"),
        xfail={"jvp": _NO_FWD_AD},
    ),
    OpCase(
        "embedding_bag_mean_last_offset",
        _bag(mode="mean", include_last_offset=True),
        ((4, 3),),
        # bag ids 3 + 8; index_add 21; counts index_add 7; clamp_min 4 (traced as a clamp);
        # divide 4·3; readout 12
        flops=3 + 8 + 21 + 7 + 4 + 12 + 12,
        aten=("aten.index_put.default", "aten.div.Tensor"),
        xfail={"jvp": _NO_FWD_AD},
    ),
    OpCase(
        "embedding_bag_per_sample_weights",
        _bag_psw(),
        ((4, 3),),
        # bag ids 3 + 8; × per-sample weight 21; padding: ne 7, mask multiply 21; index_add 21;
        # readout 12
        flops=3 + 8 + 21 + 7 + 21 + 21 + 12,
        aten=("aten.index_put.default", "aten.mul.Tensor", "aten.ne.Scalar"),
        xfail={"jvp": _NO_FWD_AD},
    ),
    OpCase(
        "embedding_bag_max",
        _bag(mode="max"),
        ((4, 3),),
        flops=21 + 12,  # max: 1 comparison per looked-up element, 7·3; readout 12
        aten=("aten._embedding_bag.default", "aten.gather.default", "aten.scatter_add.default"),
        xfail={"jvp": _NO_FWD_AD},
    ),
    OpCase(
        "embedding_bag_max_padding",
        _bag(mode="max", padding_idx=4),
        ((4, 3),),
        flops=21 + 12,  # as embedding_bag_max: the padding rows are compared too (n·d)
        aten=("aten._embedding_bag.default",),
        xfail={"jvp": _NO_FWD_AD},
    ),
]
