"""train.optimizer_offload: AdamW's state and the fp32 masters on the host, the step on the host's CPU (one process;
the dp2 ZeRO-1/2 world is test_offload_world2.py).

Parity: with the on-device step's own kernel (foreach on CPU) the offloaded step is the same arithmetic on 1-D
views of the same elements, so it must be bitwise equal; torch's fused CPU kernel (the default where this torch
has it) computes AdamW in its own order of float32 operations, a few roundings apart per step (bounded below).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from megaloom.config import ConfigError, load_config
from megaloom.models.transformer import Transformer
from megaloom.optim.build import build_optimizer
from megaloom.optim.offload import build_offloaded
from megaloom.step import TrainStep

CPU = torch.device("cpu")
STEPS = 5


def _model() -> tuple[Transformer, object]:
    cfg = load_config(None, ["model.preset=tiny", "model.vocab_size=256", "model.n_layers=3",
                             "train.optimizer_offload=true"])
    cfg.train.lr, cfg.train.grad_clip, cfg.train.weight_decay = 3e-3, 0.05, 0.1
    torch.manual_seed(0)
    return Transformer(cfg.model), cfg


def _batches() -> list[torch.Tensor]:
    return [torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(s)) for s in range(STEPS)]


def _train(model, opt, cfg) -> tuple[list[tuple[float, float]], dict]:
    step = TrainStep(model, opt, "fp32", CPU, 2, cfg.train.grad_clip)
    outs = [step(b) for b in _batches()]
    step.settle()
    return [(o.loss.item(), o.grad_norm.item()) for o in outs], {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def runs() -> dict:
    """The on-device AdamW and the offloaded one (foreach kernel, in line and on its thread; fused kernel)."""
    base, cfg = _model()
    out = {}
    for name in ("device", "foreach", "foreach-thread", "fused"):
        model = copy.deepcopy(base)
        if name == "device":
            opt = build_optimizer(model, cfg.train, CPU)
        else:
            # the on-device step's kernel on CPU (foreach), or the fused CPU kernel
            opt = build_offloaded(model, None, cfg.train, CPU, overlap=name.endswith("thread"),
                                  fused=None if name == "fused" else False)
        out[name] = (*_train(model, opt, cfg), opt)
    return out


def test_the_offloaded_step_with_the_same_kernel_is_the_on_device_step_bitwise(runs: dict) -> None:
    """Five steps, two micro-batches each, the clip active every step: losses, norms, weights bitwise equal, also
    with the host step on its thread waited for module by module by the next forward."""
    ref_log, ref_w, _ = runs["device"]
    assert all(norm > 0.05 for _, norm in ref_log)  # clipped
    for name in ("foreach", "foreach-thread"):
        log, w, _ = runs[name]
        assert log == ref_log, name
        for k, v in ref_w.items():
            assert torch.equal(v, w[k]), (name, k)


def test_the_fused_host_kernel_stays_within_float32_rounding_of_the_device_step(runs: dict) -> None:
    """The fused CPU kernel against the device's foreach AdamW on the same gradients (three steps of one fixed
    gradient, so nothing feeds back): each step rounds the decayed weight (|w| eps32 / 2 per rounding) and the
    update, at most lr in size here (m_hat / sqrt(v_hat) = 1 for a constant gradient; a handful of operations,
    each half an eps32 of it); two orders of those roundings differ by at most 4 eps32 (|w| + lr) a step. Trained
    end to end (the gradients then follow the weights) the losses agree to float32's seventh digit."""
    base, cfg = _model()
    torch.manual_seed(1)
    grads = {n: torch.randn_like(p) for n, p in base.named_parameters()}
    weights = {}
    for fused in (False, True):
        model = copy.deepcopy(base)
        opt = build_optimizer(model, cfg.train, CPU) if not fused else build_offloaded(model, None, cfg.train, CPU)
        assert fused is bool(opt.inner.defaults["fused"] if fused else opt.defaults["fused"])
        for _ in range(3):
            for n, p in model.named_parameters():
                p.grad = grads[n].clone()
            opt.step()
            opt.zero_grad()
        weights[fused] = dict(model.named_parameters())
    eps32, lr = torch.finfo(torch.float32).eps, cfg.train.lr
    for n, w in weights[False].items():
        diff = (weights[True][n] - w).abs().detach()
        assert (diff <= 3 * 4 * eps32 * (w.abs().detach() + lr)).all(), n
    losses = [loss for loss, _ in runs["fused"][0]]
    torch.testing.assert_close(losses, [loss for loss, _ in runs["device"][0]], rtol=1e-6, atol=0)


def test_the_state_is_on_the_host_and_the_device_holds_none(runs: dict) -> None:
    _, _, opt = runs["foreach"]
    n = sum(t.numel() for t in opt.tensors)
    assert opt.state_bytes() == 0 and opt.host_bytes() == 4 * 4 * n  # masters, two moments, gradient buffers
    assert all(st["exp_avg"].device.type == "cpu" for st in opt.inner.state.values())
    assert int(next(iter(opt.inner.state.values()))["step"]) == STEPS


def test_megaloom_train_offloaded_resumes_exactly_and_its_checkpoint_loads_on_the_device(small_corpus,
                                                                                         tmp_path) -> None:
    """6 steps straight; 3 steps, a checkpoint, 3 more from it: the same losses (the offloaded state saves and loads
    like the on-device one, resume exact). The step-3 checkpoint resumed without offload (AdamW on the device,
    its own kernel) continues within float32 rounding of the offloaded run."""
    from megaloom.cli import main
    from tests.conftest import tiny_overrides

    def losses(run) -> list[float]:
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    on = ["train.optimizer_offload=true", "train.grad_clip=0.05", "checkpoint.final=false"]
    assert main(["train", *tiny_overrides(small_corpus, tmp_path / "straight"), "train.steps=6", *on]) == 0
    cut = tiny_overrides(small_corpus, tmp_path / "cut")
    assert main(["train", *cut, "train.steps=3", "checkpoint.every=3", *on]) == 0
    step3 = sorted((tmp_path / "cut" / "checkpoints").iterdir())[-1]
    assert main(["train", *cut, "train.steps=6", "checkpoint.resume=auto", *on]) == 0
    assert losses(tmp_path / "cut")[-3:] == losses(tmp_path / "straight")[3:]
    device = tiny_overrides(small_corpus, tmp_path / "device")
    assert main(["train", *device, "train.steps=6", f"checkpoint.resume={step3}", *on[1:]]) == 0
    torch.testing.assert_close(losses(tmp_path / "device")[-3:], losses(tmp_path / "straight")[3:], rtol=1e-5,
                               atol=0)


@pytest.mark.parametrize("bad,fragment", [
    (["train.optimizer=lamb"], "train.optimizer=lamb"),
    (["parallel.zero=3"], "parallel.zero=3"),
    (["train.overlap_optimizer=true"], "train.overlap_optimizer=True"),
    (["train.optimizer=onebit_adam"], "train.optimizer=onebit_adam"),
])
def test_combinations_offload_cannot_serve_are_refused_with_the_fix(bad: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError, match="train.optimizer_offload=true") as e:
        load_config(None, ["train.optimizer_offload=true", *bad])
    assert fragment in str(e.value) and "train.optimizer_offload=false" in str(e.value)


def test_bucket_chunks_cover_every_bucket_even_one_without_segments_here() -> None:
    """A rank whose chunk of a bucket is padding only still issues that bucket's gather (the other ranks wait in
    it): `bucket_chunks` gives every bucket a chunk, empty where this rank holds none of it."""
    from types import SimpleNamespace

    from megaloom.optim.offload import bucket_chunks
    from megaloom.parallel.data_parallel import Segment

    flats = [torch.zeros(8), torch.zeros(8), torch.zeros(8)]
    grads = SimpleNamespace(buckets=[SimpleNamespace(param_data=f) for f in flats])
    segs = [Segment(0, 0, flats[0][:4], None), Segment(1, 0, flats[2][2:6], None), Segment(2, 0, flats[2][6:], None)]
    chunks, gathers = bucket_chunks(grads, segs)
    assert [idx for _, idx in chunks] == [[1, 2], [], [0]]  # buckets 2, 1, 0: the gathers' order
    assert [[k for k, x in enumerate(grads.buckets) if x is b] for b in gathers] == [[2], [1], [0]]
