"""Capacity planning (``meshplan capacity``, ``meshplan.capacity``): for a model and a token count,
the best plan on each cluster kind at each GPU count, with days, GPU-hours and cost (predicted,
with the cost model's measured error as a band), the Pareto front and the deadline/budget picks.

``parse`` (the inputs), ``sweep`` (sizes and searches), ``rows`` (rows and marks, pure),
``band`` (the error band's file), ``api`` (``capacity``, ``capacity_report``), ``text`` (the
printed table). The pictures are ``meshplan.report.capacity_plot``. No torch import.
"""

from meshplan.sizing.api import CapacityReport, capacity, capacity_report
from meshplan.sizing.rows import CapacityRow

__all__ = ["CapacityReport", "CapacityRow", "capacity", "capacity_report"]
