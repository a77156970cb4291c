"""Shared fixtures: a small real corpus (stdlib sources) tokenized once per test session."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> dict:
    """A 512-token BPE and token files over ~40 stdlib modules: real text, built in a few seconds."""
    from megaloom.data.preprocess import preprocess
    from megaloom.data.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("corpus")
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]
    tok = train_bpe(files, 512, root / "tokenizer.json", show_progress=False)
    prefix = str(root / "stdlib")
    preprocess([str(f) for f in files], str(tok), prefix, workers=1, show_progress=False)
    return {"tokenizer": str(tok), "prefix": prefix, "files": files}


def cli_run_losses(corpus: dict, run_dir: Path, preset: str, *extra: str) -> tuple[float, float, list[dict]]:
    """`megaloom train model.preset=PRESET` (30 steps, eval at the end) on the small corpus with the tiny overrides'
    data and training keys: (mean loss of steps 1-3, of steps 28-30, the metrics rows)."""
    import json

    from megaloom.cli import main

    data = [o for o in tiny_overrides(corpus, run_dir) if not o.startswith("model.")]
    assert main(["train", f"model.preset={preset}", "train.steps=30", "checkpoint.every=0", "train.eval_every=30",
                 *data, *extra]) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    loss = {r["step"]: r["loss"] for r in records}
    return sum(loss[s] for s in (1, 2, 3)) / 3, sum(loss[s] for s in (28, 29, 30)) / 3, records


def assert_recompute_keeps_grads(model, x, y, mode: str) -> None:
    """One backward of ``model(x, y)`` before and after `apply_recompute(model, mode)`: the same gradients, bitwise."""
    import torch

    from megaloom.models import apply_recompute

    def grads() -> dict:
        model.zero_grad(set_to_none=True)
        model(x, y).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads()
    apply_recompute(model, mode)
    for n, g in grads().items():
        assert torch.equal(g, plain[n]), n


def tiny_overrides(corpus: dict, run_dir: Path, *extra: str) -> list[str]:
    return [f"data.paths={corpus['prefix']}", f"data.tokenizer={corpus['tokenizer']}", f"run.dir={run_dir}",
            "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
            "train.seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=4", "train.log_every=1",
            "train.warmup_steps=5", "train.lr=3e-3", "train.eval_every=0", "train.eval_batches=2",
            "data.num_workers=0", "run.tensorboard=false", *extra]


def wait_for_step(proc, step: int, steps: int) -> None:
    """Read a running `megaloom train`'s console until it logs ``step``/``steps`` (then signal it, etc.)."""
    import re

    seen = []
    for line in proc.stdout:
        seen.append(line)
        if re.search(rf"step\s+{step}/{steps}\b", line):
            return
    raise AssertionError("no step line:\n" + "".join(seen) + proc.stderr.read())
