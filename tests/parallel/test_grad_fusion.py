"""parallel/grad_fusion.py's embedding path in one process: the accelerator's row-by-row accumulation (taken on CPU
by patching `rows_on_device`) against autograd's dense gradient, the stand-in it hands autograd, and which
embeddings `fusable_embeddings` takes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megaloom.parallel import grad_fusion
from megaloom.parallel.data_parallel import fusable_embeddings
from megaloom.parallel.grad_fusion import FusedEmbedding, accumulate_rows


def _ids() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (3, 40), generator=g)
    ids[0, :10] = 7  # a row many times over: the accumulation's order matters there
    return ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("on_device", [False, True])
def test_accumulate_rows_adds_the_embedding_gradient_into_main_grad(monkeypatch, dtype, on_device) -> None:
    monkeypatch.setattr(grad_fusion, "rows_on_device", lambda main_grad: on_device)
    g = torch.Generator().manual_seed(1)
    ids, grad = _ids(), torch.randn(3, 40, 16, generator=g).to(dtype)
    start = torch.randn(64, 16, generator=g)
    main = start.clone()
    accumulate_rows(main, ids, grad)
    weight = torch.zeros(64, 16, dtype=dtype, requires_grad=True)
    nn.functional.embedding(ids, weight).backward(grad)
    dense = start + weight.grad  # autograd's dense gradient (in the weight's dtype), then the bucket hook's add
    if not on_device:  # the CPU path is the unfused arithmetic
        assert torch.equal(main, dense)
    else:  # rows added in fp32 one position at a time: rounding differs; rows the batch did not touch stay exact
        exact = torch.ones(64, dtype=torch.bool)
        exact[ids.unique()] = False
        assert torch.equal(main[exact], start[exact])
        # bf16: autograd's dense gradient of row 7 (11 positions summed) is rounded to bf16 once, ours is not
        tol = 1e-6 if dtype == torch.float32 else 2 ** -8 * 11 * grad.abs().max().item()
        torch.testing.assert_close(main, dense, rtol=0, atol=tol)
        exact_sum = start.index_add(0, ids.reshape(-1), grad.reshape(-1, 16).float())
        torch.testing.assert_close(main, exact_sum, rtol=1e-6, atol=1e-6)


def test_a_fused_embedding_hands_autograd_a_stand_in_and_keeps_its_forward() -> None:
    emb = nn.Embedding(64, 16)
    emb.weight.main_grad = torch.zeros(64, 16)
    emb.weight.fused_wgrad = True
    fused = FusedEmbedding.from_embedding(emb)
    assert fused.weight is emb.weight
    ids = _ids()
    out = fused(ids)
    assert torch.equal(out, nn.functional.embedding(ids, emb.weight))
    out.sum().backward()
    assert emb.weight.grad is not None and emb.weight.grad.shape == (64, 16)  # the stand-in (its values unused)
    counts = torch.bincount(ids.reshape(-1), minlength=64).float()
    assert torch.equal(emb.weight.main_grad, counts[:, None].expand(64, 16))
    with torch.no_grad():  # no graph: a plain lookup
        assert torch.equal(fused(ids), out)


def test_only_an_untied_plain_token_embedding_is_fusable() -> None:
    class Model(nn.Module):
        def __init__(self, tie: bool = False, **kw) -> None:
            super().__init__()
            self.tok_emb = nn.Embedding(64, 16, **kw)
            self.pos_emb = nn.Embedding(8, 16)  # read as .weight by some models: never taken
            self.head = nn.Linear(16, 64, bias=False)
            if tie:
                self.head.weight = self.tok_emb.weight

    assert [n for n, _ in fusable_embeddings(Model())] == ["tok_emb"]
    assert fusable_embeddings(Model(tie=True)) == []
    assert fusable_embeddings(Model(padding_idx=0)) == []
    m = Model()
    assert fusable_embeddings(m, tied=m.tok_emb.weight) == []  # a pipeline's tied embedding
    m.tok_emb.weight.requires_grad_(False)
    assert fusable_embeddings(m) == []
