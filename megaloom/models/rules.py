"""What validating a config asks the model families (`megaloom.model_keys.base.ModelRules`): their names, presets
and size defaults, the MLP width a family gives, and the model section's rules that need the family (its traits,
its own `validate`, the adapters' targets); and the family by name, for the shared decoder built without one.

megaloom/config.py reaches this module only through `megaloom.model_keys.base.model_rules()`, which the package
wires here (megaloom/__init__.py): the config layer imports no family, and loads torch only when a config is first
validated. `check` runs at the place of the family in `megaloom.config.validate`'s order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megaloom.errors import ConfigError
from megaloom.model_keys import mla, moe
from megaloom.model_keys.base import require
from megaloom.model_keys.shape import resolved_head_dim
from megaloom.models.lora import check_targets
from megaloom.models.presets import PRESETS
from megaloom.models.recipes import train_defaults
from megaloom.models.registry import FAMILIES, get_family

if TYPE_CHECKING:
    from megaloom.config import Config
    from megaloom.model_keys import ModelConfig
    from megaloom.models.family import Family, Traits


class _Rules:
    def names(self) -> tuple[str, ...]:
        return tuple(FAMILIES)

    def presets(self) -> dict[str, dict[str, Any]]:
        return PRESETS

    def size_defaults(self, m: ModelConfig) -> dict[str, Any]:
        return train_defaults(m)

    def check(self, cfg: Config) -> None:
        check_model(cfg, _family(cfg.model.arch))

    def family(self, name: str) -> Family:
        return get_family(name)


RULES = _Rules()


def _family(name: str) -> Family:
    try:
        return get_family(name)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_model(cfg: Config, family: Family) -> None:
    """The model keys the family must be able to build: RoPE head widths, latent attention, multi-token prediction,
    RoPE scaling, the family's own rules, LoRA targets, soft-capping, the sentence-order head, the experts."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    tr = family.traits
    if tr.positions == "rope" and m.attention != "mla":  # MLA rotates qk_rope_head_dim (mla.check)
        require(resolved_head_dim(m) % 2 == 0,
                f"{m.arch} arch: head dim ({'model.head_dim' if m.head_dim else 'd_model/n_heads'}) must be even "
                "for RoPE.")
    _check_mla(m, tr)
    require(m.mtp_depth >= 0 and t.mtp_loss_weight >= 0,
            f"model.mtp_depth ({m.mtp_depth}) and train.mtp_loss_weight ({t.mtp_loss_weight}) must be >= 0.")
    require(not m.mtp_depth or (tr.causal and tr.positions == "rope" and family.objective is None
                                and not m.vision_layers),
            f"model.mtp_depth={m.mtp_depth} with model.arch={m.arch}: multi-token prediction continues a causal "
            "decoder with rotary positions that trains on next tokens; set model.mtp_depth=0.")
    _check_rope_scaling(m, tr.positions == "rope")
    if family.validate is not None:
        family.validate(m)
    check_targets(m.lora, gated_mlp=tr.gated_mlp, dense_mlp=m.moe_every != 1)
    _check_softcap(cfg, family)
    if m.sentence_order and not tr.sentence_order:
        raise ConfigError(f"model.sentence_order=true with model.arch={m.arch}: this family has no sentence-order "
                          f"head; set model.sentence_order=false (or {_owners('sentence_order')}).")
    moe.check(m, p.ep)


def _owners(trait: str) -> str:
    """The families with ``trait``, as a message offers them: "model.arch=a or model.arch=b"."""
    return " or ".join(f"model.arch={f.name}" for f in FAMILIES.values() if getattr(f.traits, trait))


def _check_mla(m: ModelConfig, traits: Traits) -> None:
    """Multi-head latent attention's keys describe a shape (model.attention=mla), in a family that can take it: one
    with rotary positions whose attention is the plain one (a family's own attention class, e.g. QK-norm, is not
    MLA's)."""
    if m.attention != "mla":
        return
    require(traits.positions == "rope" and traits.attention is None and traits.causal,
            f"model.attention=mla with model.arch={m.arch}: latent attention replaces a causal decoder's plain "
            "attention with rotary positions; this family has its own attention or no rotary positions. Set "
            "model.attention=gqa.")
    mla.check(m)


def _check_softcap(cfg: Config, family: Family) -> None:
    """Soft-capping (model.attn_softcap / final_softcap) in a family that builds it, with the kernels that can."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    for key, cap in (("attn_softcap", m.attn_softcap), ("final_softcap", m.final_softcap)):
        require(cap >= 0, f"model.{key} must be >= 0 (0 = off), got {cap}.")
        if cap and not family.traits.softcap:
            raise ConfigError(f"model.{key}={cap:g} with model.arch={m.arch}: this family does not build "
                              f"soft-capping; set model.{key}=0 (or {_owners('softcap')}).")
    if m.query_pre_attn_scalar:
        require(m.query_pre_attn_scalar > 0 and family.traits.query_scale,
                f"model.query_pre_attn_scalar={m.query_pre_attn_scalar} with model.arch={m.arch}: "
                + ("must be > 0 (0 = head_dim)." if family.traits.query_scale else
                   "this family scales queries by head_dim^-1/2 only; set model.query_pre_attn_scalar=0."))
    if m.attn_softcap:
        require(t.attention in ("auto", "torch", "math"),
                f"model.attn_softcap={m.attn_softcap:g} with train.attention={t.attention}: the fused attention "
                "kernels cannot soft-cap the scores; set train.attention=auto (or math): the attention core runs "
                "the math path.")
        require(p.cp == 1, f"model.attn_softcap={m.attn_softcap:g} with parallel.cp={p.cp}: context-parallel "
                           "attention runs the fused kernels, which cannot soft-cap; set parallel.cp=1.")
    require(not (m.final_softcap and t.fused_loss is True),
            f"model.final_softcap={m.final_softcap:g} with train.fused_loss=true: the fused head and loss compute "
            "the logits chunk by chunk without the cap; set train.fused_loss=false or auto.")


def _check_rope_scaling(m: ModelConfig, rope: bool) -> None:
    """The model.rope_* scaling keys describe a scaling the RoPE tables can compute."""
    if m.rope_scaling == "none":
        return
    require(rope, f"model.rope_scaling={m.rope_scaling} with model.arch={m.arch}: this family has no rotary "
                  "positions; set model.rope_scaling=none.")
    require(m.rope_factor > 0, f"model.rope_factor must be > 0 with model.rope_scaling={m.rope_scaling}, got "
                               f"{m.rope_factor} (e.g. 8 for Llama 3.1).")
    require(m.rope_original_max_len >= 1,
            f"model.rope_original_max_len must be >= 1 with model.rope_scaling={m.rope_scaling}, got "
            f"{m.rope_original_max_len}: set it to the context length of pretraining (e.g. 8192 for Llama 3.1).")
    if m.rope_scaling == "llama3":
        require(0 < m.rope_low_freq_factor < m.rope_high_freq_factor,
                f"model.rope_low_freq_factor ({m.rope_low_freq_factor}) must be > 0 and below "
                f"model.rope_high_freq_factor ({m.rope_high_freq_factor}) (Llama 3.1: 1 and 4).")
    else:
        require(m.rope_beta_fast > 0 and m.rope_beta_slow > 0,
                f"model.rope_beta_fast ({m.rope_beta_fast}) and model.rope_beta_slow ({m.rope_beta_slow}) must be "
                "> 0 (YaRN's defaults: 32 and 1).")
        require(m.rope_attention_factor >= 0,
                f"model.rope_attention_factor must be >= 0 (0 = YaRN's default), got {m.rope_attention_factor}.")
