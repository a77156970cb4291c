"""Hugging Face interchange: a megaloom checkpoint -> an HF model directory, and back into a megaloom run.

    to_hf(run_or_ckpt_dir, out_dir)   config.json + model.safetensors (+ tokenizer.json) for transformers'
                                      AutoModelForCausalLM.from_pretrained (the family's class, e.g.
                                      LlamaForCausalLM, GPT2LMHeadModel, Qwen3ForCausalLM); a LoRA run's
                                      adapters merged into the weights (convert/peft.py writes them apart)
    from_hf(hf_dir, out_run_dir)      run_dir/config.yaml + checkpoints/step_00000000 (model only), so
                                      `megaloom train --config out_run_dir/config.yaml` fine-tunes it

Both directions read no pickles: megaloom checkpoints through DCP (checksums verified first), HF weights
through safetensors. What is family-specific (names, layouts, config fields, refused settings) is the family's
HF mapping, ``get_family(model.arch).hf`` (megaloom/models/<family>/hf.py); the family of an HF directory is
the one whose mapping reads its config.json's model_type. See hf_names.py, hf_config.py, docs/checkpoints.md.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from pathlib import Path

import torch
import yaml

from megaloom.checkpoint.safe_metadata import SafeLoadPlanner, safe_load
from megaloom.checkpoint.store import (
    CheckpointError,
    check_compatible,
    find_checkpoints,
    save_checkpoint,
    verify_checkpoint,
)
from megaloom.config import Config, ConfigError, LoraConfig, ModelConfig, config_from_dict, validate
from megaloom.convert.errors import ConversionError
from megaloom.convert.hf_config import DTYPES, hf_config, model_settings
from megaloom.convert.hf_names import from_hf_names, to_hf_names
from megaloom.convert.peft_format import read_adapter
from megaloom.convert.safetensors_io import DEFAULT_SHARD_BYTES, INDEX, SINGLE, load_weights, save_weights
from megaloom.models.lora import merge_lora
from megaloom.models.presets import PRESETS
from megaloom.models.registry import get_family

# model.* keys added after checkpoints recorded the model in state.json; their defaults are what those checkpoints
# computed (plain RoPE, grouped-query attention, MoE routing without groups or scaling, no dense first blocks, no
# multi-token prediction), so a state.json without them still describes its model.
ADDED_LATER = {"lora", "rope_scaling", "rope_factor", "rope_original_max_len", "rope_low_freq_factor",
               "rope_high_freq_factor", "rope_beta_fast", "rope_beta_slow", "rope_attention_factor", "rope_truncate",
               "attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
               "rope_mscale_all_dim", "first_dense_layers", "n_expert_groups", "topk_groups", "routed_scaling_factor",
               "mtp_depth"}

# Files beside an HF tokenizer.json that `from_hf` copies into the run with it.
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def to_hf(run_or_ckpt_dir: str | Path, out_dir: str | Path, show_progress: bool = True, dtype: str = "float32",
          max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Export a run's newest good checkpoint (or the given checkpoint directory) as an HF model directory.
    Returns out_dir. dtype: float32 (exact), bfloat16 or float16."""
    if dtype not in DTYPES:
        raise ConversionError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}.")
    ckpt, run_dir, state = _resolve_checkpoint(Path(run_or_ckpt_dir))
    model_cfg = _model_config(run_dir, state, ckpt)
    tokenizer, eos_id = _tokenizer_of_run(run_dir)
    config_json = hf_config(model_cfg, dtype, eos_id)  # refuses what the family's HF class cannot express
    sd = _read_model_tensors(ckpt, model_cfg)
    if model_cfg.lora.rank > 0:  # a LoRA run: the adapters folded into the weights (`--to-peft` writes them apart)
        sd = merge_lora(sd, model_cfg.lora)
    tensors = to_hf_names(model_cfg, sd)
    tensors = {k: v.to(DTYPES[dtype]) for k, v in tensors.items()}

    out = Path(out_dir)
    _refuse_existing(out, ("config.json", SINGLE, INDEX), "the HF output directory")
    out.mkdir(parents=True, exist_ok=True)
    save_weights(tensors, out, max_shard_bytes, show_progress)
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / "tokenizer.json")
        # PreTrainedTokenizerFast reads tokenizer.json; this file tells AutoTokenizer to use it.
        tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_cfg.max_seq_len}
        if eos_id is not None:  # config.json's bos/eos_token_id: the end-of-document token, as the tokenizer spells it
            eod = _token_text(tokenizer, eos_id)
            tok_cfg.update(bos_token=eod, eos_token=eod)
        # A chat fine-tune: apply_chat_template formats prompts as training rendered them (the template, and the
        # special tokens it reads, e.g. Llama 3's bos_token <|begin_of_text|>, not the end-of-document token).
        tok_cfg.update(_chat_template_of_run(run_dir, tokenizer))
        (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    # config.json last: a directory with a config.json is a finished export
    (out / "config.json").write_text(json.dumps(config_json, indent=2))
    return out


def from_hf(hf_dir: str | Path, out_run_dir: str | Path, peft_dir: str | Path | None = None) -> Path:
    """Import an HF model directory (a model_type some family's HF mapping reads, e.g. LlamaForCausalLM,
    GPT2LMHeadModel, Qwen3ForCausalLM) as a new megaloom run. Returns the checkpoint. ``peft_dir``: a PEFT LoRA
    adapter trained on that model, imported with it (model.lora from its adapter_config.json; convert/peft_format.py).

    The checkpoint is model-only (no optimizer state, no RNG): training from it starts the optimizer fresh at
    step 0. tokenizer.json, if present, is copied into the run and set as data.tokenizer (with tokenizer_config.json,
    special_tokens_map.json and chat_template.jinja where the HF directory has them: its chat template)."""
    src = Path(hf_dir)
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise ConversionError(f"{src}: no config.json; pass a directory written by transformers' save_pretrained.")
    try:
        hf_cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ConversionError(f"{cfg_path}: not valid JSON ({e}).") from e
    settings = model_settings(hf_cfg, str(cfg_path))

    run_dir = Path(out_run_dir).resolve()
    _refuse_existing(run_dir, ("config.yaml", "checkpoints"), "the output run directory")
    cfg = _run_config(settings, run_dir, str(cfg_path))
    tensors = from_hf_names(cfg.model, load_weights(src), str(src))
    if peft_dir is not None:
        lora, adapters = read_adapter(peft_dir, cfg.model, tensors)
        cfg.model.lora = LoraConfig(**lora)
        try:
            validate(cfg)
        except ConfigError as e:
            raise ConversionError(f"--peft {peft_dir}: {e}") from e
        tensors.update(adapters)
    model = get_family(cfg.model.arch).build(cfg.model)  # the family's module (t5: encoder-decoder)
    try:
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as e:  # shapes that disagree with config.json (or with adapter_config.json's r)
        raise ConversionError(f"{src}{f' with --peft {peft_dir}' if peft_dir else ''}: the weights do not match "
                              f"config.json{' and adapter_config.json' if peft_dir else ''} ({e}).") from e

    run_dir.mkdir(parents=True, exist_ok=True)
    if (src / "tokenizer.json").is_file():
        shutil.copyfile(src / "tokenizer.json", run_dir / "tokenizer.json")
        cfg.data.tokenizer = str(run_dir / "tokenizer.json")
        for name in TOKENIZER_SIDE_FILES:  # its chat template and special tokens: data.chat_template=auto reads them
            if (src / name).is_file():
                shutil.copyfile(src / name, run_dir / name)
    else:  # training would otherwise fall back to megaloom's default tokenizer: other token ids
        warnings.warn(f"{src} has no tokenizer.json; set data.tokenizer in {run_dir / 'config.yaml'} to the "
                      "model's tokenizer before fine-tuning", stacklevel=2)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    run_state = {"consumed_samples": 0, "model": dataclasses.asdict(cfg.model), "imported_from": str(src.resolve())}
    return save_checkpoint(run_dir / "checkpoints", 0, model, None, run_state, keep=cfg.checkpoint.keep)


def _refuse_existing(path: Path, names: tuple[str, ...], what: str) -> None:
    found = [n for n in names if (path / n).exists()]
    if found:
        raise ConversionError(f"{what} {path} already holds {', '.join(found)}; choose a new directory or remove "
                              "them first (nothing is overwritten).")


def _resolve_checkpoint(path: Path) -> tuple[Path, Path, dict]:
    """(checkpoint dir, run dir, its verified state.json) for a run directory (the newest checkpoint that
    verifies, as resume picks it) or a checkpoint directory."""
    if not path.is_dir():
        raise ConversionError(f"{path}: not a directory; pass a run directory or run_dir/checkpoints/step_N.")
    if (path / "manifest.json").is_file() or path.name.startswith("step_"):
        return path, path.parent.parent, verify_checkpoint(path)
    candidates = find_checkpoints(path / "checkpoints")
    if not candidates:
        raise ConversionError(f"{path}: no checkpoints in {path / 'checkpoints'}; pass a run directory that has "
                              "saved at least one checkpoint, or a checkpoint directory.")
    errors = []
    for c in candidates:
        try:
            state = verify_checkpoint(c)
            if errors:
                warnings.warn(f"newer checkpoints are unusable ({'; '.join(errors)}); exporting {c}", stacklevel=3)
            return c, path, state
        except CheckpointError as e:
            errors.append(str(e))
    raise ConversionError(f"{path}: no checkpoint verifies: {'; '.join(errors)}")


def _model_config(run_dir: Path, state: dict, ckpt: Path) -> ModelConfig:
    """The model shape from run_dir/config.yaml (cross-checked with the checkpoint's state.json), or from
    state.json alone when the run's config.yaml is not there."""
    cfg_file = run_dir / "config.yaml"
    if cfg_file.is_file():
        try:
            m = config_from_dict(yaml.safe_load(cfg_file.read_text()) or {}).model
        except ConfigError as e:
            raise ConversionError(f"{cfg_file}: {e}") from e
        if "model" in state:
            check_compatible(state["model"], dataclasses.asdict(m))
        return m
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    saved = state.get("model") or {}
    if set(saved) >= fields - {"preset"} - ADDED_LATER:
        values = {k: v for k, v in saved.items() if k in fields}
        if isinstance(values.get("lora"), dict):  # state.json spells the sub-section as a mapping
            values["lora"] = LoraConfig(**values["lora"])
        return ModelConfig(**values)
    raise ConversionError(f"{ckpt}: the model settings are unknown: {cfg_file} is missing and state.json has no "
                          "complete 'model' section. Pass the run directory (run_dir/checkpoints/step_N's run_dir "
                          "must hold config.yaml).")


def _read_model_tensors(ckpt: Path, m: ModelConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's model tensors, full size, under megaloom names (fp32, as training keeps them)."""
    with torch.device("meta"):  # names and shapes only: no memory, no init
        meta = get_family(m.arch).build(m).state_dict()
    template = {"model": {k: torch.empty(v.shape, dtype=v.dtype) for k, v in meta.items()}}
    try:
        with warnings.catch_warnings():  # DCP's "assuming a single process" notice: intended here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            safe_load(template, ckpt, SafeLoadPlanner(), no_dist=True)  # unpickles nothing arbitrary
    except CheckpointError as e:  # a forged .metadata or value: refused in one line
        raise ConversionError(str(e)) from e
    except Exception as e:  # DCP reports missing keys / shape mismatches as generic errors
        raise ConversionError(f"{ckpt}: its tensors do not match the model settings of the run ({e}).") from e
    return template["model"]


def _token_text(tokenizer_json: Path, token_id: int) -> str:
    from tokenizers import Tokenizer as HFTokenizer

    return HFTokenizer.from_file(str(tokenizer_json)).id_to_token(token_id)


def _tokenizer_of_run(run_dir: Path) -> tuple[Path | None, int | None]:
    """The run's tokenizer.json (data.tokenizer) and its end-of-document id, if the file is there."""
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file():
        return None, None
    path = Path((yaml.safe_load(cfg_file.read_text()) or {}).get("data", {}).get("tokenizer") or "")
    if not path.name or not path.is_file():
        return None, None
    from megaloom.data.errors import DataError
    from megaloom.data.tokenizer import Tokenizer

    try:
        return path, Tokenizer.from_file(path).eod_id
    except DataError:
        return path, None


def _chat_template_of_run(run_dir: Path, tokenizer: Path) -> dict[str, str]:
    """tokenizer_config.json entries of a data.format=chat run: ``chat_template`` (the jinja source of the
    template it trained with; built-ins have one too) and the special tokens the template read; {} otherwise."""
    data = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("data", {})
    if data.get("format") != "chat":
        return {}
    from megaloom.data.chat.templates import resolve_template, special_tokens
    from megaloom.data.tokenizer import Tokenizer

    vocab = Tokenizer.from_file(tokenizer).hf.get_vocab()
    specials = {k: v for k, v in special_tokens(tokenizer.parent, vocab).items() if v}
    return {**specials, "chat_template": resolve_template(data.get("chat_template", "auto"), str(tokenizer),
                                                          vocab).source}


def _run_config(settings: dict, run_dir: Path, where: str) -> Config:
    """A full run config: the preset the family's mapping names, overridden by every model field of the HF config."""
    cfg = Config()
    for k, v in PRESETS[settings["preset"]].items():
        setattr(cfg.model, k, v)
    for k, v in settings.items():
        setattr(cfg.model, k, v)
    cfg.run.dir = str(run_dir)
    cfg.train.seq_len = min(cfg.train.seq_len, cfg.model.max_seq_len)
    try:
        validate(cfg)
    except ConfigError as e:
        raise ConversionError(f"{where}: the model it describes is not a valid megaloom model: {e}") from e
    return cfg
