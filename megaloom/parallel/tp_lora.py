"""LoRA adapters under tensor parallelism: each adapter is split the way its base layer is.

With y = W x + s B A x and the Megatron split of W:

  column-parallel W (rows = output features split):  B is split by rows with W (``Layout(tp_dim=0)``, with the
      same KV-head replicas), A is whole on every rank. Each rank's gradient of A sees only its rows of B, so it
      is a partial sum over tp (``tp_partial``): `sync_tp_grads` all-reduces it like a sequence-parallel norm's.
  row-parallel W (columns = input features split):   A is split by columns with W (``Layout(tp_dim=1)``), B is
      whole. ``B (A_local x_local)`` is this rank's partial product; the layer adds it to its own partial sum
      before the row-parallel reduction (all-reduce, or reduce-scatter under sp), which completes both at once.
      B's gradient, ``g (A_local x_local)^T``, is a partial sum over tp (``tp_partial``).

Everything downstream reads only the `Layout`s: gradient completion, the global norm, data-parallel buckets,
ZeRO segments, checkpoints (each factor saved under its single-model name and full shape, so a LoRA run resumes
at any layout) and the pipeline cut.
"""

from __future__ import annotations

from torch import nn

from megaloom.models.lora import LoraFactor, attach, has_lora
from megaloom.parallel.layout import Layout, set_layout


def _shard(t, dim: int, start: int, length: int) -> nn.Parameter:
    return nn.Parameter(t.detach().narrow(dim, start, length).clone(), requires_grad=t.requires_grad)


def split_column_adapter(src: nn.Module, dst: nn.Module, start: int, length: int, replicas: int) -> None:
    """``dst`` (the column-parallel layer made from ``src``, rows ``start`` .. ``start + length`` of it) gets
    ``src``'s adapter: A whole with a partial gradient, B's rows with the weight's."""
    if not has_lora(src):
        return
    if getattr(dst, "input_mode", "none") != "none":
        raise ValueError("LoRA adapters are supported on column-parallel linears inside a region (input_mode "
                         "'none'), where the layer's input is the region's")
    fan_in = src.lora_A.fan_in
    a = LoraFactor.holding(set_layout(src.lora_A.weight, Layout(tp_partial=True)), fan_in)
    b_weight = _shard(src.lora_B.weight, 0, start, length)
    b = LoraFactor.holding(set_layout(b_weight, Layout(tp_dim=0, tp_replicas=replicas)), fan_in)
    attach(dst, a, b, src.lora_scale, src.lora_dropout)


def split_row_adapter(src: nn.Module, dst: nn.Module, start: int, length: int) -> None:
    """``dst`` (the row-parallel layer made from ``src``, input columns ``start`` .. ``start + length``) gets
    ``src``'s adapter: A's columns with the weight's, B whole with a partial gradient."""
    if not has_lora(src):
        return
    fan_in = src.lora_A.fan_in
    a = LoraFactor.holding(set_layout(_shard(src.lora_A.weight, 1, start, length), Layout(tp_dim=1)), fan_in)
    b = LoraFactor.holding(set_layout(src.lora_B.weight, Layout(tp_partial=True)), fan_in)
    attach(dst, a, b, src.lora_scale, src.lora_dropout)
