"""The llava family: the decoder it wraps is unchanged for text, image features land only at <image> positions,
`megaloom train model.preset=llava-tiny` learns the synthetic set, and frozen parts get no gradients, no optimizer
state and keep their values (LLaVA's projector-only stage)."""

from __future__ import annotations

import pytest
import torch

from megaloom.config import ConfigError, load_config
from megaloom.models import Transformer
from megaloom.models.registry import get_family
from megaloom.preflight import preflight
from megaloom.train import train
from megaloom.training.trainer import Trainer

VOCAB, IMAGE_ID = 96, 95


def llava_config(*extra):
    return load_config(None, ["model.preset=llava-tiny", f"model.vocab_size={VOCAB}",
                              f"model.image_token_id={IMAGE_ID}", "train.seq_len=64", *extra])


def rows_with_images(per_image: int):
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, IMAGE_ID, (2, 64), generator=gen)
    tokens[0, 10:10 + per_image] = IMAGE_ID
    tokens[1, 4:4 + per_image] = IMAGE_ID
    tokens[1, 30:30 + per_image] = IMAGE_ID
    images = torch.randn(2, 2, 3, 32, 32, generator=gen)
    return tokens, images, torch.tensor([1, 2])


def test_text_only_forward_is_the_decoders():
    cfg = llava_config()
    torch.manual_seed(0)
    llava = get_family("llava").build(cfg.model)
    text_cfg = load_config(None, ["model.preset=llava-tiny", "model.arch=llama", f"model.vocab_size={VOCAB}"]).model
    decoder = Transformer(text_cfg)
    missing = decoder.load_state_dict({k: v for k, v in llava.state_dict().items()
                                       if not k.startswith(("vision.", "projector."))})
    assert not missing.missing_keys and not missing.unexpected_keys
    tokens = torch.randint(0, IMAGE_ID, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(llava(tokens), decoder(tokens))
        assert torch.equal(llava(tokens[:, :-1], tokens[:, 1:]), decoder(tokens[:, :-1], tokens[:, 1:]))


def test_images_change_only_what_follows_their_tokens():
    cfg = llava_config()
    torch.manual_seed(0)
    model = get_family("llava").build(cfg.model).eval()
    tokens, images, n = rows_with_images(model.tokens_per_image)
    with torch.no_grad():
        a = model(tokens, images=images, n_images=n)
        other = images.clone()
        other[1, 1] += 1.0  # row 1's second image only
        b = model(tokens, images=other, n_images=n)
        unused = images.clone()
        unused[0, 1] += 1.0  # row 0 uses one slot: the second is padding
        c = model(tokens, images=unused, n_images=n)
    changed = (a - b).abs().amax(-1) > 1e-6
    assert not changed[0].any() and not changed[1, :30].any() and changed[1, 30:].all()
    assert torch.equal(a, c)
    with pytest.raises(ValueError, match="<image> tokens"):
        model(tokens, images=images, n_images=torch.tensor([1, 1]))


def test_llava_tiny_learns_the_synthetic_set(tmp_path):
    cfg = load_config(None, ["model.preset=llava-tiny", f"run.dir={tmp_path / 'run'}", "train.steps=16",
                             "train.seq_len=96", "train.global_batch_size=4", "train.micro_batch_size=2",
                             "train.warmup_steps=3", "train.log_every=4", "train.eval_every=0",
                             "train.eval_batches=1", "checkpoint.every=0", "checkpoint.final=false",
                             "data.num_workers=1", "data.synthetic_samples=400", f"data.cache_dir={tmp_path / 'c'}",
                             "run.tensorboard=false"])
    res = train(cfg)
    first, last = res.losses[4], res.losses[16]
    assert last < first - 1.5, (first, last)
    resolved = load_config(tmp_path / "run" / "config.yaml")
    assert resolved.model.image_token_id >= 0 and resolved.data.tokenizer


def test_frozen_parts_get_no_gradients_no_optimizer_state_and_keep_their_values(tmp_path):
    cfg = load_config(None, ["model.preset=llava-tiny", f"run.dir={tmp_path / 'run'}", "train.steps=3",
                             "train.seq_len=96", "train.global_batch_size=2", "train.micro_batch_size=2",
                             "train.warmup_steps=0", "train.log_every=1", "train.eval_every=0",
                             "train.eval_batches=1", "checkpoint.every=0", "checkpoint.final=false",
                             "data.num_workers=0", "data.synthetic_samples=100", f"data.cache_dir={tmp_path / 'c'}",
                             "run.tensorboard=false", "model.freeze=vision,language"])
    trainer = Trainer(cfg).build()
    model, opt = trainer.model, trainer.optimizer
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.fit()
    projector = {n for n, _ in model.named_parameters() if n.startswith("projector.")}
    for n, p in model.named_parameters():
        assert p.grad is None, n
        assert p.requires_grad == (n in projector), n
        assert torch.equal(p, before[n]) != (n in projector), n  # frozen: unchanged; projector: trained
    stateful = {id(p) for p in opt.state}
    assert stateful == {id(p) for n, p in model.named_parameters() if n in projector}
    assert sum(len(g["params"]) for g in opt.param_groups) == len(projector)

    with pytest.raises(ConfigError, match="model.freeze"):
        load_config(None, ["model.preset=llava-tiny", "model.freeze=vision,projector,language"])
    with pytest.raises(ConfigError, match="model.freeze: 'encoder'"):
        load_config(None, ["model.preset=llava-tiny", "model.freeze=encoder"])


def test_context_parallel_and_indivisible_vision_heads_refused_naming_the_setting():
    preflight(llava_config("parallel.pp=2", "train.global_batch_size=4", "train.micro_batch_size=1"), 2)  # runs
    with pytest.raises(ConfigError, match="model.vision_heads=4"):
        preflight(llava_config("parallel.tp=8", "model.n_heads=8", "model.n_kv_heads=8"), 8)
    with pytest.raises(ConfigError, match="parallel.cp=2 with an image encoder"):
        preflight(llava_config("parallel.cp=2"), 2)


def test_generate_answers_about_an_image(tmp_path, capsys):
    from megaloom.cli import main
    from megaloom.data.image_text.synthetic import draw
    from megaloom.generate import generate, image_prompt, load_for_generation

    run = tmp_path / "run"
    train(load_config(None, ["model.preset=llava-tiny", f"run.dir={run}", "train.steps=2", "train.seq_len=96",
                             "train.global_batch_size=2", "train.micro_batch_size=2", "train.warmup_steps=0",
                             "train.eval_every=0", "train.eval_batches=1", "data.num_workers=0",
                             "data.synthetic_samples=100", f"data.cache_dir={tmp_path / 'c'}",
                             "run.tensorboard=false"]))
    image = tmp_path / "shape.png"
    draw(0, 3, 0).save(image)
    model, tok = load_for_generation(run, torch.device("cpu"))
    prompt, images = image_prompt(model, tok, "What is in the image?", [str(image)], torch.device("cpu"))
    assert (prompt == tok.image_id).sum() == model.tokens_per_image and prompt[0, -1] != tok.eod_id
    cached = generate(model, prompt, 8, temperature=0, images=images)
    assert torch.equal(cached, generate(model, prompt, 8, temperature=0, images=images, use_cache=False))
    other = {**images, "images": -images["images"]}
    assert not torch.equal(model(prompt, **images), model(prompt, **other))  # the answer depends on the image

    assert main(["generate", "--run", str(run), "--image", str(image), "--prompt", "What is in the image?",
                 "--temperature", "0", "--max-new-tokens", "8"]) == 0
    answer = capsys.readouterr().out
    assert answer.strip() and "USER:" not in answer


def test_frozen_tower_under_zero3_and_tp_trains_like_one_process_and_resumes(tmp_path):
    """model.freeze under ZeRO-3 (FSDP2 shards the frozen tower too) at tp2 x dp2 under torchrun: the single
    process's losses, and its checkpoint resumes in one process. (The sharded frozen parameters once lost their
    tp layouts, so they were initialised and checkpointed as if whole: refused until then.)"""
    from tests.parallel.test_trainer_parallel import losses, torchrun

    common = ["model.preset=llava-tiny", "train.steps=4", "train.seq_len=96", "train.global_batch_size=4",
              "train.micro_batch_size=1", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1",
              "checkpoint.every=2", "data.num_workers=0", "data.synthetic_samples=100", "run.tensorboard=false",
              "model.freeze=vision", f"data.cache_dir={tmp_path / 'c'}"]
    want = train(load_config(None, [*common, f"run.dir={tmp_path / 'one'}"])).losses
    torchrun(4, [*common, f"run.dir={tmp_path / 'z3'}", "parallel.tp=2", "parallel.zero=3"])
    got = losses(tmp_path / "z3")
    assert sorted(got) == [1, 2, 3, 4]
    for step in got:
        assert abs(got[step] - want[step]) <= 1e-5 * want[step], (step, got[step], want[step])
    ckpt = tmp_path / "z3" / "checkpoints" / "step_00000002"
    res = train(load_config(None, [*common, f"run.dir={tmp_path / 'resumed'}", f"checkpoint.resume={ckpt}"]))
    for step in (3, 4):
        assert abs(res.losses[step] - want[step]) <= 1e-5 * want[step], step


def test_fine_tuning_stage_starts_from_the_projector_stage_weights(tmp_path):
    """LLaVA's two stages by config: projector-only pretraining, then full fine-tuning from its checkpoint (its
    weights, step 0, a fresh optimizer: the first stage's optimizer state covers the projector only)."""
    common = ["model.preset=llava-tiny", "train.seq_len=96", "train.global_batch_size=2", "train.micro_batch_size=2",
              "train.warmup_steps=0", "train.eval_every=0", "train.eval_batches=1", "data.num_workers=0",
              "data.synthetic_samples=100", f"data.cache_dir={tmp_path / 'c'}", "run.tensorboard=false"]
    stage1 = Trainer(load_config(None, [*common, f"run.dir={tmp_path / 's1'}", "train.steps=2",
                                        "model.freeze=vision,language"])).build()
    stage1.fit()
    trained = {n: p.detach().clone() for n, p in stage1.model.named_parameters()}
    ckpt = tmp_path / "s1" / "checkpoints" / "step_00000002"
    stage2 = Trainer(load_config(None, [*common, f"run.dir={tmp_path / 's2'}", "train.steps=2",
                                        f"checkpoint.resume={ckpt}"])).build()
    assert stage2.step == 0 and not stage2.optimizer.state
    for n, p in stage2.model.named_parameters():
        assert torch.equal(p, trained[n]) and p.requires_grad, n
    stage2.fit()
    assert all(p.grad is None for p in stage2.model.parameters())
    assert len(stage2.optimizer.state) == len(list(stage2.model.parameters()))


def test_pipeline_partition_counts_the_image_encoder_on_the_first_stage():
    from megaloom.parallel.pipeline.partition import encoder_block_equivalents, validate_pipeline

    def sizes(*extra):
        cfg = load_config(None, ["model.preset=llava-1.5-8b", "train.micro_batch_size=1",
                                 "train.global_batch_size=8", *extra])
        p = cfg.parallel  # as preflight passes them
        return encoder_block_equivalents(cfg), validate_pipeline(cfg, 1, p.pp_first_stage_layers or None,
                                                                 p.pp_last_stage_layers or None).sizes()

    blocks, split = sizes("train.seq_len=1024", "parallel.pp=8")  # 4 images of 577 patches per 1024-token row
    assert 3 < blocks < 4 and split == [1, 4, 4, 4, 4, 5, 5, 5] and sum(split) == 32
    blocks, split = sizes("train.seq_len=4096", "parallel.pp=4")
    assert 0.5 < blocks < 1 and split == [7, 8, 8, 9]
    assert sizes("train.seq_len=2048", "parallel.pp=4", "data.max_images=1")[1] == [8] * 4  # < half a block
    # explicit counts win; a text model keeps the even split
    assert sizes("train.seq_len=1024", "parallel.pp=8", "parallel.pp_first_stage_layers=4",
                 "parallel.pp_last_stage_layers=4")[1] == [4] * 8
    cfg = load_config(None, ["model.preset=llama3-8b", "parallel.pp=8", "train.micro_batch_size=1",
                             "train.global_batch_size=8", "train.seq_len=1024"])
    assert validate_pipeline(cfg, 1).sizes() == [4] * 8


def test_image_token_resolved_from_the_tokenizer_or_refused():
    from megaloom.training.resolve import resolve_config

    cfg = load_config(None, ["model.preset=llava-tiny"])
    assert resolve_config(cfg, precision="fp32", tokenizer_path="", tokenizer_vocab=100,
                          image_token_id=99).model.image_token_id == 99
    with pytest.raises(ConfigError, match="model.image_token_id=-1"):
        resolve_config(cfg, precision="fp32", tokenizer_path="", tokenizer_vocab=100)


def test_an_moe_decoder_takes_images_too():
    cfg = llava_config("model.moe_every=1", "model.n_experts=4", "model.top_k=2")
    torch.manual_seed(0)
    model = get_family("llava").build(cfg.model)
    tokens, images, n = rows_with_images(model.tokens_per_image)
    loss = model(tokens[:, :-1], tokens[:, 1:], images=images, n_images=n)
    loss.backward()
    assert torch.isfinite(loss) and model.projector.fc1.weight.grad.abs().sum() > 0
    assert model.moe_layers and all(p.grad is not None for p in model.vision.parameters())


def test_image_text_runs_resume_exactly(tmp_path):
    """Stopped after step 5 (newest checkpoint: 4) and started again: steps 5..8 bit-equal to an uninterrupted
    run, so the packed rows and their images are the same for a step whenever it runs."""
    def cfg(run):
        return load_config(None, ["model.preset=llava-tiny", f"run.dir={tmp_path / run}", "train.steps=8",
                                  "checkpoint.every=4", "train.seq_len=96", "train.global_batch_size=2",
                                  "train.micro_batch_size=1", "train.warmup_steps=2", "train.log_every=1",
                                  "train.eval_every=0", "train.eval_batches=1", "data.num_workers=1",
                                  "data.synthetic_samples=100", f"data.cache_dir={tmp_path / 'c'}",
                                  "run.tensorboard=false"])

    ref = train(cfg("a"))
    assert train(cfg("b"), stop_after=5).final_step == 5
    resumed = train(cfg("b"))
    for step in range(5, 9):
        assert resumed.losses[step] == ref.losses[step], step
