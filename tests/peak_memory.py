"""Peak memory of building layers [START, END) of a model (START < 0: of profiling it), in a
fresh process: the kernel's high-water mark (VmHWM, reset first), less what the process held
before. Used by tests/stage/test_stage_memory.py and bench/stage_memory.py.

    python tests/peak_memory.py ENTRYPOINT KWARGS_JSON START END   ->   {"peak_bytes": ..., "param_bytes": ...}
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # the entrypoints in tests/user_model.py

from hetlaunch.runtime.model_spec import ModelSpec  # noqa: E402


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def main(entrypoint: str, kwargs: str, start: int, end: int) -> dict:
    torch.set_num_threads(1)
    spec = ModelSpec(entrypoint=entrypoint, kwargs=json.loads(kwargs))
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS:")
    params = 0
    if start < 0:
        from hetlaunch.runtime.node_measurement import profile_layers
        profile_layers(spec, micro_batch_size=1, device=torch.device("cpu"), warmup=0, repeats=1)
    else:
        from hetlaunch.runtime.model import build_model_range
        held = build_model_range(spec, start, end, seed=0)
        params = sum(p.numel() * p.element_size() for layer in held.layers for p in layer.parameters())
    return {"peak_bytes": _status("VmHWM:") - before, "param_bytes": params}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
