"""The one thing pyproject.toml cannot say: the planner's compiled loops, its simulation core
(runtime/_simcore.c), its cut program's 1F1B front (launcher/planning/_cutfront.c), its
bisection on a long chain's bottleneck (launcher/planning/_bottleneck.c) and its floor test
(launcher/planning/_floors.c). Optional: where no C compiler is found the install goes on and
runtime/fast_simulation.py, launcher/planning/cut_front.py, launcher/planning/bottleneck_fill.py and
launcher/planning/chain_bounds.py run their Python loops, which give the same plans, slower."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("hetlaunch.runtime._simcore", ["runtime/_simcore.c"], optional=True),
                   Extension("hetlaunch.launcher.planning._cutfront", ["launcher/planning/_cutfront.c"], optional=True),
                   Extension("hetlaunch.launcher.planning._bottleneck", ["launcher/planning/_bottleneck.c"],
                             optional=True),
                   Extension("hetlaunch.launcher.planning._floors", ["launcher/planning/_floors.c"], optional=True)])
