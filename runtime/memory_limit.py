"""A stage's tensor memory: measured on every stage (its peak goes into each step's report and
the run's summary) and, where its node has a limit (`emulate.memory_gb`, `memory_fraction`),
held to it, so a plan that does not fit fails with a clear error instead of silently using
more than the node was said to have.

What counts is what a GPU's allocator would hold for the stage: its tensors. On CUDA that is
the caching allocator's own peak, and the limit is also set as the allocator's memory
fraction, so CUDA itself refuses to go over. On CPU there is no allocator to ask, so the stage
counts its tensors itself: parameters, gradients and optimizer state, plus the peak of the
activations that forwards keep for their backwards (every tensor autograd saves, counted once
per storage, released when the backward of the last micro-batch that saved it is done: the
micro-batches of a step are views of one token batch, whose storage was counted once per
micro-batch in flight, 4 times on a first stage holding only the embedding). The interpreter, torch and
gloo are not counted, as a GPU's limit does not count the CUDA context: this is not the
process's RSS.

Counting costs: with the hooks installed autograd calls into Python for every tensor it saves
and again to unpack it in the backward (about 440 a step for the tiny preset in one stage:
2-3 % of its CPU step, bench/memory_counting.py). So a stage without a limit counts only on
some steps: the first COUNT_FIRST it runs and every COUNT_EVERY-th step of the run (~0.1 % of
a step). The activations a step saves are the same every step while the stage's layers are,
so its peak is found on its first step; after a live move, on the next counted one. A stage with a limit on CPU counts every step,
as the limit must hold on each. On CUDA the saved tensors are counted on the same sampled
steps (the activation figure), and the tensors in use are the allocator's own peak since the
stage started (never reset per step, so the peak of a step not counted is kept too).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
from torch import nn

GiB = 2**30
COUNT_FIRST = 2   # without a limit: the stage's first steps are counted ...
COUNT_EVERY = 25  # ... and every step whose number divides by this


class MemoryLimitExceeded(RuntimeError):
    """The stage used more memory than its node may use."""


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class StageMemory:
    """Measures a stage's tensor memory and holds it to `limit_bytes` (0: no limit, only measures,
    never refuses)."""

    def __init__(self, limit_bytes: int, device: torch.device, setting: str = "") -> None:
        self.limit_bytes = limit_bytes
        self.device = device
        self.setting = setting  # names the limit in the error, e.g. "emulate.memory_gb (1.0) of node a"
        # micro-batch -> the storages its forward saved, each as (address, bytes): a storage freed
        # before its micro-batch's backward_done (a zero-bubble I pass that runs the whole backward,
        # W after the next forward) can have its address reused by one of another size, which
        # must neither pass for it nor be subtracted in its place
        self._saved: dict[int, set[tuple[int, int]]] = defaultdict(set)
        self._holders: dict[tuple[int, int], int] = {}  # storage -> how many micro-batches in flight saved it
        self._live = 0
        self.peak_activation_bytes = 0  # the most bytes of saved activations alive at once, over the counted steps
        self.peak_used_bytes = 0  # the most tensor bytes in use (used_bytes) after a counted step
        self.counting = True  # this step's saved tensors are counted (begin_step)
        self._steps_begun = 0
        self._parameter_storages: set[int] = set()
        if device.type == "cuda" and limit_bytes:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit_bytes / total), device)
        if device.type == "cuda":  # the peak is this stage's, from here on
            torch.cuda.reset_peak_memory_stats(device)

    def begin_step(self, step: int) -> None:
        """Whether the step about to run (numbered `step` in the run) is counted: every step under a
        limit on CPU, else the stage's first COUNT_FIRST and every COUNT_EVERY-th (module docstring)."""
        self.counting = ((self.limit_bytes > 0 and self.device.type != "cuda") or self._steps_begun < COUNT_FIRST
                         or step % COUNT_EVERY == 0)
        self._steps_begun += 1

    def attach(self, module: nn.Module) -> None:
        """The stage's parameters (on their device): what autograd saves of them, often a view such
        as a transposed weight, is counted as parameters, not again as activations."""
        self._parameter_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}

    @contextlib.contextmanager
    def forward(self, microbatch):
        """Count what autograd saves during this micro-batch's forward (on a counted step)."""
        if not self.counting:
            yield
            return
        saved = self._saved[microbatch]

        def pack(t: torch.Tensor):
            address = t.untyped_storage().data_ptr()
            if address not in self._parameter_storages:  # parameters are counted as parameters
                key = (address, _tensor_bytes(t))
                if key not in saved:
                    saved.add(key)
                    held = self._holders.get(key, 0)
                    self._holders[key] = held + 1
                    if not held:  # alive already for another micro-batch: in memory once
                        self._live += key[1]
                        self.peak_activation_bytes = max(self.peak_activation_bytes, self._live)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def backward_done(self, microbatch: int) -> None:
        for key in self._saved.pop(microbatch, ()):
            held = self._holders.pop(key) - 1
            if held:
                self._holders[key] = held
            else:
                self._live -= key[1]

    def used_bytes(self, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
        """The stage's peak tensor memory so far."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        storages: dict[int, int] = {}
        for p in module.parameters():
            storages[p.untyped_storage().data_ptr()] = _tensor_bytes(p)
            if p.grad is not None:
                storages[p.grad.untyped_storage().data_ptr()] = _tensor_bytes(p.grad)
        if optimizer is not None:
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.numel() > 1:  # not the scalar step counts
                        storages[value.untyped_storage().data_ptr()] = _tensor_bytes(value)
        # Gradients are freed after each step (zero_grad(set_to_none)); in a step they exist
        # alongside the parameters, so count them as the parameters' size when absent.
        grads = sum(_tensor_bytes(p) for p in module.parameters() if p.requires_grad and p.grad is None)
        return sum(storages.values()) + grads + self.peak_activation_bytes

    def check(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, where: str) -> None:
        """After a step: the peak in use, on a counted step (and every step under a limit), then
        the limit held (none: never refuses)."""
        if not (self.counting or self.limit_bytes):
            return
        used = self.used_bytes(module, optimizer)
        self.peak_used_bytes = max(self.peak_used_bytes, used)
        if self.limit_bytes and used > self.limit_bytes:
            raise MemoryLimitExceeded(
                f"the stage's tensors use {used / 2**20:.1f} MiB {where}, over the {self.limit_bytes / 2**20:.1f} "
                f"MiB of {self.setting}; give this node fewer layers (nodes[].layers) or raise its limit")

    def out_of_memory(self, err: BaseException, where: str) -> MemoryLimitExceeded:
        """CUDA refused an allocation under the memory fraction: the same error, in our words."""
        return MemoryLimitExceeded(f"CUDA refused an allocation {where} under the {self.limit_bytes / 2**20:.1f} MiB "
                                   f"of {self.setting}: {' '.join(str(err).split())[:300]}")
