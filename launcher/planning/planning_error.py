"""The one error planning raises on purpose: no plan exists for what was asked, said in one line.

Its own module so that every part of the planner (the cost model included) can raise it, and
every caller — `hetlaunch plan`, `up`, the straggler watch re-planning mid-run — can catch it
without importing the search."""


class PlanningError(Exception):
    """One-line reason no plan exists."""
