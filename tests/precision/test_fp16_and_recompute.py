import torch

from megaloom.config import load_config
from megaloom.models import Transformer, apply_recompute
from megaloom.parallel.mesh import Mesh
from megaloom.precision.loss_scaler import DynamicLossScaler
from megaloom.step import TrainStep
from tests.parallel.harness import run_world


def tiny(seed=0, n_layers=2):
    cfg = load_config(None, ["model.vocab_size=128", "model.d_model=64", f"model.n_layers={n_layers}",
                             "model.n_heads=4", "model.n_kv_heads=2", "train.seq_len=32", "model.max_seq_len=64"])
    torch.manual_seed(seed)
    return Transformer(cfg.model)


def test_fp16_overflow_skips_step_halves_scale_and_training_goes_on():
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = TrainStep(model, opt, "fp16", torch.device("cpu"), micro_batch_size=2, grad_clip=1.0)
    batch = torch.randint(0, 128, (4, 17))
    poison = {"on": True}
    model.layers[str(1)].mlp.down_proj.weight.register_hook(
        lambda g: torch.full_like(g, float("inf")) if poison["on"] else g)

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    scale0 = step.scaler.scale
    out = step(batch)
    assert out.skipped and step.scaler.scale == scale0 / 2 and step.scaler.skipped == 1
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n  # no weight changed
    assert all(p.grad is None for p in model.parameters())

    poison["on"] = False
    out = step(batch)
    assert not out.skipped and torch.isfinite(out.grad_norm)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert step.scaler.scale == scale0 / 2


def test_scaler_grows_after_good_steps():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=3)
    for _ in range(3):
        s.update(False)
    assert s.scale == 16.0
    s.update(True)
    assert s.scale == 8.0 and s.good_steps == 0


def _overflow_on_one_rank(rank, world, device):
    mesh = Mesh(device=device, world_size=world, rank=rank, dp=world, dp_rank=rank,
                dp_cp_group=torch.distributed.group.WORLD)
    s = DynamicLossScaler(mesh=mesh)
    g = torch.ones(4)
    if rank == 1:
        g[2] = float("nan")
    return s.found_overflow([g]), s.found_overflow([torch.ones(3)])


def test_overflow_decision_is_agreed_by_all_ranks():
    results = run_world(2, _overflow_on_one_rank)
    assert results == [(True, False), (True, False)]


def _saved_bytes(model, x, y) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, y).backward()
    return total


def test_recompute_saves_less_activation_memory_in_the_expected_order():
    # Activation memory = what autograd keeps between forward and backward, measured by the saved-tensor hook.
    x, y = torch.randint(0, 128, (2, 32)), torch.randint(0, 128, (2, 32))
    sizes = {}
    grads = {}
    for mode in ("none", "selective", "full"):
        m = tiny(n_layers=4)
        apply_recompute(m, mode)
        sizes[mode] = _saved_bytes(m, x, y)
        grads[mode] = {n: p.grad.clone() for n, p in m.named_parameters()}
    assert sizes["full"] < sizes["selective"] < sizes["none"], sizes
    for mode in ("selective", "full"):
        for n, g in grads["none"].items():
            assert torch.equal(g, grads[mode][n]), (mode, n)
