"""One optimizer step: micro-batched forward/backward with gradient accumulation, clipping, update.

Shared by the training loop and the benchmarks so that what is measured is what trains. No host-device
synchronisation happens here: the loss and gradient norm come back as device tensors and are read only
when the loop logs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from megaloom.accelerator import CUDA
from megaloom.data.image_text.batch import ImageTextBatch
from megaloom.data.objective import inputs_and_labels, objective_kwargs
from megaloom.models.documents import Documents
from megaloom.models.transformer import moe_layers
from megaloom.parallel import comm
from megaloom.parallel.token_mean import target_weights, weighted
from megaloom.precision.loss_scaler import DynamicLossScaler
from megaloom.precision.offload import offload_saved

SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}  # train.attention's order
# fp8: the converted linear layers run their GEMMs in float8 (megaloom.precision.fp8); all else runs as bf16.
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


def autocast_ctx(precision: str, device: torch.device):
    """bf16/fp16/fp8: weights stay fp32 (the master copy), matmuls run in the low precision."""
    if precision in AUTOCAST:
        return torch.autocast(device.type, dtype=AUTOCAST[precision])
    return contextlib.nullcontext()


def forward_ctx(precision: str, device: torch.device, offload: bool = False):
    """Everything a training forward runs under: autocast, and optionally activation offload."""
    if not offload:
        return autocast_ctx(precision, device)
    stack = contextlib.ExitStack()
    stack.enter_context(autocast_ctx(precision, device))
    stack.enter_context(offload_saved())
    return stack


def attention_ctx(backend: str, device: torch.device):
    """Prefer one SDPA kernel on a CUDA GPU (`train.attention`; PyTorch's order elsewhere): cuDNN's is the fastest
    for causal attention on Hopper (../shared/bench probe: 2.6 ms vs flash 4.2 ms per layer at seq 4096); `torch`
    (and an unresolved `auto`) leaves PyTorch's choice. `fa4`: the blocks' causal core runs FA4 (megaloom.fa4);
    SDPA calls left prefer cuDNN."""
    if backend in ("auto", "torch") or device.type != CUDA:
        return contextlib.nullcontext()
    first = SDPA_BACKENDS["cudnn" if backend == "fa4" else backend]
    return sdpa_kernel([first] + [b for b in SDPA_BACKENDS.values() if b != first], set_priority=True)


def micro_batches(batch: torch.Tensor, micro: int):
    """Split [B, T+1] token rows (or [B, 2, T] rows of an objective, data/objective.py) into (inputs, labels)
    pairs of `micro` rows each."""
    for i in range(0, batch.shape[0], micro):
        yield inputs_and_labels(batch[i:i + micro])


def model_kwargs(x: torch.Tensor, documents: Callable[[torch.Tensor], Documents] | None) -> dict:
    """The model's keyword arguments for input tokens `x`: the document boundaries when they are used."""
    return {"docs": documents(x)} if documents is not None else {}


def model_inputs(batch: torch.Tensor, micro: int, documents: Callable[[torch.Tensor], Documents] | None = None,
                 shard=None):
    """(inputs, labels, model keyword arguments) per micro-batch of `micro` rows; an objective's extra rows (BERT's
    segment ids and sentence-order labels) are keyword arguments too. Under context parallelism
    (``shard``) the document boundaries are found in the whole sequence first, then every part is this rank's.
    An image-text batch (multimodal models) gives its own: masked labels, and the rows' images as keywords."""
    if isinstance(batch, ImageTextBatch):
        yield from batch.micro_inputs(micro)
        return
    for i in range(0, batch.shape[0], micro):
        rows = batch[i:i + micro]
        x, y = inputs_and_labels(rows)
        # BERT's sentence-order rows: segment ids and order labels (an encoder objective: never under cp, whose
        # shard would have to split the segment ids too; the bert family refuses cp).
        kwargs = model_kwargs(x, documents) | objective_kwargs(rows)
        if shard is not None:
            x, y = shard(x), shard(y)
            if "docs" in kwargs:
                kwargs["docs"] = kwargs["docs"].sharded(shard)
        yield x, y, kwargs


def folds_grad_scale(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` divides the gradients by ``optimizer.grad_scale`` inside its kernel: torch's
    fused Adam/AdamW read that attribute (it is how GradScaler unscales without a pass of its own)."""
    return isinstance(optimizer, torch.optim.Adam) and all(g.get("fused") for g in optimizer.param_groups)


def clip_gradients(model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` on one process; returns the norm before clipping (a device scalar, no host sync).

    With a fused Adam the clip coefficient is not applied by a pass of its own over the gradients but handed to
    the optimizer's kernel, which divides each gradient by ``grad_scale`` as it reads it. TrainStep clears it
    after the step. (llama3-1b on an H200: the separate pass took 3.3 ms a step, the AdamW kernel takes 2.5 ms
    longer with the scale: a small net gain, measured in bench/RESULTS.md.)"""
    if not (math.isfinite(max_norm) and folds_grad_scale(optimizer)):
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, foreach=True)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # clip_grad_norm_'s coefficient, exactly
    optimizer.grad_scale = coef.reciprocal()
    return total


@dataclass
class StepOutput:
    loss: torch.Tensor  # mean loss over the global batch (device scalar)
    grad_norm: torch.Tensor  # global gradient norm before clipping (device scalar)
    skipped: bool  # fp16 overflow: the scaler skipped the update


class TrainStep:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, precision: str,
                 device: torch.device, micro_batch_size: int, grad_clip: float, grads=None,
                 nan_guard: bool = False, pipeline=None, attention: str = "auto", offload: bool = False,
                 documents: Callable[[torch.Tensor], Documents] | None = None, seq_shard=None,
                 overlap_optimizer: bool = False, token_mean: bool = False):
        """`grads`: a megaloom.parallel.grads.GradientSync for parallel runs (reduces and clips over all
        groups); None on one process. `documents`: the document boundaries of an input micro-batch
        (data.document_mask / data.reset_positions), passed to the model as ``docs``. `seq_shard`: context
        parallelism's split of tokens and labels. `overlap_optimizer`: the update runs beside the next forward
        (megaloom.optim.overlapped_step; call `settle()` before using the weights outside a forward).
        `token_mean`: the data masks targets (chat, masked LM, image-text): the step's loss is the mean over every
        target of the global batch, not a mean of micro-batch means (megaloom.parallel.token_mean)."""
        self.seq_shard = seq_shard
        self.model, self.optimizer = model, optimizer
        self.grads = grads
        # The guard reads the norm on the host once per step (a sync); fp16 already pays it for the scaler.
        self.nan_guard = nan_guard
        self.precision, self.device = precision, device
        self.micro = micro_batch_size
        self.grad_clip = grad_clip if grad_clip > 0 else math.inf
        self.scaler = DynamicLossScaler(mesh=getattr(grads, "mesh", None)) if precision == "fp16" else None
        # With pipeline parallelism a schedule executor runs the micro-batches across stages instead of the loop.
        self.pipeline = pipeline
        self.attention = attention
        if attention == "fa4":
            from megaloom.fa4 import check_fa4

            check_fa4(device)
        self.offload = offload  # activation offload (train.offload_activations); pipelines get it via their ctx
        self.documents = documents
        self.moe = moe_layers(model)
        self.token_mean = token_mean
        if pipeline is not None and self.scaler is not None:
            pipeline.scale_loss = lambda loss: loss * self.scaler.scale
        if pipeline is not None:
            pipeline.token_mean = token_mean
        self.overlap = None
        if overlap_optimizer:
            from megaloom.optim.overlapped_step import OverlappedStep

            self.overlap = OverlappedStep(model, optimizer, device)

    def settle(self) -> None:
        """Every update queued is complete before what is queued next (checkpoints, rollbacks, the end)."""
        if self.overlap is not None:
            self.overlap.wait_all()
        wait = getattr(self.optimizer, "wait_all", None)  # train.optimizer_offload: the host step's thread
        if wait is not None:
            wait()

    def __call__(self, batch: torch.Tensor | None) -> StepOutput:
        # The preferred SDPA kernel holds for the backward too: recomputation (train.recompute) re-runs attention
        # there, and must pick the kernel the forward used (cuDNN and flash save different tensors; the
        # checkpoint refuses the mismatch). The kernel flags are global, not per thread, so the autograd
        # engine's threads see them.
        with attention_ctx(self.attention, self.device):
            return self._step(batch)

    def _step(self, batch: torch.Tensor | None) -> StepOutput:
        prepare = getattr(self.grads, "prepare_step", None)
        if prepare is not None:
            prepare()  # buckets cleared before the first backward (weight gradients fused into them arrive early)
        scale = self.scaler.scale if self.scaler is not None else 1.0
        if self.pipeline is not None:
            self._scale_aux_losses(scale / self.pipeline.schedule.microbatches)
            total = self.pipeline.run(batch, before_last_backward=getattr(self.grads, "start_last_microbatch", None))
            return self._update(total.detach().float())
        n_micro = batch.shape[0] // self.micro
        self._scale_aux_losses(scale / n_micro)
        total = torch.zeros((), device=self.device)
        start_last = getattr(self.grads, "start_last_microbatch", None)
        inputs = model_inputs(batch, self.micro, self.documents, self.seq_shard)
        weights = None
        if self.token_mean:
            inputs = list(inputs)
            mesh = getattr(self.grads, "mesh", None)
            weights = target_weights([y for _, y, _ in inputs], mesh and mesh.dp_cp_group,
                                     mesh.dp * mesh.cp if mesh else 1, mesh and mesh.recorder)
        for i, (x, y, kwargs) in enumerate(inputs):
            if start_last is not None and i == n_micro - 1:
                start_last()  # gradient buckets are reduced while this last backward is still running
            with forward_ctx(self.precision, self.device, self.offload):
                # Equal tokens per micro-batch (and per cp rank, whose means the reduction over dp x cp
                # averages): the mean of means is the mean. Masked targets: each weighs its share of them.
                loss = self.model(x, y, **kwargs)
                loss = weighted(loss, weights[i]) if weights is not None else loss / n_micro
            (loss * scale if scale != 1.0 else loss).backward()
            total += loss.detach().float()
        return self._update(total)

    def _scale_aux_losses(self, grad_scale: float) -> None:
        """MoE aux losses back-propagate from each layer's output (moe.attach_aux_loss) with the factors the
        language-model loss gets: the fp16 loss scale over the micro-batches per step."""
        for m in self.moe:
            m.aux_grad_scale = grad_scale

    def _update(self, total: torch.Tensor) -> StepOutput:
        """After the last backward: complete gradients over every group, unscale, clip, step."""
        if self.grads is not None:
            self.grads.finish()  # reduce the (scaled) gradients first, so every replica sees the same values
        if self.scaler is not None:
            scale = self.scaler.scale
            local = getattr(self.grads, "local_grads", None)
            grads = local() if local is not None else [p.grad for p in self.model.parameters() if p.grad is not None]
            overflow = self.scaler.found_overflow(grads)
            self.scaler.update(overflow)
            if overflow:  # every rank agrees: skip the update, keep the weights, halve the scale
                self.optimizer.zero_grad(set_to_none=True)
                return StepOutput(total, torch.full((), float("nan"), device=self.device), True)
            torch._foreach_mul_(grads, 1.0 / scale)
        if self.grads is not None:
            grad_norm = self.grads.clip(self.grad_clip)
        else:
            grad_norm = clip_gradients(self.model, self.optimizer, self.grad_clip)
        if self.nan_guard and not bool(torch.isfinite(grad_norm + total).item()):
            # The norm is global (reduced over every group), so every rank takes the same decision.
            self.optimizer.grad_scale = None
            self.optimizer.zero_grad(set_to_none=True)
            return StepOutput(total, grad_norm, True)
        if self.overlap is not None:
            self.overlap.step()
        else:
            self.optimizer.step()
        self.optimizer.grad_scale = None  # a clip folded in by clip_gradients holds for this step only
        self.optimizer.zero_grad(set_to_none=True)
        self._update_router_bias()
        return StepOutput(total, grad_norm, False)

    def _update_router_bias(self) -> None:
        """DeepSeek-V3 aux-loss-free balancing: move each MoE layer's selection bias toward balance, from the
        load seen by all data-parallel replicas (so the biases stay identical everywhere)."""
        mesh = getattr(self.grads, "mesh", None)
        for moe in self.moe:
            if mesh is not None and mesh.dp * mesh.cp > 1:
                comm.all_reduce(moe.load_since_update, mesh.dp_cp_group, recorder=mesh.recorder)
            moe.update_bias()
