"""What a model family is: everything the rest of megaloom may know about one architecture, in one object.

A family lives in its own folder, ``megaloom/models/<name>/``, and exports ``FAMILY``: the traits its module is
built from, its parallel plan (data, read by `megaloom.parallel.tensor`), its presets and its Hugging Face
mapping. `megaloom/models/registry.py` lists the families, one line each. Parallel code, fp8, checkpoints,
conversion and the memory plan ask the family (or the built module) and never test ``model.arch`` strings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

# The shared decoder, which every family builds on (it reads a family through `traits.FamilyView`, importing none).
from megaloom.models.traits import Traits
from megaloom.models.transformer import Transformer

if TYPE_CHECKING:
    from torch import nn

    from megaloom.config import ModelConfig
    from megaloom.models.plan_styles import Plan




@dataclass(frozen=True)
class HFMapping:
    """A family's Hugging Face conversion (``megaloom/models/<family>/hf.py``), the only place that knows how its
    tensors and settings are spelled in `transformers`. `megaloom.convert` asks ``get_family(arch).hf`` on export
    and finds the family by config.json's ``model_type`` on import; it adds what every causal LM shares (vocab
    size, tying, dtype, token ids, ``lm_head``) and refuses tensors the family did not read.

    ``architecture``: the transformers class (config.json ``architectures``). ``model_types``: the config.json
    ``model_type`` values it reads; the first one is written.
    ``to_hf_config(m: ModelConfig) -> dict``: the family's config.json fields; raises ConversionError naming a
    ``model.*`` setting the HF class cannot express.
    ``from_hf_config(hf: dict, where: str) -> dict``: ``model.*`` values, with ``arch`` and the ``preset`` to
    start from; raises ConversionError naming an HF field megaloom's model would compute differently (a missing
    required field may raise KeyError, reported by the caller).
    ``to_hf_names(sd, m: ModelConfig) -> tensors``: a full megaloom state dict -> HF tensors, all but the head
    (``head.weight`` <-> ``lm_head.weight`` is the same in every family: convert/ maps it, or ties it).
    ``from_hf_names(hf: HFTensors, m: ModelConfig) -> state dict``: the same, the other way, reading each tensor
    with ``hf.take(name)`` (`megaloom.convert.hf_common.HFTensors` refuses missing and unread tensors by name).
    ``normalize``: optional ``tensors -> tensors`` applied on import before reading (drop buffers some exports
    contain, add prefixes old checkpoints lack).
    ``head_name``: the HF name of the output head's weight (``lm_head.weight`` in causal LMs): written when it is
    not tied to the embedding, ignored on import when it is.
    ``moe``: the mapping of the family's Mixture-of-Experts models (``model.moe_every`` > 0; e.g. llama ->
    MixtralForCausalLM), another HF class; None: MoE models of the family are refused on export.
    ``sliding_window``: the HF class expresses ``model.sliding_window`` (in the family's own layer pattern, which
    ``to_hf_config`` / ``from_hf_config`` spell); False: a windowed model is refused on export and an import has
    none.
    ``mla``: the mapping of the family's models with latent attention (``model.attention=mla``, dense or MoE;
    llama -> DeepseekV3ForCausalLM); None: such models are refused on export."""

    architecture: str
    model_types: tuple[str, ...]
    to_hf_config: Callable[..., dict]
    from_hf_config: Callable[..., dict]
    to_hf_names: Callable[..., dict]
    from_hf_names: Callable[..., dict]
    normalize: Callable[[dict], dict] | None = None
    head_name: str = "lm_head.weight"
    moe: HFMapping | None = None
    sliding_window: bool = False
    mla: HFMapping | None = None


@dataclass(frozen=True)
class Family:
    name: str
    description: str
    traits: Traits
    plan: Plan
    presets: dict[str, dict] = field(default_factory=dict)
    hf: HFMapping | None = None
    validate: Callable[[ModelConfig], None] | None = None  # family-specific config rules (raise ConfigError)
    extra: dict[str, Any] = field(default_factory=dict)
    # The family's module class, a subclass of the shared decoder (llava: the decoder plus an image encoder);
    # None: `megaloom.models.transformer.Transformer` itself.
    module: Callable[..., nn.Module] | None = None
    # The training objective when it is not next-token prediction: ``objective(cfg, tokenizer)`` -> a
    # `megaloom.data.objective.Objective` that turns each packed token row into (inputs, labels). None: the
    # token rows are shifted by one (causal LM).
    objective: Callable[..., Any] | None = None
    # True: the family's model is the shared causal pre-norm decoder alone (no module of its own: no image
    # encoder, no second stack, not an encoder), the code the measured fast paths ran on; planning/levers.py turns
    # those on at "auto" for it (train.bf16_residual). False (the default) keeps them off, as "not measured".
    dense_decoder: bool = False

    def reads_images(self, m: ModelConfig) -> bool:
        """Whether this model has an image encoder (its data are image-text records, its first pipeline stage
        holds the encoder): a family that may carry one, with model.vision_layers > 0."""
        return self.traits.images and m.vision_layers > 0

    def build(self, cfg: ModelConfig) -> nn.Module:
        """The family's module on the current default device (use ``torch.device("meta")`` to build no storage)."""
        return (self.module or Transformer)(cfg, self)
