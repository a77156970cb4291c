"""The resolved config: every "auto" value filled in, as a new object, before run.dir/config.yaml is written.

Resolved here: model.vocab_size (0: the tokenizer's, padded), model.n_kv_heads (0: n_heads), model.head_dim
(0: d_model / n_heads), model.ffn_dim (0: the architecture's rule), train.precision (auto: by device),
data.tokenizer (empty: the default tokenizer's path) and train.micro_batch_size (0: the largest that the memory
plan fits). The config given to `megaloom.train.train` is never changed, and nothing changes the resolved one
after config.yaml is written.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch

from megaloom import accelerator
from megaloom.config import Config, ConfigError
from megaloom.models.registry import reads_images
from megaloom.observe.log import get_logger
from megaloom.parallel import comm
from megaloom.planning.memory_fit import auto_micro_batch, choose_recompute_casts
from megaloom.planning.memory_plan import GB

# The model shape's "auto" sizes (a module of their own, which the memory plan uses too); these names stay here.
from megaloom.planning.shape import resolve_model_shape as resolve_model_shape
from megaloom.planning.shape import resolved_model as resolved_model
from megaloom.planning.shape import vocab_pad_multiple as vocab_pad_multiple
from megaloom.runtime import Runtime

log = get_logger(__name__)


def resolve_config(cfg: Config, *, precision: str, tokenizer_path: str | Path, tokenizer_vocab: int,
                   image_token_id: int | None = None) -> Config:
    """A new Config: `cfg` with the model shape, precision and tokenizer path resolved (`cfg` is not changed).
    train.micro_batch_size=0 stays 0 here: its choice needs this resolved shape (`with_micro_batch`).
    ``image_token_id``: the tokenizer's <image> token, for model.image_token_id=-1 of a model with images."""
    cfg = copy.deepcopy(cfg)
    model = resolved_model(cfg.model, tokenizer_vocab, vocab_pad_multiple(cfg))
    if reads_images(model) and model.image_token_id < 0:
        if image_token_id is None:
            raise ConfigError("model.image_token_id=-1 asks for the tokenizer's <image> token, but the tokenizer has "
                              "none; set model.image_token_id to the id of the image placeholder token")
        model = dataclasses.replace(model, image_token_id=image_token_id)
    return dataclasses.replace(
        cfg,
        model=model,
        train=dataclasses.replace(cfg.train, precision=precision),
        data=dataclasses.replace(cfg.data, tokenizer=cfg.data.tokenizer or _resolved_path(tokenizer_path)))


def _resolved_path(path: str | Path) -> str:
    """An absolute path; an empty one (a dry run's synthetic tokens come from no tokenizer file) stays empty."""
    return str(Path(path).resolve()) if str(path) else ""


def with_micro_batch(cfg: Config, micro_batch_size: int) -> Config:
    """A new Config with train.micro_batch_size set."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=micro_batch_size))


def _budget_gb(device: torch.device) -> float | None:
    """The accelerator's memory in GB, the budget the memory plan fills (None on CPU: no device limit)."""
    total = accelerator.total_memory(device)
    return total / GB if total is not None else None


def resolve_recompute_casts(cfg: Config, rt: Runtime, device: torch.device) -> Config:
    """train.recompute_casts=auto -> on where the memory plan needs it (`choose_recompute_casts`), said on a GPU.
    The same on every rank: the plan is the worst stage's and the budget the (uniform) GPU's."""
    if cfg.train.recompute_casts != "auto":
        return cfg
    budget = _budget_gb(device)
    choice, why = choose_recompute_casts(cfg, rt.world_size, budget)
    if budget is not None and rt.is_main:
        log.info(f"megaloom: train.recompute_casts=auto -> {str(choice).lower()} ({why})")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, recompute_casts=choice))


def choose_micro_batch(cfg: Config, rt: Runtime, device: torch.device) -> int:
    """train.micro_batch_size=0: the largest micro-batch the memory plan fits on this GPU (`auto_micro_batch`);
    every rank takes the smallest of the ranks' choices, so that all run the same schedule. A collective."""
    budget = _budget_gb(device)
    mb, peak = auto_micro_batch(cfg, rt.world_size, budget)
    world = torch.distributed.group.WORLD if rt.world_size > 1 else None
    mb = int(comm.all_reduce(torch.tensor([mb], device=device), world, op="min").item())
    why = (f"planned peak {peak:.1f} GB of {budget:.1f} GB" if peak is not None
           else "no device memory limit to plan against: the largest divisor of the per-rank batch up to 8")
    # On a GPU the choice is news; on CPU (the quick start) it is the 8 runs always had: said at debug level.
    (log.info if budget is not None else log.debug)(f"megaloom: train.micro_batch_size=0 (auto) -> {mb} ({why})")
    return mb
