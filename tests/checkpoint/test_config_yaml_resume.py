"""Every config.yaml megaloom writes trains and resumes as `megaloom train --config RUN/config.yaml` (issue 49):
each family's tiny preset trains one step, then resumes from the config.yaml it wrote with train.steps raised.
A resolved default is never written back in a form that validation (or the checkpoint's shape check) refuses."""

from __future__ import annotations

import json

import pytest

from megaloom.cli import main
from megaloom.config import load_config

# Presets of every family (and every attention/router kind the tiny presets cover), each cheap at this size.
PRESETS = ["tiny", "tiny-gpt2", "qwen3-tiny", "mixtral-tiny", "deepseek-v3-tiny", "gemma-tiny", "bert-tiny",
           "t5-tiny", "llava-tiny"]
SMALL = ["model.n_layers=2", "train.seq_len=32", "train.global_batch_size=2", "train.micro_batch_size=1",
         "train.warmup_steps=1", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1",
         "checkpoint.every=1", "data.num_workers=0", "run.tensorboard=false"]


@pytest.mark.parametrize("preset", PRESETS)
def test_a_written_config_yaml_trains_on_with_train_config(small_corpus, tmp_path, preset):
    run = tmp_path / "run"
    data = (["data.synthetic_samples=40", f"data.cache_dir={tmp_path / 'cache'}"] if preset.startswith("llava")
            else [f"data.paths={small_corpus['prefix']}", f"data.tokenizer={small_corpus['tokenizer']}"])
    assert main(["train", f"model.preset={preset}", f"run.dir={run}", "train.steps=1", *SMALL, *data]) == 0
    written = run / "config.yaml"
    load_config(written)  # validates as written
    assert main(["train", "--config", str(written), "train.steps=2"]) == 0
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2], steps  # the second start resumed from step 1's checkpoint, not from scratch
    assert (run / "checkpoints" / "step_00000002").is_dir()
    load_config(written)  # and the config.yaml the resumed run wrote validates too


def _hf_configs():
    """Tiny random configs of each HF family megaloom imports (vocab 512: the small corpus's tokenizer fits)."""
    t = pytest.importorskip("transformers")
    common = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_hidden_layers=2, vocab_size=512,
                  max_position_embeddings=64)
    cfgs = {
        "llama": lambda: t.LlamaConfig(**common, num_key_value_heads=2),
        "qwen3": lambda: t.Qwen3Config(**common, num_key_value_heads=2, head_dim=16),
        "gpt2": lambda: t.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=512),
        "mixtral": lambda: t.MixtralConfig(**common, num_key_value_heads=2, num_local_experts=4),
        # Qwen3MoeConfig's defaults, norm_topk_prob=false among them (imported since issue 49)
        "qwen3_moe": lambda: t.Qwen3MoeConfig(**common, num_key_value_heads=2, head_dim=16, num_experts=4,
                                              num_experts_per_tok=2, moe_intermediate_size=32),
        "gemma2": lambda: t.Gemma2Config(**common, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                                         sliding_window=16, attn_logit_softcapping=None,
                                         final_logit_softcapping=None),
        "bert": lambda: t.BertConfig(**{**common, "vocab_size": 576}),  # + [MASK] [CLS] [SEP] the BPE lacks
        "t5": lambda: t.T5Config(vocab_size=576, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4,
                                 feed_forward_proj="gated-gelu"),
        # DeepSeek-V3 (issue 49's report): latent attention resolved head_dim to d_model / n_heads, written back
        "deepseek_v3": lambda: t.DeepseekV3Config(**common, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32,
                                                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                                                  n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
                                                  moe_intermediate_size=16, first_k_dense_replace=1,
                                                  rope_scaling=None),
    }
    return t, cfgs


HF_FAMILIES = ["llama", "qwen3", "gpt2", "mixtral", "qwen3_moe", "gemma2", "bert", "t5", "deepseek_v3"]


@pytest.mark.filterwarnings("ignore:.*has no tokenizer.json")
@pytest.mark.parametrize("family", HF_FAMILIES)
def test_an_imported_hf_checkpoint_fine_tunes_with_train_config(small_corpus, tmp_path, family):
    """`megaloom convert --from-hf HF RUN`, then `megaloom train --config RUN/config.yaml data.paths=...` twice: the
    step-0 checkpoint loads, and the config.yaml the first start wrote resumes."""
    t, cfgs = _hf_configs()
    import torch

    torch.manual_seed(0)
    hf_cfg = cfgs[family]()
    model_cls = {"bert": t.BertForMaskedLM, "t5": t.T5ForConditionalGeneration}.get(family, t.AutoModelForCausalLM)
    model = model_cls.from_config(hf_cfg) if model_cls is t.AutoModelForCausalLM else model_cls(hf_cfg)
    model.save_pretrained(tmp_path / "hf")
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(run)]) == 0
    assert not (run / ".lock").exists()
    if family == "qwen3_moe":
        assert load_config(run / "config.yaml").model.moe_norm_topk is False
    data = [f"data.paths={small_corpus['prefix']}", f"data.tokenizer={small_corpus['tokenizer']}"]
    small = [s for s in SMALL if not s.startswith("model.")]
    for steps in (1, 2):
        assert main(["train", "--config", str(run / "config.yaml"), f"train.steps={steps}", *small, *data]) == 0
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2], steps


def test_a_config_yaml_of_an_older_megaloom_with_mla_head_dim_loads(tmp_path):
    """Before issue 49 a latent-attention run's config.yaml carried model.head_dim = d_model / n_heads (resolved
    from 0); it reads back as 0 did, and a checkpoint saved with it loads into a model of head_dim 0."""
    from megaloom.checkpoint.store import check_compatible
    from megaloom.config import ConfigError

    old = load_config(None, ["model.preset=deepseek-v3-tiny"]).to_yaml().replace("head_dim: 0\n", "head_dim: 32\n", 1)
    (tmp_path / "config.yaml").write_text(old)
    cfg = load_config(tmp_path / "config.yaml")
    assert cfg.model.head_dim == 32 and cfg.model.d_model // cfg.model.n_heads == 32
    check_compatible({**cfg.model.__dict__, "n_kv_heads": 4}, {**cfg.model.__dict__, "head_dim": 0, "n_kv_heads": 0})
    with pytest.raises(ConfigError, match="model.head_dim=48 with model.attention=mla"):
        load_config(None, ["model.preset=deepseek-v3-tiny", "model.head_dim=48"])


def test_a_failed_start_leaves_no_lock_and_a_run_keeps_its_own(small_corpus, tmp_path, capsys):
    """A start refused after taking the lock (here: a checkpoint of another shape) removes the .lock it created;
    a directory a run used keeps its .lock (it names the run), also through a later failed start; config.yaml stays
    the run's (issue 49: the refused start rewrote it, and the next start failed on what it wrote)."""
    run = tmp_path / "run"
    data = [f"data.paths={small_corpus['prefix']}", f"data.tokenizer={small_corpus['tokenizer']}"]
    assert main(["train", "model.preset=tiny", f"run.dir={run}", "train.steps=1", *SMALL, *data]) == 0
    assert (run / ".lock").is_file()
    (run / ".lock").unlink()  # as a converted run directory is: a checkpoint, never a run's lock
    capsys.readouterr()
    written, requested = (run / "config.yaml").read_text(), (run / "requested.yaml").read_text()
    assert main(["train", "--config", str(run / "config.yaml"), "model.n_layers=3", "train.steps=2"]) != 0
    assert "checkpoint is incompatible" in capsys.readouterr().err
    assert not (run / ".lock").exists()
    assert (run / "config.yaml").read_text() == written  # the refused settings are not the run's config.yaml
    assert (run / "requested.yaml").read_text() == requested  # nor its requested.yaml
    assert main(["train", "--config", str(run / "config.yaml"), "train.steps=2"]) == 0
    assert (run / ".lock").is_file()
    assert main(["train", "--config", str(run / "config.yaml"), "model.n_layers=3", "train.steps=3"]) != 0
    assert (run / ".lock").is_file()  # not this start's to remove


def test_a_lock_file_removed_by_its_failed_holder_is_not_taken(tmp_path):
    """A taker that opened .lock just before a failed start removed it locks a file no longer there: it takes the
    new one, so a third run is refused rather than running beside it."""
    import fcntl

    from megaloom.resilience import run_lock

    run = tmp_path / "r"
    run.mkdir()
    stale = open(run / ".lock", "a+")  # noqa: SIM115 (the taker's handle, opened before the removal)
    (run / ".lock").unlink()
    fcntl.flock(stale.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # locks the removed file: no one else can
    f, created = run_lock._try_lock(run)
    assert f is not None and created and run_lock._still_linked(f, run / ".lock")
    f.close()
    stale.close()


def test_every_presets_resolved_config_reads_back_as_written(tmp_path):
    """Every preset, the large ones too: the config a run would write (every "auto" size resolved, as
    `resolve_config` does before config.yaml) validates when read back and reads back equal."""
    from megaloom.models.presets import PRESETS
    from megaloom.training.resolve import resolve_config

    for preset in PRESETS:
        seq = 1024 if PRESETS[preset].get("vision_layers") else 64  # a whole image (576 tokens) fits a row
        cfg = load_config(None, [f"model.preset={preset}", f"train.seq_len={seq}"])
        resolved = resolve_config(cfg, precision="fp32", tokenizer_path="", tokenizer_vocab=500, image_token_id=7)
        path = tmp_path / f"{preset}.yaml"
        path.write_text(resolved.to_yaml())
        assert load_config(path).to_dict() == resolved.to_dict(), preset
