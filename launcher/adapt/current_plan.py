"""The plan the running generation trains with, held in one place.

It changes at two moments only: when a generation is launched (its first plan, a re-plan after a
lost node, a switch at a checkpoint) and when a live move lands (the same generation, new cuts).
Calibration, the straggler watch, the trace and the generation's loop read it here; nothing
keeps a copy of its own.
"""

from __future__ import annotations

from hetlaunch.launcher.planning.plan import Plan


class CurrentPlan:
    def __init__(self):
        self.plan: Plan | None = None  # None until the first generation is launched

    def launch(self, plan: Plan) -> Plan | None:
        """A generation starts with `plan`; the plan that ran before it (None at the start)."""
        previous, self.plan = self.plan, plan
        return previous

    def moved(self, plan: Plan) -> None:
        """A live move landed: the same generation trains with `plan`'s cuts from now on."""
        self.plan = plan
