"""FLOPs per token, device peaks and MFU.

The count is the standard one (Kaplan et al.; PaLM appendix B; TorchTitan's `get_num_flop_per_token`):
6 x N non-embedding parameters (forward 2N, backward 4N) plus the attention score and value matmuls,
6 x 2 x n_layers x (n_heads x head_dim: d_model unless model.head_dim says otherwise) x seq_len per token counted
in full (not halved for the causal mask), so our MFU is directly comparable with TorchTitan's. With latent
attention the scores and values are 6 x n_layers x n_heads x (q/k head + v head) x seq_len (the 2 x head_dim
generalised; the padding of v to the q/k head size that the kernels run at is not model work). Recomputation is
not counted (MFU, not HFU). Frozen parameters
(`model.freeze`) count 4N (no weight gradient); a multimodal model's image encoder and projector are counted per
image (`image_flops`) and added for the images each step holds.
"""

from __future__ import annotations

import torch

from megaloom import accelerator
from megaloom.config import ModelConfig

# Dense bf16 tensor-core peaks in FLOP/s (no sparsity), by substring of the device name.
PEAK_BF16 = {
    "H200": 989e12, "H100": 989e12, "H800": 989e12, "GH200": 989e12,
    "A100": 312e12, "A800": 312e12, "L40S": 362e12, "B200": 2250e12, "B100": 1750e12,
}


def flops_per_token(cfg: ModelConfig, n_params_no_embedding: int, seq_len: int, n_frozen: int = 0) -> float:
    """``n_frozen``: of the parameters, those trained frozen (`model.freeze`): no weight gradient, 4N not 6N (the
    input gradient still runs through them to whatever trains below)."""
    from megaloom.models.attention_shapes import attention_width

    # heads x (q/k width + v width); multi-token prediction's blocks (model.mtp_depth) attend as the model's do
    attention = 6 * (cfg.n_layers + getattr(cfg, "mtp_depth", 0)) * attention_width(cfg) * seq_len
    return 6 * n_params_no_embedding - 2 * n_frozen + attention


def image_flops(model: torch.nn.Module) -> float:
    """Model FLOPs of one image through a multimodal model's encoder and projector (0 without one). The encoder
    runs per image, not per text position, so MFU adds this times the images of the step. Frozen parts take no
    weight gradient; a frozen encoder under nothing trainable takes no backward at all (projector-only stage)."""
    vision, projector = getattr(model, "vision", None), getattr(model, "projector", None)
    if vision is None:
        return 0.0
    trains = any(p.requires_grad for p in vision.parameters())
    n_tokens = vision.n_patches + (vision.cls is not None)
    blocks = list(vision.layers.values())
    n_enc = sum(p.numel() for b in blocks for p in b.parameters() if p.ndim >= 2)
    d = vision.pos_emb.weight.shape[-1]
    per_token = 2 * n_enc + 4 * len(blocks) * d * n_tokens  # forward: weights and attention scores / values
    encoder = n_tokens * per_token * (3 if trains else 1)
    n_proj = sum(p.numel() for p in projector.parameters() if p.ndim >= 2) if projector is not None else 0
    proj_trains = projector is not None and any(p.requires_grad for p in projector.parameters())
    projector_flops = vision.n_patches * n_proj * (2 + (2 if proj_trains else 0) + (2 if trains else 0))
    return float(encoder + projector_flops)


def device_peak_flops(device: torch.device) -> float | None:
    """bf16 dense peak of an accelerator named in PEAK_BF16, or None (CPU, or an unknown device: MFU is then
    reported as null)."""
    if not accelerator.is_accelerator(device):
        return None
    name = accelerator.device_name(device)
    for key, peak in PEAK_BF16.items():
        if key in name:
            return peak
    return None


def frozen_matmul_params(model: torch.nn.Module) -> int:
    """Of `matmul_params`, the ones trained frozen (requires_grad False)."""
    return matmul_params(model, frozen_only=True)


def matmul_params(model: torch.nn.Module, frozen_only: bool = False) -> int:
    """Parameters that take part in a token's matmuls: all but the embedding lookups, plus the output head even
    when it shares its weight with the token embedding (the head's GEMM is real work either way). Routed experts
    count top_k / n_experts of their weights: MFU of an MoE model is over its active parameters. With
    multi-token prediction the head's GEMM runs once more per depth (the modules' own weights count once)."""
    from megaloom.models.moe import MoE

    active_share = {}
    for module in model.modules():
        if isinstance(module, MoE):
            e = module.experts
            for p in (e.w_gate, e.w_up, e.w_down):
                active_share[id(p)] = module.top_k / e.w_gate.shape[0]
    seen, n = set(), 0.0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        if name.startswith(("tok_emb", "pos_emb")) and not name.startswith("head"):
            continue
        if name.startswith(("vision.", "projector.")):  # an image encoder runs per image patch, not per token
            continue
        seen.add(id(p))
        if frozen_only and p.requires_grad:
            continue
        n += p.numel() * active_share.get(id(p), 1.0)
    head, mtp = getattr(model, "head", None), getattr(model, "mtp", None)
    if mtp is not None and head is not None and not (frozen_only and head.weight.requires_grad):
        n += head.weight.numel() * len(mtp)
    return int(n)
