"""train.bf16_params through `megaloom train` (dp=2, ZeRO-1, bf16 on CPU): the run trains with bf16 weights and
fp32 master shards, its checkpoint holds the fp32 masters, and a resume continues bit for bit."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.conftest import tiny_overrides

from ..test_trainer_parallel import losses, torchrun


@pytest.mark.slow
def test_bf16_params_train_and_resume_bit_for_bit(small_corpus, tmp_path) -> None:
    base = ["train.steps=5", "checkpoint.every=3", "parallel.zero=1", "train.precision=bf16",
            "train.bf16_params=true"]
    whole = tmp_path / "whole"
    torchrun(2, tiny_overrides(small_corpus, whole, *base))
    first = losses(whole)
    assert sorted(first) == [1, 2, 3, 4, 5]
    # the checkpoint's weights are the fp32 masters, not bf16-rounded copies
    from megaloom.generate import load_for_generation

    model, _ = load_for_generation(whole, torch.device("cpu"))
    w = model.layers["0"].attn.q_proj.weight.detach()
    assert w.dtype == torch.float32 and not torch.equal(w, w.to(torch.bfloat16).float())
    # resume from step 3 (the step-5 checkpoint removed): steps 4 and 5 as the uninterrupted run
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000005")
    (resumed / "checkpoints" / "latest").unlink(missing_ok=True)
    torchrun(2, tiny_overrides(small_corpus, resumed, *base))
    again = losses(resumed)
    assert [again[s] for s in (4, 5)] == [first[s] for s in (4, 5)], (again, first)


@pytest.mark.slow
def test_bf16_params_through_a_pipeline_keep_the_fp32_stream(small_corpus, tmp_path) -> None:
    """pp=2 x dp=2, the weight gradients fused: the embedding's weight is bf16, the residual stream and the stage
    messages stay fp32 (as with fp32 weights; train.bf16_residual makes them bf16): before that, the first stage's
    bf16 output met an fp32 receive buffer and the run stopped. The losses: one process's with bf16 weights within
    bf16 noise (2e-2)."""
    base = ["train.steps=3", "parallel.pp=2", "parallel.zero=1", "train.precision=bf16", "train.bf16_residual=false",
            "train.bf16_params=true", "train.grad_accum_fusion=true"]
    torchrun(4, tiny_overrides(small_corpus, tmp_path / "pp2", *base))
    got = losses(tmp_path / "pp2")
    assert sorted(got) == [1, 2, 3] and all(5.0 < v < 7.0 for v in got.values()), got  # ln(512) = 6.24 at the start
    # the same training as one process with bf16 weights (every master in its optimizer), within bf16 noise
    from megaloom.config import load_config
    from megaloom.train import train

    one = [o for o in base if not o.startswith(("parallel.pp", "parallel.zero"))]
    ref = train(load_config(None, tiny_overrides(small_corpus, tmp_path / "one", *one))).losses
    assert all(abs(got[s] - ref[s]) <= 2e-2 * ref[s] for s in got), (got, ref)


@pytest.mark.slow
def test_bf16_params_with_context_parallelism_match_one_process(small_corpus, tmp_path) -> None:
    """cp=2 (the ring, each rank half of every sequence; zero 0: every fp32 master on both ranks, the buckets
    all-reduced over the cp group), bf16 weights and the fused weight gradients: one process's losses with bf16
    weights within bf16 noise (2e-2)."""
    from megaloom.config import load_config
    from megaloom.train import train

    base = ["train.steps=3", "train.precision=bf16", "train.bf16_params=true", "train.grad_accum_fusion=true"]
    torchrun(2, tiny_overrides(small_corpus, tmp_path / "cp2", *base, "parallel.cp=2"))
    got = losses(tmp_path / "cp2")
    ref = train(load_config(None, tiny_overrides(small_corpus, tmp_path / "one", *base))).losses
    assert sorted(got) == [1, 2, 3] and all(abs(got[s] - ref[s]) <= 2e-2 * ref[s] for s in got), (got, ref)
    assert got != ref  # (a different layout really ran)


@pytest.mark.slow
def test_bf16_params_with_expert_parallelism_match_one_process(small_corpus, tmp_path) -> None:
    """An MoE model at ep=2 x dp=2 of world 2 (each rank half of the experts, ZeRO-1 over dp, the experts' buckets
    over their edp group of 1), bf16 weights set by hand (auto leaves them off for MoE: not measured): one
    process's losses with bf16 weights within bf16 noise (2e-2)."""
    from megaloom.config import load_config
    from megaloom.train import train

    base = ["model.preset=mixtral-tiny", "train.steps=3", "train.precision=bf16", "train.bf16_params=true"]
    torchrun(2, tiny_overrides(small_corpus, tmp_path / "ep2", *base, "parallel.ep=2", "parallel.zero=1"))
    got = losses(tmp_path / "ep2")
    ref = train(load_config(None, tiny_overrides(small_corpus, tmp_path / "one", *base))).losses
    assert sorted(got) == [1, 2, 3] and all(abs(got[s] - ref[s]) <= 2e-2 * ref[s] for s in got), (got, ref)
    assert got != ref  # (a different layout really ran)


def test_bf16_params_in_one_process_keep_every_master_and_resume_bit_for_bit(small_corpus, tmp_path) -> None:
    """One process (parallel.zero=0): bf16 weights, their fp32 gradients in buckets, every fp32 master in the
    optimizer (ShardedOptimizer over every weight whole); the checkpoint holds the masters, a resume continues
    bit for bit, and the losses are those of bf16 autocast over fp32 weights within bf16 noise."""
    from megaloom.config import load_config
    from megaloom.generate import load_for_generation
    from megaloom.train import train

    base = ["train.steps=4", "checkpoint.every=2", "train.precision=bf16"]
    whole = tmp_path / "whole"
    train(load_config(None, tiny_overrides(small_corpus, whole, *base, "train.bf16_params=true")))
    first = losses(whole)
    ref = tmp_path / "ref"
    train(load_config(None, tiny_overrides(small_corpus, ref, *base, "train.bf16_params=false")))
    plain = losses(ref)
    assert sorted(first) == [1, 2, 3, 4] and all(abs(first[s] - plain[s]) <= 2e-2 * plain[s] for s in first)
    model, _ = load_for_generation(whole, torch.device("cpu"))
    w = model.layers["0"].attn.q_proj.weight.detach()
    assert w.dtype == torch.float32 and not torch.equal(w, w.to(torch.bfloat16).float())  # masters, not rounded
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    (resumed / "checkpoints" / "latest").unlink(missing_ok=True)
    train(load_config(None, tiny_overrides(small_corpus, resumed, *base, "train.bf16_params=true")))
    again = losses(resumed)
    assert [again[s] for s in (3, 4)] == [first[s] for s in (3, 4)], (again, first)


def test_a_checkpoint_of_fp32_weights_continues_with_bf16_weights(small_corpus, tmp_path) -> None:
    """A checkpoint written with fp32 weights (train.bf16_params=false, as every checkpoint before it existed)
    loads into a run with bf16 weights: its fp32 values become the optimizer's masters, and the run continues as
    the fp32 one does within bf16 noise (the same data, the same optimizer state)."""
    from megaloom.config import load_config
    from megaloom.train import train

    base = ["train.steps=4", "checkpoint.every=2", "train.precision=bf16"]
    old = tmp_path / "old"
    fp32 = train(load_config(None, tiny_overrides(small_corpus, old, *base, "train.bf16_params=false")))
    ckpt = old / "checkpoints" / "step_00000002"
    new = train(load_config(None, tiny_overrides(small_corpus, tmp_path / "new", *base, "train.bf16_params=true",
                                                 f"checkpoint.resume={ckpt}")))
    assert sorted(new.losses) == [3, 4], new.losses  # resumed after step 2
    for step in (3, 4):
        assert abs(new.losses[step] - fp32.losses[step]) <= 2e-2 * fp32.losses[step], (step, new.losses, fp32.losses)
