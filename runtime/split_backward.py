"""One micro-batch's backward in two parts, as zero-bubble schedules run it: I, the gradient of
the stage's input (what the previous stage waits for), then later W, the gradients of the weights.

The autograd graph of a stage's forward has nodes on the way from its outputs to its inputs
(the *input path*: nodes from which an input's gradient node can be reached) and nodes off it,
which lead only to weights. I runs the graph for the inputs' gradients alone, keeping it
(`retain_graph`), and a pre-hook on each input-path node that feeds a weight branch — an
*intermediate*, e.g. a matmul whose other operand is a weight — keeps the gradient that node
received. W then runs each intermediate again from that gradient with only the weights asked
for: autograd computes just the outputs a node is asked for, so a matmul does its weight GEMM
here and its input GEMM, done in I, not again. This is the split torch.distributed.pipelining's
`stage_backward_input` / `stage_backward_weight` make; written here from the graph's rules.

Weights are grouped by the intermediates they hang off; one `backward` per group accumulates
into `.grad` (so gradient hooks fire as in a full backward). A group whose intermediates lie on
one another's input path would count a gradient twice (the first would pass its gradient on to
the second, which is also seeded); such a graph (a weight used twice along one path, e.g. tied
within a stage) is not split: I then runs the full backward and W has nothing left to do. A stage
whose inputs need no gradient (the first) has no input path: I is empty and W is the whole backward.
Either way the gradients are those of a full backward, bit for bit where each weight has one use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass(eq=False)
class _Group:
    intermediates: tuple[Node, ...]
    params: list[torch.Tensor]


@dataclass(eq=False)
class SplitBackward:
    """I then W of one micro-batch: `input_grads()` once, then `weight_grads()` once."""

    outputs: list[torch.Tensor]            # what the stage produced (or its loss), each requiring grad
    grads: list[torch.Tensor | None]       # their gradients (None for a scalar loss)
    inputs: list[torch.Tensor]             # leaf inputs whose gradients go upstream
    params: list[torch.Tensor]             # the stage's trainable parameters
    _groups: list[_Group] = field(default_factory=list)
    _captured: dict[Node, tuple] = field(default_factory=dict)
    whole_in_input_pass: bool = field(init=False, default=False)  # not split: I does the weights too
    _done_i: bool = False

    def __post_init__(self):
        self.params = [p for p in self.params if p.requires_grad]
        if not self.inputs or not self.outputs:  # nothing upstream (first stage), or nothing to run back
            return
        roots = [o.grad_fn for o in self.outputs if o.grad_fn is not None]
        input_nodes = {get_gradient_edge(t).node for t in self.inputs}
        param_of = {get_gradient_edge(p).node: p for p in self.params}
        groups = _groups(roots, input_nodes, param_of)
        self.whole_in_input_pass = groups is None
        self._groups = groups or []

    def input_grads(self) -> list[torch.Tensor | None]:
        """I: the inputs' gradients (None where an input did not reach the outputs)."""
        if self._done_i:
            raise RuntimeError("input_grads ran twice for one micro-batch")
        self._done_i = True
        if not self.inputs or not self.outputs:  # the first stage: W is the whole backward
            return [None] * len(self.inputs)
        if self.whole_in_input_pass:
            for t in self.inputs:
                t.grad = None
            torch.autograd.backward(self.outputs, self.grads, inputs=self.inputs + self.params)
            return [t.grad for t in self.inputs]
        handles = [node.register_prehook(self._capture(node))
                   for node in {n for g in self._groups for n in g.intermediates}]
        try:
            grads = torch.autograd.grad(self.outputs, self.inputs, self.grads, retain_graph=bool(self._groups),
                                        allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        return list(grads)

    def weight_grads(self) -> None:
        """W: accumulate the weights' gradients into `.grad` (after `input_grads`)."""
        if not self._done_i:
            raise RuntimeError("weight_grads before input_grads")
        if self.whole_in_input_pass or not self.outputs:
            return
        if not self.inputs:
            if self.params:
                torch.autograd.backward(self.outputs, self.grads, inputs=self.params)
            return
        for i, group in enumerate(self._groups):
            edges, grads = [], []
            for node in group.intermediates:
                for k, grad in enumerate(self._captured.get(node, ())):
                    if grad is not None:
                        edges.append(GradientEdge(node, k))
                        grads.append(grad)
            if edges:
                torch.autograd.backward(edges, grads, retain_graph=i < len(self._groups) - 1, inputs=group.params)
        self._captured.clear()
        self._groups = []

    def _capture(self, node: Node):
        def hook(grad_outputs):
            self._captured[node] = tuple(grad_outputs)
        return hook


def _groups(roots: list[Node], input_nodes: set[Node], param_of: dict[Node, torch.Tensor]) -> list[_Group] | None:
    """The weights grouped by the input-path nodes they hang off, or None where the graph cannot
    be split without counting a gradient twice."""
    order, seen, stack = [], set(), [(r, False) for r in roots]
    while stack:  # every node reachable from the outputs, children before parents (post-order)
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((child, False) for child, _ in node.next_functions if child is not None and child not in seen)
    on_path: set[Node] = set()
    weights_below: dict[Node, frozenset] = {}  # off the input path: the parameters a node leads to
    for node in order:  # children first
        children = [child for child, _ in node.next_functions if child is not None]
        if node in input_nodes or any(c in on_path for c in children):
            on_path.add(node)
            continue
        below = frozenset((node,)) if node in param_of else frozenset()
        for child in children:
            below |= weights_below.get(child, frozenset())
        weights_below[node] = below
    hangs_off: dict[Node, set[Node]] = {}  # parameter node -> the input-path nodes it hangs off
    for node in on_path:
        for child, _ in node.next_functions:
            if child is not None and child not in on_path:
                for param_node in weights_below.get(child, ()):
                    hangs_off.setdefault(param_node, set()).add(node)
    if any(root not in on_path and weights_below.get(root) for root in roots):
        return None  # an output that depends on weights but not on the inputs: I never runs it
    position = {node: i for i, node in enumerate(order)}
    by_key: dict[frozenset, list[Node]] = {}
    for param_node, nodes in hangs_off.items():
        by_key.setdefault(frozenset(nodes), []).append(param_node)
    groups = []
    for key, param_nodes in by_key.items():
        if len(key) > 1 and _one_above_another(key, on_path):
            return None
        groups.append(_Group(tuple(sorted(key, key=position.__getitem__)), [param_of[n] for n in param_nodes]))
    return groups


def _one_above_another(nodes: frozenset, on_path: set[Node]) -> bool:
    """Does any of `nodes` reach another of them along the input path?"""
    for start in nodes:
        stack, seen = [c for c, _ in start.next_functions if c is not None and c in on_path], set()
        while stack:
            node = stack.pop()
            if node in nodes:
                return True
            if node in seen:
                continue
            seen.add(node)
            stack.extend(c for c, _ in node.next_functions if c is not None and c in on_path)
    return False
