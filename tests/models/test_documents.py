"""Document masking of packed samples (issue 20): a packed row behaves as its documents run one by one."""

from __future__ import annotations

import pytest
import torch

from megaloom.config import ModelConfig
from megaloom.models.documents import Documents
from megaloom.models.transformer import Transformer

EOD = 0


def _model(arch: str, **kw) -> Transformer:
    torch.manual_seed(0)
    kw = {"max_seq_len": 64, **kw}
    cfg = ModelConfig(arch=arch, vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2 if arch != "gpt2"
                      else 4, ffn_dim=128, **kw)
    return Transformer(cfg).eval()


def _packed(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One row of documents of the given lengths, each ending with EOD (the last may be cut: no EOD)."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for i, n in enumerate(lengths):
        d = torch.randint(1, 64, (n,), generator=g)
        if i < len(lengths) - 1:
            d[-1] = EOD
        docs.append(d)
    return torch.cat(docs)[None], docs


def test_ids_and_positions_from_tokens():
    x = torch.tensor([[5, 1, 0, 7, 0, 3, 4, 0, 9], [0, 2, 2, 2, 2, 2, 2, 2, 2]])
    d = Documents.from_tokens(x, EOD, reset_positions=True)
    assert d.ids.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 3], [0, 1, 1, 1, 1, 1, 1, 1, 1]]
    assert d.positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 0], [0, 0, 1, 2, 3, 4, 5, 6, 7]]
    assert Documents.from_tokens(x, EOD).positions is None


@pytest.mark.parametrize("arch,reset", [("llama", False), ("llama", True), ("gpt2", True), ("qwen3", True)])
def test_packed_logits_equal_each_document_alone(arch, reset):
    """RoPE is relative, so for llama the mask alone suffices; learned positions (gpt2) need the reset."""
    model = _model(arch)
    x, docs = _packed([7, 12, 5, 9])
    packed = model(x, docs=Documents.from_tokens(x, EOD, reset_positions=reset))
    alone = torch.cat([model(d[None]) for d in docs], dim=1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    # without the mask the documents see each other: the test can fail
    assert not torch.allclose(model(x), alone, atol=1e-3)


def test_packed_loss_and_gradients_equal_the_documents_one_by_one():
    model = _model("llama")
    x, docs = _packed([9, 14, 10], seed=1)
    y = torch.randint(1, 64, x.shape, generator=torch.Generator().manual_seed(2))
    loss = model(x, y, docs=Documents.from_tokens(x, EOD))
    loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    total, start = 0.0, 0
    for d in docs:  # token-weighted: the packed loss is the mean over all tokens
        part = model(d[None], y[:, start:start + len(d)]) * len(d) / x.shape[1]
        part.backward()
        total += float(part.detach())
        start += len(d)
    torch.testing.assert_close(float(loss), total, atol=1e-6, rtol=1e-6)
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(packed_grads[n], p.grad, atol=1e-5, rtol=1e-5, msg=n)


def test_sliding_window_and_recompute_keep_the_mask():
    from megaloom.models.transformer import apply_recompute

    model = _model("llama", sliding_window=4)
    x, docs = _packed([8, 11, 6], seed=3)
    alone = torch.cat([model(d[None]) for d in docs], dim=1)
    torch.testing.assert_close(model(x, docs=Documents.from_tokens(x, EOD)), alone, atol=1e-5, rtol=1e-5)
    for mode in ("selective", "full"):
        apply_recompute(model, mode)
        model.train()
        y = torch.randint(1, 64, x.shape)
        model(x, y, docs=Documents.from_tokens(x, EOD)).backward()  # recomputation re-applies the same mask
        model.eval()
        torch.testing.assert_close(model(x, docs=Documents.from_tokens(x, EOD)), alone, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_flex_block_mask_equals_the_dense_mask_on_gpu():
    """On GPUs the mask is FlexAttention's block mask; it must equal the dense SDPA mask's result."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = _model("llama", max_seq_len=1024).cuda()
    x, _ = _packed([300, 500, 224], seed=4)
    x = x.cuda()
    docs = Documents.from_tokens(x, EOD, reset_positions=True)
    flex = model(x, docs=docs)  # is_cuda and no dropout: the block mask
    dense = model(x, docs=Documents(docs.ids, docs.positions, mask=docs.dense_mask()))
    torch.testing.assert_close(flex, dense, atol=2e-4, rtol=2e-4)
