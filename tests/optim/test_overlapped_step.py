"""train.overlap_optimizer: the AdamW step in forward-order chunks, each waited for before the module that reads it.
On CPU the chunks run in order on the one stream: the update must be exactly the unchunked optimizer's."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from megaloom.config import ConfigError, load_config
from megaloom.models.transformer import Transformer
from megaloom.optim.build import build_optimizer
from megaloom.optim.overlapped_step import forward_order_chunks
from megaloom.step import TrainStep


def _model(*extra: str) -> tuple[Transformer, object]:
    cfg = load_config(None, ["model.preset=tiny", "model.vocab_size=256", "model.n_layers=3", *extra])
    torch.manual_seed(0)
    return Transformer(cfg.model), cfg


@pytest.mark.parametrize("tied", [True, False])
def test_chunks_follow_the_forward_and_cover_every_parameter_once(tied: bool) -> None:
    model, _ = _model(f"model.tie_embeddings={str(tied).lower()}")
    chunks = forward_order_chunks(model)
    assert [m for m, _ in chunks] == [model, *model.layers.values(), model.norm]
    assert chunks[0][1][0] is model.tok_emb.weight
    flat = [id(p) for _, ps in chunks for p in ps]
    assert sorted(flat) == sorted({id(p) for p in model.parameters()}) and len(flat) == len(set(flat))
    head_chunk = 0 if tied else len(chunks) - 1  # a tied head is the embedding: updated before anything runs
    assert any(p is model.head.weight for p in chunks[head_chunk][1])


def test_the_chunked_update_is_the_optimizer_step_exactly() -> None:
    """Four steps of two micro-batches, the clip active: the same losses, gradient norms and weights, bitwise."""
    base, cfg = _model()
    cfg.train.lr, cfg.train.grad_clip = 3e-3, 0.05
    batches = [torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(s)) for s in range(4)]
    runs = {}
    for overlap in (False, True):
        model = copy.deepcopy(base)
        opt = build_optimizer(model, cfg.train, torch.device("cpu"))
        step = TrainStep(model, opt, "fp32", torch.device("cpu"), 2, cfg.train.grad_clip, overlap_optimizer=overlap)
        outs = [step(b) for b in batches]
        step.settle()
        runs[overlap] = ([(o.loss.item(), o.grad_norm.item()) for o in outs], model.state_dict())
    assert runs[True][0] == runs[False][0]
    assert all(runs[False][0][i][1] > 0.05 for i in range(4))  # clipped every step
    for name, w in runs[False][1].items():
        assert torch.equal(w, runs[True][1][name]), name


def test_megaloom_train_with_the_lever_logs_the_same_losses(small_corpus, tmp_path) -> None:
    from megaloom.cli import main
    from tests.conftest import tiny_overrides

    losses = {}
    for overlap in ("false", "true"):
        run = tmp_path / overlap
        assert main(["train", *tiny_overrides(small_corpus, run), "train.steps=6", "checkpoint.every=3",
                     f"train.overlap_optimizer={overlap}"]) == 0
        losses[overlap] = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert losses["true"] == losses["false"] and len(losses["true"]) == 6


def test_layouts_the_lever_cannot_serve_are_refused_with_the_fix() -> None:
    for bad in (["parallel.pp=2", "model.n_layers=4"], ["parallel.zero=1"], ["train.optimizer=lamb"]):
        with pytest.raises(ConfigError, match="train.overlap_optimizer=true needs"):
            load_config(None, ["train.overlap_optimizer=true", *bad])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compiled", [False, True])
def test_on_cuda_the_side_stream_update_trains_like_the_plain_step(compiled: bool) -> None:
    """The fused AdamW with the clip folded in, on the side stream, waited for block by block (compiled blocks
    keep the waits out of their graphs): the same losses as the plain step."""
    base, cfg = _model("model.d_model=256", "model.n_heads=4", "model.max_seq_len=512")
    device = torch.device("cuda")
    base = base.to(device)
    batches = [torch.randint(0, 256, (4, 513), device=device) for _ in range(4)]
    losses = {}
    for overlap in (False, True):
        model = copy.deepcopy(base)
        if compiled:
            for layer in model.layers.values():
                layer.compile()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        step = TrainStep(model, opt, "bf16", device, 4, grad_clip=0.5, attention="math",
                         overlap_optimizer=overlap)
        losses[overlap] = []
        for b in batches:
            losses[overlap].append(step(b).loss)
            if overlap and len(losses[overlap]) > 1:
                assert step.overlap.pending  # the update of the step just taken is queued on the side stream
        step.settle()
        losses[overlap] = [float(x) for x in losses[overlap]]
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=0)
