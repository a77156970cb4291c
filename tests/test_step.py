"""TrainStep's gradient clipping: folded into a fused AdamW's kernel it must update exactly like clip_grad_norm_."""

from __future__ import annotations

import pytest
import torch

from megaloom.config import load_config
from megaloom.models.transformer import Transformer
from megaloom.step import TrainStep, clip_gradients, folds_grad_scale


def _model() -> Transformer:
    cfg = load_config(None, ["model.preset=tiny", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
                             "model.vocab_size=128", "model.max_seq_len=32", "train.seq_len=16"])
    torch.manual_seed(0)
    return Transformer(cfg.model)


@pytest.mark.parametrize("max_norm", [0.05, 1e6])  # clipping active / inactive
def test_clip_folded_into_fused_adamw_matches_clip_grad_norm(max_norm: float) -> None:
    ref, fold = _model(), _model()
    fold.load_state_dict(ref.state_dict())
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt_fold = torch.optim.AdamW(fold.parameters(), lr=1e-2, fused=True)
    assert folds_grad_scale(opt_fold)
    assert not folds_grad_scale(torch.optim.AdamW(ref.parameters(), foreach=True))
    step = TrainStep(fold, opt_fold, "fp32", torch.device("cpu"), 4, grad_clip=max_norm)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        batch = torch.randint(0, 128, (4, 17), generator=g)
        loss = ref(batch[:, :-1], batch[:, 1:])  # the reference: clip_grad_norm_ scales the gradients in place
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, foreach=True)
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)
        out = step(batch)
        torch.testing.assert_close(out.loss, loss.detach(), rtol=1e-6, atol=0)
        torch.testing.assert_close(out.grad_norm, norm, rtol=1e-6, atol=0)
        assert opt_fold.grad_scale is None  # cleared after the step
    for (name, p), q in zip(ref.named_parameters(), fold.parameters(), strict=True):
        # Rounding: g / (1/c) vs g * c differ in the last bit, and Adam's m / sqrt(v) magnifies that for elements
        # with tiny gradients: up to ~1.4e-6 after three steps at lr 1e-2 (varies with the CPU's vector width).
        # Without the folded clip the weights differ by ~1.5e-2, so atol 1e-5 still tells the two apart.
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=name)


def test_clip_gradients_hands_the_coefficient_to_the_optimizer() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model(torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))).backward()
    before = [p.grad.clone() for p in model.parameters()]
    norm = clip_gradients(model, opt, 0.01)
    expected = torch.nn.utils.get_total_norm(before)
    torch.testing.assert_close(norm, expected)
    # the gradients are untouched; the optimizer divides them by (norm + eps) / max_norm while it reads them
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before, strict=True))
    torch.testing.assert_close(opt.grad_scale, (expected + 1e-6) / 0.01)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compiled", [False, True])
def test_full_recompute_reruns_the_preferred_attention_kernel(compiled: bool) -> None:
    """train.attention=cudnn with train.recompute=full: the recompute in backward must run the kernel the forward
    ran (cuDNN and flash save differently shaped tensors, which the checkpoint refuses); the preference once held
    for the forward only (llama3-8b under `megaloom train` failed at its first backward)."""
    from megaloom.models import apply_recompute

    cfg = load_config(None, ["model.preset=tiny", "model.d_model=256", "model.n_layers=2", "model.n_heads=4",
                             "model.vocab_size=512", "model.max_seq_len=512", "train.seq_len=512"])
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = Transformer(cfg.model).to(device)
    apply_recompute(model, "full")
    if compiled:
        for layer in model.layers.values():
            layer.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step = TrainStep(model, opt, "bf16", device, 2, grad_clip=1.0, attention="cudnn")
    batch = torch.randint(0, 512, (2, 513), device=device)
    for _ in range(2):
        out = step(batch)
    assert torch.isfinite(out.loss) and torch.isfinite(out.grad_norm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_recompute_casts_trains_like_the_default_compiled_step() -> None:
    """train.recompute_casts on CUDA: compiled blocks with the lean save-set take the same steps (cuDNN attention,
    bf16, the fused AdamW with the folded clip), to bf16 reduction-order noise, and hold less memory."""
    import copy

    from megaloom.training.compile_saves import set_lean_saves

    cfg = load_config(None, ["model.preset=tiny", "model.d_model=256", "model.n_layers=2", "model.n_heads=4",
                             "model.vocab_size=512", "model.max_seq_len=512", "train.seq_len=512"])
    torch.manual_seed(0)
    device = torch.device("cuda")
    base = Transformer(cfg.model).to(device)
    batch = torch.randint(0, 512, (4, 513), device=device)
    losses, peaks = {}, {}
    try:
        for lean in (False, True):
            torch._dynamo.reset()
            set_lean_saves(lean)
            model = copy.deepcopy(base)
            for layer in model.layers.values():
                layer.compile()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
            step = TrainStep(model, opt, "bf16", device, 4, grad_clip=1.0, attention="cudnn")
            torch.cuda.reset_peak_memory_stats()
            losses[lean] = [float(step(batch).loss) for _ in range(3)]
            peaks[lean] = torch.cuda.max_memory_allocated()
    finally:
        set_lean_saves(False)
        torch._dynamo.reset()
    torch.testing.assert_close(losses[True], losses[False], rtol=5e-3, atol=0)
    assert peaks[True] < peaks[False]
