"""The Trainer's contract beyond the loss: preflight refuses before heavy work, the resolved config is a new
object that config.yaml records and nothing changes afterwards, and the given config is never touched."""

from __future__ import annotations

import pytest

import megaloom.training.trainer as trainer_mod
from megaloom.config import ConfigError, load_config
from megaloom.training.trainer import Trainer
from tests.conftest import tiny_overrides


def test_resolved_config_is_new_and_unchanged_after_config_yaml(small_corpus, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    auto = ["model.vocab_size=0", "model.n_kv_heads=0", "model.ffn_dim=0", "train.precision=auto",
            "train.micro_batch_size=0", "train.device=cpu"]
    # a save, an evaluation, a skipped step and a rollback: every path of the loop that reads the config
    extra = ["train.steps=8", "checkpoint.every=3", "train.eval_every=4", "resilience.max_bad_steps=2"]
    cfg = load_config(None, tiny_overrides(small_corpus, run, *auto, *extra))
    given = cfg.to_yaml()
    monkeypatch.setenv("MEGALOOM_FAULT", "nan:step=5:count=2")
    trainer = Trainer(cfg).build()
    written = (run / "config.yaml").read_text()
    assert trainer.cfg is not cfg and trainer.cfg.to_yaml() == written
    resolved = trainer.cfg
    m, t = resolved.model, resolved.train
    assert (m.vocab_size, m.n_kv_heads, m.ffn_dim, t.precision, t.micro_batch_size) == (512, 4, 256, "fp32", 8)
    result = trainer.fit()
    assert result.final_step == 8 and result.eval_loss is not None and "ROLLBACK" in capsys.readouterr().out
    assert trainer.cfg is resolved and resolved.to_yaml() == written  # nothing wrote to it after config.yaml
    assert cfg.to_yaml() == given  # and the config given to the trainer was never changed


@pytest.mark.parametrize("world,overrides,fragment", [
    (2, ["parallel.cp=2", "train.seq_len=30"], "parallel.cp=2 cuts each sequence"),
    (1, ["parallel.ep=2"], "model.moe_every=0"),
    (1, ["parallel.zero=1"], "but dp=1"),
    (4, ["parallel.pp=2", "parallel.zero=3"], "parallel.zero=3 together with parallel.pp>1"),
    (3, ["parallel.tp=2"], "parallel.tp"),  # validate_layout: the world does not fit
])
def test_preflight_refuses_before_any_process_group_or_data(world, overrides, fragment, tmp_path, monkeypatch):
    def heavy(*a, **k):
        raise AssertionError("heavy work started before preflight refused")

    for name in ("init_runtime", "build_datasets", "get_family"):
        monkeypatch.setattr(trainer_mod, name, heavy)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    cfg = load_config(None, [f"run.dir={tmp_path / 'r'}", *overrides])
    with pytest.raises(ConfigError, match=fragment):
        Trainer(cfg).build()
    assert not (tmp_path / "r").exists()


def test_vocab_check_runs_after_the_tokenizer_and_before_the_model(small_corpus, tmp_path, monkeypatch):
    def no_model(*a, **k):
        raise AssertionError("the model was built before the vocabulary check")

    monkeypatch.setattr(trainer_mod, "get_family", no_model)
    cfg = load_config(None, tiny_overrides(small_corpus, tmp_path / "r", "model.vocab_size=256"))
    with pytest.raises(ConfigError, match="the tokenizer has 512 tokens but model.vocab_size=256"):
        Trainer(cfg).build()
    assert not (tmp_path / "r" / "config.yaml").exists()


def test_eta_leaves_out_the_warm_up_step():
    """Issue 24 (9): the first ETA came from an interval holding the compile/warm-up step (many times slower)."""
    import torch

    from megaloom.training.records import Interval

    iv = Interval(loss_sum=torch.zeros(()), steps=4, compute_s=10.0 + 3 * 0.5, warmup_s=10.0)
    assert iv.seconds_per_step() == 0.5
    iv.reset()
    iv.steps, iv.compute_s = 2, 1.0  # later intervals: the plain mean
    assert iv.seconds_per_step() == 0.5


def test_embedding_grad_fusion_reaches_the_token_embedding(small_corpus, tmp_path):
    # One process with bf16 weights (its gradients in buckets) and the fused linears: train.embedding_grad_fusion
    # routes the untied token embedding's gradient too; two steps the same bit for bit either way (CPU: the dense
    # gradient and its add), so the setting changes where the work runs, not the numbers.
    import json

    losses = {}
    for embedding in (False, True):
        run = tmp_path / f"run-{embedding}"
        cfg = load_config(None, tiny_overrides(small_corpus, run, "train.steps=2", "train.precision=bf16",
                                               "train.bf16_params=true", "train.grad_accum_fusion=true",
                                               f"train.embedding_grad_fusion={embedding}", "model.tie_embeddings=false",
                                               "checkpoint.every=0", "checkpoint.final=false"))
        trainer = Trainer(cfg).build()
        assert getattr(trainer.model.tok_emb.weight, "fused_wgrad", False) is embedding
        assert type(trainer.model.tok_emb).__name__ == ("FusedEmbedding" if embedding else "Embedding")
        trainer.fit()
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        losses[embedding] = [r["loss"] for r in rows if r.get("loss") is not None]
    assert len(losses[True]) == 2 and losses[True] == losses[False]


def test_embedding_grad_fusion_needs_the_fused_path():
    with pytest.raises(ConfigError, match="train.embedding_grad_fusion=true"):
        load_config(None, ["train.embedding_grad_fusion=true", "train.grad_accum_fusion=false"])
