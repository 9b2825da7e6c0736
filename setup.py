"""The one thing pyproject.toml cannot say: the planner's compiled loops, its simulation core
(runtime/_simcore.c), its cut program's 1F1B front (launcher/planning/_cutfront.c), its
bisection on a long chain's bottleneck (launcher/planning/_bottleneck.c) and its floor test
(launcher/planning/_floors.c). Optional: where no C compiler is found the install goes on and
runtime/fast_simulation.py, launcher/planning/cut_front.py, launcher/planning/bottleneck_fill.py and
launcher/planning/chain_bounds.py run their Python loops, which give the same plans, slower."""

import sys

from setuptools import Extension, setup

# Each multiply and add rounded on its own, as Python rounds them: a compiler may otherwise fuse
# a * b + c into one instruction (GCC does by default on aarch64, and on x86 with -march=native),
# and a loop would no longer give its Python fallback's answers to the bit.
SAME_ROUNDING = [] if sys.platform == "win32" else ["-ffp-contract=off"]  # MSVC contracts only under /fp:fast


NUMBERS = ["launcher/planning/_py_numbers.h"]  # how the planner's loops read Python numbers


def compiled(name: str, source: str, depends: list[str] | None = None) -> Extension:
    return Extension(name, [source], depends=depends or [], optional=True, extra_compile_args=SAME_ROUNDING)


setup(ext_modules=[compiled("hetlaunch.runtime._simcore", "runtime/_simcore.c"),
                   compiled("hetlaunch.launcher.planning._cutfront", "launcher/planning/_cutfront.c", NUMBERS),
                   compiled("hetlaunch.launcher.planning._bottleneck", "launcher/planning/_bottleneck.c", NUMBERS),
                   compiled("hetlaunch.launcher.planning._floors", "launcher/planning/_floors.c", NUMBERS)])
