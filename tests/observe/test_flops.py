"""Model FLOPs for MFU: frozen parameters take no weight gradient (4N, not 6N), and a multimodal model's image
encoder and projector are counted per image (they run per image, not per text position)."""

from __future__ import annotations

import torch

from megaloom.config import load_config
from megaloom.models.freeze import freeze_parts
from megaloom.models.registry import get_family
from megaloom.observe.flops import flops_per_token, frozen_matmul_params, image_flops, matmul_params


def _llava(freeze: str):
    cfg = load_config(None, ["model.preset=llava-tiny", "model.image_token_id=5", "model.vocab_size=512",
                             f"model.freeze={freeze}",
                             "train.seq_len=96"])
    with torch.device("meta"):
        model = get_family("llava").build(cfg.model)
    freeze_parts(model, cfg.model.freeze)
    return cfg, model


def test_a_text_model_counts_6n_plus_attention():
    cfg = load_config(None, ["model.preset=tiny", "model.vocab_size=512"])
    with torch.device("meta"):
        model = get_family("llama").build(cfg.model)
    n = matmul_params(model)
    assert frozen_matmul_params(model) == 0 and image_flops(model) == 0.0
    m = cfg.model
    assert flops_per_token(m, n, 128) == 6 * n + 12 * m.n_layers * m.d_model * 128


def test_attention_flops_count_heads_times_head_dim():
    """With model.head_dim the score and value matmuls are n_heads x head_dim wide, not d_model (TorchTitan's
    12 l h q t): Qwen3-0.6B's 16 heads of 128 are 2048 wide over a d_model of 1024."""
    cfg = load_config(None, ["model.preset=qwen3-0.6b"])
    m = cfg.model
    assert flops_per_token(m, 0, 4096) == 12 * 28 * 16 * 128 * 4096


def test_frozen_decoder_counts_4n_and_the_encoder_runs_per_image():
    cfg, frozen = _llava("vision,language")  # the projector-only stage
    _, trained = _llava("")
    n = matmul_params(trained)
    assert matmul_params(frozen) == n and frozen_matmul_params(frozen) == n  # the decoder alone, all of it frozen
    attn = 12 * cfg.model.n_layers * cfg.model.d_model * 96
    assert flops_per_token(cfg.model, n, 96, frozen_matmul_params(frozen)) == 4 * n + attn
    vision = trained.vision
    tokens = vision.n_patches + (vision.cls is not None)
    blocks = list(vision.layers.values())
    n_enc = sum(p.numel() for b in blocks for p in b.parameters() if p.ndim >= 2)
    forward = tokens * (2 * n_enc + 4 * len(blocks) * vision.pos_emb.weight.shape[-1] * tokens)
    n_proj = sum(p.numel() for p in trained.projector.parameters() if p.ndim >= 2)
    # trained: encoder forward + backward (3x), projector 6N per patch; frozen encoder: forward only, and the
    # projector's input gradient is not needed (4N per patch)
    assert image_flops(trained) == 3 * forward + 6 * n_proj * vision.n_patches
    assert image_flops(frozen) == forward + 4 * n_proj * vision.n_patches
