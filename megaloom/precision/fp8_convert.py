"""`convert_to_float8`: the transformer blocks' attention and MLP linears switched to fp8 (``train.precision=fp8``;
the matmul itself and `Float8Linear` are in `megaloom.precision.fp8`).

An ``nn.Linear`` becomes a `Float8Linear` (the same Parameter objects under the same names, so checkpoints do not
change); a tensor-parallel ``ColumnParallelLinear`` / ``RowParallelLinear`` gets ``fp8_recipe`` set and runs its
local matmul in fp8 while its collectives stay in bf16.

A module of its own, above the tensor-parallel layers it recognises: they run their local matmul through
`megaloom.precision.fp8.linear`, so the matmul must sit below them and this pass above (both in fp8.py was an
import circle, issue 37).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from megaloom.models.moe import MoE
from megaloom.parallel.tp_layers import ColumnParallelLinear, RowParallelLinear
from megaloom.precision.fp8 import Float8Linear, _check_recipe


@dataclass
class Float8Summary:
    """What `convert_to_float8` did: qualified names of converted layers, and (name, reason) of those kept."""

    recipe: str
    converted: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"fp8 ({self.recipe}): {len(self.converted)} linear layers in fp8, {len(self.skipped)} kept "
                 "in bf16 (with the embedding, norms and output head)"]
        reasons: dict[str, list[str]] = {}
        for name, why in self.skipped:
            reasons.setdefault(why, []).append(name)
        for why, names in reasons.items():
            shown = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
            lines.append(f"  kept ({why}): {shown}")
        return "\n".join(lines)


def _blocks(model: nn.Module) -> list[tuple[int, str, nn.Module]]:
    """(global block index, qualified name, block) of a Transformer or a pipeline stage of one (``layers`` is
    keyed by the global block index)."""
    return [(int(k), f"layers.{k}", b) for k, b in model.layers.items()]


def _linears(block: nn.Module) -> list[tuple[str, nn.Module, str | None]]:
    """Every linear of a block: (relative name, module, reason to keep it in bf16 or None)."""
    moe_prefixes = [n + "." for n, m in block.named_modules() if isinstance(m, MoE)]
    out = []
    for name, mod in block.named_modules():
        if not isinstance(mod, nn.Linear | ColumnParallelLinear | RowParallelLinear):
            continue
        why = None
        moe = next((p for p in moe_prefixes if name.startswith(p)), None)
        if moe is not None and not name.startswith(moe + "shared."):
            why = "MoE router / experts"
        elif mod.in_features % 16 or mod.out_features % 16:
            why = "features not multiples of 16"
        elif getattr(mod, "lora_A", None) is not None:  # its conversion would drop the adapter (models/lora.py)
            why = "LoRA-adapted, model.lora"
        out.append((name, mod, why))
    return out


def convert_to_float8(model: nn.Module, recipe: str = "tensorwise", keep_first_last: bool = True,
                      fast_accum: bool = True, keep_attention: bool = False) -> Float8Summary:
    """Run the attention and MLP linears of the transformer blocks in fp8, in place.

    Works on a `Transformer`, a tensor-parallel one (its local shards are checked for the multiple-of-16
    rule) and a pipeline stage (``keep_first_last`` refers to the model's global first and last
    blocks). Never touched: embedding, output head, norms, MoE router and grouped experts (a dense shared
    expert MLP is converted). Parameters keep their objects and names. ``fast_accum``: the forward GEMM's
    accumulation (module doc); ``keep_attention``: the attention projections stay bf16 (only MLPs in fp8).
    Returns what was converted and why the rest was kept.
    """
    _check_recipe(recipe)
    blocks = _blocks(model)
    cfg = getattr(model, "cfg", None)
    n_layers = cfg.n_layers if cfg is not None else len(blocks)
    summary = Float8Summary(recipe)
    for idx, prefix, block in blocks:
        edge = "first block" if idx == 0 else "last block" if idx == n_layers - 1 else None
        for name, mod, why in _linears(block):
            full = f"{prefix}.{name}"
            if keep_first_last and edge is not None:
                why = f"{edge}, train.fp8_keep_first_last"
            elif keep_attention and why is None and name.startswith("attn."):
                why = "attention projection, train.fp8_keep_attention"
            if why is not None:
                summary.skipped.append((full, why))
                continue
            if isinstance(mod, ColumnParallelLinear | RowParallelLinear | Float8Linear):
                mod.fp8_recipe, mod.fp8_fast_accum = recipe, fast_accum
            else:
                parent_name, _, attr = name.rpartition(".")
                parent = block.get_submodule(parent_name) if parent_name else block
                setattr(parent, attr, Float8Linear.from_linear(mod, recipe, fast_accum))
            summary.converted.append(full)
    return summary
