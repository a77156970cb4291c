"""The zero-bubble split of one backward pass: the input gradient now (BI), the weight gradients later (BW).

BI asks autograd for the gradient of the stage input only, so the graph runs every node on the path from the
output to the input and skips the branches that only lead to weights (the weight matmuls of every linear
layer: about half of the backward FLOPs). While it runs, pre-hooks on the "boundary" nodes (nodes on the
input path whose inputs also feed a weight branch, e.g. the matmul node of a linear layer) record the
gradient flowing into them. BW later restarts autograd from those boundary nodes with the recorded
gradients and asks for the weights only, so it computes exactly the skipped branches. The arithmetic is the
same as one full backward, so the gradients are identical.

This is the technique of torch.distributed.pipelining's ``stage_backward_input/weight``, written against the
public autograd graph API (``Node.next_functions``, ``Node.register_prehook``, ``GradientEdge``).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


def _node(t: torch.Tensor) -> Node:
    """The node that receives ``t``'s gradient: its grad_fn, or the AccumulateGrad node of a leaf."""
    return t.grad_fn if t.grad_fn is not None else get_gradient_edge(t).node


def _consumers(root: Node) -> dict[Node, list[Node]]:
    """Reverse edges of the backward graph below ``root``: node -> the nodes that send gradient into it."""
    rev: dict[Node, list[Node]] = defaultdict(list)
    seen, queue = {root}, deque([root])
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            rev[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return rev


def _upward(start: Node, rev: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes reachable from ``start`` toward the output, not crossing ``stop``; and the ``stop`` nodes met."""
    closure, met, queue = {start}, set(), deque([start])
    while queue:
        for parent in rev.get(queue.popleft(), ()):
            if parent in stop:
                met.add(parent)
            elif parent not in closure:
                closure.add(parent)
                queue.append(parent)
    return closure, met


@dataclass(eq=False)
class _Group:
    """Weights whose gradients enter the input path at the same boundary nodes."""

    params: list[torch.nn.Parameter]
    boundary: list[Node]
    grads: dict[Node, tuple] = field(default_factory=dict)


class PendingWeightGrad:
    """What BI leaves for BW: the boundary gradients, and the graph, kept alive until `run`."""

    def __init__(self, groups: list[_Group], keep: list[torch.Tensor]) -> None:
        self.groups, self.keep = groups, keep

    def run(self) -> None:
        """Accumulate the weight gradients into ``.grad``; then drops the graph."""
        for group in self.groups:
            edges, grads = [], []
            for node in group.boundary:
                for i, g in enumerate(group.grads.get(node, ())):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(g)
            if not edges:
                continue
            handles = []
            if len(group.boundary) > 1:
                # A boundary node below another would get gradient twice (recorded, and again through the one
                # above): pin each to what it received in BI.
                for node in group.boundary:
                    recorded = group.grads.get(node)
                    if recorded is not None:
                        handles.append(node.register_prehook(lambda _g, rec=recorded: rec))
            try:
                # backward (not grad): the weights' AccumulateGrad nodes run as in a plain backward, so
                # .grad accumulates the usual way and post-accumulate-grad hooks (gradient buckets) fire.
                torch.autograd.backward(edges, grads, retain_graph=True, inputs=group.params)
            finally:
                for h in handles:
                    h.remove()
        self.groups, self.keep = [], []


def backward_input(output: torch.Tensor, grad_output: torch.Tensor | None, inp: torch.Tensor,
                   params: list[torch.nn.Parameter]) -> tuple[torch.Tensor, PendingWeightGrad]:
    """BI: the gradient of the stage input ``inp`` (a leaf that requires grad) given ``grad_output`` (None for
    a scalar loss); the weight gradients are left for `PendingWeightGrad.run`."""
    root = output.grad_fn
    rev = _consumers(root)
    input_path, _ = _upward(_node(inp), rev, set())
    unique: list[_Group] = []
    for p in params:
        acc = get_gradient_edge(p).node
        if acc not in rev:
            continue  # not used by this forward
        _, met = _upward(acc, rev, input_path)
        # Weights meeting the input path at a common node are one group (e.g. a linear's weight and bias).
        group = _Group([p], sorted(met, key=id))
        for other in [g for g in unique if any(n in met for n in g.boundary)]:
            unique.remove(other)
            group.params += other.params
            group.boundary += [n for n in other.boundary if n not in group.boundary]
        unique.append(group)

    handles = []
    for group in unique:
        for node in group.boundary:
            def record(grad_outputs: tuple, node: Node = node, group: _Group = group) -> None:
                group.grads[node] = grad_outputs
            handles.append(node.register_prehook(record))
    try:
        (dinp,) = torch.autograd.grad(output, inp, grad_output, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return dinp, PendingWeightGrad(unique, [output])
