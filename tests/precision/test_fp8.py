"""FP8 linear layers on CPU (torch._scaled_mm runs there too): the fp8 GEMMs against a fake-quantised
reference, the conversion of a model, the tensor-parallel layers, and the refusal without an FP8 GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megaloom.config import ConfigError, load_config
from megaloom.models import Transformer
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.tensor import gather_full_grads, parallelize_tensor
from megaloom.parallel.tp_layers import ColumnParallelLinear, RowParallelLinear
from megaloom.precision.fp8 import Float8Linear, float8_linear, quantize
from megaloom.precision.fp8_convert import convert_to_float8
from megaloom.runtime import resolve_precision
from megaloom.step import TrainStep
from tests.parallel.harness import run_world

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fake_quant(t: torch.Tensor, dtype: torch.dtype, dim: int | None = None) -> torch.Tensor:
    """Quantise-dequantise in fp32 with current scaling, written independently of the module under test."""
    fmax = torch.finfo(dtype).max
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = fmax / amax.float().clamp(min=1e-12)
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype).float() / scale


def reference(x2: torch.Tensor, w: torch.Tensor, g2: torch.Tensor, recipe: str):
    """(y, dx, dw) of y = x W^T from fake-quantised operands, fp32 matmuls."""
    if recipe == "tensorwise":
        xq, wq, gq = fake_quant(x2, E4M3), fake_quant(w, E4M3), fake_quant(g2, E5M2)
        return xq @ wq.t(), gq @ wq, gq.t() @ xq
    y = fake_quant(x2, E4M3, 1) @ fake_quant(w, E4M3, 1).t()
    dx = fake_quant(g2, E4M3, 1) @ fake_quant(w, E4M3, 0)
    return y, dx, g2.t() @ x2  # rowwise: the weight gradient in high precision


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("shape", [(37, 64), (3, 11, 64)])  # token counts not multiples of 16: padded for dW
def test_fp8_linear_matches_fake_quant_reference(recipe, shape) -> None:
    torch.manual_seed(0)
    x = (torch.randn(*shape) * 3).requires_grad_()
    w = (torch.randn(48, 64) * 0.05).requires_grad_()
    b = torch.randn(48).requires_grad_()
    y = float8_linear(x, w, b, recipe)
    g = torch.randn_like(y) * 1e-3
    y.backward(g)
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.float32 and y.shape == (*shape[:-1], 48)

    x2, g2 = x.detach().reshape(-1, 64), g.reshape(-1, 48)
    ry, rdx, rdw = reference(x2, w.detach(), g2, recipe)
    # tensorwise: the fp8 GEMM accumulates exactly what the reference multiplies, up to fp32 rounding;
    # rowwise: the forward and grad-input GEMMs come out of cuBLAS's rowwise kernel in bf16 (2^-8 relative).
    tol = 1e-5 if recipe == "tensorwise" else 2**-8
    for got, want in [((y - b).detach().reshape(-1, 48), ry), (x.grad.reshape(-1, 64), rdx), (w.grad, rdw)]:
        assert (got - want).abs().max() <= tol * want.abs().max(), (got - want).abs().max()
    assert torch.allclose(b.grad, g2.sum(0), rtol=1e-5, atol=1e-7)

    # against the exact fp32 linear: within fp8's few mantissa bits (e5m2 gradients are the coarsest)
    xe, we = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ye = F.linear(xe, we, b.detach())
    ye.backward(g)
    assert rel(y, ye) < 0.06 and rel(x.grad, xe.grad) < 0.1 and rel(w.grad, we.grad) < 0.1


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linear_under_autocast_keeps_dtypes(recipe) -> None:
    torch.manual_seed(1)
    x = torch.randn(2, 16, 32, requires_grad=True)  # fp32 residual stream, as in the model
    w = nn.Parameter(torch.randn(64, 32) * 0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = float8_linear(x, w, None, recipe)
        ref = F.linear(x, w)
    assert y.dtype == torch.bfloat16 == ref.dtype
    y.float().pow(2).sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32  # the master weight's dtype
    assert rel(y.float(), ref.float()) < 0.06


def test_quantize_saturates_and_survives_zeros() -> None:
    t8, s = quantize(torch.zeros(4, 16), E4M3)
    assert torch.isfinite(s) and t8.float().abs().sum() == 0
    t = torch.tensor([[1.0, -2.0], [1e-3, 4.0]])
    t8, s = quantize(t, E4M3, dim=1)
    assert s.shape == (2, 1) and t8.float().abs().amax(1).tolist() == [448.0, 448.0]


def test_fp8_linear_traces_whole_under_compile() -> None:
    torch._dynamo.reset()
    x = torch.randn(24, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    fn = torch.compile(lambda a, b: float8_linear(a, b, None, "tensorwise"), backend="aot_eager", fullgraph=True)
    y = fn(x, w)  # fullgraph: no graph break (no .item(), no host sync)
    y.sum().backward()
    assert torch.equal(y, float8_linear(x, w)) and w.grad is not None


# ------------------------------------------------------------------------------------------------ conversion
def tiny_model(n_layers: int = 4, *extra: str) -> Transformer:
    cfg = load_config(None, ["model.vocab_size=128", "model.d_model=64", f"model.n_layers={n_layers}",
                             "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128", "train.seq_len=32",
                             "model.max_seq_len=64", *extra])
    torch.manual_seed(0)
    return Transformer(cfg.model)


LINEARS = ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def test_convert_keeps_first_last_blocks_head_and_names() -> None:
    model = tiny_model()
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    params = {n: p for n, p in model.named_parameters()}
    summary = convert_to_float8(model)
    assert summary.converted == [f"layers.{i}.{n}" for i in (1, 2) for n in LINEARS]
    assert [n for n, _ in summary.skipped] == [f"layers.{i}.{n}" for i in (0, 3) for n in LINEARS]
    assert all("first block" in why or "last block" in why for _, why in summary.skipped)
    for i in range(4):
        for n in LINEARS:
            assert isinstance(model.layers[str(i)].get_submodule(n), Float8Linear) == (i in (1, 2))
    assert type(model.head) is nn.Linear and type(model.tok_emb) is nn.Embedding
    sd = model.state_dict()
    assert sd.keys() == keys.keys() and all(torch.equal(sd[k], keys[k]) for k in keys)
    assert all(p is params[n] for n, p in model.named_parameters())  # the same Parameter objects
    assert "14 linear layers in fp8" in str(summary)

    plain = tiny_model()
    plain.load_state_dict(model.state_dict())  # checkpoints move between fp8 and bf16 runs

    everything = convert_to_float8(tiny_model(), "rowwise", keep_first_last=False)
    assert len(everything.converted) == 28 and not everything.skipped

    mlp_only = convert_to_float8(tiny_model(), keep_first_last=False, keep_attention=True)
    mlp = ("gate_proj", "up_proj", "down_proj")
    assert mlp_only.converted == [f"layers.{i}.mlp.{n}" for i in range(4) for n in mlp]
    assert {why for _, why in mlp_only.skipped} == {"attention projection, train.fp8_keep_attention"}


def test_convert_skips_shapes_fp8_gemms_cannot_take_and_moe_routers() -> None:
    odd = convert_to_float8(tiny_model(4, "model.ffn_dim=72"), keep_first_last=False)
    assert {n.split(".", 2)[2] for n, why in odd.skipped if "multiples of 16" in why} == {
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    assert len(odd.converted) == 16

    moe = tiny_model(4, "model.moe_every=2", "model.n_experts=4", "model.top_k=2", "model.expert_ffn_dim=32",
                     "model.n_shared_experts=1")
    expert_weights = {n: p for n, p in moe.named_parameters() if ".experts." in n}
    s = convert_to_float8(moe, keep_first_last=False)
    assert "layers.1.mlp.router.proj" in [n for n, why in s.skipped if "MoE" in why]
    assert "layers.1.mlp.shared.up_proj" in s.converted  # a dense shared expert is an ordinary MLP
    assert type(moe.layers[str(1)].mlp.router.proj) is nn.Linear
    assert all(p is expert_weights[n] for n, p in moe.named_parameters() if ".experts." in n)

    with pytest.raises(ValueError, match="recipe"):
        convert_to_float8(tiny_model(), "delayed")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_fp8_model_trains(recipe) -> None:
    model = tiny_model()
    convert_to_float8(model, recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step = TrainStep(model, opt, "fp8", torch.device("cpu"), micro_batch_size=2, grad_clip=1.0)
    torch.manual_seed(3)
    batch = torch.randint(0, 128, (4, 33))
    losses = [step(batch).loss.item() for _ in range(8)]
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())
    assert losses[-1] < losses[0] - 0.5, losses
    # the fp8 model computes what the bf16 one does, to fp8 accuracy
    bf16 = tiny_model()
    bf16.load_state_dict(model.state_dict())
    x = batch[:, :-1]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert abs(model(x, batch[:, 1:]).item() - bf16(x, batch[:, 1:]).item()) < 0.05


@pytest.mark.parametrize("fast", [True, False])
def test_fast_accumulation_setting_reaches_the_forward_gemm_only(fast, monkeypatch) -> None:
    model = tiny_model()
    convert_to_float8(model, "tensorwise", keep_first_last=False, fast_accum=fast)
    lin = model.layers[str(0)].mlp.up_proj
    assert isinstance(lin, Float8Linear) and lin.fp8_fast_accum is fast
    seen = []
    real = torch._scaled_mm

    def spy(*args, **kwargs):
        seen.append(kwargs.get("use_fast_accum", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    x = torch.randn(2, 16, lin.in_features, requires_grad=True)
    lin(x).sum().backward()
    assert seen == [fast, False, False]  # forward y, then backward dx and dW (always promoted to fp32)


def test_convert_a_pipeline_stage_counts_blocks_globally() -> None:
    from megaloom.parallel.pipeline.partition import partition_layers
    from megaloom.parallel.pipeline.stage import prune_to_stages

    part = partition_layers(4, 2)  # stage 0: blocks 0-1, stage 1: blocks 2-3
    first, last = prune_to_stages(tiny_model(), part, 0), prune_to_stages(tiny_model(), part, 1)
    s0, s1 = convert_to_float8(first), convert_to_float8(last)
    assert s0.converted == [f"layers.1.{n}" for n in LINEARS] and s1.converted == [f"layers.2.{n}" for n in LINEARS]
    assert isinstance(last.layers["2"].mlp.up_proj, Float8Linear) and type(last.head) is nn.Linear


# ------------------------------------------------------------------------------------------ tensor parallel
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("modes", [("copy", "reduce"), ("gather", "reduce_scatter")])
def test_tp_pair_on_one_rank_matches_float8_linear(recipe, modes) -> None:
    torch.manual_seed(2)
    up, down = nn.Linear(32, 64), nn.Linear(64, 32, bias=False)  # a row-parallel bias is added after the reduce
    mesh = Mesh.single()
    col = ColumnParallelLinear.from_linear(up, mesh, modes[0])
    row = RowParallelLinear.from_linear(down, mesh, modes[1])
    col.fp8_recipe = row.fp8_recipe = recipe
    col.fp8_linear = row.fp8_linear = float8_linear  # what convert_to_float8 hands a tensor-parallel layer
    f_up, f_down = Float8Linear.from_linear(up, recipe), Float8Linear.from_linear(down, recipe)
    x = torch.randn(2, 16, 32)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya = row(F.gelu(col(xa)))
        yb = f_down(F.gelu(f_up(xb)))
    ya.float().sum().backward()
    grads_a = [xa.grad] + [p.grad.clone() for p in (col.weight, col.bias, row.weight)]
    for p in (up.weight, up.bias, down.weight):
        p.grad = None
    yb.float().sum().backward()
    grads_b = [xb.grad] + [p.grad for p in (up.weight, up.bias, down.weight)]
    assert torch.equal(ya, yb)
    for a, b in zip(grads_a, grads_b, strict=True):
        assert torch.equal(a, b)
    # and the off switch is F.linear again
    col.fp8_recipe = None
    assert torch.equal(col(x), F.linear(x, col.weight, col.bias))


def test_convert_a_tensor_parallel_model_sets_the_local_matmuls() -> None:
    model = tiny_model(4)
    parallelize_tensor(model, Mesh(tp=2), sp=True)  # shapes only: no process group, identity collectives
    s = convert_to_float8(model, keep_first_last=True)
    assert len(s.converted) == 14
    assert model.layers[str(1)].attn.k_proj.fp8_recipe == "tensorwise"  # local shard [16, 64]
    assert model.layers[str(1)].attn.k_proj.fp8_linear is float8_linear
    assert model.layers[str(0)].attn.q_proj.fp8_recipe is None and model.head.fp8_recipe is None


def _tp2_fp8_world(rank: int, world: int, device: torch.device) -> dict:
    """tp=2 with sequence parallelism and fp8 blocks vs the same fp8 model on one process."""
    from megaloom.parallel.mesh import Mesh as M

    mesh = M(device=device, world_size=world, rank=rank, tp=world, tp_rank=rank,
             tp_group=torch.distributed.group.WORLD)
    exact, single, par = tiny_model().to(device), tiny_model().to(device), tiny_model()
    convert_to_float8(single, keep_first_last=False)
    parallelize_tensor(par, mesh, sp=True)
    convert_to_float8(par, keep_first_last=False)
    torch.manual_seed(5)
    batch = torch.randint(0, 128, (2, 33))
    x, y = batch[:, :-1].to(device), batch[:, 1:].to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        losses = [m(x, y) for m in (par, single, exact)]
    for loss in losses:
        loss.backward()
    full = gather_full_grads(par, mesh, synced=False)
    names = [n for n, g in full.items() if g is not None and n.startswith("layers.")]

    def flat(grads: dict) -> torch.Tensor:
        return torch.cat([grads[n].reshape(-1) for n in names])

    want = flat({n: p.grad for n, p in exact.named_parameters()})
    return {"loss": [v.item() for v in losses], "rel_grad_tp": rel(flat(full), want),
            "rel_grad_single": rel(flat({n: p.grad for n, p in single.named_parameters()}), want)}


def test_tp2_sequence_parallel_fp8_matches_one_process() -> None:
    out = run_world(2, _tp2_fp8_world)
    for r in out:  # scales are per local shard, so as close to bf16 as one process is, not equal to it
        tp, single, exact = r["loss"]
        assert abs(tp - exact) < 0.02 and abs(single - exact) < 0.02, r
        assert r["rel_grad_tp"] < 1.5 * r["rel_grad_single"] and r["rel_grad_tp"] < 0.12, r
    assert out[0]["loss"] == out[1]["loss"]


# ------------------------------------------------------------------------------------------------ refusal
def test_fp8_without_an_fp8_gpu_is_refused() -> None:
    cfg = load_config(None, ["train.precision=fp8"])
    with pytest.raises(ConfigError, match="bf16"):
        resolve_precision(cfg, torch.device("cpu"))
