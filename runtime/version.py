"""The versions an agent reports at registration; the coordinator refuses a mismatch.

Both are read from the installed packages' metadata, so asking costs no torch import
(`hetlaunch --help`, `--version` and `validate` stay fast)."""

from importlib.metadata import PackageNotFoundError, version


# How runtime/node_measurement.py times layers: part of the profile cache's key
# (launcher/cluster_measurement.py), so a node's timings cached another way are measured again.
# 2: forward, backward, I and W each timed as a piece of its own, as the executor runs them (2026-12-04).
MEASUREMENT_METHOD = 2


def hetlaunch_version() -> str:
    try:
        return version("hetlaunch")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"


def torch_version() -> str:
    try:
        return version("torch")
    except PackageNotFoundError:  # a torch built from source without metadata: ask the module
        import torch

        return torch.__version__
