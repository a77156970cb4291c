"""Fused, chunked linear + cross-entropy: the output head and the loss without ever holding the [N, V] logits.

For llama3-1b at 4 x 4096 tokens and a 128,256-token vocabulary, ``cross_entropy(head(x), labels)`` materialises
bf16 logits (4.2 GB), their fp32 copy (8.4 GB), the log-softmax (8.4 GB) and in backward the fp32 and bf16 logit
gradients: the head is the largest single memory item of a 1B model's step. Here the tokens are processed in
chunks (Liger-Kernel / TorchTitan style). For each chunk, in the forward pass:

    logits = x_c @ W^T            (the autocast dtype when autocast is on, as F.linear would compute it)
    p      = softmax(fp32(logits)); loss_c = sum(logsumexp - logit[label]) over the chunk's valid tokens
    g      = p - onehot(label)    (zero rows for ignored tokens), cast to the matmul dtype
    grad_x[c] = g @ W;  grad_W += g^T @ x_c  (fp32 accumulator)

so the gradient is complete when the forward ends: backward only multiplies the stored ``grad_x`` [N, D] and
``grad_W`` [V, D] by ``grad_output / n_valid`` (no recomputation). Peak extra memory is one chunk of logits
and its gradient (plus an fp32 copy on the eager path), grad_x and grad_W. The 1/n_valid factor is applied in
backward together with the incoming gradient (e.g. the fp16 loss scale), so small probabilities do not underflow
when ``g`` is fp16.

Semantics are those of ``megaloom.models.transformer.cross_entropy``: mean over tokens whose label is not
``ignore_index`` (-100), fp32 result, NaN when every token is ignored (with zero gradients).
"""

from __future__ import annotations

import torch
from torch import nn

from megaloom.accelerator import CUDA, fp32_out_gemm

IGNORE_INDEX = -100
# Target size of one chunk's logits, in elements: 2**29 = 1 GiB in bf16, 4096 tokens for a 128k vocabulary. The
# compiled CUDA path holds only bf16 [C, V] buffers (logits, gradient); the eager path adds one fp32 buffer.
# On one H200 (llama3-1b, 16384 tokens) 4096-token chunks ran the head + loss in 47 ms vs 50 ms with 2048.
CHUNK_LOGIT_ELEMENTS = 2**29


def default_chunk_tokens(vocab: int, n_elements: int = CHUNK_LOGIT_ELEMENTS) -> int:
    """Tokens per chunk so that one chunk's logits are about ``n_elements`` values (a multiple of 256, at least
    256: full tiles for the matmuls)."""
    return max(256, (n_elements // max(vocab, 1)) // 256 * 256)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """What F.linear would compute in: the autocast dtype when autocast is on for x's device, else x's dtype."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def _chunk_inplace(xc: torch.Tensor, wc: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                   need_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's summed loss and ``g = p - onehot`` (in the matmul dtype), through one fp32 [C, V] buffer."""
    z = (xc @ wc.t()).float()  # a fresh buffer (the matmul output itself when fp32), modified in place below
    lab = labels.unsqueeze(1)
    target = z.gather(1, lab).squeeze(1)
    m = z.amax(dim=1, keepdim=True)
    p = z.sub_(m).exp_()  # in place: exp(z - max)
    sum_exp = p.sum(dim=1, keepdim=True)
    lse = m.squeeze(1) + sum_exp.squeeze(1).log()
    loss_sum = torch.where(valid, lse - target, 0.0).sum()
    if not need_grad:
        return loss_sum, None
    p.div_(sum_exp)  # softmax
    p.scatter_add_(1, lab, torch.full_like(target, -1.0).unsqueeze(1))  # - onehot
    p.mul_(valid.unsqueeze(1))  # ignored tokens contribute nothing
    return loss_sum, p.to(xc.dtype)


def _chunk_pure(xc: torch.Tensor, wc: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                need_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same without in-place ops: what torch.compile fuses into few passes over the low-precision logits."""
    z = (xc @ wc.t()).float()
    lab = labels.unsqueeze(1)
    m = z.amax(dim=1, keepdim=True)
    ez = (z - m).exp()
    sum_exp = ez.sum(dim=1, keepdim=True)
    lse = (m + sum_exp.log()).squeeze(1)
    loss_sum = torch.where(valid, lse - z.gather(1, lab).squeeze(1), 0.0).sum()
    if not need_grad:
        return loss_sum, None
    onehot = torch.arange(z.shape[1], device=z.device).unsqueeze(0) == lab
    g = torch.where(valid.unsqueeze(1), ez / sum_exp - onehot.float(), 0.0)
    return loss_sum, g.to(xc.dtype)


# On CUDA the per-chunk softmax / loss / gradient runs as a compiled kernel (inductor fuses the fp32 upcast,
# reductions and the gradient into two passes over the bf16 logits); eager elsewhere and when the caller is
# already being compiled. Set False to use the eager in-place version everywhere.
COMPILE_CHUNK = True
_compiled_chunk = None


def _chunk_function(device: torch.device):
    global _compiled_chunk
    if not COMPILE_CHUNK or device.type != CUDA or torch.compiler.is_compiling():
        return _chunk_inplace
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(_chunk_pure, dynamic=False)
    return _compiled_chunk


def _accumulate(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 acc + a @ b (acc None: the first chunk, a @ b alone). With fp32-output GEMMs the product is
    accumulated by the GEMM's epilogue, in place: no zero fill, no copy of the [V, D] accumulator (an
    out-of-place addmm copied it, ~0.5 ms per chunk for llama3-1b's head on an H200). Otherwise the
    low-precision product, then an fp32 add (a [V, D] pass more, ~1 ms per chunk)."""
    f32 = torch.float32
    if a.dtype == f32:
        return a @ b if acc is None else acc.addmm_(a, b)
    if not torch.compiler.is_compiling() and fp32_out_gemm(a.device):
        return torch.mm(a, b, out_dtype=f32) if acc is None else torch.addmm(acc, a, b, out_dtype=f32, out=acc)
    return (a @ b).to(f32) if acc is None else acc.add_(a @ b)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """mean CE(x @ weight^T, labels) with the gradient computed in forward, chunk by chunk (see module doc).

    Inputs: x [N, D], weight [V, D], labels [N] (int64); returns the fp32 scalar loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                compute_dtype: torch.dtype, ignore_index: int, need_grad_x: bool,
                need_grad_w: bool) -> torch.Tensor:
        n = x.shape[0]
        with torch.autocast(x.device.type, enabled=False):  # every cast below is explicit
            wc = weight.to(compute_dtype)
            valid = labels != ignore_index
            safe = torch.where(valid, labels, 0)
            total = torch.zeros((), dtype=torch.float32, device=x.device)
            grad_x = torch.empty_like(x) if need_grad_x else None
            grad_w = None  # fp32 [V, D], created by the first chunk's GEMM
            chunk_fn = _chunk_function(x.device)
            for s in range(0, n, chunk_tokens):
                e = min(s + chunk_tokens, n)
                xc = x[s:e].to(compute_dtype)
                loss_sum, g = chunk_fn(xc, wc, safe[s:e], valid[s:e], need_grad_x or need_grad_w)
                total = total + loss_sum
                if need_grad_x:
                    grad_x[s:e] = g @ wc
                if need_grad_w:
                    grad_w = _accumulate(grad_w, g.t(), xc)
                del g
            if need_grad_w and grad_w is None:  # no tokens at all
                grad_w = torch.zeros_like(weight, dtype=torch.float32)
            n_valid = valid.sum().to(torch.float32)
            loss = total / n_valid
        if grad_w is not None and grad_w.dtype != weight.dtype:
            grad_w = grad_w.to(weight.dtype)
        ctx.has = (grad_x is not None, grad_w is not None)
        ctx.save_for_backward(*(t for t in (grad_x, grad_w) if t is not None), n_valid)
        return loss

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        saved = list(ctx.saved_tensors)
        n_valid = saved.pop()
        factor = grad_output.float() / n_valid.clamp(min=1.0)
        grad_x = grad_w = None
        # Out of place: the saved gradients stay valid for a second backward through the same graph (retain_graph;
        # the zero-bubble pipeline split runs this node for the input gradient, then again for the weights).
        # (A 0-dim fp32 factor keeps the saved tensors' dtypes: x.dtype and weight.dtype.)
        # One multi-tensor kernel: an elementwise multiply by a 0-dim CUDA tensor broadcasts it with stride 0
        # and falls off the vectorised path (~2.6 TB/s instead of ~4 on an H200's 1 GB fp32 head gradient).
        scaled = list(torch._foreach_mul(saved, factor))
        if ctx.has[0]:
            grad_x = scaled.pop(0)
        if ctx.has[1]:
            grad_w = scaled.pop(0)
        return grad_x, grad_w, None, None, None, None, None, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         chunk_tokens: int | None = None, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean token cross-entropy of ``x @ weight^T`` against ``labels`` (fp32 scalar), computed in chunks of
    ``chunk_tokens`` tokens (default: `default_chunk_tokens`) without materialising the full logits.

    x [..., D] (fp32 or bf16), weight [V, D] (any float dtype; its gradient comes out in weight.dtype), labels
    [...] matching x's leading dims. Under autocast the matmuls run in the autocast dtype, as ``F.linear``
    would; without it in x's dtype. Equal (to rounding) to ``F.cross_entropy(F.linear(x, weight).float(),
    labels, ignore_index=ignore_index)``.
    """
    d = x.shape[-1]
    x2, lab = x.reshape(-1, d), labels.reshape(-1)
    if x2.shape[0] != lab.shape[0]:
        raise ValueError(f"linear_cross_entropy: {x2.shape[0]} tokens in x but {lab.shape[0]} labels")
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    if chunk <= 0:
        raise ValueError(f"linear_cross_entropy: chunk_tokens must be > 0, got {chunk}")
    grad_on = torch.is_grad_enabled()
    return ChunkedLinearCrossEntropy.apply(x2, weight, lab, chunk, _compute_dtype(x2), ignore_index,
                                           grad_on and x2.requires_grad, grad_on and weight.requires_grad)


def fused_head_loss(head: nn.Linear, x: torch.Tensor, labels: torch.Tensor,
                    chunk_tokens: int | None = None) -> torch.Tensor:
    """``cross_entropy(head(x), labels)`` fused and chunked."""
    if head.bias is not None:
        raise ValueError("fused_head_loss: the output head has a bias; the fused loss supports bias-free heads")
    return linear_cross_entropy(x, head.weight, labels, chunk_tokens)


class FusedHeadLoss(nn.Module):
    """The model's loss slot (``Transformer.loss``) with head and cross-entropy fused in chunks
    (train.fused_loss): the full logits never exist. ``chunk_tokens``: tokens per chunk (None: ~1 GiB of
    logits)."""

    def __init__(self, chunk_tokens: int | None = None) -> None:
        super().__init__()
        self.chunk_tokens = chunk_tokens

    def forward(self, head: nn.Linear, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return fused_head_loss(head, x, labels, self.chunk_tokens)
