"""`convert_to_float8`: the transformer blocks' attention and MLP linears switched to fp8 (``train.precision=fp8``;
the matmul itself and `Float8Linear` are in `megaloom.precision.fp8`).

An ``nn.Linear`` becomes a `Float8Linear` (the same Parameter objects under the same names, so checkpoints do not
change); a tensor-parallel ``ColumnParallelLinear`` / ``RowParallelLinear`` gets ``fp8_recipe`` set and runs its
local matmul in fp8 while its collectives stay in bf16.

A module of its own, above the tensor-parallel layers it recognises. Those import nothing of precision/: this pass
hands each the fp8 matmul (`megaloom.precision.fp8.float8_linear`, as ``fp8_linear``) with its recipe, as it hands
the grouped experts theirs (``fp8_mm``).

``experts=True`` (train.fp8_experts) also runs the grouped MoE experts' GEMMs in fp8 (`megaloom.precision.fp8_grouped`)
by setting `GroupedExperts.fp8_mm`; their parameters are untouched.

Which GEMM backend runs is chosen here, explicitly, from the model's device: the blockwise recipe and the fp8 experts
have a fast kernel on CUDA compute capability 9.x only and an fp32 emulation elsewhere. The summary names it (the
trainer logs the summary once); on a GPU without the kernel it also warns, since the emulation is slower than bf16.
On the kernel, a small case is first checked against the emulation (`fp8_block.check_kernel`,
`fp8_grouped.check_kernel`): a torch that refuses or misreads the scales fails here, before training, naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from megaloom import accelerator
from megaloom.models.moe import MoE
from megaloom.observe.log import get_logger
from megaloom.parallel.tp_layers import ColumnParallelLinear, RowParallelLinear
from megaloom.precision import fp8_block, fp8_grouped
from megaloom.precision.fp8 import Float8Linear, _check_recipe, float8_linear

log = get_logger(__name__)


@dataclass
class Float8Summary:
    """What `convert_to_float8` did: qualified names of converted layers, and (name, reason) of those kept."""

    recipe: str
    converted: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    experts: list[str] = field(default_factory=list)  # MoE layers whose expert GEMMs run in fp8 (train.fp8_experts)
    backends: list[str] = field(default_factory=list)  # which GEMM backend runs, where it is a choice

    def __str__(self) -> str:
        lines = [f"fp8 ({self.recipe}): {len(self.converted)} linear layers in fp8, {len(self.skipped)} kept "
                 "in bf16 (with the embedding, norms and output head)"]
        reasons: dict[str, list[str]] = {}
        for name, why in self.skipped:
            reasons.setdefault(why, []).append(name)
        for why, names in reasons.items():
            lines.append(f"  kept ({why}): {_shown(names)}")
        if self.experts:
            lines.append(f"  experts in fp8 (rowwise, train.fp8_experts): {len(self.experts)} MoE layers: "
                         f"{_shown(self.experts)}")
        lines += [f"  {b}" for b in self.backends]
        return "\n".join(lines)


def _shown(names: list[str]) -> str:
    return ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")


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
                      fast_accum: bool = True, keep_attention: bool = False, experts: bool = False,
                      device: torch.device | None = None) -> Float8Summary:
    """Run the attention and MLP linears of the transformer blocks in fp8, in place.

    Works on a `Transformer`, a tensor-parallel one (its local shards are checked for the multiple-of-16
    rule) and a pipeline stage (``keep_first_last`` refers to the model's global first and last
    blocks). Never touched: embedding, output head, norms, MoE router, and the grouped experts unless
    ``experts`` (a dense shared expert MLP is converted). Parameters keep their objects and names. ``fast_accum``:
    the forward GEMM's accumulation (module doc); ``keep_attention``: the attention projections stay bf16 (only
    MLPs in fp8); ``experts``: the MoE layers' grouped expert GEMMs in rowwise fp8 too (train.fp8_experts; the
    first and last blocks' follow ``keep_first_last``); ``device``: where the model will train, for the choice of
    GEMM backend (default: its parameters' device; a model still on the meta device needs it). Returns what was
    converted and why the rest was kept.
    """
    _check_recipe(recipe)
    blocks = _blocks(model)
    cfg = getattr(model, "cfg", None)
    n_layers = cfg.n_layers if cfg is not None else len(blocks)
    summary = Float8Summary(recipe)
    for idx, prefix, block in blocks:
        edge = "first block" if idx == 0 else "last block" if idx == n_layers - 1 else None
        if experts and not (keep_first_last and edge is not None):
            for name, mod in block.named_modules():
                if isinstance(mod, MoE):
                    mod.experts.fp8_mm = partial(fp8_grouped.float8_grouped_mm, fast_accum=fast_accum)
                    summary.experts.append(f"{prefix}.{name}")
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
                if not isinstance(mod, Float8Linear):  # a tensor-parallel layer is given the kernel it calls
                    mod.fp8_linear = float8_linear
            else:
                parent_name, _, attr = name.rpartition(".")
                parent = block.get_submodule(parent_name) if parent_name else block
                setattr(parent, attr, Float8Linear.from_linear(mod, recipe, fast_accum))
            summary.converted.append(full)
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    _choose_backends(device, summary, blockwise=recipe == "blockwise" and bool(summary.converted))
    return summary


def _choose_backends(device: torch.device, summary: Float8Summary, blockwise: bool) -> None:
    """Name the GEMM backend of the blockwise linears and the fp8 experts on ``device`` (module doc), warn where a
    GPU has to emulate them, and check the kernel against the emulation where it runs."""
    if device.type == "meta":  # no device known: the GEMMs choose per call (`backend_for`), nothing to check
        return
    for wanted, mod, key in ((blockwise, fp8_block, "train.fp8_recipe=blockwise"),
                             (bool(summary.experts), fp8_grouped, "train.fp8_experts=true")):
        if not wanted:
            continue
        summary.backends.append(mod.describe_backend(device))
        if mod.backend_for(device) == mod.KERNEL:
            mod.check_kernel(device)
        elif accelerator.is_accelerator(device):
            log.warning(f"megaloom: {key} on a device without the fast kernel: {mod.describe_backend(device)}")
