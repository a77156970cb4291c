import json

import torch

from megaloom.config import load_config
from megaloom.train import train
from tests.conftest import tiny_overrides


def test_loss_falls_and_run_dir_contract(small_corpus, tmp_path):
    run = tmp_path / "run"
    cfg = load_config(None, tiny_overrides(small_corpus, run, "train.steps=60", "checkpoint.every=0",
                                           "run.tensorboard=true", "train.log_every=5", "train.eval_every=30"))
    res = train(cfg)
    first, last = res.losses[5], res.losses[60]
    assert first > 5.5 and last < first - 0.9, (first, last)  # from ~ln(512)=6.2 to below 5
    assert (run / "config.yaml").is_file()
    assert list((run / "checkpoints").glob("step_00000060"))
    assert list(run.glob("events.out.tfevents.*"))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "mem_gb"):
            assert key in r
        assert (r["mfu"] is None) == (not torch.cuda.is_available())  # null on CPU
    assert [r["step"] for r in records] == list(range(5, 61, 5))
    assert records[-1]["eval_loss"] < records[0]["loss"]
    resolved = load_config(run / "config.yaml")
    assert resolved.model.vocab_size == 512 and resolved.train.precision == "fp32"
    assert load_config(run / "requested.yaml") == cfg  # the config as given, beside the resolved one
    assert cfg.train.precision == "auto" and cfg.model.vocab_size == 0  # left as written: auto


def test_no_final_checkpoint_when_asked(small_corpus, tmp_path):
    """(A GPU job's train.attention=fa4 rides along: on CPU the run takes PyTorch's SDPA, and config.yaml says so,
    while requested.yaml keeps fa4 as given: passed back, it trains on from the periodic checkpoint.)"""
    run = tmp_path / "run"
    res = train(load_config(None, tiny_overrides(small_corpus, run, "train.steps=6", "checkpoint.every=4",
                                                 "checkpoint.final=false", "train.attention=fa4")))
    assert res.final_step == 6
    assert [p.name for p in (run / "checkpoints").glob("step_*")] == ["step_00000004"]  # the periodic one only
    assert load_config(run / "config.yaml").train.attention == "torch"
    requested = load_config(run / "requested.yaml", ["train.steps=8"])
    assert requested.train.attention == "fa4" and requested.train.precision == "auto"
    assert train(requested).final_step == 8
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 8 and 5 in steps  # resumed at step 4 (steps 5 and 6 run again), not from scratch


def test_exact_resume_after_stop(small_corpus, tmp_path):
    base = ["train.steps=12", "checkpoint.every=4", "model.dropout=0.1"]
    ref = train(load_config(None, tiny_overrides(small_corpus, tmp_path / "a", *base)))
    cfg = load_config(None, tiny_overrides(small_corpus, tmp_path / "b", *base))
    part = train(cfg, stop_after=6)  # "crash" after step 6: the newest checkpoint is step 4
    assert part.final_step == 6
    resumed = train(load_config(None, tiny_overrides(small_corpus, tmp_path / "b", *base)))
    for step in range(5, 13):
        assert resumed.losses[step] == ref.losses[step], step  # bit-exact on CPU fp32
    assert resumed.eval_loss == ref.eval_loss


def test_resume_falls_back_past_a_corrupt_checkpoint(small_corpus, tmp_path, capsys):
    base = ["train.steps=8", "checkpoint.every=4"]
    run = tmp_path / "c"
    train(load_config(None, tiny_overrides(small_corpus, run, *base)), stop_after=8)
    shard = next((run / "checkpoints" / "step_00000008").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated
    res = train(load_config(None, tiny_overrides(small_corpus, run, "train.steps=10", "checkpoint.every=4")))
    out = capsys.readouterr().out
    assert "corrupt" in out and "resumed from" in out and "step_00000004" in out
    assert min(res.losses) == 5


def test_generation_from_a_run(small_corpus, tmp_path):
    from megaloom.generate import generate, load_for_generation

    run = tmp_path / "g"
    train(load_config(None, tiny_overrides(small_corpus, run, "train.steps=3")))
    model, tok = load_for_generation(run, torch.device("cpu"))
    prompt = torch.tensor([tok.encode("def ")])
    out = generate(model, prompt, 12, temperature=0.8, top_k=20, seed=1)
    assert out.shape[1] > prompt.shape[1]
    assert isinstance(tok.decode(out[0].tolist()), str)


def test_moe_models_train_resume_exactly_and_log_expert_load(small_corpus, tmp_path):
    base = ["model.preset=deepseek-v3-tiny", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=0",
            "model.first_dense_layers=0", "model.n_layers=2", "train.steps=8", "checkpoint.every=4"]
    ref = train(load_config(None, tiny_overrides(small_corpus, tmp_path / "a", *base)))
    train(load_config(None, tiny_overrides(small_corpus, tmp_path / "b", *base)), stop_after=6)
    resumed = train(load_config(None, tiny_overrides(small_corpus, tmp_path / "b", *base)))
    for step in range(5, 9):
        assert resumed.losses[step] == ref.losses[step], step  # router bias is checkpointed with the model
    recs = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert len(recs[-1]["moe_load_max_over_mean"]) == 2 and len(recs[-1]["moe_tokens_per_expert"][0]) == 16
    from megaloom.plot import plot_run

    plot_run(tmp_path / "a")
    assert (tmp_path / "a" / "expert_load.png").stat().st_size > 1000  # the per-expert load heat map
    mix = train(load_config(None, tiny_overrides(small_corpus, tmp_path / "m", "model.preset=mixtral-tiny",
                                                 "model.d_model=64", "train.steps=30", "train.log_every=5",
                                                 "model.capacity_factor=1.0")))
    assert mix.losses[30] < mix.losses[5] - 0.5


def test_resume_keeps_one_metric_row_per_step_summary_and_status(small_corpus, tmp_path, capsys):
    """Issue 24 (8): a resume replays the steps after its checkpoint; metrics.jsonl keeps one row per step
    (it had steps 5 and 6 twice), the end of a run prints one summary line, and `megaloom status` says a
    finished run is finished."""
    from megaloom.cli import main

    base = ["train.steps=8", "checkpoint.every=4"]
    run = tmp_path / "m"
    train(load_config(None, tiny_overrides(small_corpus, run, *base)), stop_after=6)
    assert main(["status", str(run)]) == 0
    assert "at step 6 of train.steps=8" in capsys.readouterr().out
    train(load_config(None, tiny_overrides(small_corpus, run, *base)))
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9)), steps
    summary = [line for line in capsys.readouterr().out.splitlines() if line.startswith("megaloom: done:")]
    assert len(summary) == 1 and "step 8/8 (4 trained now" in summary[0] and "final loss" in summary[0]
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert "finished: step 8 of train.steps=8" in out and "step_00000008" in out


def test_document_mask_trains(small_corpus, tmp_path):
    """data.document_mask / reset_positions reach the model (models/documents.py; parity in tests/models and
    tests/parallel/test_world2.py); and pipelines carry them (every stage finds them from the tokens)."""

    from megaloom.training.trainer import Trainer

    cfg = load_config(None, tiny_overrides(small_corpus, tmp_path / "d", "train.steps=2", "data.document_mask=true",
                                           "data.reset_positions=true", "train.eval_every=2"))
    trainer = Trainer(cfg).build()
    x = torch.tensor([[5, trainer.tokenizer.eod_id, 7, 8]])
    docs = trainer.train_step.documents(x)
    assert docs.ids.tolist() == [[0, 0, 1, 1]] and docs.positions.tolist() == [[0, 1, 0, 1]]
    res = trainer.fit()
    assert res.final_step == 2 and all(v == v for v in res.losses.values()) and res.eval_loss is not None
    # pipelines carry them too: every stage finds them from the tokens (tests/data/test_chat_token_mean.py trains
    # dp2 x pp2 on chat data against the single process)
