"""The CUDA path of asynchronous saving: non-blocking copies into pinned host buffers that are reused."""

from __future__ import annotations

import time

import pytest
import torch

from megaloom.checkpoint import load_checkpoint, save_checkpoint
from megaloom.checkpoint.async_save import AsyncCheckpointer
from megaloom.config import load_config
from megaloom.models import Transformer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def build(*extra: str):
    cfg = load_config(None, ["model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
                             "train.seq_len=16", "model.max_seq_len=16", *extra])
    torch.manual_seed(0)
    model = Transformer(cfg.model).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    return model, opt


def train_step(model, opt) -> None:
    x = torch.randint(0, model.cfg.vocab_size, (4, 16), device="cuda")
    model(x, x).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


def test_cuda_snapshot_is_pinned_reused_and_consistent(tmp_path):
    model, opt = build()
    train_step(model, opt)
    ckpt = AsyncCheckpointer()
    ckpt.save(tmp_path, 1, model, opt, {}, keep=2)
    ckpt.wait()
    buffers = dict(ckpt._buffers._bufs)
    assert buffers and all(b.is_pinned() for n, b in buffers.items() if b.ndim > 0)
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    ckpt.save(tmp_path, 2, model, opt, {}, keep=2)
    for _ in range(3):  # the GPU keeps updating the parameters while the thread writes
        train_step(model, opt)
    ckpt.wait()
    assert all(ckpt._buffers._bufs[n] is b for n, b in buffers.items())  # no new pinned allocations

    model2, opt2 = build()
    load_checkpoint(tmp_path / "step_00000002", model2, opt2)
    for k, v in model2.state_dict().items():
        assert torch.equal(v.cpu(), expected[k]), k


def test_cuda_stall_against_blocking_save(tmp_path, record_property):
    # about 90M parameters (the tiny preset keeps ffn_dim=384): 1.1 GB of fp32 weights + AdamW moments
    model, opt = build("model.vocab_size=32768", "model.d_model=1024", "model.n_layers=6", "model.n_heads=8",
                       "model.tie_embeddings=false")
    train_step(model, opt)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    save_checkpoint(tmp_path / "blocking", 1, model, opt, {}, keep=1)
    blocking = time.perf_counter() - t0
    ckpt = AsyncCheckpointer()
    first = ckpt.save(tmp_path / "async", 1, model, opt, {}, keep=1)  # allocates and pins the buffers
    ckpt.wait()
    train_step(model, opt)
    torch.cuda.synchronize()
    second = ckpt.save(tmp_path / "async", 2, model, opt, {}, keep=1)
    ckpt.wait()
    gb = ckpt.host_buffer_bytes / 1e9
    print(f"\n{gb:.2f} GB state: blocking save {blocking:.2f}s; async stall first {first.stall_s:.3f}s "
          f"(pinning), then {second.stall_s:.3f}s + background write {second.write_s:.2f}s")
    record_property("blocking_s", blocking)
    record_property("async_stall_s", second.stall_s)
    record_property("async_write_s", second.write_s)
