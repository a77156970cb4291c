"""Megatron's tensor-parallel layers: each rank holds a slice of the weight, with a collective at its edge.

A column-parallel linear splits the output features (weight rows) and is the entry of a parallel region;
a row-parallel linear splits the input features and is its exit, where the partial sums are reduced.
The pair (column then row) costs one all-reduce forward and one backward. With sequence parallelism the
activations outside the region are split along the sequence instead of replicated, and the all-reduce
becomes an all-gather on entry plus a reduce-scatter on exit (same bytes, 1/tp the activation memory); the
column-parallel linears then save only this rank's sequence shard and gather it again in backward
(`sp_linear`), so their saved input shrinks with tp too.

Every parameter carries how it is split, for gradient sync, checkpoints and `gather_full_params`, as its
`Layout` (megaloom/parallel/layout.py): rows (``tp_dim=0``), columns (``tp_dim=1``) or replicated, copies
of one slice over groups of tp ranks (``tp_replicas``), or replicated with a partial gradient (``tp_partial``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megaloom.models.lora import has_lora, lora_delta
from megaloom.parallel import borders
from megaloom.parallel.collective_matmul import linear_reduce_scatter
from megaloom.parallel.grad_fusion import embedding_lookup, fused_linear
from megaloom.parallel.layout import Layout, set_layout
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.sp_linear import SeqRegion, gathered_linears, lean_path_active, to_compute_dtype
from megaloom.parallel.tp_lora import split_column_adapter, split_row_adapter

INPUT_MODES = ("copy", "gather", "none")
OUTPUT_MODES = ("reduce", "reduce_scatter")
# (x, weight, bias, recipe, fast_accum) -> y: the fp8 matmul (`megaloom.precision.fp8.float8_linear`), handed to a
# layer by `precision.fp8_convert.convert_to_float8` with its recipe: precision/ builds on this engine, so the engine
# is given the kernel rather than importing it.
Fp8Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, str, bool], torch.Tensor]


def _shard(t: torch.Tensor, dim: int, start: int, length: int) -> nn.Parameter:
    return nn.Parameter(t.detach().narrow(dim, start, length).clone())


class ColumnParallelLinear(nn.Module):
    """y[..., local out] = x W_local^T + b_local with W_local = rows of the full [out, in] weight.

    ``input_mode``: "copy" (replicated input: identity forward, all-reduce backward), "gather" (sequence
    shards: all-gather forward, reduce-scatter backward) or "none" (the caller already entered the region,
    e.g. once for q, k and v together). The output stays split (no gather), as the next layer wants it.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, mesh: Mesh, input_mode: str = "copy",
                 replicas: int = 1) -> None:
        super().__init__()
        if input_mode not in INPUT_MODES:
            raise ValueError(f"input_mode must be one of {INPUT_MODES}, got {input_mode!r}")
        self.mesh, self.input_mode = mesh, input_mode
        self.out_features, self.in_features = weight.shape  # local: what the attention reads head counts from
        self.weight = set_layout(weight, Layout(tp_dim=0, tp_replicas=replicas))
        self.bias = set_layout(bias, Layout(tp_dim=0, tp_replicas=replicas)) if bias is not None else None
        self.fp8_recipe: str | None = None  # set by precision.fp8_convert.convert_to_float8: the matmul in fp8
        self.fp8_fast_accum = True
        self.fp8_linear: Fp8Linear | None = None  # set with fp8_recipe: the kernel that runs it
        self.seq_region: SeqRegion | None = None  # set by the enclosing sp region: outputs come from it
        self.region_input = True  # False: reads a tensor made inside its region (styles.Colwise.region_input)
        self.ring = False  # input "gather" as ring steps under the GEMM (parallel.async_tp, collective_matmul)
        self.overlap = False  # compiled: gathers in the form Inductor fuses with this GEMM (parallel.async_tp)
        self.fused_wgrad = False  # weight gradient into weight.main_grad (train.grad_accum_fusion, grad_fusion)

    @classmethod
    def from_linear(cls, linear: nn.Linear, mesh: Mesh, input_mode: str = "copy",
                    rows: tuple[int, int] | None = None, replicas: int = 1) -> ColumnParallelLinear:
        """Copy this rank's rows of an initialised full layer; ``rows`` (start, length) overrides the even
        split."""
        start, length = rows if rows is not None else (mesh.tp_rank * linear.out_features // mesh.tp,
                                                       linear.out_features // mesh.tp)
        bias = _shard(linear.bias, 0, start, length) if linear.bias is not None else None
        new = cls(_shard(linear.weight, 0, start, length), bias, mesh, input_mode, replicas)
        split_column_adapter(linear, new, start, length, replicas)  # model.lora: B's rows with the weight's
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = rank_major(self._base, x, self.mesh.tp) if self.overlap and torch.compiler.is_compiling() else \
            self._base(x)
        # model.lora (inside a region only: x is the region's input, whole on every rank): this rank's rows
        return y + lora_delta(self, x) if has_lora(self) else y

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        g, rec = self.mesh.tp_group, self.mesh.recorder
        if self.seq_region is not None and (y := self.seq_region.output(self, x)) is not None:
            return y
        if self.input_mode == "copy":
            x = borders.copy_to_tp(x, g, rec)
        elif self.input_mode == "gather":  # sequence shards, gathered in the compute dtype (fp8: as they come)
            if self.fp8_recipe is None:
                x = to_compute_dtype(x)
                if lean_path_active() and not self.fused_wgrad:  # saves the shard, not the gathered sequence
                    return gathered_linears(x, None, [(self.weight, self.bias)], g, rec, ring=self.ring)[0]
            x = borders.gather_from_seq(x, g, rec, self.overlap)
        if self.fused_wgrad:
            return fused_linear(x, self.weight, self.bias)
        return local_linear(self, x, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local of tp={self.mesh.tp}), bias={self.bias is not None}, input={self.input_mode}")


class RowParallelLinear(nn.Module):
    """y = reduce(x_local W_local^T) + b, W_local = columns of the full [out, in] weight, x already split.

    ``output_mode``: "reduce" (all-reduce: replicated output) or "reduce_scatter" (sequence shards). The
    bias is replicated and added after the reduction (adding it before would count it tp times).
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, mesh: Mesh,
                 output_mode: str = "reduce") -> None:
        super().__init__()
        if output_mode not in OUTPUT_MODES:
            raise ValueError(f"output_mode must be one of {OUTPUT_MODES}, got {output_mode!r}")
        self.mesh, self.output_mode = mesh, output_mode
        self.out_features, self.in_features = weight.shape
        self.weight = set_layout(weight, Layout(tp_dim=1))
        sp = output_mode == "reduce_scatter"
        self.bias = set_layout(bias, Layout(tp_partial=sp)) if bias is not None else None
        self.fp8_recipe: str | None = None  # set by precision.fp8_convert.convert_to_float8: the matmul in fp8
        self.fp8_fast_accum = True
        self.fp8_linear: Fp8Linear | None = None  # set with fp8_recipe: the kernel that runs it
        self.ring = False  # "reduce_scatter" as ring steps under the GEMM (parallel.async_tp, collective_matmul)
        self.overlap = False  # compiled: the reduce-scatter in the form Inductor fuses with this GEMM (async_tp)
        self.fused_wgrad = False  # weight gradient into weight.main_grad (train.grad_accum_fusion, grad_fusion)

    @classmethod
    def from_linear(cls, linear: nn.Linear, mesh: Mesh, output_mode: str = "reduce") -> RowParallelLinear:
        n = linear.in_features // mesh.tp
        bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None
        new = cls(_shard(linear.weight, 1, mesh.tp_rank * n, n), bias, mesh, output_mode)
        split_row_adapter(linear, new, mesh.tp_rank * n, n)  # model.lora: A's columns with the weight's
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, rec = self.mesh.tp_group, self.mesh.recorder
        if (self.ring and self.output_mode == "reduce_scatter" and self.fp8_recipe is None and lean_path_active()
                and not self.fused_wgrad and not has_lora(self)):  # (LoRA with async_tp: refused by preflight)
            x = to_compute_dtype(x)
            w = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
            y = linear_reduce_scatter(x, w, g, rec)
            return y + self.bias if self.bias is not None else y
        if self.fused_wgrad:
            y = fused_linear(x, self.weight, None)
        else:
            y = local_linear(self, x, None)
        if has_lora(self):  # this rank's partial product of the adapter, summed by the same reduction
            y = y + lora_delta(self, x)
        if self.output_mode == "reduce":
            y = borders.reduce_from_tp(y, g, rec)
        else:
            y = borders.reduce_scatter_to_seq(y, g, rec, self.overlap)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local of tp={self.mesh.tp}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, output={self.output_mode}")


def local_linear(layer: ColumnParallelLinear | RowParallelLinear, x: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """This rank's matmul of a tensor-parallel layer: F.linear, or in fp8 when ``fp8_recipe`` is set."""
    if layer.fp8_recipe is None:
        return F.linear(x, layer.weight, bias)
    return layer.fp8_linear(x, layer.weight, bias, layer.fp8_recipe, layer.fp8_fast_accum)


def rank_major(linear, x: torch.Tensor, tp: int) -> torch.Tensor:
    """``linear(x)`` for a region's gathered sequence x [1, tp * t, in] computed on the view [tp, t, in]: a
    linear treats rows alike, so this is the same product, but its GEMM then reads the dim-0 all-gather's result
    in the shape it came in, which Inductor's micro-pipeline TP pass needs to fuse the gather into the GEMM
    (`borders.gather_from_seq`, traced). Other inputs (more rows, a sequence tp does not divide): ``linear(x)``."""
    if x.dim() != 3 or x.shape[0] != 1 or x.shape[1] % tp:
        return linear(x)
    y = linear(x.view(tp, x.shape[1] // tp, x.shape[2]))
    return y.view(1, x.shape[1], y.shape[-1])


def lookup_vocab_rows(ids: torch.Tensor, weight: torch.Tensor, vocab_start: int, mesh: Mesh,
                      output_mode: str) -> torch.Tensor:
    """Embeddings of ``ids`` from this rank's vocabulary rows ``weight`` (from row ``vocab_start``): the rows it
    owns looked up, the others zero, summed over tp ("reduce") or summed and split along the sequence
    ("reduce_scatter"). Also what a pipeline's last stage looks tokens up with in its tied head rows."""
    g, rec = mesh.tp_group, mesh.recorder
    local = ids - vocab_start
    outside = (local < 0) | (local >= weight.shape[0])
    out = embedding_lookup(local.masked_fill(outside, 0), weight).masked_fill(outside.unsqueeze(-1), 0.0)
    if output_mode == "reduce":
        return borders.reduce_from_tp(out, g, rec)
    # Reduce-scattered in the compute dtype (half the bytes under bf16 autocast, as every other sp
    # collective); the residual stream it starts stays in the weights' dtype.
    return borders.reduce_scatter_to_seq(to_compute_dtype(out), g, rec).to(out.dtype)


class VocabParallelEmbedding(nn.Module):
    """Rows (token ids) split across tp ranks; each rank looks up the ids it owns, zeros the rest, and the
    partial results are summed ("reduce") or summed and split along the sequence ("reduce_scatter")."""

    def __init__(self, weight: nn.Parameter, mesh: Mesh, output_mode: str = "reduce") -> None:
        super().__init__()
        if output_mode not in OUTPUT_MODES:
            raise ValueError(f"output_mode must be one of {OUTPUT_MODES}, got {output_mode!r}")
        self.mesh, self.output_mode = mesh, output_mode
        self.num_embeddings, self.embedding_dim = weight.shape  # local rows
        self.vocab_start = mesh.tp_rank * self.num_embeddings
        self.weight = set_layout(weight, Layout(tp_dim=0))

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, mesh: Mesh,
                       output_mode: str = "reduce") -> VocabParallelEmbedding:
        n = emb.num_embeddings // mesh.tp
        return cls(_shard(emb.weight, 0, mesh.tp_rank * n, n), mesh, output_mode)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return lookup_vocab_rows(ids, self.weight, self.vocab_start, self.mesh, self.output_mode)

    def extra_repr(self) -> str:
        return (f"rows {self.vocab_start}..{self.vocab_start + self.num_embeddings} of "
                f"{self.num_embeddings * self.mesh.tp}, dim={self.embedding_dim}, output={self.output_mode}")
