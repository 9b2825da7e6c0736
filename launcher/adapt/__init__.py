"""The running plan: what changes it while a job trains, and the one place that holds it.

* current_plan.py: the plan the running generation trains with (set at a launch and a live move);
* replanner.py: the job's planner while it runs (the profile and its corrections, the codecs
  allowed, the live nodes): plan, re-cut, re-plan, price, join;
* calibration.py: the plan checked against the first steps, the profile corrected;
* straggler.py: nodes and links that change speed mid-run, and the change that answers them;
* live_moves.py: the coordinator's side of moving layers between running stages;
* payoff.py: every change checked on the steps after it, and undone when it did not pay.
"""
