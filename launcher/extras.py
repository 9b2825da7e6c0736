"""Settings that need an optional extra: checked before anything starts, one line when it is missing.

Kept apart from launcher/observers.py, which imports what a run needs (protos, the timeline),
so that `hetlaunch validate` stays free of torch and grpc.
"""

from __future__ import annotations

import importlib

EXTRAS = {"tensorboard": ("tensorboard", "observe.tensorboard"),
          "prometheus_client": ("prometheus", "coordinator.metrics_port"), "ray": ("ray", "launch: ray")}


class MissingExtra(Exception):
    """One line: which setting needs which extra."""


def check_extras(cluster) -> None:
    """MissingExtra if the YAML asks for TensorBoard, Prometheus or Ray and its package is not installed."""
    wanted = []
    if cluster.observe.tensorboard:
        wanted.append("tensorboard")
    if cluster.coordinator.metrics_port is not None:
        wanted.append("prometheus_client")
    if cluster.ray is not None:
        wanted.append("ray")
    for module in wanted:
        try:
            importlib.import_module(module)
        except ImportError:
            extra, setting = EXTRAS[module]
            raise MissingExtra(f"{setting} needs the {module} package: pip install 'hetlaunch[{extra}]'") from None
