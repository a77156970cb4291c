"""Muon on one process (megaloom/optim/muon.py): Newton-Schulz orthogonalises, the optimizer equals a plain
reference written from the papers' formulas, the split of parameters, the state it keeps, and the refused settings.
The layouts (tp, ZeRO, ep) against this single process: tests/parallel/test_muon_world.py."""

from __future__ import annotations

import math

import pytest
import torch

from megaloom.config import ConfigError, load_config
from megaloom.models.registry import get_family
from megaloom.optim.build import build_optimizer
from megaloom.optim.muon import build_muon, is_muon_param, newton_schulz
from megaloom.parallel.mesh import Mesh
from tests.parallel.worlds import tiny_config

LR, WD, BETAS, MOMENTUM = 2e-2, 0.1, (0.9, 0.95), 0.95


def _model(moe: bool = False) -> torch.nn.Module:
    cfg = tiny_config(extra=("model.moe_every=1", "model.n_experts=4") if moe else ())
    torch.manual_seed(0)
    return get_family(cfg.model.arch).build(cfg.model)


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (3, 48, 80)])
def test_newton_schulz_gives_singular_values_near_one_and_the_polar_factor(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    g[..., 0, :] *= 50  # a badly conditioned input: one direction dominates the gradient
    o = newton_schulz(g).float()
    assert o.shape == g.shape and o.dtype == g.dtype
    s = torch.linalg.svdvals(o)
    assert s.min() > 0.6 and s.max() < 1.25, (s.min(), s.max())  # the quintic's band around 1, not exactly 1
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    polar = u @ vh
    cos = (o * polar).sum(dim=(-2, -1)) / (o.norm(dim=(-2, -1)) * polar.norm(dim=(-2, -1)))
    assert cos.min() > 0.95, cos


def _reference_ns(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Newton-Schulz written out per matrix in float64, from Jordan's description."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = x.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).float()


def _reference_step(model, muon_names: set[str], bufs: dict, adamw: torch.optim.Optimizer) -> None:
    """One step of the papers' Muon over ``muon_names`` (expert stacks: one matrix each) and AdamW for the rest."""
    adamw.step()
    for name, p in model.named_parameters():
        if name not in muon_names:
            continue
        g = p.grad
        buf = bufs.setdefault(name, torch.zeros_like(p))
        buf.mul_(MOMENTUM).add_((1 - MOMENTUM) * g)
        u = (1 - MOMENTUM) * g + MOMENTUM * buf
        mats = u if u.ndim == 3 else u[None]
        o = torch.stack([_reference_ns(m) for m in mats]).view_as(p)
        scale = 0.2 * math.sqrt(max(p.shape[-2], p.shape[-1]))
        p.mul_(1 - LR * WD).add_(o, alpha=-LR * scale)


@pytest.mark.parametrize("moe", [False, True])
def test_muon_equals_the_reference_over_steps(moe):
    model, ref = _model(moe), _model(moe)
    opt = build_muon(model, Mesh.single(), LR, WD, BETAS, MOMENTUM, ns_dtype=torch.float32)
    muon_names = {n for n, p in ref.named_parameters() if is_muon_param(n, p)}
    rest = [p for n, p in ref.named_parameters() if n not in muon_names]
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.ndim >= 2], "weight_decay": WD},
                               {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}],
                              lr=LR, betas=BETAS, eps=1e-8)
    bufs: dict = {}
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        x = torch.randint(0, 128, (4, 17), generator=gen)
        for m in (model, ref):
            m(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        with torch.no_grad():
            _reference_step(ref, muon_names, bufs, adamw)
        opt.zero_grad()
        ref.zero_grad(set_to_none=True)  # all of the reference, the Muon matrices too
        err = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters(), strict=True))
        assert err < 2e-6, err
    moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(), _model(moe).parameters(),
                                                                strict=True))
    assert moved > 1e-3


def test_the_split_and_the_state_kept():
    """Block matrices (and expert stacks) by Muon with one state tensor each; embedding and norms by AdamW (two)."""
    model = _model(moe=True)
    names = {n for n, p in model.named_parameters() if is_muon_param(n, p)}
    assert "layers.0.attn.q_proj.weight" in names and "layers.0.mlp.experts.w_gate" in names
    assert "layers.0.mlp.router.proj.weight" in names
    assert not any(n.startswith("tok_emb") or n.endswith("norm.weight") for n in names)
    opt = build_muon(model, Mesh.single(), LR, WD, BETAS)
    params = dict(model.named_parameters())
    for n, p in params.items():
        keys = set(opt.state[p])
        assert keys == ({"step", "momentum_buffer"} if n in names else {"step", "exp_avg", "exp_avg_sq"}), (n, keys)
    assert opt.param_groups[0]["use_muon"] and all(not g["use_muon"] for g in opt.param_groups[1:])


def test_build_optimizer_builds_muon_and_the_schedule_sets_every_group():
    cfg = load_config(None, ["train.optimizer=muon", "model.preset=tiny"]).train
    opt = build_optimizer(_model(), cfg, torch.device("cpu"))
    for g in opt.param_groups:
        g["lr"] = 0.5
    assert {g["lr"] for g in opt.adamw.param_groups} == {0.5}  # AdamW's groups are the same objects


@pytest.mark.parametrize(("overrides", "fragment"), [
    (["parallel.zero=3"], "parallel.zero=1 or 2"),
    (["train.muon_qk_clip=100", "parallel.cp=2"], "parallel.cp=1"),
    (["train.muon_momentum=1.0"], "train.muon_momentum"),
    (["train.muon_ns_steps=0"], "train.muon_ns_steps"),
    (["train.overlap_optimizer=true"], "train.overlap_optimizer=false"),
])
def test_refused_settings_name_the_setting_and_the_fix(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(None, ["train.optimizer=muon", *overrides])
