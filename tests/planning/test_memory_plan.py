"""The memory plan's activation model against what autograd really saves.

One forward of a tiny model runs under `torch.autograd.graph.saved_tensors_hooks`; every tensor saved for
backward is recorded by its storage (unique storages, their full size; parameters and buffers excluded, as
they are counted as weights). Saved bf16 copies of weights (autocast's casts) are told apart by their
autograd history (a ToCopy of a parameter) and compared with `weight_cast_bytes`; everything else with the
predicted embedding + blocks + head bytes. Per-block bytes are the difference between a 4- and a 2-block
model, so they do not depend on how saved tensors are attributed to modules.

On CPU, `device="cpu"` is predicted: PyTorch's composite RMSNorm (which also saves x * rsqrt) and its CPU
flash kernel (q, k, v, out, logsumexp, as flash / cuDNN on GPU) or, with dropout, the math backend. The
same comparison runs with `device="cuda"` on a GPU (marked gpu): fused RMSNorm, flash / cuDNN attention,
grouped GEMMs for MoE.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from megaloom.config import load_config
from megaloom.models import Transformer, apply_recompute
from megaloom.models.attention_kernel import attention_backend
from megaloom.observe.saved_tensors import SavedStorages
from megaloom.planning.memory_activations import (
    block_activation_bytes,
    embedding_activation_bytes,
    head_activation_bytes,
)
from megaloom.planning.memory_params import analytic_params, count_model_params
from megaloom.planning.memory_plan import plan_memory

B, T, VOCAB = 4, 64, 512
SHAPE = ["model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
         f"model.vocab_size={VOCAB}", f"train.seq_len={T}", f"train.micro_batch_size={B}",
         f"train.global_batch_size={B}"]
MOE = ["model.preset=mixtral-tiny", "model.moe_every=1", "model.n_experts=4", "model.top_k=2",
       "model.expert_ffn_dim=48", "model.n_shared_experts=1", "model.aux_loss_weight=0.01",
       "model.z_loss_weight=0.001"]


def make_cfg(arch: str, precision: str, recompute: str, n_layers: int, *extra: str):
    preset = {"llama": "tiny", "gpt2": "tiny-gpt2"}.get(arch)
    head = [f"model.preset={preset}"] if preset else []
    kv = ["model.n_kv_heads=0"] if arch == "gpt2" else []
    # eager: what measure_saved runs (compiled save-sets are checked in tests/test_compile_saves.py)
    return load_config(None, [*head, *SHAPE, *kv, f"model.n_layers={n_layers}", f"train.precision={precision}",
                              f"train.recompute={recompute}", "train.compile=false", *extra])


def measure_saved(cfg, device: str = "cpu", attention=None) -> tuple[int, int]:
    """(activation bytes, weight-cast bytes) saved for backward by one forward with labels."""
    torch.manual_seed(0)
    model = Transformer(cfg.model).to(device)
    # As the trainer: selective recompute re-runs the attention core only under the math kernel.
    apply_recompute(model, cfg.train.recompute,
                    core_attention=(attention or attention_backend(cfg, device)) == "math")
    if getattr(cfg.train, "fused_loss", False) is True:
        from megaloom.models.fused_ce import FusedHeadLoss

        model.loss = FusedHeadLoss()
    x = torch.randint(0, VOCAB, (B, T), device=device)
    y = torch.randint(0, VOCAB, (B, T), device=device)
    kernel = contextlib.nullcontext()
    if attention == "math":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kernel = sdpa_kernel([SDPBackend.MATH])
    return saved_bytes(model, x, y, cfg.train.precision, device, kernel)


def saved_bytes(model, x, y, precision: str, device: str = "cpu", extra=None) -> tuple[int, int]:
    """(activation bytes, weight-cast bytes) of the distinct storages autograd saves in ``model(x, y)``, the
    model's own parameters and buffers excluded."""
    auto = torch.autocast(device, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with SavedStorages([*model.parameters(), *model.buffers()]) as saved, auto, extra or contextlib.nullcontext():
        loss = model(x, y)
    assert torch.isfinite(loss)
    return saved.activations, saved.weight_casts


def predicted(cfg, device: str = "cpu", attention=None) -> tuple[int, int, int]:
    """(activation bytes, saved weight-cast bytes, bytes of one block) for one micro-batch of the whole model."""
    n = B * T
    blocks = [sum(block_activation_bytes(cfg, tokens=n, batch=B, layer=i, device=device, attention=attention,
                                         grouped_mm=device == "cuda" or None).values())
              for i in range(cfg.model.n_layers)]
    acts = (sum(embedding_activation_bytes(cfg, tokens=n, batch=B, device=device).values()) + sum(blocks)
            + sum(head_activation_bytes(cfg, tokens=n, device=device).values()))
    counts = analytic_params(cfg, list(range(cfg.model.n_layers)))
    casts = 0
    if cfg.train.precision == "bf16":  # full recompute: only the head's copy is saved (the blocks' are cached)
        casts = 0 if getattr(cfg.train, "fused_loss", False) is True else 2 * counts.matmul_head
        casts += 0 if cfg.train.recompute == "full" else 2 * sum(counts.matmul_layers.values())
    return acts, casts, blocks[-1]


def check(arch, precision, recompute, *extra, device="cpu", attention=None, fused=False) -> dict:
    """Predicted == measured, for the whole model and per block; returns the numbers (for the report)."""
    two, four = (make_cfg(arch, precision, recompute, n, *extra) for n in (2, 4))
    for c in (two, four):
        c.train.fused_loss = fused  # (set directly: the key is train.fused_loss where the config has it)
    m2, c2 = measure_saved(two, device, attention)
    m4, c4 = measure_saved(four, device, attention)
    p2, pc2, block = predicted(two, device, attention)
    p4, pc4, _ = predicted(four, device, attention)
    per_block = (m4 - m2) // 2
    assert per_block == block, f"one block saves {per_block} bytes, predicted {block}"
    assert (m2, m4) == (p2, p4), f"whole model: measured {(m2, m4)}, predicted {(p2, p4)}"
    assert (c2, c4) == (pc2, pc4), f"weight casts: measured {(c2, c4)}, predicted {(pc2, pc4)}"
    return {"block": block, "model_2_layers": m2, "casts_2_layers": c2}


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_dense_blocks_saved_bytes_are_exact(arch, precision, recompute):
    check(arch, precision, recompute)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_moe_blocks_saved_bytes_are_exact(precision, recompute):
    check("moe", precision, recompute, *MOE)


@pytest.mark.parametrize("case", [
    ("llama", "bf16", "none", "model.sliding_window=16"),  # the window mask is saved in the compute dtype
    ("llama", "fp32", "none", "model.parallel_block=true"),  # one normed input shared by both branches
    ("llama", "bf16", "selective", "model.parallel_block=true"),
    ("gpt2", "fp32", "none", "model.dropout=0.1"),  # CPU: dropout sends SDPA to the math backend
    ("llama", "fp32", "none", "model.tie_embeddings=false"),
    ("llama", "bf16", "selective", "model.dropout=0.1"),
    ("moe", "bf16", "none", *MOE, "model.dropout=0.1"),
    ("moe", "fp32", "selective", *MOE, "model.router_score=sigmoid"),
    ("gpt2", "bf16", "none", "model.parallel_block=true"),
    ("llama", "bf16", "none", "model.head_dim=48"),  # heads wider than d_model / n_heads (Qwen3-0.6B's kind)
    ("llama", "fp32", "selective", "model.head_dim=8"),  # and narrower
])
def test_variants_saved_bytes_are_exact(case):
    check(*case)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fused_loss_saves_gradients_not_logits(precision):
    pytest.importorskip("megaloom.models.fused_ce")
    check("llama", precision, "none", fused=True)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_math_attention_backend(precision, recompute):
    check("llama", precision, recompute, attention="math")


GPU_CASES = [
    ("llama", "bf16", "none"), ("llama", "bf16", "selective"), ("llama", "bf16", "full"),
    ("gpt2", "bf16", "none"), ("gpt2", "bf16", "selective"),
    ("llama", "fp32", "none"),  # fp32 with grouped-query heads: the math backend
    ("gpt2", "fp32", "none"),  # fp32, multi-head: the efficient kernel
    ("moe", "bf16", "none", *MOE), ("moe", "bf16", "selective", *MOE),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_saved_bytes_are_exact(case):
    """The GPU save-sets: fused RMSNorm, flash / cuDNN attention (whatever SDPA picks), grouped GEMMs."""
    check(*case, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", [("llama", "bf16", "none"), ("gpt2", "bf16", "none", "model.dropout=0.1"),
                                  ("llama", "bf16", "none", "model.sliding_window=16")])
def test_gpu_variants(case):
    check(*case, device="cuda")
    check(*case, device="cuda", attention="math")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fused_loss():
    pytest.importorskip("megaloom.models.fused_ce")
    check("llama", "bf16", "none", device="cuda", fused=True)


# ------------------------------------------------------------------------------------------- parameters


@pytest.mark.parametrize("preset,extra", [
    ("tiny", []), ("tiny-gpt2", []), ("mixtral-tiny", []), ("deepseek-v3-tiny", []), ("gpt2-124m", []),
    ("llama3-1b", []), ("llama3-1b-untied", []), ("tiny", ["model.parallel_block=true"]),
    ("qwen3-0.6b", []), ("tiny", ["model.head_dim=48", "model.qkv_bias=true"]),  # head_dim != d_model / n_heads
])
def test_analytic_parameter_counts_match_the_module(preset, extra):
    cfg = load_config(None, [f"model.preset={preset}", "model.vocab_size=50304", *extra])
    with torch.device("meta"):
        model = Transformer(cfg.model)
    exact = count_model_params(model)
    guess = analytic_params(cfg, list(range(cfg.model.n_layers)))
    assert guess.local == exact.local
    assert guess.matmul_layers == exact.matmul_layers
    assert guess.matmul_head == exact.matmul_head
    assert guess.block_params == exact.block_params


# ----------------------------------------------------------------------------------------------- the plan


def _big(recompute: str, *extra: str):
    return load_config(None, ["model.preset=llama3-1b-untied", "train.seq_len=4096", "model.max_seq_len=8192",
                              "train.micro_batch_size=2", "train.global_batch_size=2", f"train.recompute={recompute}",
                              "train.precision=bf16", "train.fused_loss=false", *extra])


def test_plan_orders_recompute_modes_and_reports():
    plans = {r: plan_memory(_big(r, "train.compile=false"), device="cuda") for r in ("none", "selective", "full")}
    assert plans["full"].peak < plans["selective"].peak < plans["none"].peak
    # compiled: the partitioner's save-set, leaner than eager; selective is bounded by it (not modelled compiled)
    compiled = {r: plan_memory(_big(r), device="cuda") for r in ("none", "selective", "full")}
    assert compiled["full"].peak < compiled["selective"].peak <= compiled["none"].peak < plans["none"].peak
    p = plans["none"]
    # llama3-1b-untied: 1.498B parameters, 16 bytes each of weights, gradients and AdamW state.
    assert p.weights == 4 * 1_498_482_688 and p.optimizer == 2 * p.weights and p.gradients == p.weights
    assert p.peak_phase == "loss backward"  # the 128k-vocabulary loss dominates at this shape
    assert p.peak == max(p.phases.values())
    table = p.table()
    assert "peak" in table and "activations" in table
    d = json.loads(p.to_json())
    assert d["peak"] == p.peak and d["phases"]["loss backward"] == p.peak


def test_plan_counts_the_module_exactly():
    cfg = make_cfg("llama", "fp32", "none", 2)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    p = plan_memory(cfg, model, device="cpu")
    assert p.weights == 4 * sum(q.numel() for q in model.parameters())
    assert not p.notes  # counted from the module
    assert p.step_transient == p.weights  # foreach AdamW on CPU: one fp32 temporary per parameter


def test_gradient_accumulation_keeps_gradients_during_later_forwards():
    one = plan_memory(_big("none"), device="cuda")
    four = plan_memory(_big("none", "train.global_batch_size=8"), device="cuda")
    assert four.peak - one.peak == one.gradients  # the last micro-batch runs with the accumulated gradients


def test_pipeline_first_stage_holds_pp_micro_batches():
    cfg = _big("none", "parallel.pp=4", "train.global_batch_size=16")
    first = plan_memory(cfg, world_size=4, device="cuda", pp_rank=0)
    last = plan_memory(cfg, world_size=4, device="cuda", pp_rank=3)
    assert first.in_flight == 4 and last.in_flight == 1  # 1F1B: pp - rank
    assert first.layers == last.layers == 4
    assert last.loss_transient > 0 and first.loss_transient == 0


def test_first_stage_running_all_forwards_first_peaks_after_its_first_backward():
    # GPipe: every forward before any backward. The stage's gradients live in persistent buckets (pipelines reduce
    # them over dp bucket by bucket, megaloom.parallel.data_parallel), so when the first backward ends the other
    # micro-batches' activations are still held and the embedding's dense gradient is being added into its bucket.
    cfg = _big("none", "parallel.pp=4", "train.global_batch_size=16", "parallel.schedule=gpipe",
               "train.precision=fp32")  # fp32: no weight casts in flight
    first = plan_memory(cfg, world_size=4, device="cuda", pp_rank=0)
    static = first.weights + first.optimizer + first.workspace + first.gradients
    assert first.gradients == first.weights  # fp32 buckets of every parameter of the stage
    act = first.activations // first.in_flight  # one micro-batch of this stage
    assert first.in_flight == 8
    assert first.phases["forward"] == static + 8 * act
    emb = 4 * 2048 * 128256  # llama3-1b's untied embedding, fp32
    assert first.phases["backward"] == static + 7 * act + emb
    assert first.peak == max(first.phases.values())


def test_interleaved_first_backward_frees_one_chunk_micro_batch():
    # Interleaved, pp 4 x vpp 2 with 4 micro-batches: rank 0 runs its 8 chunk forwards first; its first backward
    # (of its second chunk, layers 8-9 of 16) frees that chunk's micro-batch; the buckets exist throughout.
    cfg = _big("none", "parallel.pp=4", "parallel.vpp=2", "parallel.schedule=interleaved", "train.precision=fp32",
               "train.global_batch_size=8", "model.n_layers=16", "train.seq_len=1024")
    plan = plan_memory(cfg, world_size=4, device="cuda", pp_rank=0)
    assert plan.layers == 4 and plan.in_flight == 8
    static = plan.weights + plan.optimizer + plan.workspace + plan.gradients
    a1 = 2 * sum(plan.per_layer.values()) + 4 * 2 * 1024 * 2048  # one micro-batch of chunk 1 (+ its kept output)
    assert plan.phases["backward"] == static + plan.activations - a1


def test_plan_without_update_has_no_optimizer_state():
    cfg = _big("none", "parallel.pp=4", "train.global_batch_size=16")
    with_update = plan_memory(cfg, world_size=8, device="cpu", pp_rank=3)
    lean = plan_memory(cfg, world_size=8, device="cpu", pp_rank=3, update=False)
    assert lean.optimizer == 0 and with_update.optimizer == 2 * with_update.weights
    # The end of the step: no AdamW temporaries, no flattened copy of the gradients (buckets are reduced in
    # place), only clipping's per-parameter square of the largest parameter.
    assert lean.phases["optimizer step"] == lean.weights + lean.gradients + lean.step_transient
    assert lean.step_transient == 4 * 2048 * 128256  # the (untied) head
    assert lean.phases["forward"] == with_update.phases["forward"] - with_update.optimizer
    assert any("without an optimizer update" in n for n in lean.notes) and lean.setup["update"] is False


def test_zero_shards_optimizer_state():
    z0 = plan_memory(_big("none", "train.global_batch_size=8"), world_size=4, device="cuda")
    z1 = plan_memory(_big("none", "train.global_batch_size=8", "parallel.zero=1", "parallel.param_gather=fp32"),
                     world_size=4, device="cuda")
    assert z1.optimizer * 4 == z0.optimizer
    assert z1.gradients == z0.gradients  # the buckets: the reduced 1/dp chunk is reduce-scattered in place
    z2 = plan_memory(_big("none", "train.global_batch_size=8", "parallel.zero=2", "parallel.param_gather=fp32"),
                     world_size=4, device="cuda")
    assert z2.gradients == z0.gradients + z0.gradients // 4  # zero 2: the buckets in backward + its own shard
    # bf16 parameter all-gathers (the default in bf16) keep an fp32 master shard beside the two moments
    z1b = plan_memory(_big("none", "train.global_batch_size=8", "parallel.zero=1"), world_size=4, device="cuda")
    assert z1b.optimizer * 8 == z1.optimizer * 12 and any("master shard" in n for n in z1b.notes)


def test_zero_optimizer_step_temporaries_are_one_parameter_group_on_cpu():
    """The foreach AdamW (CPU) steps a ZeRO shard in groups of STEP_GROUP_ELEMENTS (megaloom.parallel.data_parallel):
    its sqrt(exp_avg_sq) temporary is one group's, not the shard's; zero 0 still takes the whole state's."""
    from megaloom.parallel.data_parallel import STEP_GROUP_ELEMENTS

    cfg0 = _big("none", "train.global_batch_size=8", "parallel.tp=2")
    z0 = plan_memory(cfg0, world_size=4, device="cpu")
    z1 = plan_memory(_big("none", "train.global_batch_size=8", "parallel.tp=2", "parallel.zero=1"), world_size=4,
                     device="cpu")
    shard = z1.optimizer // 8
    assert z0.step_transient == z0.optimizer // 2  # 4 bytes per parameter of the whole (tp) state
    head = 128256 * 2048 // 2  # the largest parameter (the untied head's tp shard) fills its own bucket
    assert z1.step_transient == 4 * (STEP_GROUP_ELEMENTS + head // 2) < 4 * shard


def test_async_checkpoint_host_copy_is_the_rank_share_on_gpu_and_none_on_cpu():
    """An async save stages what this rank writes in pinned host memory on a GPU (with ZeRO-1/2 its own segment of
    the weights and its optimizer shard; not the device's peak); on CPU it writes the state in place."""
    over = ("train.global_batch_size=8", "parallel.tp=2", "parallel.zero=1", "parallel.param_gather=fp32")
    gpu = plan_memory(_big("none", *over), world_size=4, device="cuda")
    assert gpu.checkpoint_host == gpu.optimizer + gpu.optimizer // 2  # 4 + 8 bytes per element of the shard
    assert gpu.checkpoint_host < gpu.weights + gpu.optimizer  # not every replica's full tp weights
    masters = plan_memory(_big("none", *over[:-1]), world_size=4, device="cuda")  # bf16 gathers: fp32 masters
    assert masters.checkpoint_host == masters.optimizer  # the master shard is what is written for the weights
    no_async = plan_memory(_big("none", *over, "checkpoint.async_save=false"), world_size=4, device="cuda")
    assert no_async.checkpoint_host == 0 and no_async.peak == gpu.peak  # host memory: never in the GPU's peak
    assert plan_memory(_big("none", *over), world_size=4, device="cpu").checkpoint_host == 0


if __name__ == "__main__":  # the numbers behind the tests: python tests/planning/test_memory_plan.py
    cases = [(a, p, r) for a in ("gpt2", "llama") for p in ("fp32", "bf16") for r in ("none", "selective", "full")]
    cases += [("moe", p, r, *MOE) for p in ("fp32", "bf16") for r in ("none", "selective", "full")]
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        for case in cases if dev == "cpu" else GPU_CASES:
            two = make_cfg(*case[:3], 2, *case[3:])
            m2, c2 = measure_saved(two, dev)
            p2, pc2, block = predicted(two, dev)
            print(f"{dev:5} {case[0]:6}{case[1]:6}{case[2]:10} block {block:>9} B | 2-block model: measured "
                  f"{m2:>9} B, predicted {p2:>9} B | weight casts measured {c2:>7}, predicted {pc2:>7}")


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 2), (2, 4)])
def test_analytic_counts_follow_expert_and_tensor_parallelism(tp, ep):
    """Counted from the config, a rank of an ep x tp layout holds what parallelize_tensor leaves it (a mesh with
    sizes but no process groups splits the module without communicating)."""
    from megaloom.parallel.mesh import Mesh
    from megaloom.parallel.tensor import parallelize_tensor

    cfg = load_config(None, ["model.preset=mixtral-tiny", "model.vocab_size=50304", "model.n_kv_heads=4",
                             f"parallel.tp={tp}", f"parallel.ep={ep}"])
    with torch.device("meta"):
        model = Transformer(cfg.model)
    parallelize_tensor(model, Mesh(tp=tp, ep=ep, dp=ep), sp=False)
    exact = count_model_params(model)
    guess = analytic_params(cfg, list(range(cfg.model.n_layers)), tp=tp, ep=ep)
    assert guess.local == exact.local
    assert guess.matmul_layers == exact.matmul_layers


def test_fp8_keep_attention_plans_bf16_projection_inputs_and_casts():
    fp8 = make_cfg("llama", "fp8", "none", 4)
    kept = make_cfg("llama", "fp8", "none", 4, "train.fp8_keep_attention=true")
    a = block_activation_bytes(fp8, tokens=B * T, batch=B, device="cuda", attention="flash", fp8=True)
    b = block_activation_bytes(kept, tokens=B * T, batch=B, device="cuda", attention="flash", fp8=True)
    assert b["q/k/v inputs"] == 2 * a["q/k/v inputs"] == 3 * 2 * B * T * 64  # bf16 inputs, not 1-byte fp8
    assert b["mlp inputs"] == a["mlp inputs"]  # the MLP stays in fp8
    attn_weights = 2 * 64 * 64 + 2 * 64 * 2 * 16  # q, o [64, 64]; k, v [32, 64] (2 KV heads of 16)
    extra_casts = 2 * attn_weights * 2  # bf16 copies of the two middle blocks' attention weights
    pa, pb = (plan_memory(c, device="cuda") for c in (fp8, kept))
    assert pb.weight_casts - pa.weight_casts == extra_casts


def test_frozen_parameters_are_stored_but_hold_no_gradients_or_optimizer_state():
    """model.freeze (llava's projector-only stage): the frozen weights still take 4 bytes each on the GPU; only the
    trained ones have gradients and AdamW moments (the plan once dropped the frozen weights from its count)."""
    from megaloom.models.freeze import freeze_parts
    from megaloom.models.registry import get_family

    cfg = load_config(None, ["model.preset=llava-tiny", "model.image_token_id=5", "model.vocab_size=512",
                             "model.freeze=vision,language", "train.seq_len=96", "train.micro_batch_size=2",
                             "train.global_batch_size=2"])
    torch.manual_seed(0)
    model = get_family("llava").build(cfg.model)
    freeze_parts(model, cfg.model.freeze)
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 0 < trained < total
    plan = plan_memory(cfg, model, device="cpu")
    assert plan.weights == 4 * total
    assert plan.optimizer == 8 * trained


def test_bf16_params_halve_the_trained_weights_and_make_no_weight_casts() -> None:
    from megaloom.planning.memory_plan import plan_memory

    base = ["model.preset=llama3-8b", "model.vocab_size=128256", "parallel.zero=1", "train.precision=bf16",
            "parallel.tp=8", "train.seq_len=4096", "train.global_batch_size=64", "train.micro_batch_size=1",
            "train.compile=false"]
    off = plan_memory(load_config(None, [*base, "train.bf16_params=false"]), world_size=64, device="cuda")
    on = plan_memory(load_config(None, [*base, "train.bf16_params=true"]), world_size=64, device="cuda")
    auto = plan_memory(load_config(None, base), world_size=64, device="cuda")  # on at auto here (levers.py)
    assert auto.weights == on.weights and auto.peak == on.peak
    assert on.weights * 2 == off.weights and on.optimizer == off.optimizer  # the fp32 masters were there before
    assert on.weight_casts == 0 < off.weight_casts
    assert on.peak < off.peak
    # zero 0: the masters are every weight (Megatron's non-distributed optimizer): +4 bytes a weight in the
    # optimizer line, 2 in the weights; one process too (its gradients in buckets, fp32)
    for world in (8, 1):
        over = [*base[:2], "parallel.zero=0", "train.precision=bf16", f"parallel.tp={min(world, 8)}",
                *base[5:]]
        off0 = plan_memory(load_config(None, over), world_size=world, device="cuda")
        on0 = plan_memory(load_config(None, [*over, "train.bf16_params=true"]), world_size=world, device="cuda")
        assert on0.weights * 2 == off0.weights and on0.weight_casts == 0 < off0.weight_casts, world
        assert on0.optimizer == off0.optimizer + off0.weights, (world, on0.optimizer, off0.optimizer)
    # ZeRO-3 (FSDP2's own bf16 policy) and 1-bit optimizers: refused before anything is built
    for bad in (["parallel.zero=3"], ["train.optimizer=onebit_adam"]):
        with pytest.raises(Exception, match="train.bf16_params=true keeps the fp32 weights only in the optimizer"):
            load_config(None, [*base[:2], *bad, "train.bf16_params=true"])
