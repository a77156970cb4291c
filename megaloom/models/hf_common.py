"""What the families' Hugging Face mappings (``megaloom/models/<family>/hf.py``) share: reading HF tensors with
missing and unexpected names refused, refusing an HF setting by name, and RoPE's base from either config layout.

Here, beside `family.HFMapping`, rather than in `megaloom.convert`: the families are built from it, and convert/
is built on the families (it finds a family's mapping through the registry), so convert/ sits above models/.
Imports nothing of megaloom's models, so a family module can import it while the registry is being built.
"""

from __future__ import annotations

import torch

from megaloom.errors import ConversionError

Tensors = dict[str, torch.Tensor]


class HFTensors:
    """HF tensors being read into megaloom names: ``take`` each one needed (missing -> ConversionError naming
    it); `check_all_read` then refuses whatever nobody took, so a model of another layout never loads half-way."""

    def __init__(self, tensors: Tensors, arch: str, n_layers: int, where: str) -> None:
        self.tensors, self.arch, self.n_layers, self.where = tensors, arch, n_layers, where
        self.read: set[str] = set()

    def take(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ConversionError(f"{self.where}: tensor {name!r} is missing (a {self.arch} model with {self.n_layers} "
                                  "layers needs it); is the config.json from the same model as the weights?")
        self.read.add(name)
        return self.tensors[name]

    def ignore(self, name: str) -> None:
        """``name`` may be present and is not read (e.g. a tied head some exports write too)."""
        self.read.add(name)

    def check_all_read(self) -> None:
        extra = sorted(set(self.tensors) - self.read)
        if extra:
            shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
            raise ConversionError(f"{self.where}: unexpected tensors {shown}; megaloom's {self.arch} model has no such "
                                  "parameters (is num_hidden_layers / n_layer right, or is this another architecture?)")


def refuse(where: str, field: str, found: object, works: str) -> None:
    """Raise the ConversionError for an HF setting megaloom's model would compute differently."""
    raise ConversionError(f"{where}: {field}={found!r} is not supported by megaloom's model ({works}).")


def refuse_head_dim(m, architecture: str) -> None:
    """Export refusal for HF classes whose heads are always hidden_size / num_attention_heads wide (GPT-2, BERT):
    a model.head_dim other than that cannot be expressed."""
    if m.head_dim and m.head_dim * m.n_heads != m.d_model:
        raise ConversionError(f"model.head_dim={m.head_dim}: {architecture}'s attention heads are hidden_size / "
                              f"num_attention_heads = {m.d_model / m.n_heads:g} wide; only models with model.head_dim="
                              f"0 (or d_model / n_heads) can be exported as it.")


def _kind(params: dict) -> str:
    return params.get("rope_type", params.get("type")) or "default"


def _rope_parameters(hf: dict, where: str = "config.json") -> dict:
    """The RoPE parameters of either layout: 5.x's rope_parameters, else 4.x's rope_scaling (+ rope_theta); both
    present with other scaling kinds are refused (which one transformers reads depends on its version)."""
    params = dict(hf.get("rope_parameters") or {})
    old = hf.get("rope_scaling") or {}
    if old and params and _kind(old) != _kind(params):
        refuse(where, "rope_scaling", old, f"one RoPE scaling: rope_parameters says {_kind(params)!r}; remove one "
               "of the two fields")
    return params if params else dict(old)


def rope_theta(hf: dict, where: str) -> float:
    """RoPE base from either the 4.x (rope_theta) or the 5.x (rope_parameters) layout; partial RoPE is refused."""
    params = _rope_parameters(hf, where)
    if hf.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)) != 1.0:
        refuse(where, "partial_rotary_factor", hf.get("partial_rotary_factor", params.get("partial_rotary_factor")),
               "RoPE over the whole head only: 1.0")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def rope_settings(hf: dict, where: str) -> dict:
    """model.rope_* values from config.json: the base, and the frequency scaling of rope_scaling (transformers 4.x)
    or rope_parameters (5.x), as transformers 5 computes it. 'llama3' (Llama 3.1/3.2/3.3) and 'yarn' (Qwen's; not
    DeepSeek's mscale variant) are read; other kinds are refused by name. A missing
    original_max_position_embeddings is max_position_embeddings, as transformers assumes."""
    out = {"rope_theta": rope_theta(hf, where)}
    params = _rope_parameters(hf, where)
    kind = _kind(params)
    if kind == "default":
        return out
    field = "rope_parameters.rope_type" if (hf.get("rope_parameters") or {}).get("rope_type") else "rope_scaling"
    if kind not in ("llama3", "yarn"):
        refuse(where, field, kind, "plain RoPE, 'llama3' (Llama 3.1/3.2/3.3) or 'yarn' scaling; linear, dynamic "
               "and longrope scaling are not implemented")
    original = int(params.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
                   or hf.get("max_position_embeddings", 2048))
    factor = params.get("factor")
    if factor is None and kind == "yarn":  # transformers: the ratio of the context lengths
        factor = hf.get("max_position_embeddings", original) / original
    if factor is None:
        refuse(where, f"{field}.factor", None, "the llama3 scaling needs its factor")
    out.update(rope_scaling=kind, rope_factor=float(factor), rope_original_max_len=original)
    if kind == "llama3":
        out.update(rope_low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                   rope_high_freq_factor=float(params.get("high_freq_factor", 4.0)))
        return out
    for key in ("mscale", "mscale_all_dim"):
        if params.get(key) and params.get("attention_factor") is None:
            refuse(where, f"{field}.{key}", params[key], "YaRN as Qwen uses it: DeepSeek's mscale variant of the "
                   "attention factor is not implemented")
    out.update(rope_beta_fast=float(params.get("beta_fast") or 32.0), rope_beta_slow=float(params.get("beta_slow")
               or 1.0), rope_attention_factor=float(params.get("attention_factor") or 0.0),
               rope_truncate=bool(params.get("truncate", True)))
    return out


def rope_config(m) -> dict:
    """RoPE in config.json (``m``: a ModelConfig): rope_theta (+ rope_scaling) for transformers 4.x,
    rope_parameters for 5.x."""
    params = {"rope_type": "default", "rope_theta": m.rope_theta}
    kind = getattr(m, "rope_scaling", "none")
    if kind == "none":
        return {"rope_theta": m.rope_theta, "rope_parameters": params}
    scaling = {"rope_type": kind, "factor": m.rope_factor, "original_max_position_embeddings": m.rope_original_max_len}
    if kind == "llama3":
        scaling.update(low_freq_factor=m.rope_low_freq_factor, high_freq_factor=m.rope_high_freq_factor)
    else:
        scaling.update(beta_fast=m.rope_beta_fast, beta_slow=m.rope_beta_slow)
        if m.rope_attention_factor:
            scaling["attention_factor"] = m.rope_attention_factor
        if not m.rope_truncate:
            scaling["truncate"] = False
    return {"rope_theta": m.rope_theta, "rope_scaling": scaling, "rope_parameters": {**params, **scaling}}
