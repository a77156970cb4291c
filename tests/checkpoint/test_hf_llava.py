"""Hugging Face interchange of the llava family (LlavaForConditionalGeneration: CLIP vision tower, GeLU projector,
Llama), checked by logits with images at atol 1e-5 both ways, and what it refuses."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megaloom.config import load_config  # noqa: E402
from megaloom.convert import ConversionError, from_hf, to_hf  # noqa: E402
from megaloom.models.registry import get_family  # noqa: E402
from tests.checkpoint.hf_common import megaloom_from_run  # noqa: E402

ATOL = 1e-5
VOCAB, IMAGE_ID, IMAGE, PATCH = 128, 127, 16, 4
PER_IMAGE = (IMAGE // PATCH) ** 2
pytestmark = pytest.mark.filterwarnings("ignore:.*has no tokenizer.json")


def hf_model(tied: bool, feature_layer: int = -2, **changes):
    """A tiny random LLaVA in float32 with every norm randomised (a swapped norm would show in the logits)."""
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=4, image_size=IMAGE, patch_size=PATCH,
                                           projection_dim=32)
    text = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                    rms_norm_eps=1e-6, tie_word_embeddings=tied)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_ID,
                                   vision_feature_layer=feature_layer, image_seq_length=PER_IMAGE,
                                   tie_word_embeddings=tied, **changes)
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model.eval()


def inputs():
    """Two rows: one with one image, one with two, text around them; pixels [3 images, 3, H, W]."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB - 1, (2, 3 * PER_IMAGE), generator=gen)
    ids[0, 2:2 + PER_IMAGE] = IMAGE_ID
    ids[1, 1:1 + PER_IMAGE] = IMAGE_ID
    ids[1, 2 + PER_IMAGE:2 + 2 * PER_IMAGE] = IMAGE_ID
    return ids, torch.randn(3, 3, IMAGE, IMAGE, generator=gen)


def hf_logits(model, ids, pixels):
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=pixels).logits


@pytest.mark.parametrize("tied", [False, True])
def test_hf_llava_imports_with_equal_logits_and_exports_the_same_tensors(tmp_path, tied):
    ref = hf_model(tied)
    ref.save_pretrained(tmp_path / "hf")
    ids, pixels = inputs()
    expected = hf_logits(ref, ids, pixels)

    from_hf(tmp_path / "hf", tmp_path / "run")
    model, cfg = megaloom_from_run(tmp_path / "run")
    m = cfg.model
    # vision_feature_layer=-2: the last of CLIP's 3 blocks is never read, so 2 are kept
    assert (m.arch, m.vision_layers, m.vision_d_model, m.image_token_id, m.tie_embeddings) == ("llava", 2, 32,
                                                                                               IMAGE_ID, tied)
    with torch.no_grad():
        got = model(ids, images=pixels)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        # the same images as [rows, slots] with the count per row: the training layout
        slots = torch.zeros(2, 2, 3, IMAGE, IMAGE)
        slots[0, 0], slots[1, :2] = pixels[0], pixels[1:]
        torch.testing.assert_close(model(ids, images=slots, n_images=torch.tensor([1, 2])), expected, atol=ATOL,
                                   rtol=0)

    to_hf(tmp_path / "run", tmp_path / "back", show_progress=False)
    hf_cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert hf_cfg["architectures"] == ["LlavaForConditionalGeneration"] and hf_cfg["vision_feature_layer"] == -1
    back = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "back").eval()
    torch.testing.assert_close(hf_logits(back, ids, pixels), expected, atol=ATOL, rtol=0)
    ref_sd = ref.state_dict()
    for k, v in back.state_dict().items():
        if ".encoder.layers.2." not in k and "post_layernorm" not in k:
            assert torch.equal(v, ref_sd[k]), k


def test_megaloom_llava_exports_to_transformers_with_equal_logits(tmp_path):
    """A model built by megaloom from a config (not from HF) -> transformers: the same logits."""
    from megaloom.checkpoint import save_checkpoint

    cfg = load_config(None, ["model.preset=llava-tiny", f"model.vocab_size={VOCAB}", f"model.image_size={IMAGE}",
                             f"model.patch_size={PATCH}", f"model.image_token_id={IMAGE_ID}", "model.vision_cls=true",
                             "model.vision_act=quick_gelu", "model.tie_embeddings=false", "train.seq_len=64",
                             f"run.dir={tmp_path / 'run'}"])
    torch.manual_seed(0)
    model = get_family("llava").build(cfg.model).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(cfg.to_yaml())
    save_checkpoint(run / "checkpoints", 1, model, None, {"model": cfg.model.__dict__}, keep=1)
    to_hf(run, tmp_path / "hf", show_progress=False)
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    ids, pixels = inputs()
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(hf, ids, pixels), model(ids, images=pixels), atol=ATOL, rtol=0)


def test_hf_llava_refusals_name_the_field(tmp_path):
    hf_model(False, vision_feature_select_strategy="full").save_pretrained(tmp_path / "full")
    with pytest.raises(ConversionError, match="vision_feature_select_strategy"):
        from_hf(tmp_path / "full", tmp_path / "run1")
    hf_model(False, projector_hidden_act="relu").save_pretrained(tmp_path / "relu")
    with pytest.raises(ConversionError, match="projector_hidden_act"):
        from_hf(tmp_path / "relu", tmp_path / "run2")
