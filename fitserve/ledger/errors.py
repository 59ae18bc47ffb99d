"""The one exception type the planner raises for input it cannot plan."""

from __future__ import annotations


class PlanError(ValueError):
    """A plan that cannot be made: bad input, or a machine the model does not fit.

    The message always says which input or which memory line is at fault.
    """
