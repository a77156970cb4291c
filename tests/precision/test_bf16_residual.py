"""train.bf16_residual: the residual stream between blocks in bf16 under autocast, norms and the loss in fp32.

On CPU (bf16 autocast works there): the stream is bf16 from the embedding to the final norm and the loss fp32;
the loss stays within bf16 noise of the fp32 stream; without autocast nothing changes (bit-identical); the
memory plan still predicts what autograd saves (the norms save an fp32 copy, full recompute a bf16 block
input); bad settings are refused in one line before anything is built.
"""

from __future__ import annotations

import pytest
import torch

from megaloom.config import ConfigError, load_config
from megaloom.models import Transformer, apply_recompute
from megaloom.planning.memory_activations import block_activation_bytes
from megaloom.runtime import resolve_precision

B, T, VOCAB = 2, 32, 256


def _cfg(arch: str, n_layers: int = 2, recompute: str = "none", *extra: str):
    preset = {"llama": "tiny", "gpt2": "tiny-gpt2"}[arch]
    return load_config(None, [f"model.preset={preset}", "model.d_model=64", "model.n_heads=4", "model.ffn_dim=128",
                              f"model.vocab_size={VOCAB}", f"model.max_seq_len={T}", f"train.seq_len={T}",
                              f"model.n_layers={n_layers}", "train.precision=bf16", "train.bf16_residual=true",
                              f"train.recompute={recompute}", *extra])


def _model(cfg, bf16_residual: bool) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    apply_recompute(model, cfg.train.recompute, core_attention=False)  # as the trainer with the CPU flash kernel
    model.residual_dtype = torch.bfloat16 if bf16_residual else None
    return model


def _batch():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (B, T), generator=gen) for _ in range(2)]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_stream_is_bf16_and_the_loss_within_bf16_noise(arch):
    cfg = _cfg(arch)
    x, y = _batch()
    fp32_stream, bf16_stream = _model(cfg, False), _model(cfg, True)
    seen: list[torch.dtype] = []
    for block in bf16_stream.layers.values():
        block.register_forward_hook(lambda m, args, out: seen.extend([args[0].dtype, out.dtype]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, loss = fp32_stream(x, y), bf16_stream(x, y)
    assert seen == [torch.bfloat16] * 4 and loss.dtype == torch.float32
    assert abs(loss.item() - ref.item()) <= 2e-2 * ref.item()
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in bf16_stream.parameters())


def test_without_autocast_nothing_changes():
    cfg = _cfg("llama")
    x, y = _batch()
    a, b = _model(cfg, False), _model(cfg, True)
    la, lb = a(x, y), b(x, y)
    la.backward()
    lb.backward()
    assert torch.equal(la, lb)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_memory_plan_matches_what_is_saved(arch, recompute):
    from tests.planning.test_memory_plan import saved_bytes

    x, y = _batch()
    measured = {}
    for n in (2, 4):
        cfg = _cfg(arch, n, recompute)
        measured[n] = saved_bytes(_model(cfg, True), x, y, "bf16")[0]
    plan = block_activation_bytes(_cfg(arch, 2, recompute), tokens=B * T, batch=B, device="cpu")
    assert (measured[4] - measured[2]) // 2 == sum(plan.values()), plan


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="train.bf16_residual=true with train.precision=fp32"):
        load_config(None, ["train.precision=fp32", "train.bf16_residual=true"])
    with pytest.raises(ConfigError, match="train.bf16_residual=true with train.precision=fp16"):
        load_config(None, ["train.precision=fp16", "train.bf16_residual=true"])
    with pytest.raises(ConfigError, match="precision auto is fp32"):
        resolve_precision(load_config(None, ["train.bf16_residual=true"]), torch.device("cpu"))


@pytest.mark.slow
def test_pipeline_messages_halve():
    """A dry run (rank 0 of 2, fake process group) of pp=2 under bf16: each activation message and its gradient
    is bf16 with train.bf16_residual, fp32 without (the counted bytes of the pp group's sends and receives)."""
    from tests.test_dryrun import _calls, _dry

    over = ["parallel.pp=2", "train.micro_batch_size=1", "train.global_batch_size=2", "train.seq_len=64",
            "model.n_layers=2", "train.precision=bf16"]
    sent = {flag: _calls(_dry(2, "0", [*over, f"train.bf16_residual={flag}"]))[("pp", "send")]
            for flag in ("false", "true")}
    d = load_config(None, over).model.d_model
    assert sent["false"] == (2, 2 * 64 * d * 4) and sent["true"] == (2, 2 * 64 * d * 2), sent
