"""The compiled tensor-parallel overlap (parallel/tp_overlap.py) in a world of 2 (gloo on CPU).

What the CPU can prove: Inductor's micro-pipeline TP pass finds, in a compiled tp + sp block's graphs, every
all-gather with the GEMMs that read it and every reduce-scatter with the GEMM that produces it (the fusion itself,
over CUDA symmetric memory, needs GPUs: test_gpu_world.py); and the overlap forms of the borders give the
single process's results (the same collectives, in other shapes).
"""

from __future__ import annotations

import copy

import torch

from megaloom.parallel.mesh import Mesh

from .worlds import inputs_and_labels, parity_case, tiny_config, token_rows


def _patterns(graph) -> dict:
    from torch._inductor.fx_passes import micro_pipeline_tp as mp

    gathers, scatters = mp.find_all_gather_patterns(graph), mp.find_reduce_scatter_patterns(graph)
    return {"backward": mp._is_backward(graph),
            "gather_gemms": [len(mp._find_consumer_matmuls(g.res_node)) for g in gathers],
            "scatter_gemm": [mp._find_producer_matmul(r.input_node) is not None for r in scatters]}


def graph_patterns(mesh: Mesh, arch: str, overlap: bool, rows: int = 1) -> list[dict]:
    """One forward and backward of the tp + sp model with every block compiled by Inductor (CPU), the micro-
    pipeline TP pass's matchers run on each post-grad graph (after megaloom's reshape folding when ``overlap``)."""
    import torch._inductor.config as inductor_config

    from megaloom.models.registry import get_family
    from megaloom.parallel.tensor import parallelize_tensor
    from megaloom.parallel.tp_overlap import FoldReshapeChains

    found: list[dict] = []
    cfg = tiny_config(arch, tp=mesh.tp, sp=True, world=mesh.world_size)
    torch.manual_seed(0)
    model = parallelize_tensor(get_family(cfg.model.arch).build(cfg.model), mesh, True, overlap=overlap)
    torch._dynamo.reset()
    with inductor_config.patch(post_grad_custom_pre_pass=FoldReshapeChains() if overlap else None,
                               post_grad_custom_post_pass=lambda g: found.append(_patterns(g))):
        for layer in model.layers.values():
            layer.compile(backend="inductor")
        x, y = inputs_and_labels(token_rows(torch.Generator().manual_seed(1), rows, arch))
        logits = model(x)
        logits.float().square().mean().backward()
    torch._dynamo.reset()
    return found


def suite_overlap_world2(rank: int, world: int, device: torch.device) -> dict:
    mesh = Mesh.build(tiny_config(tp=2, sp=True, world=world), world, rank, device)
    res: dict = {}
    for overlap in (False, True):
        res[f"patterns-{overlap}"] = graph_patterns(mesh, "llama", overlap)
    res["patterns-rows2"] = graph_patterns(mesh, "llama", True, rows=2)  # funcol's dim-1 forms
    for arch in ("llama", "qwen3"):
        res[f"parity-{arch}"] = parity_case(copy.copy(mesh), arch, True, steps=3, compiled=True, overlap=True)
    return res
