"""Tensor-parallel communication hidden under the GEMMs of compiled blocks (``parallel.async_tp``).

Under sequence parallelism every attention and MLP region starts with an all-gather of the sequence and ends
with a reduce-scatter. Compiled blocks trace them as functional collectives (`borders`), and Inductor's
micro-pipeline TP pass (``torch._inductor.config._micro_pipeline_tp``, TorchTitan's async TP) can replace an
all-gather and the GEMMs that read its result by ``symm_mem.fused_all_gather_matmul``, and a GEMM and the
reduce-scatter of its output by ``symm_mem.fused_matmul_reduce_scatter``: each split into tp steps, the
communication of one step (over CUDA symmetric memory, copy engines) under the GEMM of another. What megaloom
supplies is the graph in the shapes the pass recognises, and the switch:

- the borders in their fusable forms (``overlap`` in `borders`: with one row per micro-batch the
  dim-0 gather that the column-parallel linears read rank-major, `tp_layers.rank_major`; funcol's dim-1 forms
  otherwise), which the same collectives and so the same results as before;
- `FoldReshapeChains`, a post-grad pass run before the micro-pipeline pass: a reshape of a reshape reads the
  original tensor instead (the same values), so that a GEMM's input is one reshape away from the gather, as the
  pass's matcher requires (the region's [1, tp t, d] view and the linear's [tp, t, d] view otherwise stand
  between them);
- `enable`: the pass on, symmetric memory for the tp group (CUDA with NCCL only; symmetric memory needs peers
  on other GPUs of the node).

`route` says which of the three ways a run takes: "compiled" (this module), "ring" (the eager collective
matmuls of `collective_matmul`) or "off", and why. On gloo (CPU) the compiled blocks get the same graph with the
plain collectives: the CPU worlds prove the arithmetic, `tests/parallel/test_tp_overlap.py` that the pass finds
the patterns in a tp + sp block, and a GPU world of 2+ (tests/parallel/test_gpu_world.py) what is unproven here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megaloom import accelerator

try:  # torch >= 2.6
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # pragma: no cover - an older torch: the pass as a plain callable
    CustomGraphPass = object  # type: ignore[assignment,misc]

aten = torch.ops.aten


_GEMMS = (aten.mm.default, aten._scaled_mm.default)


class FoldReshapeChains(CustomGraphPass):
    """``reshape(reshape(x, a), b)`` -> ``reshape(x, b)`` where the outer reshape is a GEMM's input: the same
    values (a reshape reads elements in order); the inner reshapes go when nothing else reads them. Only GEMM
    inputs: the reshape of a GEMM's output back to its input's leading shape is the other half of the pattern
    (reshape -> mm -> reshape) and must stay as it is."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if (node.op != "call_function" or node.target not in (aten.reshape.default, aten.view.default)
                    or not any(u.target in _GEMMS for u in node.users)):
                continue
            inner = node.args[0]
            while (isinstance(inner, torch.fx.Node) and inner.op == "call_function"
                   and inner.target in (aten.reshape.default, aten.view.default)):
                inner = inner.args[0]
            if inner is not node.args[0]:
                folded = node.args[0]
                node.args = (inner, *node.args[1:])
                node.target = aten.reshape.default  # a view of a non-viewable input would fail; reshape copies
                while isinstance(folded, torch.fx.Node) and not folded.users and folded is not inner:
                    nxt = folded.args[0]
                    graph.erase_node(folded)
                    folded = nxt

    def uuid(self) -> str:
        return "megaloom-fold-reshape-chains-1"


@dataclass(frozen=True)
class Route:
    how: str  # "compiled", "ring" or "off"
    why: str


def route(setting: str | bool, tp: int, sp: bool, compiled: bool, device_type: str, backend: str) -> Route:
    """How ``parallel.async_tp`` (auto / true / false) runs here. auto: compiled on CUDA with NCCL (where the
    pass can fuse), off elsewhere and in eager mode (the ring's eager steps were never measured faster); true:
    compiled or ring by ``compiled``; false: off."""
    if setting is False or setting == "false":
        return Route("off", "parallel.async_tp=false")
    if tp == 1 or not sp:
        return Route("off", "needs tp > 1 with sequence parallelism (parallel.sp)")
    symmetric = accelerator.is_cuda(device_type) and backend == "nccl"  # symmetric memory: NVIDIA GPUs, NCCL
    if compiled:
        if symmetric:
            return Route("compiled", "Inductor's micro-pipeline TP over symmetric memory")
        return Route("off", f"compiled blocks overlap through GPU symmetric memory over NCCL; this run is "
                            f"{device_type} on {backend}: the same graph with the plain collectives")
    if setting is True or setting == "true":
        return Route("ring", "eager blocks: the collective-matmul ring steps")
    return Route("off", "auto in eager mode: the ring steps are opt-in (parallel.async_tp=true)")


def enable(tp_group) -> None:
    """The micro-pipeline TP pass on (process-wide, as TorchTitan sets it) with the reshape folding before it, and
    symmetric memory for ``tp_group``. Call once, before the first compiled forward, on every rank."""
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    current = inductor_config.post_grad_custom_pre_pass
    if current is None or isinstance(current, FoldReshapeChains):
        inductor_config.post_grad_custom_pre_pass = FoldReshapeChains()
    elif not any(isinstance(p, FoldReshapeChains) for p in (current if isinstance(current, (list, tuple))
                                                             else (current,))):
        extra = list(current) if isinstance(current, (list, tuple)) else [current]
        inductor_config.post_grad_custom_pre_pass = [FoldReshapeChains(), *extra]
    enable_symm_mem_for_group(tp_group.group_name)
