"""train.fused_loss wired through the config, the Transformer's loss slot and the training loop."""

from __future__ import annotations

import pytest
import torch

from megaloom.config import ConfigError, load_config
from megaloom.models.fused_ce import FusedHeadLoss, fused_head_loss
from megaloom.models.transformer import cross_entropy
from megaloom.optim.build import build_optimizer
from megaloom.step import TrainStep
from megaloom.train import train
from tests.conftest import tiny_overrides
from tests.models.test_fused_ce import _tiny_model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("tie", [True, False])
def test_transformer_training_with_the_hook_matches(tie):
    """A few AdamW steps of a tiny Transformer: the same losses and weights with and without the fused loss."""
    torch.manual_seed(5)
    batches = [torch.randint(0, 160, (4, 33)) for _ in range(4)]

    def run(fused: bool):
        model = _tiny_model(tie)
        if fused:
            model.loss = FusedHeadLoss(chunk_tokens=24)  # 64 tokens: 3 chunks
        t = load_config(None, ["train.lr=3e-3"]).train
        opt = build_optimizer(model, t, torch.device("cpu"))
        step = TrainStep(model, opt, "fp32", torch.device("cpu"), micro_batch_size=2, grad_clip=1.0)
        losses = [float(step(b).loss) for b in batches]
        return losses, model

    (ref, m_ref), (out, m_out) = run(False), run(True)
    for a, b in zip(out, ref, strict=True):
        assert abs(a - b) <= 1e-6 * abs(b), (out, ref)
    # Adam divides by sqrt(v): last-bit differences of a tiny gradient grow to ~2e-5 of a weight in 4 steps (seen
    # on o_proj); a wrong loss gradient would show in the losses above and move weights by far more.
    for (n, p), q in zip(m_out.named_parameters(), m_ref.parameters(), strict=True):
        assert _rel(p.detach(), q.detach()) < 1e-4, n
    # eval (no grad) and logits without labels are unchanged
    x = batches[0][:, :-1]
    with torch.no_grad():
        assert m_out(x).shape == (4, 32, 160)
        assert abs(float(m_out(x, batches[0][:, 1:])) - float(cross_entropy(m_out(x), batches[0][:, 1:]))) < 1e-5


def test_train_loop_with_fused_loss_matches(small_corpus, tmp_path, monkeypatch):
    """`megaloom train` with train.fused_loss=true: the same logged losses (fp32 on CPU) and eval loss."""
    import megaloom.models.fused_ce as fused_mod

    calls = []
    monkeypatch.setattr(fused_mod, "fused_head_loss", lambda *a: calls.append(1) or fused_head_loss(*a))
    base = ["train.steps=4", "checkpoint.every=0", "train.eval_every=4", "train.device=cpu"]  # fp32: exact
    ref = train(load_config(None, tiny_overrides(small_corpus, tmp_path / "a", *base)))
    out = train(load_config(None, tiny_overrides(small_corpus, tmp_path / "b", *base, "train.fused_loss=true")))
    assert len(calls) == 4 * 2 + 2 * 2  # 4 steps x 2 micro-batches, then 2 eval batches x 2
    assert sorted(out.losses) == sorted(ref.losses) == [1, 2, 3, 4]
    for step, loss in ref.losses.items():
        assert abs(out.losses[step] - loss) <= 1e-6 * loss, (out.losses, ref.losses)
    assert abs(out.eval_loss - ref.eval_loss) <= 1e-6 * ref.eval_loss


def test_config_key_and_tp_refusal():
    assert load_config(None, []).train.fused_loss == "auto"  # resolved per device (megaloom/planning/levers.py)
    assert load_config(None, ["train.fused_loss=false"]).train.fused_loss is False
    assert load_config(None, ["train.fused_loss=true"]).train.fused_loss is True
    with pytest.raises(ConfigError, match=r"train\.fused_loss.*parallel\.tp"):
        load_config(None, ["train.fused_loss=true", "parallel.tp=2"])
