"""Colours of the pictures: the role palette and the FLOP fill scale (no Graphviz here).

Role colours: black for the forward, seven colours from Paul Tol's colour-blind-safe schemes
("muted", "vibrant" and "light", https://personal.sron.nl/~pault/) and two tangent colours found
by a search over a 16-level RGB grid, chosen so that every two roles differ in hue (at least 25
degrees of CIELAB hue angle apart for normal vision: the backward's input and weight gradients
are orange and raspberry, the JVP's two tangents blue and violet) and stay apart (CIE76 colour
difference of at least 15) for normal vision and as simulated for protanopia, deuteranopia and
tritanopia with the matrices of G. M. Machado, M. M. Oliveira and L. A. F. Fernandes, "A
Physiologically-based Model for Simulation of Color Vision Deficiency", IEEE TVCG 15(6), 2009
(severity 1). A role is drawn as a box's header strip and border around a fill from the FLOP
scale, so every role colour also stays clear of that scale (CIE76 difference of at least 20
from each of viridis' 256 colours, normal vision: Tol's teal and indigo, the earlier tangent
colours, were 6.6 and 14 from it). tests/test_render.py checks all three.
FLOP fills: matplotlib's perceptually uniform ``viridis``, on a log10 scale.
"""

from __future__ import annotations

import math

#: role → colour (see the module docstring for how they were chosen)
ROLE_COLOURS = {
    "forward": "#000000",
    "loss": "#DDCC77",  # sand
    "grad_input": "#EE7733",  # orange
    "grad_weight": "#EE3377",  # raspberry
    "grad_accum": "#AA4499",  # purple
    "update": "#117733",  # green
    "tangent_from_input": "#0088EE",  # blue
    "tangent_from_param": "#3322AA",  # violet
    "direction": "#99DDFF",  # pale blue
}
RESIDUAL_COLOUR = "#882255"
GHOST_COLOUR = "#8C8C8C"
PARAM_COLOUR = "#7F7F7F"
#: a box with no FLOPs, and the background of every label
WHITE = "#FFFFFF"
COLORMAP = "viridis"


def role_colour(role: str) -> str:
    """The colour of ``role`` (black for a role outside :data:`ROLE_COLOURS`)."""
    return ROLE_COLOURS.get(role, "#000000")


class FlopScale:
    """log10(FLOPs) → viridis hex colour, over [lo, hi] FLOPs (the non-zero values given)."""

    def __init__(self, values: list[int]):
        from matplotlib import colormaps
        from matplotlib.colors import to_hex

        self._cmap = colormaps[COLORMAP]
        self._hex = to_hex
        nz = [v for v in values if v > 0]
        self.lo = min(nz) if nz else 1
        self.hi = max(nz) if nz else 1

    def t(self, flops: int) -> float:
        """Position of ``flops`` on the scale, 0 (lo) to 1 (hi), clamped."""
        a, b = math.log10(self.lo), math.log10(self.hi)
        return 1.0 if b <= a else min(1.0, max(0.0, (math.log10(flops) - a) / (b - a)))

    def colour(self, flops: int) -> str:
        """Fill colour for ``flops`` (white for none)."""
        if flops <= 0:
            return WHITE
        return self._hex(self._cmap(self.t(flops))).upper()

    def ticks(self, n: int = 6) -> list[tuple[str, int]]:
        """``n`` evenly spaced (log) stops: (colour, FLOPs)."""
        if self.hi <= self.lo:
            return [(self.colour(self.hi), self.hi)]
        a, b = math.log10(self.lo), math.log10(self.hi)
        stops = [10 ** (a + (b - a) * i / (n - 1)) for i in range(n)]
        return [(self.colour(int(round(s))), int(round(s))) for s in stops]
