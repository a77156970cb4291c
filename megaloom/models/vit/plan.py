"""The image encoder's tensor-parallel plan: Megatron's attention and MLP split (q/k/v and up_proj column-parallel,
o_proj and down_proj row-parallel), without sequence parallelism: the patches of an image are not split over the
ranks even when the language model's residual stream is (``sequence=False``), so each block's output is all-reduced
and every rank holds the whole image's features. Patch embedding, class token, positions and norms are replicated;
their gradients are complete on every rank (each region's entry all-reduces its input gradient).
"""

from __future__ import annotations

from megaloom.models.plan_styles import Colwise, Plan, Region, Rowwise


def vision_plan(prefix: str) -> Plan:
    """The plan of a `VisionTransformer` held at submodule ``prefix`` (e.g. "vision")."""
    return {
        f"{prefix}.layers.*.attn": Region(sequence=False),
        f"{prefix}.layers.*.attn.q_proj": Colwise(),
        f"{prefix}.layers.*.attn.k_proj": Colwise(),
        f"{prefix}.layers.*.attn.v_proj": Colwise(),
        f"{prefix}.layers.*.attn.o_proj": Rowwise(sequence=False),
        f"{prefix}.layers.*.mlp": Region(sequence=False),
        f"{prefix}.layers.*.mlp.up_proj": Colwise(),
        f"{prefix}.layers.*.mlp.down_proj": Rowwise(sequence=False),
    }
