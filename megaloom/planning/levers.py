"""The speed levers a user leaves at "auto" (train.compile, train.fused_loss, train.attention, train.bf16_residual,
train.grad_accum_fusion, train.bf16_params), chosen for the device.

A run typed with only the model and the batch should take the fastest path that is proven equal to the plain
one. Each lever turns on where it is supported and was measured to pay (one H200, llama3-1b-untied, seq 4096, bf16;
bench/RESULTS.md), and stays off elsewhere, so CPU runs are what they were; on an accelerator other than CUDA (xpu,
musa, npu, mps: none measured) each stays off as on CPU, but precision auto is bf16 there as on CUDA:

- ``train.compile``: each block compiled (57.8k -> 61.9k tok/s together with the fused loss; fp8 needs it to pay;
  the MoE preset qwen3-moe-2.6b: 50.4k -> 71.5k). Off on CPU (compile time dominates tiny models). With
  parallel.async_tp the compiled blocks overlap through Inductor (parallel/tp_overlap.py); the eager ring is
  train.compile=false.
- ``train.fused_loss``: the chunked head + loss (+7% tok/s and -20 GB at a 128k vocabulary). Needs tp=1 (tensor
  parallelism has its own vocab-parallel loss) and a head without bias (not bert's); kept off with context
  parallelism (not tested there), and with final-logit soft-capping (model.final_softcap: the chunks would skip
  the cap).
- ``train.attention``: FlashAttention-4 (megaloom/fa4.py) where the flash-attn-4 package is installed on Hopper or
  Blackwell (kernel 2.13 vs cuDNN's 2.43 ms at seq 4096, 7.35 vs 8.80 at 16k; steps +2.5% at 4k, +7.9% at 16k,
  +12.7% at 32k; loss within 0.54% of the plain path over 200 steps, 2026-12-04); else cuDNN's SDPA on Hopper or
  newer (2.6 vs flash's 4.2 ms per layer at seq 4096; the other kernels stay fallbacks); PyTorch's own order
  elsewhere. A model with soft-capped attention scores (model.attn_softcap, Gemma 2) gets ``math`` everywhere: no
  fused kernel applies the cap, so its core is the math path, and the memory plan counts its scores.
- ``train.bf16_residual``: the residual stream between blocks in bf16 under bf16/fp8 autocast (Megatron's and
  TorchTitan's numerics; norms and the loss still compute in fp32): +1.0% tok/s at seq 4096 and +1.1% at 16k,
  -1 GB, and the loss within 0.55% of the plain fp32-residual path over 200 steps (2026-12-04). On for the dense
  decoders (the families whose `Family.dense_decoder` says their model is the shared causal pre-norm decoder
  alone: llama, where it was measured, and qwen3 and gpt2, which run the same code); off for MoE (its layer's
  output is fp32 and no run measured it), the other families (encoders, LLaVA: not measured), CPU and fp32/fp16.

- ``train.grad_accum_fusion``: the blocks' weight-gradient GEMMs accumulate into the fp32 data-parallel buckets
  (megaloom/parallel/grad_fusion.py). Proven equal to the plain path on CPU worlds; measured on an H100 (issue 47,
  2026-12-06, the dry run of a llama3-70b tp8 x pp8 x vpp2 4k rank: 832 -> 747 ms, elementwise 190 -> 86 ms), so
  on at auto on CUDA where the buckets allow it (zero 0/1, not zb, not the eager async-tp ring); off elsewhere.

- ``train.bf16_params``: the trained weights in bf16 with fp32 masters in the optimizer (ZeRO-1/2's shards; every
  weight at zero 0; megaloom/parallel/data_parallel.py). Measured on an H100 (2026-12-06, the llama3-70b tp8 pp8
  vpp2 4k rank with the fusion on): first 747 -> 757 ms (the bf16 weights had been left out of the fused weight
  gradients), then with them fused 752 -> 707 ms (61.0 -> 64.9% MFU) and peak 65.3 -> 38.7 GB. On at auto on CUDA
  for bf16 training with ZeRO-1/2 of a dense decoder with AdamW or LAMB (the measured code); off at zero 0 (every
  master kept: +2 bytes a weight, not measured), for MoE, fp8, offload, 1-bit, Muon, LoRA and frozen parts.

Explicit true/false (or a kernel name) is never changed. `resolve_levers` returns the resolved copy, written to
run.dir/config.yaml, and one line per choice for the start-up log.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megaloom import accelerator
from megaloom.accelerator import compute_precision
from megaloom.config import Config
from megaloom.fa4 import fa4_importable
from megaloom.models.registry import get_family


@dataclass(frozen=True)
class LeverChoice:
    key: str  # e.g. "train.compile"
    value: object
    why: str

    def describe(self) -> str:
        shown = ("on" if self.value else "off") if isinstance(self.value, bool) else self.value
        return f"{self.key.removeprefix('train.')} {shown} ({self.why})"


MEASURED_ON = "CUDA"  # where the levers were measured (an H200, bench/RESULTS.md): the reason each says on or off


def _off_cuda(device: str) -> str:
    """Why a lever measured on CUDA alone stays off on ``device``."""
    return "not on CPU" if not accelerator.is_accelerator(device) else f"measured on {MEASURED_ON} only, not {device}"


def _compile(cfg: Config, device: str) -> LeverChoice:
    if not accelerator.is_cuda(device):
        return LeverChoice("train.compile", False, _off_cuda(device))
    return LeverChoice("train.compile", True, MEASURED_ON)


def _fused_loss(cfg: Config, device: str) -> LeverChoice:
    if cfg.model.final_softcap:  # before the device: the same choice everywhere, said the same way
        return LeverChoice("train.fused_loss", False, "model.final_softcap: the chunks would skip the cap")
    if not accelerator.is_cuda(device):
        return LeverChoice("train.fused_loss", False, _off_cuda(device))
    if cfg.parallel.tp > 1:
        return LeverChoice("train.fused_loss", False, "tp>1 has its vocab-parallel loss")
    if cfg.parallel.cp > 1:
        return LeverChoice("train.fused_loss", False, "not with cp>1")
    if get_family(cfg.model.arch).traits.head_bias:
        return LeverChoice("train.fused_loss", False, f"the head has a bias ({cfg.model.arch})")
    return LeverChoice("train.fused_loss", True, f"{MEASURED_ON}, tp=1")


def _attention(device: str, capability: tuple[int, int] | None) -> LeverChoice:
    if accelerator.is_cuda(device) and capability is not None and capability >= (9, 0):
        cc = f"compute capability {capability[0]}.{capability[1]}"
        if capability[0] in (9, 10) and fa4_importable():
            return LeverChoice("train.attention", "fa4", f"{cc}, flash-attn-4 installed")
        return LeverChoice("train.attention", "cudnn", cc)
    why = (_off_cuda(device) if not accelerator.is_cuda(device) else "before Hopper" if capability is not None
           else "GPU unknown")
    return LeverChoice("train.attention", "torch", why)


def _bf16_residual(cfg: Config, device: str) -> LeverChoice:
    precision = compute_precision(cfg, device)
    if not accelerator.is_cuda(device):
        return LeverChoice("train.bf16_residual", False, _off_cuda(device))
    if precision not in ("bf16", "fp8"):
        return LeverChoice("train.bf16_residual", False, f"precision {precision}")
    if not get_family(cfg.model.arch).dense_decoder:  # the family says whether its model is the measured code
        return LeverChoice("train.bf16_residual", False, f"{cfg.model.arch}: not measured")
    if cfg.model.moe_every:
        return LeverChoice("train.bf16_residual", False, "MoE: not measured")
    return LeverChoice("train.bf16_residual", True, f"{MEASURED_ON}, {precision}, dense decoder")


FUSION_MEASURED = "llama3-70b tp8 pp8 vpp2 4k rank 832 -> 747 ms, H100 2026-12-06"


def _grad_accum_fusion(cfg: Config, device: str, compiled: bool) -> LeverChoice:
    # Measured on CUDA (issue 47: the dry run of a large job's rank, many micro-batches of small shapes); off
    # where the buckets it adds into do not live across micro-batches or a weight pass is deferred.
    p = cfg.parallel
    if not accelerator.is_cuda(device):
        return LeverChoice("train.grad_accum_fusion", False, _off_cuda(device))
    if p.zero not in (0, 1):
        return LeverChoice("train.grad_accum_fusion", False, f"parallel.zero={p.zero} frees or shards the buckets")
    if p.schedule == "zb":
        return LeverChoice("train.grad_accum_fusion", False, "the zb schedule defers its weight pass")
    if p.async_tp is True and not compiled and p.tp > 1:
        return LeverChoice("train.grad_accum_fusion", False, "the eager async-tp ring linears")
    return LeverChoice("train.grad_accum_fusion", True, FUSION_MEASURED)


BF16_PARAMS_MEASURED = ("llama3-70b tp8 pp8 vpp2 4k rank 752 -> 707 ms, 65.3 -> 38.7 GB peak, H100 2026-12-06")


def _bf16_params(cfg: Config, device: str) -> LeverChoice:
    # Measured on an H100 (the dry run's 70B rank, bench/run_speed.sh dryrun 70b-4k-bf16p, with the fused weight
    # gradients reaching the bf16 weights): -6% step, -41% peak. On where that is the code that ran: ZeRO-1/2's
    # master shards (zero 0 holds every master: +2 bytes a weight, not measured), bf16, a dense decoder, AdamW/LAMB.
    p, t = cfg.parallel, cfg.train
    name = "train.bf16_params"
    if not accelerator.is_cuda(device):
        return LeverChoice(name, False, _off_cuda(device))
    precision = compute_precision(cfg, device)
    if precision != "bf16":
        return LeverChoice(name, False, f"precision {precision}: not measured")
    if p.zero not in (1, 2) or p.param_gather != "auto":
        return LeverChoice(name, False, f"parallel.zero={p.zero}: no master shards (set true to hold every "
                                        "master at zero 0)" if p.zero not in (1, 2) else "parallel.param_gather")
    if t.optimizer not in ("adamw", "lamb") or t.optimizer_offload:
        return LeverChoice(name, False, f"train.optimizer={t.optimizer}"
                                        f"{' with optimizer_offload' if t.optimizer_offload else ''}")
    if not get_family(cfg.model.arch).dense_decoder or cfg.model.moe_every:
        return LeverChoice(name, False, f"{cfg.model.arch}{' MoE' if cfg.model.moe_every else ''}: not measured")
    if cfg.model.lora.rank or cfg.model.freeze:  # fine-tunes: frozen fp32 weights beside bf16 ones, not measured
        return LeverChoice(name, False, "LoRA / frozen parts: not measured")
    return LeverChoice(name, True, BF16_PARAMS_MEASURED)


def choose_levers(cfg: Config, device: str, capability: tuple[int, int] | None = None) -> list[LeverChoice]:
    """The choice for every lever of ``cfg`` left at "auto" on ``device`` (a device type: "cpu", CUDA's, another
    accelerator's; ``capability``: a CUDA GPU's compute capability when known)."""
    t = cfg.train
    out = []
    if t.compile == "auto":
        out.append(_compile(cfg, device))
    if t.fused_loss == "auto":
        out.append(_fused_loss(cfg, device))
    if t.attention == "auto":
        out.append(LeverChoice("train.attention", "math", "model.attn_softcap: no fused kernel soft-caps the "
                                                          "scores") if cfg.model.attn_softcap
                   else _attention(device, capability))
    if t.bf16_residual == "auto":
        out.append(_bf16_residual(cfg, device))
    if t.grad_accum_fusion == "auto":
        compiled = t.compile is True or any(c.key == "train.compile" and c.value for c in out)
        out.append(_grad_accum_fusion(cfg, device, compiled))
    if t.embedding_grad_fusion == "auto":  # built and proven on CPU; its GPU time not yet measured
        out.append(LeverChoice("train.embedding_grad_fusion", False, "not yet measured on a GPU"))
    if t.bf16_params == "auto":
        out.append(_bf16_params(cfg, device))
    return out


def resolve_levers(cfg: Config, device: str,
                   capability: tuple[int, int] | None = None) -> tuple[Config, list[LeverChoice]]:
    """A copy of ``cfg`` with its "auto" levers resolved, and the choices made (``cfg`` is not changed)."""
    choices = choose_levers(cfg, device, capability)
    if not choices:
        return cfg, []
    train = dataclasses.replace(cfg.train, **{c.key.removeprefix("train."): c.value for c in choices})
    return dataclasses.replace(cfg, train=train), choices


def describe_levers(choices: list[LeverChoice]) -> str:
    """The start-up line: what "auto" chose and why."""
    return "auto: " + ", ".join(c.describe() for c in choices)
