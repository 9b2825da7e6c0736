"""The one thing pyproject.toml cannot say: the planner's compiled simulation core
(runtime/_simcore.c). Optional: where no C compiler is found the install goes on and
runtime/fast_simulation.py runs its Python loops, which give the same plans, slower."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("hetlaunch.runtime._simcore", ["runtime/_simcore.c"], optional=True)])
