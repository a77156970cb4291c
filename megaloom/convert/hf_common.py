"""What the families' Hugging Face mappings (``megaloom/models/<family>/hf.py``) share: reading HF tensors with
missing and unexpected names refused, refusing an HF setting by name, and RoPE's base from either config layout.

Imports nothing of megaloom's models, so a family module can import it while the registry is being built.
"""

from __future__ import annotations

import torch

from megaloom.convert.errors import ConversionError

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


def rope_theta(hf: dict, where: str) -> float:
    """RoPE base from either the 4.x (rope_theta, rope_scaling) or the 5.x (rope_parameters) layout; scaled
    and partial RoPE are refused."""
    scaling = hf.get("rope_scaling")
    if scaling:
        refuse(where, "rope_scaling", scaling, "plain RoPE only; Llama 3.1/3.2's 'llama3' frequency scaling, "
               "linear, dynamic and yarn scaling are not implemented")
    params = hf.get("rope_parameters") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        refuse(where, "rope_parameters.rope_type", kind, "plain RoPE ('default') only; Llama 3.1/3.2's "
               "'llama3' frequency scaling, linear, dynamic and yarn scaling are not implemented")
    if hf.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)) != 1.0:
        refuse(where, "partial_rotary_factor", hf.get("partial_rotary_factor", params.get("partial_rotary_factor")),
               "RoPE over the whole head only: 1.0")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def rope_config(theta: float) -> dict:
    """RoPE's base in config.json: rope_theta for transformers 4.x, rope_parameters for 5.x."""
    return {"rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta}}
