"""The one typed configuration object that flows from the CLI to every part of megaloom.

Every default lives here and nowhere else (the model section's in megaloom/model_keys/, one group of keys per
owner, assembled into `ModelConfig`). A run is described by a YAML file and/or dotted
``key=value`` overrides (``model.preset=tiny train.steps=50``); both are validated against these
dataclasses before anything heavy starts, so a typo or an impossible value fails in milliseconds with
a message that names the key and what would be valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from megaloom.errors import ConfigError as ConfigError
from megaloom.model_keys import LoraConfig as LoraConfig
from megaloom.model_keys import ModelConfig
from megaloom.model_keys import check as check_model_keys
from megaloom.model_keys import resolved_head_dim as resolved_head_dim
from megaloom.model_keys.base import AUTO_BOOL, AutoBool, _f, model_rules
from megaloom.model_keys.base import require as _require
from megaloom.model_keys.shape import resolved_expert_ffn_dim


def _choices(f: dataclasses.Field) -> tuple | None:
    """A field's allowed values; a callable is asked (model.arch: the registered families)."""
    ch = f.metadata.get("choices")
    return ch() if callable(ch) else ch


TRACKERS = ("tensorboard", "wandb", "mlflow")  # run.trackers (megaloom/observe/trackers/)

# The run directory's two configs: the resolved one (every "auto" filled in; what the run is, read back by resume,
# `megaloom generate` and `megaloom convert`) and the one the user gave (defaults as written, to run elsewhere).
RUN_CONFIG = "config.yaml"
REQUESTED_CONFIG = "requested.yaml"

# The model section (ModelConfig, its sub-section LoraConfig, resolved_head_dim) is assembled from one group of keys
# per owner in megaloom/model_keys/; the rules that need a model family are asked through `model_rules()`
# (megaloom/models/rules.py, wired by megaloom/__init__.py): this module imports no family.


@dataclass
class ParallelConfig:
    tp: int = _f(1, "Tensor-parallel size (Megatron column/row layers).")
    pp: int = _f(1, "Pipeline-parallel size.")
    vpp: int = _f(1, "Virtual pipeline stages per pipeline rank (interleaved schedule).")
    cp: int = _f(1, "Context-parallel size: each sequence split over cp ranks (load-balanced causal chunks); "
                    "train.seq_len must be a multiple of 2 * cp.")
    cp_mode: str = _f("auto", "Context-parallel attention: ring (key/value blocks passed around the cp ranks), "
                              "alltoall (Ulysses: heads split instead of the sequence; the heads per tp rank must be "
                              "multiples of cp) or auto (alltoall when the heads divide, else ring).",
                      ("auto", "ring", "alltoall"))
    ep: int = _f(1, "Expert-parallel size (MoE).")
    sp: bool = _f(False, "Sequence parallelism inside tensor-parallel groups.")
    async_tp: AutoBool = _f("auto", "With sp: tensor-parallel communication hidden under the GEMMs. Compiled "
                                    "blocks: Inductor's micro-pipeline TP over CUDA symmetric memory (TorchTitan's "
                                    "async TP; CUDA with NCCL); eager blocks: each region's all-gather and "
                                    "reduce-scatter as tp ring steps (collective matmul, Megatron's tp-comm-overlap). "
                                    "auto = the compiled route where it runs (CUDA, NCCL, train.compile), else off; "
                                    "true = compiled or ring by train.compile.", AUTO_BOOL)
    zero: int = _f(0, "ZeRO stage: 0 off, 1 optimizer state, 2 + gradients, 3 + parameters.", (0, 1, 2, 3))
    schedule: str = _f("1f1b", "Pipeline schedule.", ("gpipe", "1f1b", "interleaved", "zb"))
    pp_first_stage_layers: int = _f(0, "Layers on the first pipeline stage (which also embeds); 0 = balanced. With "
                                       "vpp > 1: the first pipeline rank's layers, all its chunks together.")
    pp_last_stage_layers: int = _f(0, "Layers on the last pipeline stage (it also holds head and loss); 0 = balanced. "
                                      "With vpp > 1: the last pipeline rank's layers, all its chunks together.")
    pp_scatter_gather: bool = _f(True, "With pp > 1 and tp > 1 without sp: each tp rank sends only its 1/tp of a "
                                       "pipeline message (activation or gradient, identical on a stage's tp ranks "
                                       "without sp) and the receiving stage all-gathers it over tp: the inter-stage "
                                       "bytes divided by tp (Megatron-LM's scatter/gather optimisation). With sp the "
                                       "messages are already 1/tp.")
    timeline_step: int = _f(0, "With pp > 1: time every pipeline action of this step and draw the measured "
                               "timeline (run.dir/timeline_step<N>.png/.json); 0 = off.")
    bucket_mb: float = _f(25.0, "Size of the gradient buckets reduced (overlapped with backward) over data parallel.")
    param_gather: str = _f("auto", "ZeRO's parameter all-gathers: auto = in the compute dtype (bf16 when training in "
                                   "bf16/fp8: half the bytes; fp32 master shards kept apart; FSDP2 mixed precision "
                                   "for zero=3), fp32 = full-precision weights on every replica.", ("auto", "fp32"))


@dataclass
class TrainConfig:
    steps: int = _f(600, "Optimizer steps to train for.")
    seed: int = _f(1234, "Seed for initialisation, data order and dropout.")
    global_batch_size: int = _f(16, "Sequences per optimizer step, summed over data-parallel ranks.")
    micro_batch_size: int = _f(8, "Sequences per forward/backward pass; the rest is gradient accumulation. 0 = auto: "
                                  "the largest that divides the per-rank batch and fits the GPU per the memory plan "
                                  "(on CPU: at most 8). Not given and parallel.pp=1: auto. (With pipelines it is "
                                  "chosen by hand: the micro-batch count sets the bubble; 8 when not given.)")
    seq_len: int = _f(128, "Tokens per training sequence.")
    lr: float = _f(3e-3, "Peak learning rate. Models wider than 256 (the published presets) default by width "
                         "instead: 6e-4 to 1.5e-4 (megaloom/models/recipes.py).")
    min_lr: float = _f(3e-4, "Learning rate at the end of the cosine decay (models wider than 256: lr / 10).")
    warmup_steps: int = _f(50, "Linear warmup steps from 0 to lr (models wider than 256: 700 or 2000 by width, at most "
                               "a tenth of train.steps).")
    lr_decay_steps: int = _f(0, "Steps of cosine decay after which lr stays at min_lr; 0 = train.steps.")
    optimizer: str = _f("adamw", "adamw, lamb (layer-wise trust ratio: MegaScale's choice for large batches), or "
                                 "onebit_adam / onebit_lamb: after train.onebit_warmup_steps of plain AdamW / LAMB, "
                                 "the variance (and LAMB's trust ratio) frozen and the data-parallel traffic cut to "
                                 "the momentum's sign bits with error feedback (1-bit Adam / 1-bit LAMB; "
                                 "megaloom/optim/onebit.py; parallel.zero=0), or muon (the blocks' weight matrices "
                                 "by Muon: Nesterov momentum orthogonalised by Newton-Schulz, scaled to AdamW's "
                                 "update RMS so train.lr carries over; AdamW for embeddings, head, norms, biases; "
                                 "megaloom/optim/muon.py; parallel.zero 0, 1 or 2).",
                        ("adamw", "lamb", "onebit_adam", "onebit_lamb", "muon"))
    muon_momentum: float = _f(0.95, "With train.optimizer=muon: the momentum (Nesterov) of the Muon matrices.")
    muon_ns_steps: int = _f(5, "With train.optimizer=muon: Newton-Schulz iterations (bf16, Jordan's quintic "
                               "coefficients) orthogonalising each matrix's update.")
    muon_qk_clip: float = _f(0.0, "With train.optimizer=muon: MuonClip's tau (Kimi K2: after each step, the W_q and "
                                  "W_k rows of a head whose largest pre-softmax logit in the step exceeded tau "
                                  "scaled by sqrt(tau / max); a key head shared by grouped query heads by its group's; "
                                  "megaloom/optim/qk_clip.py). 0 = off. The logits are measured in the attention "
                                  "module (an extra q k^T in fp32, chunked); not with parallel.cp > 1, MLA or "
                                  "QK-norm.")
    onebit_warmup_steps: int = _f(100, "With train.optimizer=onebit_adam / onebit_lamb: steps of uncompressed AdamW / "
                                       "LAMB before the variance freezes and compression starts. The papers warm up "
                                       "for 15-25% of training (DeepSpeed's BERT runs: 23k of 152k steps); too short "
                                       "a warm-up freezes a variance that is still moving.")
    onebit_variance_window: float = _f(0.5, "With train.optimizer=onebit_adam / onebit_lamb: the last fraction of the "
                                            "warm-up whose mean squared gradient becomes the frozen variance (a "
                                            "less noisy estimate than Adam's average at the warm-up's end, which "
                                            "0 keeps, as DeepSpeed does).")
    onebit_variance_updates: int = _f(0, "With train.optimizer=onebit_adam: after the warm-up, keep updating the "
                                         "variance with an uncompressed step at exponentially growing intervals "
                                         "(0/1 Adam's policy, Lu et al. 2022): N updates at each interval, which "
                                         "starts at 1 and doubles after every N (DeepSpeed's var_update_scaler, 16). "
                                         "0 = frozen after the warm-up (1-bit Adam).")
    weight_decay: float = _f(0.1, "Decoupled weight decay (not applied to biases and norm weights).")
    beta1: float = _f(0.9, "AdamW beta1.")
    beta2: float = _f(0.95, "AdamW beta2.")
    grad_clip: float = _f(1.0, "Clip the global gradient norm to this value; 0 = off.")
    precision: str = _f("auto", "auto = fp32 on CPU, bf16 on GPU; fp8 = the blocks' attention and MLP linears in "
                        "float8 (compute capability >= 8.9), the rest bf16.", ("auto", "fp32", "bf16", "fp16", "fp8"))
    fp8_recipe: str = _f("tensorwise", "With precision=fp8: tensorwise (one current scale per tensor, e4m3 forward, "
                         "e5m2 gradients), rowwise (a scale per row, e4m3, weight gradient in bf16) or blockwise "
                         "(DeepSeek-V3's: e4m3 everywhere, a scale per 1x128 tile of activations and gradients and "
                         "per 128x128 block of weights, fp32 accumulation, all three GEMMs in fp8; shapes are "
                         "zero-padded to whole blocks, never refused; torch._scaled_mm's block-scaled kernel on "
                         "compute capability 9.x, an fp32 emulation elsewhere, logged; precision/fp8_block.py).",
                         ("tensorwise", "rowwise", "blockwise"))
    fp8_keep_first_last: bool = _f(True, "With precision=fp8: keep the first and last transformer blocks in bf16.")
    fp8_keep_attention: bool = _f(False, "With precision=fp8: keep the attention projections (q, k, v, o) in bf16 "
                                         "and run only the MLP linears in fp8 (more accurate, less speed-up).")
    fp8_fast_accum: bool = _f(True, "With precision=fp8: the forward GEMM accumulates in the tensor cores' fast, "
                                    "reduced-precision mode (torchao's default); false promotes partial sums to fp32.")
    fp8_experts: bool = _f(False, "With precision=fp8 and an MoE model: the grouped experts' GEMMs in fp8 too "
                                  "(rowwise e4m3 forward and grad-input, weight gradient bf16; "
                                  "torch._scaled_grouped_mm on compute capability 9.x, an fp32 emulation elsewhere, "
                                  "logged; precision/fp8_grouped.py). model.d_model and the expert width per "
                                  "tensor-parallel rank must be multiples of 16. The first and last blocks' experts "
                                  "follow train.fp8_keep_first_last.")
    recompute: str = _f("none", "Activation recomputation.", ("none", "selective", "full"))
    recompute_layers: int = _f(0, "With recompute=full: recompute only the first N blocks of each pipeline stage "
                                  "(of the model without pipeline); 0 = all.")
    recompute_casts: AutoBool = _f("auto", "With train.compile: compiled blocks recompute in backward the cheap values "
                                           "a backward matmul reads (the weights' bf16 copies, norm outputs, the "
                                           "SwiGLU product) instead of saving them (megaloom/training/"
                                           "compile_saves.py): far less activation memory for ~1% of speed. auto = on "
                                           "only on a GPU where the memory plan does not fit without it.", AUTO_BOOL)
    overlap_optimizer: bool = _f(False, "Run the AdamW step on a side CUDA stream, chunk by chunk in the order the "
                                        "next forward reads the weights, each waited for just before its module "
                                        "(megaloom/optim/overlapped_step.py): the memory-bound update beside "
                                        "the next forward's GEMMs. Same update; pp=1, zero=0, adamw only.")
    optimizer_offload: bool = _f(False, "AdamW's state and the fp32 master weights on the host (pinned), the step run "
                                        "by torch's CPU AdamW, the weights copied back in the parameters' dtype "
                                        "(megaloom/optim/offload.py): 12-16 bytes per parameter off the device. "
                                        "zero=0: the host step overlaps the next forward chunk by chunk; ZeRO-1/2: "
                                        "each rank offloads its shard. adamw only; not with zero=3.")
    grad_accum_fusion: AutoBool = _f("auto", "The blocks' linears add their weight gradients straight into the fp32 "
                                             "data-parallel gradient buckets, the GEMM accumulating in fp32 on CUDA, "
                                             "instead of a bf16 gradient, its fp32 copy and an add per micro-batch "
                                             "(Megatron's gradient_accumulation_fusion; megaloom/parallel/"
                                             "grad_fusion.py). Needs the buckets: world > 1, parallel.zero 0 or 1, "
                                             "not the zb schedule. auto = on CUDA where the buckets allow it "
                                             "(measured: a llama3-70b tp8 pp8 vpp2 rank 834 -> 764 ms on an H100), "
                                             "off elsewhere.", AUTO_BOOL)
    embedding_grad_fusion: AutoBool = _f("auto", "With train.grad_accum_fusion, the untied token embedding adds its "
                                                 "weight gradient's rows straight into its fp32 main gradient (an "
                                                 "index_put accumulate on CUDA) instead of a dense [vocab, d] "
                                                 "gradient and its add per micro-batch (megaloom/parallel/"
                                                 "grad_fusion.py). auto = off: not yet measured on a GPU.",
                                         AUTO_BOOL)
    bf16_params: AutoBool = _f("auto", "With parallel.zero 0, 1 or 2, training in bf16 or fp8 (parallel."
                                       "param_gather=auto): the trained weights held in bf16, their fp32 values only "
                                       "in the optimizer's masters: ZeRO's shards (Megatron's distributed optimizer: "
                                       "half the weight memory), every weight at zero 0 (+2 bytes a weight); no "
                                       "per-micro-batch weight casts, ZeRO's all-gather landing in the weights. "
                                       "Norm weights and biases are bf16 too. auto = off (measured on an H100: a "
                                       "llama3-70b rank's peak -41%, its step +1.3%).", AUTO_BOOL)
    offload_activations: bool = _f(False, "Keep the large tensors saved for backward in pinned CPU memory "
                                          "(GPU only; trades PCIe traffic for activation memory).")
    compile: AutoBool = _f("auto", "torch.compile each transformer block. auto = on CUDA (measured to pay for dense "
                                   "and MoE models; megaloom/planning/levers.py), off on CPU and with "
                                   "parallel.async_tp.", AUTO_BOOL)
    fused_loss: AutoBool = _f("auto", "Compute the output head and cross-entropy fused, in chunks of tokens, never "
                                      "holding the full [tokens, vocab] logits (megaloom.models.fused_ce); needs "
                                      "parallel.tp=1 (tensor parallelism has its own vocab-parallel loss). auto = on "
                                      "CUDA with tp=1 and cp=1, off otherwise.", AUTO_BOOL)
    bf16_residual: AutoBool = _f("auto", "With precision bf16 or fp8: keep the residual stream between blocks in bf16 "
                                         "(Megatron's and TorchTitan's numerics) instead of fp32, halving pipeline "
                                         "messages and saved block inputs; norms still compute in fp32, the loss too. "
                                         "auto = on CUDA with bf16/fp8 for the dense decoders (llama, qwen3, gpt2: "
                                         "measured +1% tokens/s, loss within 0.6% over 200 steps), off elsewhere; "
                                         "fp32 runs are unaffected.", AUTO_BOOL)
    attention: str = _f("auto", "Preferred SDPA kernel on GPU (the others remain fallbacks); torch = PyTorch's own "
                                "order; fa4 = FlashAttention-4 for the causal core (pip install flash-attn-4; "
                                "Hopper/Blackwell; megaloom/fa4.py); auto = fa4 where it is installed on Hopper or "
                                "Blackwell, else cudnn on Hopper or newer (both measured fastest there), else "
                                "torch.",
                        ("auto", "torch", "cudnn", "flash", "efficient", "math", "fa4"))
    mtp_loss_weight: float = _f(0.3, "With model.mtp_depth: the multi-token-prediction losses' weight beside the "
                                      "language-model loss (their mean over the depths times this; DeepSeek-V3: 0.3, "
                                      "then 0.1 late in training: train.mtp_loss_weight_late).")
    mtp_loss_weight_late: float = _f(-1.0, "With model.mtp_depth: the weight from step train.mtp_late_step on "
                                           "(DeepSeek-V3 lowers 0.3 to 0.1 for its last 4.8T of 14.8T tokens); < 0 = "
                                           "train.mtp_loss_weight throughout.")
    mtp_late_step: int = _f(0, "With train.mtp_loss_weight_late >= 0: the first step that uses it.")
    log_every: int = _f(10, "Steps between metric lines (loss is averaged over the interval).")
    eval_every: int = _f(200, "Steps between evaluations on the validation split; 0 = only at the end.")
    eval_batches: int = _f(4, "Global batches per evaluation.")
    device: str = _f("auto", "auto = this machine's accelerator (torch.accelerator: cuda, xpu, mps, ...) if one is "
                             "available, else cpu; or cpu; or an accelerator type torch knows (cuda, xpu, musa, npu, "
                             "mps, ...: each rank on the device of its local rank); or TYPE:N (one process per node "
                             "only: several on one device are refused). The process group's backend is torch's for "
                             "the type (nccl, xccl, gloo, ...; megaloom/accelerator.py). Tested: cpu, cuda.")


@dataclass
class DataConfig:
    paths: list[str] = _f([], "Token-file prefixes from `megaloom preprocess`; empty = embedded default corpus. With "
                              "data.format=chat: JSONL conversation files (or folders of them).")
    weights: list[float] = _f([], "Blending weights, one per path; empty = proportional to token counts.")
    tokenizer: str = _f("", "Path to a tokenizer.json; empty = the default BPE trained on the embedded corpus.")
    split: str = _f("98,2", "train,valid percentages of documents.")
    cache_dir: str = _f("", "Cache for the default corpus and sample indices; empty = $MEGALOOM_CACHE or "
                            "~/.cache/megaloom.")
    num_workers: int = _f(1, "Background data-loading processes (0 = load in the training process).")
    prefetch: int = _f(2, "Batches prefetched per loading process.")
    default_vocab_size: int = _f(8192, "Vocabulary of the default tokenizer trained on the embedded corpus.")
    document_mask: bool = _f(False, "Attention stays inside each document of a packed sample (documents end with the "
                                    "tokenizer's EOD token): as if every document were its own sample.")
    reset_positions: bool = _f(False, "Positions (RoPE angles, learned position rows) restart at 0 with each "
                                      "document of a packed sample.")
    format: str = _f("tokens", "tokens = token files (data.paths) or the default corpus, packed across documents; "
                               "chat = supervised fine-tuning on conversations (JSONL, {\"messages\": [{\"role\": ..., "
                               "\"content\": ...}]} a line; or Parquet / datasets .arrow / save_to_disk tables, "
                               "data.chat_column), rendered with data.chat_template, packed whole with "
                               "document masks and restarting positions (on unless set, with parallel.pp=1), the "
                               "loss on assistant tokens only (megaloom/data/chat/).", ("tokens", "chat"))
    chat_template: str = _f("auto", "With data.format=chat: auto = the template shipped with data.tokenizer "
                                    "(chat_template.jinja or tokenizer_config.json's chat_template beside it, "
                                    "rendered with jinja2), else chatml; or a built-in one by name: chatml, llama3; "
                                    "or a .jinja file.")
    chat_column: str = _f("messages", "With data.format=chat and tables in data.paths (Parquet, datasets .arrow "
                                      "files, save_to_disk folders): the column holding each row's conversation, a "
                                      "list of {role, content} messages.")
    chat_split: str = _f("", "With data.format=chat and a saved DatasetDict folder in data.paths: the split to train "
                             "on (e.g. train); empty = its only split (one of several is refused, naming them).")
    images: str = _f("", "Image-text data for a multimodal model (model.vision_layers > 0): a folder of *.jsonl "
                         "records with their images, or of WebDataset-style *.tar shards; empty = a generated "
                         "synthetic set (shapes and colours with captions).")
    max_images: int = _f(4, "Most images in one packed training row (several image-text samples share a row).")
    synthetic_samples: int = _f(2000, "Image-text pairs in the generated synthetic set (data.images empty).")


@dataclass
class CheckpointConfig:
    every: int = _f(200, "Steps between checkpoints; 0 = only at the end.")
    keep: int = _f(3, "Most recent checkpoints kept; older ones are deleted.")
    resume: str = _f("auto", "auto = latest in run.dir if any; none = start fresh; or a checkpoint directory.")
    async_save: bool = _f(True, "Two-stage save: copy to host memory at the step boundary, write in the background "
                                "(every rank its own slices).")
    final: bool = _f(True, "Save at the last step. false for throwaway runs (benchmarks, parity checks): a 1B "
                           "model's 18 GB of weights and optimizer state are not written.")
    timeout_s: float = _f(3600.0, "Timeout of the checkpoint process group (save barriers, checksum gathering, the "
                                  "vote on which checkpoint verified): slow storage must not trip the training "
                                  "collectives' timeout.")
    allow_data_change: bool = _f(False, "Resume even though the token files differ from those the checkpoint was "
                                        "trained on (each checkpoint records their sizes, token counts and hashes "
                                        "of the index and a sample of the tokens; a mismatch is refused by "
                                        "default). The data stream then continues at the same step on the new data: "
                                        "no longer the samples the uninterrupted run would have read.")


@dataclass
class RunConfig:
    dir: str = _f("runs/default", "Run directory: config.yaml (resolved), requested.yaml (as given), metrics.jsonl, "
                                         "checkpoints/, TensorBoard events.")
    tensorboard: bool = _f(True, "Write TensorBoard event files into run.dir (with tensorboard in run.trackers; false "
                                 "turns them off whatever run.trackers says).")
    trackers: list[str] = _f(["tensorboard"], "Where the numbers of each metrics.jsonl record also go (rank 0; "
                                              "metrics.jsonl is always written): any of tensorboard, wandb (pip "
                                              "install 'megaloom[wandb]'; WANDB_MODE=offline needs no account), "
                                              "mlflow (pip install 'megaloom[mlflow]'). A tracker that cannot "
                                              "start stops the run before its first step (see "
                                              "run.trackers_optional); one that fails later warns once and is left "
                                              "out; training goes on.")
    trackers_optional: bool = _f(False, "A tracker of run.trackers that cannot start (not installed, a server that "
                                        "does not answer, a store MLflow refuses) only warns and is left out; false: "
                                        "it is an error before the first step.")
    project: str = _f("megaloom", "The W&B project and MLflow experiment the run logs into (run.trackers).")
    mlflow_uri: str = _f("", "MLflow tracking URI (e.g. http://host:5000, sqlite:////abs/path/mlflow.db); empty "
                             "= $MLFLOW_TRACKING_URI, else sqlite:///<run.dir>/mlflow.db (a local database, which "
                             "current MLflow accepts; its file store file:/path/mlruns needs "
                             "MLFLOW_ALLOW_FILE_STORE=true).")


@dataclass
class ResilienceConfig:
    nan_guard: bool = _f(True, "Skip an optimizer step whose loss or gradient norm is not finite (all ranks agree).")
    max_bad_steps: int = _f(3, "Non-finite steps in a row after which the run rolls back to the last checkpoint "
                               "and skips the data window that caused them.")
    max_rollbacks: int = _f(3, "Rollbacks one run may make; the next run of bad steps stops it (exit 1). A run that "
                               "diverges again before passing the step of its last rollback, on other data, stops "
                               "at once: the data is not the cause. 0 = stop at the first run of bad steps.")
    heartbeat: bool = _f(True, "Each rank writes run.dir/heartbeat/rank<N>.json (step, time, last op).")
    heartbeat_every_s: float = _f(10.0, "Seconds between a rank's heartbeat writes (one small file write per rank "
                                        "per interval, from one background thread): 1,024 ranks make ~100 writes/s.")
    hang_timeout_s: float = _f(900.0, "Seconds without a finished step after which the watchdog reports and exits "
                                      "non-zero (torchrun restarts); 0 = off. Not armed before the first step.")
    collective_timeout_s: float = _f(1800.0, "Timeout of every training process group (NCCL/gloo): a collective "
                                             "stuck this long aborts the job. Must exceed resilience.hang_timeout_s "
                                             "so that megaloom's watchdog reports (who is stuck where) first.")
    init_timeout_s: float = _f(0.0, "Timeout of the training process groups until the first step has finished "
                                    "(communicator set-up, torch.compile, the data-cache build); then they take "
                                    "resilience.collective_timeout_s (TorchTitan's init/train timeouts). "
                                    "0 = 2 x resilience.collective_timeout_s.")
    straggler_every: int = _f(100, "Steps between straggler checks (per-rank compute time vs the median); 0 = off.")
    straggler_factor: float = _f(1.5, "A rank is a straggler when its compute time exceeds the median by this factor.")
    save_on_signal: bool = _f(True, "SIGTERM / SIGUSR1 (preemption) or Ctrl-C: every rank saves the same step at a "
                                    "step boundary they agree on, then the run stops (exit 0; Ctrl-C 130). A second "
                                    "Ctrl-C stops at once. false: the signals act as without megaloom.")
    signal_check_every: int = _f(1, "Steps between the ranks' checks for a stop signal (one 4-byte all-reduce on a "
                                    "gloo group, overlapped with the next steps). Raise it for thousands of ranks "
                                    "with short steps; the stop comes up to 2x this many steps after the signal.")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


SECTIONS: dict[str, type] = {f.name: f.type for f in fields(Config)}  # type: ignore[misc]
_SECTION_TYPES = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig, "data": DataConfig,
                  "checkpoint": CheckpointConfig, "run": RunConfig, "resilience": ResilienceConfig}


def _keys_of(cls: type, prefix: str) -> list[str]:
    """The dotted keys of a section's dataclass; a field that is a dataclass itself (a sub-section, model.lora)
    contributes its own keys one level deeper (model.lora.rank)."""
    out = []
    for name, typ in _field_types(cls).items():
        if dataclasses.is_dataclass(typ):
            out += _keys_of(typ, f"{prefix}{name}.")
        else:
            out.append(f"{prefix}{name}")
    return out


def all_keys() -> list[str]:
    return [k for s, cls in _SECTION_TYPES.items() for k in _keys_of(cls, f"{s}.")]


@functools.cache
def _subsections() -> frozenset[str]:
    """Keys naming a sub-section (model.lora): in YAML a mapping of its own keys. Computed once: reading a
    config.yaml asked for it once per key, and each time walked every class's type hints (0.6 s a file)."""
    return frozenset(k.rsplit(".", 1)[0] for k in all_keys() if k.count(".") > 1)


def _set_key(cfg: Config, key: str, value: Any) -> None:
    """Set the (known) dotted ``key`` of ``cfg``, checked against its annotated type."""
    *path, name = key.split(".")
    obj: Any = cfg
    for part in path:
        obj = getattr(obj, part)
    setattr(obj, name, _coerce(key, value, _field_types(type(obj))[name]))


def _suggest(key: str, options: list[str]) -> str:
    close = difflib.get_close_matches(key, options, n=1, cutoff=0.5)
    return f" Did you mean '{close[0]}'?" if close else ""


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Check ``value`` against the annotated type, converting YAML scalars where it is lossless."""
    origin = typing.get_origin(typ)
    if origin in (list, types.GenericAlias) or origin is list:
        (item,) = typing.get_args(typ)
        if isinstance(value, str):  # "a,b" on the command line
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {value!r}. Use a YAML list or comma-separated values.")
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if typ == AutoBool:  # true / false / auto
        if isinstance(value, str) and value.lower() == "auto":
            return "auto"
        try:
            return _coerce(key, value, bool)
        except ConfigError:
            raise ConfigError(f"{key}: expected true, false or auto, got {value!r}.") from None
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "on", "off", "yes", "no", "1", "0"):
            return value.lower() in ("true", "on", "yes", "1")
        raise ConfigError(f"{key}: expected true or false, got {value!r}.")
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}.")
        return value
    if typ is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {value!r}.")
        return float(value)
    if typ is str:
        if isinstance(value, bool | list | dict) or value is None:
            raise ConfigError(f"{key}: expected a string, got {value!r}.")
        return str(value)
    raise AssertionError(f"unsupported config type {typ} for {key}")


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """A config class's field types (cached: the classes do not change; callers only read the mapping)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form key=value (e.g. train.steps=50).")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    if value is None:
        value = raw
    return key.strip(), value


def _flatten(d: dict, where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for section, body in d.items():
        if section not in _SECTION_TYPES:
            raise ConfigError(f"{where}: unknown section '{section}'.{_suggest(section, list(_SECTION_TYPES))} "
                              f"Valid sections: {', '.join(_SECTION_TYPES)}.")
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"{where}: section '{section}' must be a mapping of keys to values.")
        for k, v in body.items():
            _flatten_into(out, f"{section}.{k}", v, where)
    return out


def _flatten_into(out: dict[str, Any], key: str, value: Any, where: str) -> None:
    """``key: value``, or a sub-section's mapping (model: {lora: {rank: 8}}) as its dotted keys."""
    if key in _subsections():
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: '{key}' is a section of its own: give its keys as a mapping "
                              f"({key}: {{...}}) or as dotted keys ({key}.<name>).")
        for k, v in value.items():
            _flatten_into(out, f"{key}.{k}", v, where)
    else:
        out[key] = value


def load_yaml(path: Path, what: str) -> Any:
    """A YAML file's content (safe loader: no Python tags); a syntax error or a refused tag is one ConfigError line
    naming the file, the place and the problem."""
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        if isinstance(e, yaml.constructor.ConstructorError):
            problem += " (only plain YAML is read: Python tags are refused)"
        raise ConfigError(f"{what} {path}: not valid YAML{where}: {problem}.") from e


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- model preset <- YAML file <- command-line overrides, then validation."""
    values: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--config: file '{p}' not found.")
        data = load_yaml(p, "--config") or {}
        if not isinstance(data, dict):
            raise ConfigError(f"--config {p}: expected a mapping of sections (model:, train:, ...).")
        values.update(_flatten(data, str(p)))
    for item in overrides:
        k, v = parse_override(item)
        values[k] = v

    valid = all_keys()
    for k in values:
        if k not in valid:
            raise ConfigError(f"unknown config key '{k}'.{_suggest(k, valid)} "
                              f"See `megaloom config --list` for every key.")

    cfg = Config()
    preset = values.get("model.preset", cfg.model.preset)
    PRESETS = model_rules().presets()
    if not isinstance(preset, str) or preset not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {preset!r}.{_suggest(str(preset), list(PRESETS))} "
                          f"Valid: {', '.join(PRESETS)}.")
    for k, v in PRESETS[preset].items():
        setattr(cfg.model, k, v)
    cfg.model.preset = preset

    for k, v in values.items():
        _set_key(cfg, k, v)
    _apply_size_defaults(cfg, set(values))
    if "train.micro_batch_size" not in values and cfg.parallel.pp == 1:
        cfg.train.micro_batch_size = 0  # auto: the memory plan picks it for the device (training/resolve.py)
    if cfg.data.format == "chat":
        # Packed conversations must not see each other, and each starts at position 0 as at inference.
        for key in ("document_mask", "reset_positions"):
            if f"data.{key}" not in values:
                setattr(cfg.data, key, True)
    validate(cfg)
    return cfg


def _apply_size_defaults(cfg: Config, given: set[str]) -> None:
    """Learning rate, warm-up, min_lr and init std by the model's width (megaloom/models/recipes.py), for each key
    the user did not give."""
    defaults = model_rules().size_defaults(cfg.model)
    if not defaults:
        return
    for key, value in defaults.items():
        if key not in given:
            section, name = key.split(".", 1)
            setattr(getattr(cfg, section), name, value)
    if "train.warmup_steps" not in given:  # a short run still reaches its peak lr
        cfg.train.warmup_steps = min(cfg.train.warmup_steps, max(1, cfg.train.steps // 10))
    if "train.min_lr" not in given:
        cfg.train.min_lr = float(f"{cfg.train.lr / 10:.6g}")


def config_from_dict(d: dict) -> Config:
    """Rebuild a Config from a resolved config.yaml (as written into a run directory)."""
    flat = _flatten(d, "config.yaml")
    cfg = Config()
    known = set(all_keys())
    for k, v in flat.items():
        if k not in known:
            raise ConfigError(f"config.yaml: unknown key '{k}'.{_suggest(k, all_keys())}")
        _set_key(cfg, k, v)
    validate(cfg)
    return cfg


# train.device's form: auto, cpu, or TYPE[:N]. Whether this torch knows TYPE and the machine has one is checked by
# megaloom/accelerator.py (`check_type` in preflight, `check` when the rank picks its device), which imports torch;
# config.py does not (every command, `megaloom status` too, loads it), so the form and the names live here.
DEVICE_FORM = re.compile(r"auto|cpu|(?!cpu:|auto:)[a-z][a-z0-9_]*(:\d+)?")
DEVICE_TYPES_NAMED = "cuda, xpu, musa, npu, mps, ..."  # the accelerator types messages name (any torch knows works)


def _check_timeouts(r: ResilienceConfig) -> None:
    """The order of the timeouts: heartbeat interval < watchdog < process-group timeout."""
    _require(r.heartbeat_every_s > 0, f"resilience.heartbeat_every_s must be > 0, got {r.heartbeat_every_s}.")
    _require(r.collective_timeout_s > 0,
             f"resilience.collective_timeout_s must be > 0, got {r.collective_timeout_s} (e.g. 1800).")
    _require(r.init_timeout_s == 0 or r.init_timeout_s >= r.collective_timeout_s,
             f"resilience.init_timeout_s ({r.init_timeout_s:g}) must be 0 (auto) or at least "
             f"resilience.collective_timeout_s ({r.collective_timeout_s:g}): it covers the first step, which only "
             "takes longer than the others.")
    if r.hang_timeout_s > 0:
        _require(r.collective_timeout_s > r.hang_timeout_s,
                 f"resilience.collective_timeout_s ({r.collective_timeout_s:g}) must exceed "
                 f"resilience.hang_timeout_s ({r.hang_timeout_s:g}): the process group would abort before the "
                 f"watchdog reports who is stuck. Raise it (e.g. {2 * r.hang_timeout_s:g}) or lower the watchdog's.")


def _check_muon(cfg: Config) -> None:
    """train.optimizer=muon: its settings, and the layouts it cannot serve (megaloom/optim/muon.py says why)."""
    t, p = cfg.train, cfg.parallel
    _require(0 <= t.muon_momentum < 1, f"train.muon_momentum must be in [0, 1), got {t.muon_momentum}; e.g. 0.95.")
    _require(t.muon_ns_steps >= 1, f"train.muon_ns_steps must be >= 1, got {t.muon_ns_steps}; e.g. 5.")
    _require(t.muon_qk_clip >= 0, f"train.muon_qk_clip is a logit threshold (tau > 0) or 0 (off), got "
                                  f"{t.muon_qk_clip}; e.g. train.muon_qk_clip=100.")
    _require(p.zero in (0, 1, 2),
             f"train.optimizer=muon with parallel.zero={p.zero}: FSDP2 (ZeRO-3) shards every matrix by rows and "
             "updates the shards with no step at which Muon could gather the whole matrix for Newton-Schulz; set "
             "parallel.zero=1 or 2 (Muon's momentum stays sharded) or train.optimizer=adamw.")
    # QK-clip (megaloom/optim/qk_clip.py): the layouts whose attention it cannot measure or scale are refused there
    # (MLA, QK-norm, LoRA-frozen q/k: read from the built model); this one is a setting.
    _require(not t.muon_qk_clip or p.cp == 1,
             f"train.muon_qk_clip={t.muon_qk_clip} with parallel.cp={p.cp}: the attention runs on pieces of the "
             "sequence and no module sees a head's whole scores; set parallel.cp=1 or train.muon_qk_clip=0.")


def validate(cfg: Config) -> None:
    """Reject impossible values with a message naming the key and what would work. The checks run in this order
    (a config with several mistakes reports the first), each group a function of its own."""
    _check_choices(cfg)
    _check_bounds(cfg)
    check_model_keys(cfg.model, cfg.data.max_images, cfg.train.seq_len)  # the image encoder, the heads
    model_rules().check(cfg)  # the model section against its family (megaloom/models/rules.py)
    _check_parallel(cfg)
    _check_optimizer(cfg)
    _check_levers(cfg)
    _check_batch_and_io(cfg)


def _check_choices(cfg: Config) -> None:
    """Every field with declared choices holds one of them."""
    for section, cls in _SECTION_TYPES.items():
        obj = getattr(cfg, section)
        for f in fields(cls):
            choices = _choices(f)
            if choices and getattr(obj, f.name) not in choices:
                v = getattr(obj, f.name)
                raise ConfigError(f"{section}.{f.name}: {v!r} is not one of {', '.join(map(str, choices))}."
                                  f"{_suggest(str(v), [str(c) for c in choices])}")


def _check_bounds(cfg: Config) -> None:
    """The counts and sizes that must be positive or non-negative, and the ranges of rates and timeouts."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    for key, v in [("model.n_layers", m.n_layers), ("model.d_model", m.d_model), ("model.n_heads", m.n_heads),
                   ("model.max_seq_len", m.max_seq_len), ("train.steps", t.steps),
                   ("train.global_batch_size", t.global_batch_size),
                   ("train.seq_len", t.seq_len), ("train.log_every", t.log_every),
                   ("train.eval_batches", t.eval_batches), ("parallel.tp", p.tp), ("parallel.pp", p.pp),
                   ("parallel.vpp", p.vpp), ("parallel.cp", p.cp), ("parallel.ep", p.ep),
                   ("checkpoint.keep", cfg.checkpoint.keep),
                   ("resilience.max_bad_steps", cfg.resilience.max_bad_steps),
                   ("resilience.signal_check_every", cfg.resilience.signal_check_every)]:
        _require(v >= 1, f"{key} must be >= 1, got {v}.")
    for key, v in [("model.n_kv_heads", m.n_kv_heads), ("model.ffn_dim", m.ffn_dim),
                   ("model.vocab_size", m.vocab_size), ("model.sliding_window", m.sliding_window),
                   ("train.micro_batch_size", t.micro_batch_size),
                   ("train.warmup_steps", t.warmup_steps), ("train.lr_decay_steps", t.lr_decay_steps),
                   ("train.eval_every", t.eval_every), ("train.recompute_layers", t.recompute_layers),
                   ("parallel.timeline_step", p.timeline_step),
                   ("checkpoint.every", cfg.checkpoint.every),
                   ("data.num_workers", cfg.data.num_workers), ("train.weight_decay", t.weight_decay),
                   ("train.grad_clip", t.grad_clip), ("train.min_lr", t.min_lr),
                   ("resilience.hang_timeout_s", cfg.resilience.hang_timeout_s),
                   ("resilience.straggler_every", cfg.resilience.straggler_every),
                   ("resilience.max_rollbacks", cfg.resilience.max_rollbacks)]:
        _require(v >= 0, f"{key} must be >= 0, got {v}.")
    _require(t.lr > 0, f"train.lr must be > 0, got {t.lr}.")
    _require(p.bucket_mb > 0, f"parallel.bucket_mb must be > 0, got {p.bucket_mb}.")
    _require(cfg.resilience.straggler_factor > 1, "resilience.straggler_factor must be > 1 (e.g. 1.5).")
    _check_timeouts(cfg.resilience)
    _require(t.min_lr <= t.lr, f"train.min_lr ({t.min_lr}) must not exceed train.lr ({t.lr}).")
    _require(0 <= m.dropout < 1, f"model.dropout must be in [0, 1), got {m.dropout}.")
    _require(0 <= t.beta1 < 1 and 0 <= t.beta2 < 1, "train.beta1 and train.beta2 must be in [0, 1).")


def _check_parallel(cfg: Config) -> None:
    """Settings of the parallel section that depend on each other."""
    p = cfg.parallel
    if p.async_tp is True and p.tp > 1:
        _require(p.sp, "parallel.async_tp=true overlaps sequence parallelism's all-gathers and reduce-scatters with "
                       "the GEMMs; set parallel.sp=true (or parallel.async_tp=auto or false).")


def _check_optimizer(cfg: Config) -> None:
    """The optimizer's own settings and the layouts each optimizer serves."""
    t, p = cfg.train, cfg.parallel
    if t.optimizer.startswith("onebit"):
        _require(t.onebit_warmup_steps >= 1,
                 f"train.onebit_warmup_steps must be >= 1 (the variance is frozen where the warm-up leaves it), got "
                 f"{t.onebit_warmup_steps}; e.g. train.onebit_warmup_steps={max(1, t.steps // 5)}.")
        _require(0 <= t.onebit_variance_window <= 1,
                 f"train.onebit_variance_window is a fraction of the warm-up (0 to 1), got {t.onebit_variance_window}; "
                 "e.g. train.onebit_variance_window=0.5 (its second half), or 0 for Adam's variance at its end.")
        _require(t.onebit_variance_updates >= 0 and (t.onebit_variance_updates == 0 or t.optimizer == "onebit_adam"),
                 f"train.onebit_variance_updates={t.onebit_variance_updates}: a count of updates per interval (>= 0) "
                 "that refreshes 1-bit Adam's variance; 1-bit LAMB's frozen trust ratios assume a frozen variance. "
                 "Set it to 0, or e.g. 16 with train.optimizer=onebit_adam.")
        _require(p.zero == 0,
                 f"train.optimizer={t.optimizer} with parallel.zero={p.zero}: 1-bit compression keeps the momentum and "
                 "the frozen variance of every parameter on every data-parallel rank (each rank updates the whole "
                 "momentum from its own gradient and applies the same decompressed momentum to all its weights), so "
                 "ZeRO would have to all-gather the parameters every step, the traffic 1-bit compression removes. Set "
                 "parallel.zero=0, or keep ZeRO with train.optimizer=adamw or lamb.")
    if t.optimizer == "muon":
        _check_muon(cfg)
    if t.overlap_optimizer:
        _require(p.pp == 1 and p.zero == 0 and t.optimizer == "adamw",
                 f"train.overlap_optimizer=true needs one model replica's whole AdamW per rank (parallel.pp=1, "
                 f"parallel.zero=0, train.optimizer=adamw); got pp={p.pp}, zero={p.zero}, optimizer={t.optimizer}. "
                 "Set train.overlap_optimizer=false, or those settings.")
    if t.optimizer_offload:
        _require(t.optimizer == "adamw" and p.zero in (0, 1, 2) and not t.overlap_optimizer,
                 f"train.optimizer_offload=true runs torch's AdamW on the host over whole parameters (parallel.zero=0) "
                 f"or each rank's ZeRO-1/2 shard; got train.optimizer={t.optimizer}, parallel.zero={p.zero}, "
                 f"train.overlap_optimizer={t.overlap_optimizer}. Set train.optimizer=adamw, parallel.zero 0, 1 or 2 "
                 "and train.overlap_optimizer=false (offload overlaps its own step), or train.optimizer_offload=false.")


def _check_levers(cfg: Config) -> None:
    """The speed and memory levers set to true: each needs the layout it was built for."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    _require(t.bf16_params is not True or (p.zero in (0, 1, 2) and p.param_gather == "auto"
                                            and t.optimizer in ("adamw", "lamb")
                                            and not (t.optimizer_offload and p.zero == 0)),
             f"train.bf16_params=true keeps the fp32 weights only in the optimizer's masters (ZeRO's shards, or every "
             f"weight at zero 0): it needs parallel.zero 0, 1 or 2 (got {p.zero}; ZeRO-3 has FSDP2's own bf16 "
             f"policy), parallel.param_gather=auto (got {p.param_gather}) and AdamW or LAMB (got train.optimizer="
             f"{t.optimizer}; at zero 0 not with train.optimizer_offload, whose host masters start from the "
             f"parameters); set train.bf16_params=false or auto, or those settings.")
    ring = p.async_tp is True and t.compile is not True and p.tp > 1  # eager ring linears (may: compile auto)
    _require(t.grad_accum_fusion is not True or (p.zero in (0, 1) and p.schedule != "zb" and not ring),
             f"train.grad_accum_fusion=true adds weight gradients into the data-parallel buckets that parallel.zero "
             f"0 and 1 keep (zero={p.zero}), outside the zero-bubble schedule's deferred weight pass (schedule="
             f"{p.schedule}) and the eager async-tp ring linears (async_tp={p.async_tp}, compile={t.compile}); set "
             "train.grad_accum_fusion=false or auto, or change those settings.")
    _require(t.embedding_grad_fusion is not True or t.grad_accum_fusion is not False,
             "train.embedding_grad_fusion=true adds the embedding's gradient into the buckets as train."
             "grad_accum_fusion does for the linears; with train.grad_accum_fusion=false there is no fused path: set "
             "train.grad_accum_fusion=true (or auto, on a GPU) or train.embedding_grad_fusion=false.")
    _require(t.recompute_casts is not True or t.compile is not False,
             "train.recompute_casts=true changes what compiled blocks save, and train.compile=false compiles none; "
             "set train.compile=true (or auto, on a GPU) or leave train.recompute_casts at auto.")
    _check_fp8_experts(m, t, p)
    _require(t.bf16_residual is not True or t.precision in ("auto", "bf16", "fp8"),
             f"train.bf16_residual=true with train.precision={t.precision}: a bf16 residual stream needs bf16 "
             "autocast. Use train.precision=bf16 (or fp8), or train.bf16_residual=false.")
    _require(not (t.fused_loss is True and p.tp > 1),
             f"train.fused_loss=true with parallel.tp={p.tp}: tensor parallelism computes its own vocab-parallel "
             "loss over the head's shards; set train.fused_loss=false or parallel.tp=1.")


def _check_batch_and_io(cfg: Config) -> None:
    """Sequence length and batch sizes, the device's form, trackers, chat template, data weights, resume."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    _require(t.seq_len <= m.max_seq_len,
             f"train.seq_len ({t.seq_len}) exceeds model.max_seq_len ({m.max_seq_len}); "
             f"lower train.seq_len or raise model.max_seq_len.")
    _require(t.micro_batch_size > 0 or p.pp == 1,
             f"train.micro_batch_size=0 (auto) with parallel.pp={p.pp}: with pipelines the number of micro-batches "
             "sets the bubble, so choose it: set train.micro_batch_size (e.g. from `megaloom memory --gpu-gb`).")
    _require(t.micro_batch_size == 0 or t.global_batch_size % t.micro_batch_size == 0,
             f"train.global_batch_size ({t.global_batch_size}) must be a multiple of train.micro_batch_size "
             f"({t.micro_batch_size}) times the data-parallel size.")
    _require(DEVICE_FORM.fullmatch(t.device) is not None,
             f"train.device: {t.device!r} is not auto, cpu, or an accelerator type with an optional index (TYPE or "
             f"TYPE:N, lower case as torch.device spells it: {DEVICE_TYPES_NAMED}).")
    for name in cfg.run.trackers:
        _require(name in TRACKERS, f"run.trackers: {name!r} is not one of {', '.join(TRACKERS)}."
                                   f"{_suggest(name, list(TRACKERS))}")
    _require(cfg.data.chat_template in ("auto", "chatml", "llama3") or cfg.data.chat_template.endswith(".jinja"),
             f"data.chat_template: {cfg.data.chat_template!r} is not auto, chatml, llama3 or a .jinja file."
             f"{_suggest(cfg.data.chat_template, ['auto', 'chatml', 'llama3'])}")
    if cfg.data.weights:
        _require(len(cfg.data.weights) == len(cfg.data.paths),
                 f"data.weights has {len(cfg.data.weights)} entries but data.paths has {len(cfg.data.paths)}; "
                 "give one weight per path or none.")
    r = cfg.checkpoint.resume
    _require(r in ("auto", "none") or bool(r), "checkpoint.resume must be auto, none or a checkpoint directory.")


def _check_fp8_experts(m: ModelConfig, t: TrainConfig, p: ParallelConfig) -> None:
    """train.fp8_experts: fp8 training of a model with MoE layers whose expert GEMMs fp8 kernels can take."""
    if not t.fp8_experts:
        return
    _require(t.precision == "fp8", f"train.fp8_experts=true runs the MoE experts' GEMMs in float8 and needs "
                                   f"train.precision=fp8 (got {t.precision}); set train.precision=fp8 or "
                                   "train.fp8_experts=false.")
    _require(bool(m.moe_every), "train.fp8_experts=true but this model has no MoE layers (model.moe_every=0); set "
                                "train.fp8_experts=false.")
    width = resolved_expert_ffn_dim(m)
    local = width // p.tp if width % p.tp == 0 else width  # a width tp does not divide is refused where it is split
    _require(m.d_model % 16 == 0 and local % 16 == 0,
             f"train.fp8_experts=true: the fp8 grouped GEMMs need model.d_model ({m.d_model}) and the expert width "
             f"per tensor-parallel rank ({local}: model.expert_ffn_dim or the MLP width, / parallel.tp={p.tp}) to be "
             "multiples of 16; change them or set train.fp8_experts=false.")


def describe_keys() -> str:
    """Every key with its default and docstring: the config reference (`megaloom config --list`)."""
    lines = []
    for section, cls in _SECTION_TYPES.items():
        lines.append(f"[{section}]")
        lines += _describe(cls(), f"{section}.")
    return "\n".join(lines)


def _describe(inst: Any, prefix: str) -> list[str]:
    lines = []
    for f in fields(inst):
        value = getattr(inst, f.name)
        if dataclasses.is_dataclass(value):  # a sub-section: its keys, one level deeper
            lines += _describe(value, f"{prefix}{f.name}.")
            continue
        ch = _choices(f)
        extra = f" (one of: {', '.join(map(str, ch))})" if ch else ""
        lines.append(f"  {prefix}{f.name} = {value!r}  # {f.metadata['help']}{extra}")
    return lines
