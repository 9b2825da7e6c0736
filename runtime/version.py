"""The versions an agent reports at registration; the coordinator refuses a mismatch.

Both are read from the installed packages' metadata, so asking costs no torch import
(`hetlaunch --help`, `--version` and `validate` stay fast)."""

from importlib.metadata import PackageNotFoundError, version


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
