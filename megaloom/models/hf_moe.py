"""Mixture-of-Experts layers between megaloom's layout and Hugging Face's (Mixtral, Qwen3-MoE), shared by the
families' MoE mappings.

megaloom stacks each layer's experts for its grouped GEMM, input-major (``x @ w``): ``mlp.experts.w_gate`` /
``w_up`` [E, D, F] and ``w_down`` [E, F, D], and the router is ``mlp.router.proj.weight`` [E, D]. Hugging Face
checkpoints hold one ``nn.Linear`` weight (output-major) per expert, ``<prefix>.experts.<j>.<gate|up|down>.weight``
([F, D], [F, D], [D, F]; Mixtral calls them w1, w3, w2), and the router ``<prefix>.gate.weight`` [E, D]; that is
the layout on the Hub and what transformers' ``save_pretrained`` writes, so export writes it. transformers 5 holds
the experts stacked in memory, ``<prefix>.experts.gate_up_proj`` [E, 2F, D] (gate rows first) and
``<prefix>.experts.down_proj`` [E, D, F]; a checkpoint saved in that layout (a state dict written as it is) is read
too. The router's aux-loss-free selection bias (``router.expert_bias``, DeepSeek-V3's balancing) has no HF
counterpart: export refuses a model whose bias is not zero, import sets it to zero.

Here rather than in `megaloom.convert` for the reason hf_common.py gives (convert/ is built on the families).
Imports nothing of megaloom's models (a family's hf.py imports it while the registry is being built).
"""

from __future__ import annotations

import torch

from megaloom.errors import ConversionError
from megaloom.models.hf_common import HFTensors, Tensors


def moe_layer_to_hf(sd: Tensors, i: int, prefix: str, experts: tuple[str, str, str]) -> Tensors:
    """Layer ``i``'s router and experts under ``prefix`` (e.g. ``model.layers.3.mlp``), one tensor per expert;
    ``experts``: the HF names of the gate, up and down projections."""
    ml = f"layers.{i}.mlp"
    bias = sd.get(f"{ml}.router.expert_bias")
    if bias is not None and bool(bias.ne(0).any()):
        raise ConversionError(f"{ml}.router.expert_bias is not zero (model.aux_free_bias_rate trained a selection "
                              "bias): Hugging Face's Mixtral / Qwen3-MoE routers choose experts without one, so the "
                              "exported model would route tokens differently. Only MoE models trained with "
                              "model.aux_free_bias_rate=0 can be exported.")
    out = {f"{prefix}.gate.weight": sd[f"{ml}.router.proj.weight"]}
    gate, up, down = (sd[f"{ml}.experts.w_{n}"] for n in ("gate", "up", "down"))
    for j in range(gate.shape[0]):
        for name, w in zip(experts, (gate[j], up[j], down[j]), strict=True):
            out[f"{prefix}.experts.{j}.{name}.weight"] = w.t()
    return out


def moe_layer_from_hf(hf: HFTensors, i: int, prefixes: tuple[str, ...], experts: tuple[str, str, str],
                      n_experts: int) -> Tensors:
    """Layer ``i``'s router and stacked experts from the first of ``prefixes`` whose router is present, in either
    HF layout (one tensor per expert, or transformers 5's stacked ``gate_up_proj`` / ``down_proj``)."""
    prefix = next((p for p in prefixes if f"{p}.gate.weight" in hf.tensors), prefixes[0])
    router = hf.take(f"{prefix}.gate.weight")
    stacked = f"{prefix}.experts.gate_up_proj"
    if stacked in hf.tensors:
        gate_up, down = hf.take(stacked), hf.take(f"{prefix}.experts.down_proj")
        if gate_up.dim() != 3 or gate_up.shape[0] != n_experts or gate_up.shape[1] % 2:
            raise ConversionError(f"{hf.where}: {stacked} has shape {tuple(gate_up.shape)}; expected [experts="
                                  f"{n_experts}, 2 * expert width, hidden size] (gate rows, then up rows)")
        f = gate_up.shape[1] // 2
        w_gate, w_up, w_down = gate_up[:, :f].transpose(1, 2), gate_up[:, f:].transpose(1, 2), down.transpose(1, 2)
    else:
        per = [[hf.take(f"{prefix}.experts.{j}.{name}.weight").t() for j in range(n_experts)] for name in experts]
        w_gate, w_up, w_down = (torch.stack(ws) for ws in per)
    ml = f"layers.{i}.mlp"
    return {f"{ml}.router.proj.weight": router, f"{ml}.router.expert_bias": torch.zeros(n_experts),
            f"{ml}.experts.w_gate": w_gate, f"{ml}.experts.w_up": w_up, f"{ml}.experts.w_down": w_down}
