"""Weight gradients added straight into the data-parallel gradient buckets (train.grad_accum_fusion).

Without it, every micro-batch's backward of a block's linear computes the weight gradient in the compute dtype
(bf16), autograd casts it to the fp32 parameter's dtype, and the bucket hook (`data_parallel.DataParallelGrads`)
adds it into ``p.main_grad``: two passes over every weight per micro-batch, in memory-bound kernels (18 bytes an
element). With many micro-batches of small shapes (a large job's rank: tp 8, micro-batch 1) they were ~55 ms
of adds and ~25 ms of casts in an 850 ms llama3-70b step on an H200 (docs/performance.md). Here, as Megatron-LM's
``gradient_accumulation_fusion`` does, the weight-gradient GEMM itself accumulates into the fp32 bucket: on CUDA
one ``addmm(main_grad, g^T, x, out_dtype=float32, out=main_grad)`` (the GEMM's epilogue reads and writes the
fp32 accumulator: 8 bytes an element, no extra kernel); elsewhere the product is added as before.

How it fits in:

- `FusedWgradLinear` is the autograd function of one linear: forward as autocast's linear (input, weight and
  bias cast to the compute dtype), backward the input gradient and the bias gradient as usual, and the weight
  gradient through the custom op ``megaloom::accumulate_wgrad``, which mutates ``main_grad``. The op is opaque to
  torch.compile (Inductor calls it in place of its own weight-gradient GEMM, with the accumulator as a graph
  input), so compiled blocks fuse too.
- For the parameter itself the function returns an uninitialised tensor of its shape (an allocation, no
  kernel): autograd still runs the parameter's accumulation node, so the bucket hook still sees the gradient
  "arrive" and reduces full buckets during the last backward, as before; the hook knows these parameters
  (``Parameter.fused_wgrad``) and only drops the stand-in.
- The buckets must be cleared before the first backward of a step, not at the first gradient
  (`DataParallelGrads.prepare_step`, called by TrainStep).

With train.bf16_params the weights are bf16 and their fp32 main gradients still live in the buckets: the same
GEMM accumulates into them (before, those weights were left out and their bf16 gradients went through the
bucket hook's add: +36 ms of elementwise kernels on the H100 70B rank, 2026-12-06).

With train.embedding_grad_fusion (off at auto until measured) the untied token embedding fuses too
(`FusedEmbeddingGrad`; `data_parallel.fusable_embeddings` takes ``model.tok_emb`` alone): its weight gradient is the
batch's rows of a [vocab, d] matrix, which autograd builds dense (a zero-fill of the whole table, a sort and a
scatter) before the bucket hook adds the whole table into ``main_grad`` once more: per micro-batch ~1 ms of the
70B rank's [16,032, 8,192] bf16 table on the H100 (16 of them a step, 2026-12-06 trace). Fused, the op
``megaloom::accumulate_rows`` adds only the batch's rows into the fp32 ``main_grad``, on an accelerator with one
``index_put_(accumulate=True)`` (sorted by row, deterministic, no host sync); on CPU the dense gradient and the add
as before, bit for bit. Not a tied embedding (the head adds into the same parameter through autograd), nor one
with ``padding_idx``, ``max_norm`` or sparse gradients.

Where: the linears of the blocks (attention q/k/v/o and the dense MLP, plain or tensor-parallel), with data
parallelism's buckets (world > 1, parallel.zero 0 or 1: zero 2 frees the buckets between steps). Not fp8 linears
(their own weight-gradient path), not the head (nor the embedding but as above), not expert weights, and not with the
zero-bubble schedule (whose deferred weight pass reads the weights' gradients from autograd). The pass that finds
and switches them is `data_parallel.enable_grad_accum_fusion`, above the tensor-parallel layers that call
`fused_linear` here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import Function

from megaloom.accelerator import fp32_out_gemm


@torch.library.custom_op("megaloom::accumulate_wgrad", mutates_args=("main_grad",))
def accumulate_wgrad(main_grad: Tensor, grad_out: Tensor, inp: Tensor) -> None:
    """``main_grad += grad_out^T @ inp`` over all leading dimensions; ``main_grad`` is fp32 [out, in]."""
    g = grad_out.reshape(-1, grad_out.shape[-1])
    x = inp.reshape(-1, inp.shape[-1])
    if g.dtype == torch.float32:  # as autograd + the bucket hook compute it: the product, then the add
        main_grad.add_(g.t() @ x)
    elif fp32_out_gemm(g.device):
        torch.addmm(main_grad, g.t(), x, out_dtype=torch.float32, out=main_grad)
    else:
        main_grad.add_(g.t() @ x)


@accumulate_wgrad.register_fake
def _(main_grad: Tensor, grad_out: Tensor, inp: Tensor) -> None:
    return None


def _compute_dtype(x: Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class FusedWgradLinear(Function):
    """y = x W^T + b in the compute dtype; W's gradient accumulated into ``main_grad`` (module doc)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, main_grad: Tensor) -> Tensor:
        dtype = _compute_dtype(x)
        xc = x if x.dtype == dtype else x.to(dtype)
        wc = weight if weight.dtype == dtype else weight.to(dtype)
        bc = None if bias is None else bias if bias.dtype == dtype else bias.to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            out = F.linear(xc, wc, bc)
        ctx.save_for_backward(xc, wc)
        # Not a saved tensor: the accumulations of the other micro-batches in flight (and of the other weights in its
        # bucket) change it in place between this forward and its backward, which autograd's version check refuses.
        ctx.main_grad = main_grad
        ctx.x_dtype, ctx.w_dtype, ctx.has_bias = x.dtype, weight.dtype, bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        xc, wc = ctx.saved_tensors
        main_grad = ctx.main_grad
        grad_x = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad @ wc).to(ctx.x_dtype)
        accumulate_wgrad(main_grad, grad, xc)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype)
        # The weight's "gradient" is a stand-in of its shape (no kernel): its accumulation node and hook still run.
        # In the weight's own dtype (bf16 with train.bf16_params): autograd would cast an fp32 stand-in to it.
        return grad_x, torch.empty_like(main_grad, dtype=ctx.w_dtype), grad_b, None


def fused_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The linear of a fused parameter (``weight.main_grad`` exists): see the module doc."""
    return FusedWgradLinear.apply(x, weight, bias, weight.main_grad)


class FusedLinear(nn.Linear):
    """An ``nn.Linear`` whose weight gradient goes straight into ``weight.main_grad`` (the same parameters, so
    names, checkpoints and hooks are unchanged)."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> FusedLinear:
        new = cls.__new__(cls)
        new.__dict__.update(linear.__dict__)  # the same parameters and hooks, by reference
        return new

    def forward(self, x: Tensor) -> Tensor:
        return fused_linear(x, self.weight, self.bias)


def rows_on_device(main_grad: Tensor) -> bool:
    """Whether `accumulate_rows` adds the rows one by one (an accelerator: ``index_put_`` accumulate) rather than
    as the dense gradient (CPU: the unfused arithmetic). A function of its own so a CPU test can take either."""
    return main_grad.device.type != "cpu"


@torch.library.custom_op("megaloom::accumulate_rows", mutates_args=("main_grad",))
def accumulate_rows(main_grad: Tensor, ids: Tensor, grad_out: Tensor) -> None:
    """``main_grad[ids[i]] += grad_out[i]`` for every position i: an embedding's weight gradient added into its fp32
    ``main_grad`` [rows, d] (``grad_out``: [..., d] in the weight's dtype, ``ids``: [...] local rows)."""
    g = grad_out.reshape(-1, grad_out.shape[-1])
    i = ids.reshape(-1)
    if rows_on_device(main_grad):  # the batch's rows only; sorted by row on CUDA: deterministic
        main_grad.index_put_((i,), g.to(torch.float32), accumulate=True)
    else:  # as autograd (the dense gradient in the weight's dtype) + the bucket hook's add
        main_grad.add_(torch.ops.aten.embedding_dense_backward(g, i, main_grad.shape[0], -1, False))


@accumulate_rows.register_fake
def _(main_grad: Tensor, ids: Tensor, grad_out: Tensor) -> None:
    return None


class FusedEmbeddingGrad(Function):
    """``weight[ids]``; the weight's gradient accumulated into ``main_grad`` (module doc)."""

    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, main_grad: Tensor) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.main_grad, ctx.w_dtype = main_grad, weight.dtype  # (not saved: changed in place, as FusedWgradLinear's)
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (ids,) = ctx.saved_tensors
        accumulate_rows(ctx.main_grad, ids, grad.to(ctx.w_dtype))
        return None, torch.empty_like(ctx.main_grad, dtype=ctx.w_dtype), None


def embedding_lookup(ids: Tensor, weight: Tensor) -> Tensor:
    """``F.embedding(ids, weight)``, its weight gradient fused when the weight is (``weight.fused_wgrad``)."""
    if getattr(weight, "fused_wgrad", False) and weight.requires_grad and torch.is_grad_enabled():
        return FusedEmbeddingGrad.apply(ids, weight, weight.main_grad)
    return F.embedding(ids, weight)


class FusedEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose weight gradient goes straight into ``weight.main_grad`` (the same parameter)."""

    @classmethod
    def from_embedding(cls, emb: nn.Embedding) -> FusedEmbedding:
        new = cls.__new__(cls)
        new.__dict__.update(emb.__dict__)
        return new

    def forward(self, ids: Tensor) -> Tensor:
        return embedding_lookup(ids, self.weight)
