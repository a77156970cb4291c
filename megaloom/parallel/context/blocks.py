"""One block of attention that returns its log-sum-exp, the matching backward, and the online-softmax merge.

Ring attention computes attention of the local queries against one key/value block at a time and merges the
partial results: with ``out_b`` the block's softmax-weighted values and ``lse_b`` the log-sum-exp of its scores,

    lse = logaddexp(lse, lse_b);  out = out * exp(lse_old - lse) + out_b * exp(lse_b - lse)

is exact (Milakov & Gimelshein 2018; the flash-attention recurrence). Backward needs no merge: with the *final*
``out`` and ``lse`` of the row, each block's probabilities are ``exp(s - lse)`` and its gradients follow from
those alone (dS = P * (dP - rowsum(dO * O))), so every block is recomputed independently.

Two kernels: `math` (explicit matmuls in fp32: exact in float32, any device, GQA by repeating heads), used on
CPU and for fp32; `flash` (PyTorch's own flash-attention ops, which return the log-sum-exp) on CUDA in
fp16/bf16. SDPA itself cannot be used: it does not return the log-sum-exp.
"""

from __future__ import annotations

import torch

from megaloom.accelerator import CUDA


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _sum_kv(g: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `_repeat_kv`: sum the query heads that shared a key/value head."""
    if groups == 1:
        return g
    b, h, t, d = g.shape
    return g.view(b, h // groups, groups, t, d).sum(2)


def _use_flash(q: torch.Tensor) -> bool:
    return q.device.type == CUDA and q.dtype in (torch.float16, torch.bfloat16)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:  # square diagonal block: query i sees keys 0..i
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B, H, Tq, D] over k, v [B, Hkv, Tk, D] (Hkv divides H): (out [B, H, Tq, D] fp32,
    lse [B, H, Tq] fp32). ``causal``: a diagonal block (Tq == Tk, query i sees keys <= i)."""
    groups = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    if _use_flash(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, False, scale=scale)[:2]
        return out.float(), lse.float()
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse[..., None]), v.float())
    return out, lse


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) in fp32 of one block, given the rows' final ``out`` and ``lse`` (from the merge)
    and the gradient ``dout`` of the final output. dk, dv have k's (grouped) head count."""
    groups = q.shape[1] // k.shape[1]
    kr, vr = _repeat_kv(k, groups), _repeat_kv(v, groups)
    if _use_flash(q):
        t_q, t_k = q.shape[2], k.shape[2]
        # What the dense forward hands its backward: no cumulative lengths (None: not the varlen kernel, which any
        # defined tensor would select) and a philox seed/offset that dropout 0 never reads.
        seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
        offset = torch.zeros((), dtype=torch.uint64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.to(q.dtype).contiguous(), q.contiguous(), kr.contiguous(), vr.contiguous(),
            out.to(q.dtype).contiguous(), lse.float().contiguous(), None, None, t_q, t_k, 0.0, causal,
            seed, offset, scale=scale)
        return dq.float(), _sum_kv(dk.float(), groups), _sum_kv(dv.float(), groups)
    dout, out = dout.float(), out.float()
    p = torch.exp(_scores(q, kr, causal, scale) - lse[..., None])
    dv = torch.matmul(p.transpose(-1, -2), dout)
    dp = torch.matmul(dout, vr.float().transpose(-1, -2))
    ds = p * (dp - (dout * out).sum(-1, keepdim=True)) * scale
    dq = torch.matmul(ds, kr.float())
    dk = torch.matmul(ds.transpose(-1, -2), q.float())
    return dq, _sum_kv(dk, groups), _sum_kv(dv, groups)


def merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Fold a block's (out_b, lse_b) into the running (out, lse), in place (fp32)."""
    new = torch.logaddexp(lse, lse_b)
    out.mul_(torch.exp(lse - new)[..., None]).add_(out_b * torch.exp(lse_b - new)[..., None])
    lse.copy_(new)


# ------------------------------------------------------------------- which part of a block the causal split needs

def ring_step_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      rank: int, src: int, scale: float) -> None:
    """Merge the keys/values of cp rank ``src`` into this rank's (out, lse), under the load-balanced split
    (layout.py: each rank holds chunks r and 2cp-1-r). With c tokens per chunk:

      src == rank: causal over the local 2c tokens (their positions increase along the local order);
      src <  rank: the source's first chunk precedes both local chunks, its second follows both:
                   all 2c queries x the first c keys, no mask;
      src >  rank: both source chunks lie between the local ones: the second c queries x all 2c keys.

    Every off-diagonal step is c x 2c scores on every rank: the balance the split exists for."""
    c = q.shape[2] // 2
    if src == rank:
        merge(out, lse, *block_forward(q, k, v, True, scale))
    elif src < rank:
        merge(out, lse, *block_forward(q, k[:, :, :c], v[:, :, :c], False, scale))
    else:
        merge(out[:, :, c:], lse[:, :, c:], *block_forward(q[:, :, c:], k, v, False, scale))


def ring_step_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, dq: torch.Tensor, rank: int, src: int,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of `ring_step_forward`: adds into ``dq`` (fp32) and returns this step's (dk, dv) for the
    whole source block (fp32, zeros where the step did not look)."""
    c = q.shape[2] // 2
    if src == rank:
        dq_b, dk, dv = block_backward(dout, q, k, v, out, lse, True, scale)
        dq.add_(dq_b)
        return dk, dv
    if src < rank:
        dq_b, dk_b, dv_b = block_backward(dout, q, k[:, :, :c], v[:, :, :c], out, lse, False, scale)
        dq.add_(dq_b)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        dk[:, :, :c], dv[:, :, :c] = dk_b, dv_b
        return dk, dv
    dq_b, dk, dv = block_backward(dout[:, :, c:], q[:, :, c:], k, v, out[:, :, c:], lse[:, :, c:], False, scale)
    dq[:, :, c:].add_(dq_b)
    return dk, dv
