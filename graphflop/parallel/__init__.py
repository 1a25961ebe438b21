"""Parallel plans: what every rank computes, holds and sends under data, tensor, sequence and
pipeline parallelism and ZeRO, from graphflop's train graph.

:class:`~graphflop.parallel.plan.Plan` says how the step is split;
:func:`~graphflop.parallel.predict.predict` puts an analysis on it
(:mod:`~graphflop.parallel.placement`: TP placements and collectives node by node;
:mod:`~graphflop.parallel.tp_plan`: the default Megatron plan) and returns a
:class:`~graphflop.parallel.predict.PlanReport`.
"""

from graphflop.parallel.plan import SCHEDULES, Plan, PlanError, read_tp_plan
from graphflop.parallel.predict import PlanReport, RankClass, find_blocks, pipeline_units, predict

__all__ = [
    "SCHEDULES",
    "Plan",
    "PlanError",
    "PlanReport",
    "RankClass",
    "find_blocks",
    "pipeline_units",
    "predict",
    "read_tp_plan",
]
