"""Op-database cases: views, copies and index ops. FLOPs worked out by hand in each comment
(docs/flops_conventions.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphflop.testing.opdb.core import OpCase, W, X, index, module_of, scale_slice, set_row


def _add_to_diagonal(h):
    """An in-place write into a diagonal view of an intermediate (``h.diagonal().add_(1)``)."""
    h.diagonal(0, 1, 2).add_(1)
    return h


#: PyTorch's ONNX exporter decomposes diagonal_scatter (the transpose of diagonal) into an
#: in-place copy, which its functional pass refuses: graphflop names the op and stops
_NO_DIAGONAL_SCATTER_ONNX = "ONNX: PyTorch's exporter cannot convert aten.diagonal_scatter"

#: the reference, not graphflop: its JVP is checked against finite differences instead
_NO_GRID_FWD_AD = "torch.func.jvp: PyTorch has no forward-mode derivative for aten.grid_sampler_2d"

#: the antialiased resize's transpose is PyTorch's own backward kernel: no forward ops (its
#: ONNX export untested); a gap, as the op was one before it had rules
_AA_BACKWARD = (
    "the antialiased resize's transpose calls _upsample_*2d_aa_backward (PyTorch's kernel): "
    "no forward-op form yet"
)

# ---------------------------------------------------------------------------------------------
# views, copies, index ops: 0 FLOPs; mul 24 before (x * w) and the readout after
# ---------------------------------------------------------------------------------------------
SHAPE = [
    OpCase(
        "flatten",
        module_of(lambda s, x: (x * s.w).flatten(1) * s.r, {"w": W}, {"r": (2, 12)}),
        (X,),
        flops=24 + 24,
        aten=("aten.view.default", "aten.reshape.default"),
    ),
    OpCase(
        "view",
        module_of(lambda s, x: (x * s.w).view(6, 4) * s.r, {"w": W}, {"r": (6, 4)}),
        (X,),
        flops=24 + 24,
        aten=("aten.view.default",),
    ),
    OpCase(
        "permute",
        module_of(lambda s, x: (x * s.w).permute(2, 0, 1) * s.r, {"w": W}, {"r": (4, 2, 3)}),
        (X,),
        flops=24 + 24,
        aten=("aten.permute.default",),
    ),
    OpCase(
        "transpose",
        module_of(lambda s, x: (x * s.w).transpose(0, 2) * s.r, {"w": W}, {"r": (4, 3, 2)}),
        (X,),
        flops=24 + 24,
        aten=("aten.permute.default",),
    ),
    OpCase(
        "reshape_noncontig",
        module_of(
            lambda s, x: (x * s.w).transpose(1, 2).reshape(2, 12) * s.r, {"w": W}, {"r": (2, 12)}
        ),
        (X,),
        flops=24 + 24,
        aten=("aten.clone.default", "aten.view.default"),
    ),
    OpCase(
        "unsqueeze",
        module_of(lambda s, x: (x * s.w).unsqueeze(1) * s.r, {"w": W}, {"r": (2, 1, 3, 4)}),
        (X,),
        flops=24 + 24,
        aten=("aten.unsqueeze.default", "aten.squeeze.dims"),
    ),
    OpCase(
        "squeeze",
        module_of(lambda s, x: (x * s.w).squeeze(1) * s.r, {"w": (1, 4)}, {"r": (2, 4)}),
        ((2, 1, 4),),
        flops=8 + 8,
        aten=("aten.squeeze.dims",),
    ),
    OpCase(
        "expand",
        module_of(lambda s, x: x.expand(2, 3, 4) * s.w, {"w": W}),
        ((2, 1, 4),),
        flops=24,
        aten=("aten.expand.default", "aten.sum.dim_IntList"),
    ),
    OpCase(
        "slice",
        module_of(lambda s, x: (x * s.w)[:, 1:3] * s.r, {"w": W}, {"r": (2, 2, 4)}),
        (X,),
        flops=24 + 16,
        aten=("aten.slice.Tensor", "aten.slice_scatter.default"),
    ),
    OpCase(
        "slice_step_neg",
        module_of(lambda s, x: (x * s.w)[..., ::2][:, -2:] * s.r, {"w": W}, {"r": (2, 2, 2)}),
        (X,),
        flops=24 + 8,
        aten=("aten.slice.Tensor",),
    ),
    OpCase(
        "select",
        module_of(lambda s, x: (x * s.w)[:, 1] * s.r, {"w": W}, {"r": (2, 4)}),
        (X,),
        flops=24 + 8,
        aten=("aten.select.int", "aten.select_scatter.default"),
    ),
    OpCase(
        "alias",
        module_of(lambda s, x: (x * s.w)[...] * s.r, {"w": W}, {"r": X}),
        (X,),
        flops=24 + 24,
        aten=("aten.alias.default",),
    ),
    OpCase(
        "cat",
        module_of(lambda s, x, y: torch.cat([x * s.w, y], 1) * s.r, {"w": W}, {"r": (2, 5, 4)}),
        (X, (2, 2, 4)),
        flops=24 + 40,
        aten=("aten.cat.default", "aten.slice.Tensor"),
    ),
    OpCase(
        "cat_param",
        module_of(lambda s, x: torch.cat([s.b, x, s.b], 0) * s.r, {"b": (1, 4)}, {"r": (5, 4)}),
        ((3, 4),),
        flops=20,
        aten=("aten.cat.default",),
    ),
    OpCase(
        "gather",
        module_of(
            lambda s, x: torch.gather(x * s.w, 2, s.idx) * s.r,
            {"w": W},
            {"idx": index(4, 2, 3, 5), "r": (2, 3, 5)},
        ),
        (X,),
        flops=24 + 30,  # gather: 0 FLOPs (docs/flops_conventions.md); readout 30
        aten=("aten.gather.default", "aten.scatter_add.default"),
    ),
    OpCase(
        "scatter_add",
        module_of(
            lambda s, x: s.base.scatter_add(2, s.idx, x * s.w) * s.r,
            {"base": X, "w": (3, 3)},
            {"idx": index(4, 2, 3, 3), "r": X},
        ),
        ((2, 3, 3),),
        flops=18 + 18 + 24,  # mul 18; scatter_add: 1 per added element (18); readout 24
        aten=("aten.scatter_add.default", "aten.gather.default"),
    ),
    OpCase(
        "pad",
        module_of(lambda s, x: F.pad(x * s.w, (1, 2)) * s.r, {"w": W}, {"r": (2, 3, 7)}),
        (X,),
        flops=24 + 42,
        aten=("aten.constant_pad_nd.default",),
    ),
    OpCase(
        "pad_2d",
        module_of(lambda s, x: F.pad(x * s.w, (0, 1, 2, 0)) * s.r, {"w": W}, {"r": (2, 5, 5)}),
        (X,),
        flops=24 + 50,
        aten=("aten.constant_pad_nd.default",),
    ),
    OpCase(
        "to_float64",
        module_of(lambda s, x: x.to(torch.float64) * s.w, {"w": W}),
        ((X, torch.float32),),
        flops=24,  # the cast is a copy: 0 FLOPs; mul 24
        aten=("aten._to_copy.default",),
    ),
]

# ---------------------------------------------------------------------------------------------
# small real-model patterns
# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# more views and index ops (mul 24 before, readout after)
# ---------------------------------------------------------------------------------------------
SHAPE_MORE = [
    OpCase(
        "stft_of_real_part",
        module_of(
            lambda s, x: (
                torch.view_as_real(
                    torch.stft(
                        torch.view_as_complex(x * s.w).real,
                        n_fft=4,
                        hop_length=2,
                        window=s.win,
                        center=False,
                        return_complex=True,
                    )
                )
                * s.r
            ),
            {"w": (8, 2)},
            {"win": (4,), "r": (2, 3, 3, 2)},
        ),
        ((2, 8, 2),),
        # the frames of a strided view (the real parts, every other element of the storage);
        # mul 32; view_as_complex, .real, as_strided: views (0); × window 2·3·4 = 24; one-sided
        # r2c of 4 points per frame 2.5·24·log2 4 = 120; view 0; readout 36
        flops=32 + 24 + 120 + 36,
        aten=("aten.as_strided.default", "aten.index_put.default"),
    ),
    OpCase(
        "as_strided_overlapping",
        module_of(
            lambda s, x: (x * s.w).reshape(-1).as_strided((5, 6), (4, 1)) * s.r,
            {"w": W},
            {"r": (5, 6)},
        ),
        (X,),
        # mul 24; 5 overlapping windows of 6 of the 24 elements, a view (0); readout 30
        flops=24 + 30,
        aten=("aten.as_strided.default", "aten.index_put.default"),
    ),
    OpCase(
        "stft",
        module_of(
            lambda s, x: (
                torch.view_as_real(
                    torch.stft(
                        x * s.w,
                        n_fft=4,
                        hop_length=2,
                        window=s.win,
                        center=False,
                        return_complex=True,
                    )
                )
                * s.r
            ),
            {"w": (8,)},
            {"win": (4,), "r": (2, 3, 3, 2)},
        ),
        ((2, 8),),
        # mul 16; 3 frames of 4 per signal (as_strided, a view, 0); × window 2·3·4 = 24;
        # one-sided r2c of 4 points per frame: 2.5·24·log2 4 = 120; view 0; readout 36
        flops=16 + 24 + 120 + 36,
        aten=("aten.as_strided.default", "aten._fft_r2c.default"),
    ),
    OpCase(
        "split_uneven",
        module_of(
            lambda s, x: (lambda p: torch.cat([p[1], p[0]], -1))((x * s.w).split(3, -1)) * s.r,
            {"w": W},
            {"r": X},
        ),
        (X,),
        flops=24 + 24,  # mul; readout (split and cat: 0 FLOPs)
        aten=("aten.split_with_sizes.default", "aten.cat.default"),
    ),
    OpCase(
        "unbind",
        module_of(lambda s, x: (x * s.w).unbind(1)[2] * s.r, {"w": W}, {"r": (2, 4)}),
        (X,),
        flops=24 + 8,
        aten=("aten.split_with_sizes.default", "aten.squeeze.dims"),
    ),
    # in-place writes into views of an intermediate, functionalised
    OpCase(
        "setitem_slice_scale",
        module_of(lambda s, x: scale_slice(x * s.w) * s.r, {"w": W}, {"r": X}),
        (X,),
        # mul 24; slice (2,2,4) *2: 16; readout 24
        flops=24 + 16 + 24,
        aten=("aten.slice_scatter.default",),
    ),
    OpCase(
        "setitem_select_src",
        module_of(lambda s, x: set_row(x * s.w, s.v) * s.r, {"w": W, "v": (4,)}, {"r": X}),
        (X,),
        # mul 24; h[:, 1] = v: a copy of v broadcast (0 FLOPs), then core ATen's
        # select_scatter: arange == 1 (3) and a where (24); readout 24
        flops=24 + 3 + 24 + 24,
        aten=("aten.copy.default", "aten.where.self"),
    ),
    OpCase(
        "diagonal",
        module_of(lambda s, x: (x * s.w).diagonal(0, 1, 2) * s.r, {"w": W}, {"r": (2, 3)}),
        (X,),
        # mul 24; the diagonal of each 3x4 matrix, a view (0); readout 2*3 = 6
        flops=24 + 6,
        aten=("aten.diagonal.default",),
        xfail={"onnx": _NO_DIAGONAL_SCATTER_ONNX},
    ),
    OpCase(
        "diagonal_offset_swapped",
        module_of(lambda s, x: (x * s.w).diagonal(-1, 2, 1) * s.r, {"w": W}, {"r": (2, 3)}),
        (X,),
        # mul 24; diagonal -1 of dims (2, 1): entries [i+1, i] of each 3x4 matrix, 3 of them, a
        # view (0); readout 2*3 = 6
        flops=24 + 6,
        aten=("aten.diagonal.default",),
        xfail={"onnx": _NO_DIAGONAL_SCATTER_ONNX},
    ),
    OpCase(
        "setitem_diagonal_add",
        module_of(lambda s, x: _add_to_diagonal(x * s.w) * s.r, {"w": W}, {"r": X}),
        (X,),
        # mul 24; the diagonal (2x3) += 1: add 6, written back by diagonal_scatter (a copy, 0);
        # readout 24
        flops=24 + 6 + 24,
        aten=("aten.diagonal_scatter.default",),
        xfail={"onnx": _NO_DIAGONAL_SCATTER_ONNX},
    ),
    OpCase(
        "flip",
        module_of(lambda s, x: (x * s.w).flip(1, 2) * s.r, {"w": W}, {"r": X}),
        (X,),
        flops=24 + 24,
        aten=("aten.flip.default",),
    ),
    OpCase(
        "roll",
        module_of(lambda s, x: (x * s.w).roll(1, 2) * s.r, {"w": W}, {"r": X}),
        (X,),
        # mul 24; index arithmetic on arange(4): add 4, fmod 4; readout 24
        flops=24 + 8 + 24,
        aten=("aten.index_select.default", "aten.fmod.Scalar", "aten.index_add.default"),
    ),
    OpCase(
        "index_select",
        module_of(
            lambda s, x: (x * s.w).index_select(2, s.idx) * s.r,
            {"w": W},
            {"idx": lambda: torch.tensor([3, 0, 3]), "r": (2, 3, 3)},
        ),
        (X,),
        flops=24 + 18,
        aten=("aten.index_select.default", "aten.index_add.default"),
    ),
    OpCase(
        "index_tensor",
        module_of(
            lambda s, x: (x * s.w)[:, s.idx] * s.r,
            {"w": W},
            {"idx": lambda: torch.tensor([[2, 0], [2, 1]]), "r": (2, 2, 2, 4)},
        ),
        (X,),
        flops=24 + 32,
        aten=("aten.index.Tensor", "aten.index_put.default"),
    ),
    OpCase(
        "index_put_accumulate",
        module_of(
            lambda s, x: (x * s.w).index_put((s.idx,), s.v, accumulate=True) * s.r,
            {"w": W, "v": (3, 3, 4)},
            {"idx": lambda: torch.tensor([1, 0, 1]), "r": X},
        ),
        (X,),
        flops=24 + 36 + 24,  # mul; 36 added elements; readout
        aten=("aten.index_put.default", "aten.index.Tensor"),
    ),
    OpCase(
        "index_put_overwrite",
        module_of(
            lambda s, x: (x * s.w).index_put((s.i, s.j), s.v) * s.r,
            {"w": W, "v": (2, 4)},
            {"i": lambda: torch.tensor([0, 1]), "j": lambda: torch.tensor([2, 0]), "r": X},
        ),
        (X,),
        flops=24 + 24,  # mul; the copy costs 0; readout
        aten=("aten.index_put.default",),
    ),
    OpCase(
        "upsample_nearest",
        module_of(
            lambda s, x: F.interpolate(x * s.w, scale_factor=2) * s.r,
            {"w": (3, 3)},
            {"r": (1, 2, 6, 6)},
        ),
        ((1, 2, 3, 3),),
        # mul 18; source indices of the 6 output rows and 6 columns: a mul and an add each
        # (24); gather 0; readout 72
        flops=18 + 24 + 72,
        aten=("aten.index.Tensor",),
    ),
    OpCase(
        "upsample_bilinear",
        module_of(
            lambda s, x: F.interpolate(x * s.w, size=(5, 4), mode="bilinear") * s.r,
            {"w": (3, 3)},
            {"r": (1, 2, 5, 4)},
        ),
        ((1, 2, 3, 3),),
        # sum of the parts (PyTorch's decomposition): mul 187, add 138, sub 138, clamp 27
        flops=187 + 138 + 138 + 27,
        aten=("aten.index.Tensor", "aten.clamp.default"),
    ),
    OpCase(
        "upsample_bilinear_antialias",
        module_of(
            lambda s, x: F.interpolate(x * s.w, size=(4, 5), mode="bilinear", antialias=True),
            {"w": (6, 5)},
        ),
        ((1, 2, 6, 5),),
        # mul 60; kept whole, 2 per filter tap (tests/test_ops_extra.py by hand): 200
        flops=60 + 200,
        xfail={"no_backward": _AA_BACKWARD, "onnx": _AA_BACKWARD},
        aten=("aten._upsample_bilinear2d_aa.default",),
    ),
    OpCase(
        "upsample_bicubic_antialias",
        module_of(
            lambda s, x: F.interpolate(x * s.w, size=(4, 3), mode="bicubic", antialias=True),
            {"w": (6, 5)},
        ),
        ((1, 2, 6, 5),),
        # mul 60; kept whole, 2 per filter tap (tests/test_ops_extra.py by hand): 528
        flops=60 + 528,
        xfail={"no_backward": _AA_BACKWARD, "onnx": _AA_BACKWARD},
        aten=("aten._upsample_bicubic2d_aa.default",),
    ),
    OpCase(
        "upsample_bilinear_align_corners",
        module_of(
            lambda s, x: (
                F.interpolate(x * s.w, scale_factor=2, mode="bilinear", align_corners=True) * s.r
            ),
            {"w": (3, 3)},
            {"r": (1, 2, 6, 6)},
        ),
        ((1, 2, 3, 3),),
        # sum of the parts: mul 318, add 228, sub 228, clamp 36
        flops=318 + 228 + 228 + 36,
        aten=("aten.index.Tensor",),
    ),
    OpCase(
        "grid_sample_bilinear",
        module_of(
            lambda s, x: F.grid_sample(x * s.w, s.g, align_corners=False) * s.r,
            {"w": (4, 4), "g": (1, 3, 3, 2)},
            {"r": (1, 2, 3, 3)},
        ),
        ((1, 2, 4, 4),),
        # mul 32; PyTorch's decomposition on the grid expanded to E = N·C·oH·oW = 18 elements:
        # unnormalize x and y (mul, add: 4E), floor (2E), the +1 corners (2E), four weights
        # (two sub and a mul each: 12E), per corner the bounds test (four comparisons, three
        # logical_and: 7E), three where (3E) and the weighted gather (mul: E) (11E each, 44E),
        # the corners summed (3E): 67E = 1,206; readout 18
        flops=32 + 67 * 18 + 18,
        aten=("aten.index.Tensor", "aten.floor.default", "aten.logical_and.default"),
        xfail={"jvp": _NO_GRID_FWD_AD},
    ),
    OpCase(
        "grid_sample_nearest_border",
        module_of(
            lambda s, x: (
                F.grid_sample(
                    x * s.w, s.g, mode="nearest", padding_mode="border", align_corners=True
                )
                * s.r
            ),
            {"w": (4, 4), "g": (1, 3, 3, 2)},
            {"r": (1, 2, 3, 3)},
        ),
        ((1, 2, 4, 4),),
        # mul 32; on E = 18: unnormalize (4E), clamp to the border (2E), round (2E), the bounds
        # test (7E), three where (3E) and the gather times its weight, a where of 1 (mul: E):
        # 19E = 342 (the gather itself 0); readout 18. The output is piecewise constant in the
        # grid: its derivatives reach x only
        flops=32 + 19 * 18 + 18,
        aten=("aten.index.Tensor", "aten.round.default", "aten.clamp.default"),
        xfail={"jvp": _NO_GRID_FWD_AD},
    ),
    OpCase(
        "grid_sample_bicubic_reflection",
        module_of(
            lambda s, x: (
                F.grid_sample(
                    x * s.w, s.g, mode="bicubic", padding_mode="reflection", align_corners=False
                )
                * s.r
            ),
            {"w": (4, 4), "g": (1, 3, 3, 2)},
            {"r": (1, 2, 3, 3)},
        ),
        ((1, 2, 4, 4),),
        # mul 32; PyTorch's decomposition (its CPU path) on E = 18 elements: unnormalize (4E),
        # floor (2E), the fractions tx, ty (2E); per row offset (four): its y (add) and three
        # shifted x (sub, add, add), 16E; sixteen bounded reads, each reflecting x and y (sub,
        # abs, fmod, div, floor, bitwise_and, eq, add, sub, where, then clamp: 11E each) plus
        # the bounds test (7E), three where (3E) and the gather times its weight (E): 33E,
        # 528E in all; five cubic interpolations (four along x, one along y), each computing
        # its weights again (1 - t, t + 1, 2 - t: 3E; the two cubic polynomials on stacked
        # pairs, 6 and 5 ops on 2E: 22E) and the weighted sum (4 mul, 3 add): 32E, 160E in
        # all; 712E = 12,816; readout 18
        flops=32 + 712 * 18 + 18,
        aten=("aten.bitwise_and.Scalar", "aten.fmod.Scalar", "aten.abs.default"),
        xfail={"jvp": _NO_GRID_FWD_AD},
    ),
    OpCase(
        "pad_reflect",
        module_of(
            lambda s, x: F.pad(x * s.w, (1, 2, 2, 1), mode="reflect") * s.r,
            {"w": (3, 4)},
            {"r": (1, 2, 6, 7)},
        ),
        ((1, 2, 3, 4),),
        # mul 24; reflected indices for 6 rows and 7 columns (13 positions), two abs and two
        # sub each: abs 26, sub 26; gather 0; readout 84
        flops=24 + 26 + 26 + 84,
        aten=("aten.index.Tensor",),
    ),
    OpCase(
        "pad_replicate",
        module_of(
            lambda s, x: F.pad(x * s.w, (1, 2, 0, 1), mode="replicate") * s.r,
            {"w": (3, 4)},
            {"r": (1, 2, 4, 7)},
        ),
        ((1, 2, 3, 4),),
        # mul 24; clamped indices on 4 rows and 7 columns: 11; gather 0; readout 56
        flops=24 + 11 + 56,
        aten=("aten.index.Tensor", "aten.clamp.default"),
    ),
]

# ---------------------------------------------------------------------------------------------
# index_add and index_copy (both traced as index_put)
# ---------------------------------------------------------------------------------------------
INDEX_MORE = [
    OpCase(
        "index_add_alpha",
        module_of(
            lambda s, x: (x * s.w).index_add(1, s.idx, s.v, alpha=2.0) * s.r,
            {"w": W, "v": (2, 3, 4)},
            {"idx": lambda: torch.tensor([2, 0, 2]), "r": X},
        ),
        (X,),
        # mul 24; alpha·v 24; index_put(accumulate) adds 24 elements (row 2 twice); readout 24
        flops=24 + 24 + 24 + 24,
        aten=("aten.index_put.default",),
    ),
    OpCase(
        "index_copy",
        module_of(
            lambda s, x: (x * s.w).index_copy(1, s.idx, s.v) * s.r,
            {"w": W, "v": (2, 2, 4)},
            {"idx": lambda: torch.tensor([2, 0]), "r": X},
        ),
        (X,),
        flops=24 + 24,  # mul; the copy costs 0; readout
        aten=("aten.index_put.default",),
    ),
]

# ---------------------------------------------------------------------------------------------
# masked writes whose value needs a gradient: a boolean mask in x[:, m] = v and x[m] = v (traced
# as index_put), masked_scatter; the value's cotangent is found without the data-dependent count
# of set elements (graphflop/ops/shape.py)
# ---------------------------------------------------------------------------------------------


def _mask_cols(h, m, v):
    """``h[:, m] = v`` on a copy of the intermediate ``h``."""
    h = h.clone()
    h[:, m] = v
    return h


def _mask_cols_from_first(h, m):
    """``h[:, m] = 2 * h[:, :1]`` on a copy of ``h``: the value, read from ``h`` itself, is
    broadcast along the set columns."""
    h = h.clone()
    h[:, m] = 2 * h[:, :1]
    return h


def _mask_all(h, m, v):
    """``h[m] = v`` on a copy of the intermediate ``h``."""
    h = h.clone()
    h[m] = v
    return h


def _every_third() -> torch.Tensor:
    """A (2, 3, 4) mask with 8 set elements (flat positions 0, 3, …, 21)."""
    return torch.arange(24).reshape(2, 3, 4) % 3 == 0


MASKED_WRITES = [
    OpCase(
        "setitem_mask_broadcast",
        module_of(
            lambda s, x: _mask_cols_from_first(x * s.w, s.m) * s.r,
            {"w": W},
            {"m": lambda: torch.tensor([True, False, True]), "r": X},
        ),
        (X,),
        # mul 24; 2·h[:, :1] 8; the write 0; readout 24
        flops=24 + 8 + 24,
        aten=("aten.index_put.default", "aten.where.ScalarOther", "aten.sum.dim_IntList"),
    ),
    OpCase(
        "setitem_mask_per_element",
        module_of(
            lambda s, x: _mask_cols(x * s.w, s.m, s.v) * s.r,
            {"w": W, "v": (2, 2, 4)},
            {"m": lambda: torch.tensor([True, False, True]), "r": X},
        ),
        (X,),
        flops=24 + 24,  # mul; the write 0; readout
        aten=("aten.index_put.default", "aten.cumsum.default", "aten.scatter_add.default"),
    ),
    OpCase(
        "setitem_whole_mask_scalar",
        module_of(
            lambda s, x: _mask_all(x * s.w, s.m, s.v * 3) * s.r,
            {"w": W, "v": ()},
            {"m": _every_third, "r": X},
        ),
        (X,),
        flops=24 + 1 + 24,  # mul; v·3; the write 0; readout
        aten=("aten.index_put.default", "aten.where.ScalarOther"),
    ),
    OpCase(
        "setitem_whole_mask_vector",
        module_of(
            lambda s, x: _mask_all(x * s.w, s.m, s.v) * s.r,
            {"w": W, "v": (8,)},
            {"m": _every_third, "r": X},
        ),
        (X,),
        flops=24 + 24,  # mul; the write 0; readout
        aten=("aten.index_put.default", "aten.scatter_add.default"),
    ),
    OpCase(
        "masked_scatter",
        module_of(
            lambda s, x: (x * s.w).masked_scatter(s.m, s.v) * s.r,
            {"w": W, "v": (5, 3)},
            {"m": lambda: torch.arange(12).reshape(3, 4) % 2 == 0, "r": X},
        ),
        (X,),
        # mul 24; the write 0 (12 of v's 15 elements taken: the (3, 4) mask broadcast over the
        # batch sets 6 per batch element); readout 24
        flops=24 + 24,
        aten=("aten.masked_scatter.default", "aten.cumsum.default", "aten.scatter_add.default"),
    ),
]

# ---------------------------------------------------------------------------------------------
# scatter.src, scatter.value, scatter_reduce (graphflop/ops/scatter.py);
# indices unique along the scattered dim (repeated writes are unspecified in PyTorch)
# ---------------------------------------------------------------------------------------------


def _perm_index() -> torch.Tensor:
    return torch.tensor([[[0, 2, 3, 1]], [[3, 1, 0, 2]]]).expand(2, 3, 4).clone()[:, :, :2]


def _reduce_index() -> torch.Tensor:
    return torch.tensor([[[0, 2, 0, 1, 2, 0]]]).expand(2, 3, 6).clone()


SCATTER = [
    OpCase(
        "scatter_src",
        module_of(
            lambda s, x: torch.scatter(x * s.w, 2, s.idx, s.v) * s.r,
            {"w": W, "v": (2, 3, 2)},
            {"idx": _perm_index, "r": X},
        ),
        (X,),
        flops=24 + 24,  # mul; the scatter copies (0); readout
        aten=("aten.scatter.src", "aten.scatter.value", "aten.gather.default"),
    ),
    OpCase(
        "scatter_value",
        module_of(
            lambda s, x: torch.scatter(x * s.w, 2, s.idx, 1.5) * s.r,
            {"w": W},
            {"idx": _perm_index, "r": X},
        ),
        (X,),
        flops=24 + 24,  # mul; the scatter copies (0); readout
        aten=("aten.scatter.value",),
    ),
    OpCase(
        "scatter_reduce_sum",
        module_of(
            lambda s, x: torch.scatter_reduce(x * s.w, 2, s.idx, s.v, "sum") * s.r,
            {"w": W, "v": (2, 3, 6)},
            {"idx": _reduce_index, "r": X},
        ),
        (X,),
        flops=24 + 36 + 24,  # mul; scatter_add of 36 source elements; readout
        aten=("aten.scatter_add.default",),
    ),
    OpCase(
        "scatter_reduce_mean_exclude_self",
        module_of(
            lambda s, x: (
                torch.scatter_reduce(x * s.w, 2, s.idx, s.v, "mean", include_self=False) * s.r
            ),
            {"w": W, "v": (2, 3, 6)},
            {"idx": _reduce_index, "r": X},
        ),
        (X,),
        # mul 24; hit positions zeroed (0); sums 36; counts: 36 adds of ones; clamp 24; div 24;
        # readout 24
        flops=24 + 36 + 36 + 24 + 24 + 24,
        aten=("aten.scatter_add.default", "aten.scatter.value", "aten.div.Tensor"),
    ),
    OpCase(
        "scatter_reduce_amax",
        module_of(
            lambda s, x: torch.scatter_reduce(x * s.w, 2, s.idx, s.v, "amax") * s.r,
            {"w": W, "v": (2, 3, 6)},
            {"idx": _reduce_index, "r": X},
        ),
        (X,),
        flops=24 + 36 + 24,  # mul; one comparison per source element; readout
        aten=("aten.scatter_reduce.two", "aten.scatter_add.default", "aten.eq.Tensor"),
    ),
]
