"""llava on a GPU: `megaloom train model.preset=llava-tiny` in bf16 (and fp8 on compute capability >= 8.9: the
decoder blocks in fp8, the image encoder in bf16) learns the synthetic set, with pinned image batches."""

from __future__ import annotations

import pytest
import torch

from megaloom.config import load_config
from megaloom.train import train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_llava_tiny_trains_on_the_gpu(tmp_path, precision):
    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability >= 8.9")
    res = train(load_config(None, [
        "model.preset=llava-tiny", f"run.dir={tmp_path / 'run'}", f"train.precision={precision}", "train.steps=40",
        "train.seq_len=256", "train.global_batch_size=8", "train.micro_batch_size=4", "train.warmup_steps=4",
        "train.log_every=10", "train.eval_every=0", "train.eval_batches=1", "checkpoint.final=false",
        "data.num_workers=2", f"data.cache_dir={tmp_path / 'c'}", "run.tensorboard=false",
        "model.vision_d_model=128", "model.vision_heads=4", "model.vision_ffn_dim=512",
        f"train.fp8_keep_first_last={precision != 'fp8'}"]))
    assert res.losses[40] < res.losses[10] - 1.0, res.losses
