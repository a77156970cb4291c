"""1-bit Adam / LAMB in one process (megaloom/optim/onebit.py): the warm-up equal to plain AdamW / LAMB and the frozen
state after it, the config's refusals, and the in-place background checkpoint waiting for a compressed step. The
multi-rank proofs (dp=4 against a simulation, bytes, exact resume; tp, pp, ep) run in the parallel worlds:
tests/parallel/dp/test_dp_world4.py, pipeline/test_zero_pp_world.py, test_trainer_parallel.py; the exchange
itself in tests/optim/test_compressed.py and dp/test_dp_world2.py (1,000 steps against float64)."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from megaloom.checkpoint import async_save as async_mod
from megaloom.checkpoint import find_checkpoints, load_checkpoint
from megaloom.checkpoint.async_save import AsyncCheckpointer
from megaloom.config import ConfigError, load_config
from megaloom.models import Transformer
from megaloom.optim.lamb import build_lamb
from megaloom.optim.onebit import PAD_MULTIPLE, OnebitOptimizer
from megaloom.optim.param_groups import param_groups
from megaloom.optim.zero import build_data_parallel
from megaloom.parallel.mesh import Mesh
from megaloom.planning.comm import variance_refresh

SETTINGS = ["model.vocab_size=64", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "train.seq_len=16",
            "model.max_seq_len=16"]
LR, BETAS, WD = 1e-2, (0.9, 0.95), 0.1


def _model(seed: int = 0) -> Transformer:
    cfg = load_config(None, SETTINGS)
    torch.manual_seed(seed)
    return Transformer(cfg.model)


def _onebit(model: Transformer, kind: str, warmup: int) -> OnebitOptimizer:
    grads = build_data_parallel(model, Mesh.single(), 0, 0.01, pad_multiple=PAD_MULTIPLE)
    return OnebitOptimizer(model, grads, kind, lr=LR, betas=BETAS, eps=1e-8 if kind == "adam" else 1e-6,
                           weight_decay=WD, warmup_steps=warmup)


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))


def _step(model, opt, seed: int, grads=None) -> None:
    x = _batch(seed)
    if grads is not None:
        grads.start_last_microbatch()
    model(x, x).backward()
    if grads is not None:
        grads.finish()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_warmup_is_plain_adamw_or_lamb_then_the_variance_freezes(kind: str) -> None:
    base = _model()
    ref = copy.deepcopy(base)
    plain = torch.optim.AdamW(param_groups(ref, WD), lr=LR, betas=BETAS, eps=1e-8, foreach=True) if kind == "adam" \
        else build_lamb(ref, WD, LR, BETAS, 1e-6)
    model = copy.deepcopy(base)
    opt = _onebit(model, kind, warmup=3)
    for s in range(3):
        _step(ref, plain, s)
        _step(model, opt, s, opt.grads)
        for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q), (s, n)  # the same optimizer code on the same gradient
    assert opt.compressing() and opt.grads.local
    frozen = [opt.state[p]["exp_avg_sq"].clone() for p in opt.params]
    if kind == "lamb":  # the fresh variance starts where the frozen one stops; the ratios' average is frozen
        assert all(torch.equal(opt.state[p]["exp_avg_sq_fresh"], v) for p, v in zip(opt.params, frozen, strict=True))
        ratios = opt.frozen_trust_ratios().clone()
    before = [p.detach().clone() for p in model.parameters()]
    for s in range(3, 5):
        _step(model, opt, s, opt.grads)
    assert all(torch.equal(opt.state[p]["exp_avg_sq"], v) for p, v in zip(opt.params, frozen, strict=True))
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert float(opt.state[opt.params[0]]["step"]) == 5 and opt.steps == 5
    if kind == "lamb":
        assert torch.equal(opt.frozen_trust_ratios(), ratios) and (ratios != 1).any()
        assert not all(torch.equal(opt.state[p]["exp_avg_sq_fresh"], v)
                       for p, v in zip(opt.params, frozen, strict=True))


@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_the_frozen_variance_is_the_windows_mean_squared_gradient(kind: str) -> None:
    """train.onebit_variance_window=0.5 of a 4-step warm-up: the warm-up is still plain AdamW / LAMB (its own
    exponential variance), and what freezes is the mean g^2 of steps 3 and 4 scaled by (1 - b2^4), so the update's
    v_hat is that mean; the sums live only inside the window (state key and bytes), then are freed."""
    base = _model()
    ref = copy.deepcopy(base)
    plain = torch.optim.AdamW(param_groups(ref, WD), lr=LR, betas=BETAS, eps=1e-8, foreach=True) if kind == "adam" \
        else build_lamb(ref, WD, LR, BETAS, 1e-6)
    model = copy.deepcopy(base)
    grads = build_data_parallel(model, Mesh.single(), 0, 0.01, pad_multiple=PAD_MULTIPLE)
    opt = OnebitOptimizer(model, grads, kind, lr=LR, betas=BETAS, eps=1e-8 if kind == "adam" else 1e-6,
                          weight_decay=WD, warmup_steps=4, variance_window=0.5)
    squares = {p: torch.zeros_like(p) for p in ref.parameters()}
    held = []
    for s in range(4):
        x = _batch(s)
        ref(x, x).backward()
        for p in ref.parameters() if s >= 2 else ():  # the window: the warm-up's last 2 steps
            squares[p] += p.grad * p.grad
        plain.step()
        plain.zero_grad(set_to_none=True)
        _step(model, opt, s, opt.grads)
        held.append(("exp_avg_sq_window" in opt.state[opt.params[0]], opt.state_bytes()))
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q), s  # the warm-up is the plain optimizer's
    assert [h for h, _ in held] == [False, False, True, False]  # open after the window's first step, then freed
    assert held[2][1] == held[1][1] + 4 * sum(v.numel() for v in opt.v) and held[3][1] == held[1][1]
    b2 = BETAS[1]
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        want = squares[q] / 2 * (1 - b2 ** 4)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], want, rtol=1e-6, atol=0)
        assert not torch.equal(opt.state[p]["exp_avg_sq"], plain.state[q]["exp_avg_sq"])  # not Adam's own
        if kind == "lamb":
            assert torch.equal(opt.state[p]["exp_avg_sq_fresh"], opt.state[p]["exp_avg_sq"])


@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_an_element_quiet_when_the_variance_froze_steps_no_further_than_adam_would(kind: str) -> None:
    """An element whose frozen variance is ~0 (untouched in the warm-up's last steps) and then gets a gradient
    steps by at most Adam's own bound (onebit.step_bound: 1 learning rate at beta2=0.95), not by g / eps."""
    from megaloom.optim.onebit import step_bound

    model = _model()
    opt = _onebit(model, kind, warmup=3)
    for s in range(3):
        _step(model, opt, s, opt.grads)
    quiet = opt.params[0]  # the embedding: zero variance and momentum, as for a token the warm-up never saw
    opt.state[quiet]["exp_avg_sq"].zero_()
    opt.state[quiet]["exp_avg"].zero_()
    before = [p.detach().clone() for p in opt.params]
    _step(model, opt, 3, opt.grads)
    if kind == "adam":
        decay = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
        moved = max((p.detach() - q * (1 - LR * decay[id(p)])).abs().max()
                    for p, q in zip(opt.params, before, strict=True))
        assert moved <= LR * step_bound(BETAS) * (1 + 1e-5), moved  # unbounded: about LR * 0.1 * |g| / 1e-8
    # LAMB scales each parameter's step by its frozen trust ratio and a bounded factor; the bound keeps it finite
    assert all(torch.isfinite(p).all() for p in opt.params)
    assert (opt.params[0].detach() - before[0]).abs().max() < 1.0


@pytest.mark.parametrize("overrides, fragment", [
    (["train.optimizer=onebit_adam", "parallel.zero=1"], "Set parallel.zero=0, or keep ZeRO with train.optimizer"),
    (["train.optimizer=onebit_lamb", "parallel.zero=3"], "train.optimizer=onebit_lamb with parallel.zero=3"),
    (["train.optimizer=onebit_adam", "train.onebit_warmup_steps=0"], "train.onebit_warmup_steps must be >= 1"),
    (["train.optimizer=onebit"], "train.optimizer: 'onebit' is not one of"),
    (["train.optimizer=onebit_adam", "train.onebit_variance_window=1.5"], "train.onebit_variance_window is a fraction"),
    (["train.optimizer=onebit_lamb", "train.onebit_variance_updates=16"], "e.g. 16 with train.optimizer=onebit_adam"),
    (["train.optimizer=onebit_adam", "train.onebit_variance_updates=-1"], "train.onebit_variance_updates=-1"),
])
def test_config_refusals_name_the_setting_and_the_fix(overrides: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        load_config(None, overrides)
    cfg = load_config(None, ["train.optimizer=onebit_lamb", "train.onebit_warmup_steps=7"])
    assert cfg.train.optimizer == "onebit_lamb" and cfg.train.onebit_warmup_steps == 7


def test_an_in_place_background_save_holds_the_state_of_its_step(tmp_path, monkeypatch) -> None:
    """A compressed step changes the momentum and the weights without its inner torch optimizer's step: the
    in-place background write must still finish before that step starts (the 1-bit optimizer's own pre-hook)."""
    model = _model()
    opt = _onebit(model, "adam", warmup=1)
    _step(model, opt, 0, opt.grads)
    real_write, events, stepping = async_mod.write_tensors, [], threading.Event()
    opt.register_step_pre_hook(lambda *_: stepping.set())  # runs before the save's hook (registered first)

    def slow_write(*args, **kwargs):  # still writing when the next update starts, however loaded the machine
        stepping.wait(30)
        time.sleep(0.05)
        real_write(*args, **kwargs)
        events.append("written")

    monkeypatch.setattr(async_mod, "write_tensors", slow_write)
    at_save = ({n: p.detach().clone() for n, p in model.named_parameters()},
               {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()})
    ckpt = AsyncCheckpointer()
    record = ckpt.save(tmp_path, 1, model, opt, {}, keep=2)
    opt.register_step_pre_hook(lambda *_: events.append("update"))  # runs after the save's own hook
    _step(model, opt, 1, opt.grads)  # compressed
    assert events == ["written", "update"] and record.in_place and record.update_wait_s > 0, (events, record)
    ckpt.wait()
    fresh = _model(seed=1)
    opt2 = _onebit(fresh, "adam", warmup=1)
    load_checkpoint(find_checkpoints(tmp_path)[0], fresh, opt2)
    assert opt2.steps == 1 and opt2.compressing()
    for n, p in fresh.named_parameters():
        assert torch.equal(p, at_save[0][n]) and torch.equal(opt2.state[p]["exp_avg"], at_save[1][n]), n


def test_variance_refreshes_follow_zero_one_adams_doubling_intervals() -> None:
    """train.onebit_variance_updates=N: multiples of an interval that starts at 1 and doubles after every N updates
    (N = 2: 1, 2 | 4, 6 | 8, 12 | 16, 24 | ...; N = 16 after a 300-step warm-up: 45 of the next 1,700 steps)."""
    assert [t for t in range(1, 50) if variance_refresh(t, 2)] == [1, 2, 4, 6, 8, 12, 16, 24, 32, 48]
    assert [t for t in range(1, 50) if variance_refresh(t, 1)] == [1, 2, 4, 8, 16, 32]
    assert sum(variance_refresh(t, 16) for t in range(301, 2001)) == 45
    assert not any(variance_refresh(t, 0) for t in range(1, 100))  # 1-bit Adam: frozen
    model = _model()
    grads = build_data_parallel(model, Mesh.single(torch.device("cpu")), 0, 1.0, pad_multiple=PAD_MULTIPLE)
    opt = OnebitOptimizer(model, grads, "adam", lr=LR, betas=BETAS, weight_decay=WD, warmup_steps=2,
                          variance_updates=2)
    kinds = []
    for _ in range(8):
        kinds.append("refresh" if opt.refreshing() else "compressed" if opt.compressing() else "warm-up")
        opt.steps += 1
    assert kinds == ["warm-up"] * 2 + ["compressed", "refresh", "compressed", "refresh", "compressed", "refresh"]
    with pytest.raises(ConfigError, match="onebit_variance_updates"):
        OnebitOptimizer(model, grads, "lamb", warmup_steps=2, variance_updates=2)


def test_step_model_against_hand_computed_numbers() -> None:
    """docs/parallelism.md's when-it-pays model: 1e9 parameters over 2 ranks at 10 GB/s, HBM 1 TB/s, no latency:
    AdamW's ring all-reduce sends 2 x 1/2 x 4e9 bytes = 0.4 s, 1-bit 2 x 1/2 x 1e9 / 8 = 0.0125 s plus 130 bytes
    per element of compression passes (0.13 s); with no backward to hide under, 1-bit wins below
    7.75 x 1/2 x 1e9 / 0.13 s = 29.8 GB/s."""
    from megaloom.optim.onebit import StepModel, run_volume_ratio

    m = StepModel(params=1e9, ranks=2, link_gb_s=10, hbm_gb_s=1000, alpha_s=0)
    assert m.adamw_exposed_s() == pytest.approx(0.4) and m.onebit_s() == pytest.approx(0.1425)
    assert m.gain_s() == pytest.approx(0.2575) and m.breakeven_gb_s() == pytest.approx(29.8077, rel=1e-4)
    hidden = StepModel(params=1e9, ranks=2, link_gb_s=10, overlap_s=0.5, hbm_gb_s=1000, alpha_s=0)
    assert hidden.adamw_exposed_s() == 0 and hidden.gain_s() < 0  # fast links: the all-reduce hides under backward
    assert run_volume_ratio(0.2) == pytest.approx(1 / (0.2 + 0.8 / 32))
