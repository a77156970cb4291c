"""parallel.async_tp's routes (parallel/tp_overlap.py): which runs where, the reshape folding, and a world of 2."""

from __future__ import annotations

import operator

import pytest
import torch

from megaloom.parallel.tp_overlap import FoldReshapeChains, route

from .checks import assert_parity
from .harness import run_world
from .overlap_worlds import suite_overlap_world2


@pytest.mark.parametrize("setting,tp,sp,compiled,device,backend,how", [
    ("auto", 8, True, True, "cuda", "nccl", "compiled"),
    (True, 8, True, True, "cuda", "nccl", "compiled"),
    ("auto", 8, True, False, "cuda", "nccl", "off"),  # the eager ring is opt-in
    (True, 8, True, False, "cuda", "nccl", "ring"),
    (True, 2, True, False, "cpu", "gloo", "ring"),
    ("auto", 2, True, True, "cpu", "gloo", "off"),  # no symmetric memory: the same graph, plain collectives
    ("auto", 8, True, True, "cuda", "fake", "off"),  # a dry run
    ("auto", 8, False, True, "cuda", "nccl", "off"),  # needs sp
    ("auto", 1, True, True, "cuda", "nccl", "off"),
    (False, 8, True, True, "cuda", "nccl", "off"),
])
def test_route_by_device_backend_and_compile(setting, tp, sp, compiled, device, backend, how) -> None:
    r = route(setting, tp, sp, compiled, device, backend)
    assert r.how == how and r.why


def test_reshape_chains_before_a_gemm_fold_and_keep_their_values() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(a, w):
        g = a.reshape(1, 16, 8).reshape(2, 8, 8)  # the region's view, then the rank-major one
        y = torch.mm(g.reshape(16, 8), w)
        return y.reshape(2, 8, 4).reshape(1, 16, 4)  # the GEMM's output side stays as it was

    a, w = torch.randn(2, 8, 8), torch.randn(8, 4)
    gm = make_fx(f)(a, w)
    FoldReshapeChains()(gm.graph)
    gm.graph.lint()
    gm.recompile()
    mm = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.mm.default)
    reshape_in = mm.args[0]
    assert reshape_in.args[0].op == "placeholder"  # one reshape between the input and the GEMM
    outs = [u for u in mm.users]
    assert len(outs) == 1 and list(outs[0].args[1]) == [2, 8, 4]  # the output reshape untouched
    assert torch.equal(gm(a, w), f(a, w))
    assert operator.eq(FoldReshapeChains().uuid(), FoldReshapeChains().uuid())


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_world(2, suite_overlap_world2, timeout=400)


@pytest.mark.slow
def test_inductor_finds_every_gather_and_scatter_with_its_gemms(world) -> None:
    for res in world:
        fwd, bwd = (next(g for g in res["patterns-True"] if g["backward"] == b) for b in (False, True))
        # forward: the attention region's gather feeds q, k and v; the MLP's feeds gate and up; both regions end
        # in a reduce-scatter of one GEMM's output (o and down)
        assert fwd["gather_gemms"] == [3, 2] and fwd["scatter_gemm"] == [True, True], fwd
        # backward: the gradients' gathers (of o's and down's outputs) feed their GEMMs; the input gradients'
        # reduce-scatters sum three (two) GEMMs, which the pass cannot fuse (said in docs/parallelism.md)
        assert sorted(bwd["gather_gemms"]) == [1, 1] and bwd["scatter_gemm"] == [False, False], bwd
        before = next(g for g in res["patterns-False"] if not g["backward"])
        assert before["gather_gemms"] == [0, 0] and before["scatter_gemm"] == [False, False], before  # what it was
        rows2 = next(g for g in res["patterns-rows2"] if not g["backward"])
        assert rows2["gather_gemms"] == [3, 2] and rows2["scatter_gemm"] == [True, True], rows2


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_overlap_forms_train_like_one_process(world, arch) -> None:
    for res in world:
        assert_parity(res[f"parity-{arch}"])
        assert res[f"parity-{arch}"]["graph_breaks"] == 0
