"""Preflight: every refusal of a config that needs no process group, data or model, before any heavy work.

`preflight` runs first of all (it needs only the world size; `preflight_launch` runs it, and checks the data
files exist (conversation files: every line parses), in the process that `megaloom train --nproc N` starts
torchrun from); `preflight_vocab` is its one check that needs the tokenizer, run as soon as the tokenizer is known
and before the model is built. `load_config`'s `validate()` has already checked each value on its own; these are the
checks of how values fit together with the world size, the pipeline partition and this build's features.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from megaloom import accelerator
from megaloom.config import Config, ConfigError, ModelConfig
from megaloom.data.chat.settings import check_chat_config
from megaloom.models.registry import get_family
from megaloom.parallel.context import check_context
from megaloom.parallel.mesh import validate_layout
from megaloom.parallel.pipeline.partition import Partition, validate_pipeline


@dataclass(frozen=True)
class Checked:
    """What preflight established: the parallel sizes (tp, pp, dp, cp, ep, world) and the pipeline partition."""
    sizes: dict[str, int]
    partition: Partition | None  # the layers of each pipeline stage (parallel.pp > 1), else None


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_world_size_from_env() -> int:
    """The processes of this job on this node (torchrun's LOCAL_WORLD_SIZE; 1 outside torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def preflight(cfg: Config, world_size: int, local_world_size: int | None = None) -> Checked:
    """Refuse what cannot run, before any process group, data or model exists; return the layout.
    ``local_world_size``: the job's processes on this node (default: torchrun's LOCAL_WORLD_SIZE, else 1)."""
    check_device(cfg, local_world_size_from_env() if local_world_size is None else local_world_size)
    refuse_unbuilt(cfg)
    sizes = validate_layout(cfg, world_size)
    partition = validate_pipeline(cfg, sizes["dp"], cfg.parallel.pp_first_stage_layers or None,
                                  cfg.parallel.pp_last_stage_layers or None) if cfg.parallel.pp > 1 else None
    if cfg.parallel.zero == 3 and cfg.parallel.pp > 1:
        raise ConfigError("parallel.zero=3 together with parallel.pp>1 is not available (each micro-batch would "
                          "gather every stage's parameters again; ZeRO-1/2 shard the optimizer state and gradients "
                          "of a stage); use parallel.zero=1 or 2 with pipelines.")
    if cfg.parallel.zero and sizes["dp"] == 1:
        raise ConfigError(f"parallel.zero={cfg.parallel.zero} shards over data-parallel ranks, but dp=1 (world "
                          f"{sizes['world']} = tp*pp*cp); set parallel.zero=0 or run more processes.")
    return Checked(sizes=sizes, partition=partition)


def check_device(cfg: Config, local_world_size: int) -> None:
    """train.device=TYPE:N with several processes on a node puts all of them on device N (NCCL then fails with
    "Duplicate GPU detected", or they share one device's memory): refused, naming the fix, for every accelerator
    type. One process per node (multi-node, --nproc-per-node 1) may pick its device so. Then the type itself:
    refused where this torch does not know it (`accelerator.check_type`; whether this machine has one is asked
    when the rank picks its device, `accelerator.check`, still before any process group, data or model)."""
    d = cfg.train.device
    kind, _, index = d.partition(":")
    if index and local_world_size > 1:
        cuda = accelerator.is_cuda(kind)
        noun = "GPU" if cuda else f"{kind} device"
        symptom = ' (NCCL: "Duplicate GPU detected")' if cuda else ""
        env = accelerator.visible_devices_env(kind)
        restrict = f" (restrict the {noun}s used with {env})" if env else ""
        raise ConfigError(f"train.device={d} with {local_world_size} processes on this node would put every rank on "
                          f"{noun} {index}{symptom}; set train.device={kind} (or auto) so that each rank takes the "
                          f"{noun} of its local rank{restrict}.")
    accelerator.check_type(d)


def preflight_launch(cfg: Config, world_size: int) -> Checked:
    """`megaloom train --nproc N` in the launching process, before torchrun starts any rank: `preflight` at the
    job's world size, and the data files and tokenizer exist (opening a token file's index validates its header;
    no data is read). A refusal here prints once, not once per rank."""
    from pathlib import Path

    from megaloom.data.errors import DataError
    from megaloom.data.indexed import IndexedTokens

    checked = preflight(cfg, world_size, local_world_size=world_size)  # --nproc N: N processes on this node
    chat = cfg.data.format == "chat"
    if chat:  # every conversation line parses: a malformed one is refused here, once
        from megaloom.data.chat.records import check_chat_files

        check_chat_files(cfg.data.paths, cfg.data.chat_column, cfg.data.chat_split)
    else:
        for prefix in cfg.data.paths:
            IndexedTokens(prefix)
    if cfg.data.tokenizer and not Path(cfg.data.tokenizer).expanduser().is_file():
        raise DataError(f"tokenizer file {cfg.data.tokenizer} does not exist; set data.tokenizer to a tokenizer.json "
                        "(or leave it empty to use the default tokenizer)")
    if cfg.data.paths and not chat:  # token files made by another tokenizer: refused here once, not by every rank
        from megaloom.data.corpus import cache_root
        from megaloom.data.dataset import resolve_sources

        resolve_sources(cfg.data, cache_root(cfg.data.cache_dir))
    return checked


def preflight_vocab(m: ModelConfig, tokenizer_vocab: int) -> None:
    """The tokenizer's ids must fit the embedding: model.vocab_size is 0 (follow the tokenizer) or large enough."""
    if m.vocab_size and tokenizer_vocab > m.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer_vocab} tokens but model.vocab_size={m.vocab_size}; set "
                          f"model.vocab_size>={tokenizer_vocab} (or 0 to follow the tokenizer).")


def refuse_unbuilt(cfg: Config) -> None:
    """Say plainly which parallel features this build does not have yet, instead of ignoring the setting."""
    p = cfg.parallel
    if p.ep > 1 and not cfg.model.moe_every:
        raise ConfigError(f"parallel.ep={p.ep} splits MoE experts, but this model has none (model.moe_every=0); "
                          "set parallel.ep=1 or choose an MoE preset (e.g. model.preset=mixtral-tiny).")
    check_context(cfg)
    check_chat_config(cfg)
    objective = get_family(cfg.model.arch).objective  # an encoder's objective refuses what it cannot read
    if objective is not None:
        objective.check(cfg)
    m = cfg.model
    if get_family(m.arch).reads_images(m):
        refuse_unbuilt_vision(cfg)
    if m.mtp_depth:
        refuse_unbuilt_mtp(cfg)
    if m.lora.rank > 0:
        refuse_unbuilt_lora(cfg)
    if p.cp > 1 and m.moe_every and (m.aux_loss_weight or m.capacity_factor):
        # Both are functions of the whole sequence's routing statistics, which a cp rank does not see.
        raise ConfigError(f"parallel.cp={p.cp} with an MoE load-balancing loss (model.aux_loss_weight="
                          f"{m.aux_loss_weight}) or capacity dropping (model.capacity_factor={m.capacity_factor}) is "
                          "not available yet: each cp rank sees only its part of the sequence; set both to 0 (the "
                          "aux-loss-free bias, model.aux_free_bias_rate, works with cp).")


def refuse_unbuilt_mtp(cfg: Config) -> None:
    """Multi-token prediction (model.mtp_depth): what it does not run with yet."""
    p, m = cfg.parallel, cfg.model
    if p.cp > 1:
        raise ConfigError(f"model.mtp_depth={m.mtp_depth} with parallel.cp={p.cp} is not available yet: its modules "
                          "read the tokens k places ahead, which under context parallelism live on other ranks; set "
                          "parallel.cp=1 (or model.mtp_depth=0).")
    if cfg.data.format != "tokens":
        raise ConfigError(f"model.mtp_depth={m.mtp_depth} with data.format={cfg.data.format}: multi-token prediction "
                          "reads the tokens ahead from the labels, which chat data masks (-100 outside the "
                          "assistant's turns); use data.format=tokens (or model.mtp_depth=0).")
    if m.lora.rank > 0:
        raise ConfigError(f"model.mtp_depth={m.mtp_depth} with model.lora.rank={m.lora.rank} is not available yet: "
                          "the adapters go on the model's blocks, so the prediction modules would train frozen; set "
                          "model.mtp_depth=0 for a LoRA fine-tune.")


def refuse_unbuilt_lora(cfg: Config) -> None:
    """model.lora: the layouts its adapters do not support yet, each named with the fix."""
    p, r = cfg.parallel, cfg.model.lora.rank
    if cfg.model.attention == "mla":
        raise ConfigError(f"model.lora.rank={r} with model.attention=mla is not available yet (the adapters know the "
                          "q/k/v/o projections of grouped-query attention, not latent attention's); set "
                          "model.lora.rank=0.")
    if p.async_tp is True and p.tp > 1 and cfg.train.compile is not True:
        raise ConfigError(f"model.lora.rank={r} with parallel.async_tp=true in eager mode is not available yet (the "
                          "ring regions hand their linears a stand-in of the gathered input, which the adapters would "
                          "read); set parallel.async_tp=false or auto, or train.compile=true (the compiled route).")


def refuse_unbuilt_vision(cfg: Config) -> None:
    """A model with an image encoder (llava): what its layouts do not support yet."""
    p, m = cfg.parallel, cfg.model
    if p.cp > 1:
        raise ConfigError(f"parallel.cp={p.cp} with an image encoder (model.vision_layers={m.vision_layers}): image "
                          "features are not split over context-parallel ranks in this build; set parallel.cp=1.")
    if m.vision_heads % p.tp:
        raise ConfigError(f"parallel.tp={p.tp} does not divide model.vision_heads={m.vision_heads} (each tp rank "
                          "runs whole heads of the image encoder too); choose a tp that divides both head counts.")
