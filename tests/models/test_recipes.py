"""Training defaults by model width (megaloom/models/recipes.py): the published shapes get their own learning rate,
warm-up and init std; what the user sets wins; CPU-sized presets keep the dataclass defaults."""

from __future__ import annotations

import pytest

from megaloom.config import Config, load_config


@pytest.mark.parametrize("preset,lr,std", [("gpt2-124m", 6e-4, 0.02), ("llama3-1b-untied", 3e-4, 0.01398),
                                           ("llama3-8b", 3e-4, 0.00988), ("llama3-70b", 1.5e-4, 0.00699)])
def test_published_shapes_default_by_width(preset, lr, std):
    cfg = load_config(None, [f"model.preset={preset}", "train.steps=100000"])
    assert (cfg.train.lr, cfg.model.init_std) == (lr, std) and cfg.train.min_lr == pytest.approx(lr / 10)
    assert cfg.train.warmup_steps == (700 if preset == "gpt2-124m" else 2000)


def test_a_short_run_still_warms_up_within_a_tenth_of_its_steps():
    assert load_config(None, ["model.preset=llama3-8b", "train.steps=600"]).train.warmup_steps == 60


def test_what_the_user_sets_wins(tmp_path):
    cfg = load_config(None, ["model.preset=llama3-8b", "train.lr=1e-5", "train.warmup_steps=7", "model.init_std=0.03"])
    assert (cfg.train.lr, cfg.train.warmup_steps, cfg.model.init_std) == (1e-5, 7, 0.03)
    assert cfg.train.min_lr == pytest.approx(1e-6)
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("train:\n  min_lr: 0.0\n")
    assert load_config(yaml_file, ["model.preset=llama3-1b"]).train.min_lr == 0.0


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt2", "mixtral-tiny", "qwen3-tiny"])
def test_cpu_presets_keep_the_defaults(preset):
    cfg, plain = load_config(None, [f"model.preset={preset}"]), Config()
    assert (cfg.train.lr, cfg.train.min_lr, cfg.train.warmup_steps, cfg.model.init_std) == (
        plain.train.lr, plain.train.min_lr, plain.train.warmup_steps, plain.model.init_std)
