"""Multi-token prediction (model.mtp_depth, megaloom/models/mtp.py) on one process: the model's loss and gradients
against a reference written the paper's way (each depth on the sequence shortened by k, no filler positions), the
fused head + loss, the weight schedule and the refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megaloom.config import ConfigError, load_config
from megaloom.models.fused_ce import FusedHeadLoss
from megaloom.models.layers import norm_input
from megaloom.models.registry import get_family
from megaloom.preflight import refuse_unbuilt
from megaloom.training.options import mtp_loss_weight_at

MLA = ["model.attention=mla", "model.n_kv_heads=0", "model.kv_lora_rank=16", "model.qk_nope_head_dim=8",
       "model.qk_rope_head_dim=8", "model.v_head_dim=8"]
MOE = ["model.moe_every=1", "model.first_dense_layers=1", "model.n_experts=4", "model.top_k=2",
       "model.expert_ffn_dim=32", "model.n_shared_experts=1", "model.router_score=sigmoid",
       "model.aux_loss_weight=0"]  # (an MTP block's balancing loss also sees its k filler positions: mtp.py)


def build(*extra: str):
    cfg = load_config(None, ["model.preset=tiny", "model.vocab_size=96", "model.d_model=32", "model.n_heads=4",
                             "model.n_layers=2", "model.ffn_dim=64", "model.max_seq_len=32", "train.seq_len=16",
                             "model.mtp_depth=2", *extra])
    torch.manual_seed(0)
    return cfg, get_family(cfg.model.arch).build(cfg.model)


def reference_loss(model, x: torch.Tensor, y: torch.Tensor, weight: float) -> torch.Tensor:
    """DeepSeek-V3's objective computed directly: depth k runs on the T - k positions that have a target, reads
    the input tokens k ahead, and its loss is the mean over those positions."""
    t = x.shape[1]
    rope = model.rope(t)
    h = model.run_layers(model.embed(x), rope, list(range(len(model.layers))))
    main = F.cross_entropy(model.head(model.norm(h)).flatten(0, 1), y.flatten())
    losses = []
    for k, m in enumerate(model.mtp.values(), start=1):
        n = t - k
        emb = model.tok_emb(x[:, k:])
        inp = torch.cat([m.enorm(emb), m.hnorm(norm_input(h[:, :n], m.hnorm))], -1)
        h = m.block(m.eh_proj(inp), (rope[0][:n], rope[1][:n]))
        logits = model.head(m.norm(h))
        losses.append(F.cross_entropy(logits.flatten(0, 1), y[:, k:].flatten()))
    return main + weight * torch.stack(losses).mean()


def grads(model, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("extra", [[], [*MLA, *MOE, "model.tie_embeddings=false"]], ids=["llama", "deepseek"])
def test_loss_and_gradients_equal_the_direct_objective(extra):
    cfg, model = build(*extra)
    model.mtp_loss_weight = 0.3
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 96, (2, 17), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    loss = model(x, y)
    got = grads(model, loss)
    ref_loss = reference_loss(model, x, y, 0.3)
    want = grads(model, ref_loss)
    # the value returned is the language-model loss: the MTP term is zero in value, whole in gradient
    main = F.cross_entropy(model.eval()(x).flatten(0, 1), y.flatten())
    model.train()
    assert abs(loss.item() - main.item()) < 1e-6
    assert model.last_mtp_loss is not None and model.last_mtp_loss > 0
    assert set(got) == set(want) and any(n.startswith("mtp.1.") for n in got)
    for n, g in want.items():
        torch.testing.assert_close(got[n], g, atol=1e-6, rtol=1e-5, msg=n)


def test_fused_head_and_loss_give_the_same_gradients():
    cfg, model = build()
    tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(2))
    plain = grads(model, model(tokens[:, :-1], tokens[:, 1:]))
    model.loss = FusedHeadLoss(chunk_tokens=8)
    fused = grads(model, model(tokens[:, :-1], tokens[:, 1:]))
    for n, g in plain.items():
        torch.testing.assert_close(fused[n], g, atol=1e-6, rtol=1e-5, msg=n)


def test_evaluation_and_generation_skip_the_modules():
    cfg, model = build()
    x = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    model.last_mtp_loss = None
    with torch.no_grad():
        model(x, x)
    assert model.last_mtp_loss is None
    assert sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp.")) > 0


def test_training_logs_the_mtp_loss_and_follows_the_weight_schedule(small_corpus, tmp_path):
    import json

    from megaloom.train import train
    from tests.conftest import tiny_overrides

    cfg = load_config(None, tiny_overrides(small_corpus, tmp_path / "run", "model.mtp_depth=1", "train.steps=3",
                                           "train.mtp_loss_weight_late=0.1", "train.mtp_late_step=3",
                                           "checkpoint.every=0"))
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(0 < r["mtp_loss"] < 20 for r in rows)


def test_weight_schedule():
    t = load_config(None, ["train.mtp_loss_weight=0.3", "train.mtp_loss_weight_late=0.1",
                           "train.mtp_late_step=5"]).train
    assert [mtp_loss_weight_at(s, t) for s in (1, 4, 5, 9)] == [0.3, 0.3, 0.1, 0.1]
    assert mtp_loss_weight_at(100, load_config(None, []).train) == 0.3


@pytest.mark.parametrize("extra,words", [
    (["model.arch=gpt2", "model.n_kv_heads=0"], "rotary positions"),
    (["parallel.cp=2"], "parallel.cp"),
])
def test_what_it_does_not_run_with_is_refused(extra, words):
    with pytest.raises(ConfigError, match=words):
        cfg = load_config(None, ["model.preset=tiny", "model.mtp_depth=1", *extra])
        refuse_unbuilt(cfg)


def test_untied_mtp_under_pipelines_trains_the_single_process_run(small_corpus, tmp_path):
    """DeepSeek-V3's arrangement: untied embeddings, an MTP module on the last of 2 pipeline stages, which keeps a
    copy of the input embedding summed with the first stage's (parallel/pipeline/stage.py). `megaloom train` under
    torchrun equals the single process, and its checkpoint resumes in one process."""
    from megaloom.train import train
    from tests.conftest import tiny_overrides
    from tests.parallel.test_trainer_parallel import losses, torchrun

    base = ["model.mtp_depth=1", "model.tie_embeddings=false", "train.steps=4", "train.micro_batch_size=2",
            "checkpoint.every=2", "train.grad_clip=0.5"]
    ref = train(load_config(None, tiny_overrides(small_corpus, tmp_path / "ref", *base))).losses
    torchrun(2, tiny_overrides(small_corpus, tmp_path / "pp2", *base, "parallel.pp=2"))
    got = losses(tmp_path / "pp2")
    for step in range(1, 5):
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
    ckpt = tmp_path / "pp2" / "checkpoints" / "step_00000002"
    resumed = train(load_config(None, tiny_overrides(small_corpus, tmp_path / "resumed", *base,
                                                     f"checkpoint.resume={ckpt}"))).losses
    for step in (3, 4):
        assert resumed[step] == pytest.approx(ref[step], rel=1e-5), step
