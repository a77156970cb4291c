"""LAMB against a straightforward single-tensor implementation of You et al. 2019, and the piecewise
(sharded) norm path against whole tensors."""

from __future__ import annotations

import math

import pytest
import torch

from megaloom.optim.lamb import Lamb, tp_norm_sync, trust_ratio
from megaloom.optim.zero import shard_norm_sync
from megaloom.parallel.mesh import Mesh


def reference_lamb(w: torch.Tensor, grads: list[torch.Tensor], lr: float, b1: float, b2: float, eps: float,
                   wd: float) -> torch.Tensor:
    """One parameter, float64, written out step by step."""
    w = w.double().clone()
    m = torch.zeros_like(w)
    v = torch.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat = m / (1 - b1**t)
        v_hat = v / (1 - b2**t)
        u = m_hat / (v_hat.sqrt() + eps) + wd * w
        w_norm, u_norm = w.norm().item(), u.norm().item()
        ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
        w = w - lr * ratio * u
    return w


def make_problem(seed: int = 0) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(6, 5), (5,), (3, 4, 2), (4,)]
    weights = [torch.randn(s, generator=gen) * 0.3 for s in shapes]
    weights[3].zero_()  # a fresh zero bias: ||w|| = 0, trust ratio 1
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(5)]
    return weights, [list(g) for g in zip(*grads, strict=True)]


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lamb_matches_reference(wd: float) -> None:
    weights, grads = make_problem()
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = Lamb([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
               lr=0.01, betas=(0.9, 0.99), eps=1e-6)
    for step in range(5):
        for p, g in zip(params, grads, strict=True):
            p.grad = g[step].clone()
        opt.step()
    for p, w, g in zip(params, weights, grads, strict=True):
        expected = reference_lamb(w, g, 0.01, 0.9, 0.99, 1e-6, wd if w.ndim >= 2 else 0.0)
        torch.testing.assert_close(p.detach().double(), expected, rtol=1e-5, atol=1e-6)
        assert not torch.equal(p.detach(), w)  # every parameter moved (the zero bias by lr * update)
    assert {k for st in opt.state.values() for k in st} == {"step", "exp_avg", "exp_avg_sq"}
    assert all(float(st["step"]) == 5 for st in opt.state.values())


def test_trust_ratio_is_one_when_a_norm_is_zero() -> None:
    w_sq = torch.tensor([4.0, 0.0, 9.0, 0.0])
    u_sq = torch.tensor([1.0, 1.0, 0.0, 0.0])
    assert trust_ratio(w_sq, u_sq).tolist() == [2.0, 1.0, 1.0, 1.0]


def test_pieces_of_a_parameter_share_one_trust_ratio() -> None:
    """ZeRO cuts parameters into segments; with the shard norm exchange (here one process, no peers) the
    update equals LAMB on the whole tensors."""
    weights, grads = make_problem(1)
    whole = [torch.nn.Parameter(w.clone()) for w in weights]
    opt_whole = Lamb(whole, lr=0.02, weight_decay=0.05)
    flat = [w.reshape(-1) for w in weights]
    pieces, owners = [], []
    for i, f in enumerate(flat):  # cut every parameter into up to three uneven pieces
        cuts = sorted({0, f.numel() // 3, f.numel() // 2 + 1, f.numel()})
        for a, b in zip(cuts, cuts[1:], strict=False):
            pieces.append(torch.nn.Parameter(f[a:b].clone()))
            owners.append((i, a, b))
    sync = shard_norm_sync([o[0] for o in owners], whole, Mesh.single(), None)
    opt_pieces = Lamb(pieces, lr=0.02, weight_decay=0.05, norm_sync=sync)
    for step in range(3):
        for p, g in zip(whole, grads, strict=True):
            p.grad = g[step].clone()
        for p, (i, a, b) in zip(pieces, owners, strict=True):
            p.grad = grads[i][step].reshape(-1)[a:b].clone()
        opt_whole.step()
        opt_pieces.step()
    for p, (i, a, b) in zip(pieces, owners, strict=True):
        torch.testing.assert_close(p.detach(), whole[i].detach().reshape(-1)[a:b], rtol=1e-6, atol=1e-7)


def test_tp_norm_sync_only_with_tensor_parallelism() -> None:
    assert tp_norm_sync([torch.zeros(2)], Mesh.single()) is None


@pytest.mark.parametrize("bad", [dict(lr=-1.0), dict(betas=(1.0, 0.9)), dict(eps=-1e-8), dict(weight_decay=-0.1)])
def test_invalid_hyperparameters(bad: dict) -> None:
    with pytest.raises(ValueError, match="LAMB"):
        Lamb([torch.nn.Parameter(torch.zeros(2))], **bad)


def test_missing_gradient_counts_as_zero() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = Lamb([p], lr=0.1)
    opt.step()  # no gradient: the update is 0 / (0 + eps) = 0, so the weight stays
    assert torch.equal(p.detach(), torch.ones(3)) and not math.isnan(float(opt.state[p]["step"]))
