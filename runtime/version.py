"""The versions an agent reports at registration; the coordinator refuses a mismatch."""

from importlib.metadata import PackageNotFoundError, version

import torch


def hetlaunch_version() -> str:
    try:
        return version("hetlaunch")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"


def torch_version() -> str:
    return torch.__version__
