"""FP8 through the training loop and the config (train.precision=fp8, train.fp8_recipe,
train.fp8_keep_first_last), on CPU: the FP8-GPU check is bypassed and the blocks run fp8 GEMMs under bf16
autocast."""

from __future__ import annotations

import pytest

from megaloom.config import ConfigError, load_config


def test_fp8_config_keys() -> None:
    cfg = load_config(None, ["train.precision=fp8"])
    assert cfg.train.fp8_recipe == "tensorwise" and cfg.train.fp8_keep_first_last is True
    assert load_config(None, ["train.fp8_recipe=rowwise"]).train.fp8_recipe == "rowwise"
    with pytest.raises(ConfigError):
        load_config(None, ["train.fp8_recipe=delayed"])


def test_train_loop_converts_and_trains_in_fp8(small_corpus, tmp_path, monkeypatch, capsys) -> None:
    """The trainer's fp8 path end to end on CPU (the FP8-GPU check bypassed; bf16 autocast on CPU)."""
    from megaloom.train import train
    from tests.conftest import tiny_overrides

    monkeypatch.setattr("megaloom.training.trainer.resolve_precision", lambda cfg, device: "fp8")
    # 3 blocks: the first and last stay bf16 (train.fp8_keep_first_last), the middle one's 7 linears in fp8
    cfg = load_config(None, tiny_overrides(small_corpus, tmp_path / "run", "model.n_layers=3", "train.steps=12",
                                           "checkpoint.every=0", "train.fp8_recipe=rowwise"))
    res = train(cfg)
    assert "fp8 (rowwise): 7 linear layers in fp8" in capsys.readouterr().out
    assert res.losses[12] < res.losses[1] - 0.4, res.losses  # 6.23 -> 5.62 on CPU


def test_fp8_trains_with_onebit_adam(small_corpus, tmp_path, monkeypatch, capsys) -> None:
    """train.precision=fp8 with train.optimizer=onebit_adam (issue 40: 1-bit works with fp8): the fp8 linears'
    weights are ordinary fp32 parameters in the gradient buckets, warmed up with AdamW, then frozen-variance
    updates (one process: the exchange of a one-rank group is exact; the compressed one is in the dp worlds)."""
    from megaloom.train import train
    from tests.conftest import tiny_overrides

    monkeypatch.setattr("megaloom.training.trainer.resolve_precision", lambda cfg, device: "fp8")
    cfg = load_config(None, tiny_overrides(small_corpus, tmp_path / "run", "model.n_layers=3", "train.steps=12",
                                           "checkpoint.every=0", "train.optimizer=onebit_adam",
                                           "train.onebit_warmup_steps=5"))
    res = train(cfg)
    assert "fp8 (tensorwise): 7 linear layers in fp8" in capsys.readouterr().out
    assert all(loss == loss for loss in res.losses.values())  # finite
    # 6.23 -> 5.98 (step 5, the warm-up's end) -> 5.65 (step 12) on CPU
    assert res.losses[12] < res.losses[5] - 0.15 and res.losses[5] < res.losses[1], res.losses
