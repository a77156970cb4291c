import torch

from megaloom.cli import main
from megaloom.config import load_config
from megaloom.models import Transformer
from megaloom.step import TrainStep
from megaloom.train import train
from tests.conftest import tiny_overrides


def test_nan_guard_skips_the_step_and_training_continues():
    cfg = load_config(None, ["model.vocab_size=128", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
                             "train.seq_len=32", "model.max_seq_len=64"])
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = TrainStep(model, opt, "fp32", torch.device("cpu"), 2, 1.0, nan_guard=True)
    poison = {"on": True}
    model.layers[str(0)].attn.q_proj.weight.register_hook(
        lambda g: torch.full_like(g, float("nan")) if poison["on"] else g)
    batch = torch.randint(0, 128, (4, 17))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = step(batch)
    assert out.skipped
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    poison["on"] = False
    out = step(batch)
    assert not out.skipped and torch.isfinite(out.grad_norm)


def test_heartbeat_and_status(small_corpus, tmp_path, capsys):
    run = tmp_path / "r"
    train(load_config(None, tiny_overrides(small_corpus, run, "train.steps=3")))
    assert (run / "heartbeat" / "rank0.json").is_file()
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert "rank" in out and "   0" in out
