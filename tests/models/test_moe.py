import math

import pytest
import torch
import torch.nn.functional as F

from megaloom.models.moe import (
    GroupedExperts,
    LocalDispatcher,
    MoE,
    Router,
    expert_capacity,
    load_balancing_loss,
    z_loss,
)

D, FF, E = 16, 24, 6


def make_moe(**kw):
    torch.manual_seed(0)
    args = dict(d_model=D, n_experts=E, top_k=2, expert_ffn_dim=FF)
    args.update(kw)
    return MoE(**args).double()


def reference_moe(moe, x, dropped=frozenset()):
    """Each token through its experts, one at a time, weighted sum; (t, j) pairs in `dropped` are skipped."""
    xf = x.reshape(-1, x.shape[-1])
    r = moe.router(xf)
    ex = moe.experts
    out = torch.zeros_like(xf)
    for t in range(xf.shape[0]):
        for j in range(moe.top_k):
            if (t, j) in dropped:
                continue
            e = int(r.experts[t, j])
            h = F.silu(xf[t] @ ex.w_gate[e]) * (xf[t] @ ex.w_up[e])
            out[t] += r.weights[t, j].to(xf.dtype) * (h @ ex.w_down[e])
    if moe.shared is not None:
        out = out + moe.shared(xf)
    return out.view(x.shape), r


def fcfs_dropped(experts, capacity):
    """Straightforward reference: walk tokens in order, then top-k rank; an expert takes the first `capacity`."""
    seen, dropped = {}, set()
    for t in range(experts.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            seen[e] = seen.get(e, 0) + 1
            if seen[e] > capacity:
                dropped.add((t, j))
    return dropped


@pytest.mark.parametrize("normalize", [False, True])
def test_router_softmax_topk_matches_reference(normalize):
    torch.manual_seed(1)
    r = Router(D, E, 2, "softmax", normalize_weights=normalize)
    x = torch.randn(10, D)
    out = r(x)
    probs = (x @ r.proj.weight.T).softmax(-1)
    w, idx = torch.topk(probs, 2, dim=-1)
    if normalize:
        w = w / w.sum(-1, keepdim=True)
    assert torch.equal(out.experts, idx)
    torch.testing.assert_close(out.weights, w)
    torch.testing.assert_close(out.probs, probs)


def test_router_sigmoid_renormalised_and_bias_only_affects_selection():
    torch.manual_seed(2)
    r = Router(D, E, 3, "sigmoid")
    x = torch.randn(10, D)
    out = r(x)
    s = (x @ r.proj.weight.T).sigmoid()
    w, idx = torch.topk(s, 3, dim=-1)
    assert torch.equal(out.experts, idx)
    torch.testing.assert_close(out.weights, w / w.sum(-1, keepdim=True))
    # a large bias on expert 4 forces it into every selection; its weight still comes from the unbiased score
    r.expert_bias[4] = 10.0
    out = r(x)
    assert (out.experts == 4).any(-1).all()
    sel = s.gather(-1, out.experts)
    torch.testing.assert_close(out.weights, sel / sel.sum(-1, keepdim=True))


def test_router_sigmoid_without_renormalisation_weights_raw_scores_times_scaling():
    """model.moe_norm_topk=false with sigmoid scores (DeepSeek's norm_topk_prob=false): the chosen scores as they
    are, times routed_scaling_factor; a model built from the config passes the key to every router."""
    torch.manual_seed(2)
    r = Router(D, E, 3, "sigmoid", normalize_weights=False, routed_scaling=2.5)
    x = torch.randn(10, D)
    out = r(x)
    w, idx = torch.topk((x @ r.proj.weight.T).sigmoid(), 3, dim=-1)
    assert torch.equal(out.experts, idx)
    torch.testing.assert_close(out.weights, w * 2.5)
    from megaloom.config import load_config
    from megaloom.models import Transformer

    for norm in (True, False):
        cfg = load_config(None, ["model.preset=deepseek-v3-tiny", "model.vocab_size=64", "model.n_layers=2",
                                 f"model.moe_norm_topk={str(norm).lower()}"])
        routers = [m for m in Transformer(cfg.model).modules() if isinstance(m, Router)]
        assert routers and all(m.normalize_weights is norm for m in routers)


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_grouped_fallback_equals_per_token_loop(score_fn):
    moe = make_moe(score_fn=score_fn)
    x = torch.randn(2, 9, D, dtype=torch.float64)
    y = moe(x)
    ref, _ = reference_moe(moe, x)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=0)
    assert float(moe.last_dropped_fraction) == 0.0
    assert moe.last_load.sum() == 2 * 9 * 2


def test_fp32_fallback_close_to_reference():
    moe = make_moe().float()
    x = torch.randn(3, 7, D)
    ref, _ = reference_moe(moe, x)
    torch.testing.assert_close(moe(x), ref, atol=1e-5, rtol=0)


def test_large_capacity_equals_dropless():
    moe = make_moe()
    x = torch.randn(2, 8, D, dtype=torch.float64)
    y0 = moe(x)
    moe.capacity_factor = 100.0
    y1 = moe(x)
    assert float(moe.last_dropped_fraction) == 0.0
    torch.testing.assert_close(y1, y0, atol=0, rtol=0)


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0])
def test_small_capacity_drops_first_come_first_served(capacity_factor):
    moe = make_moe(capacity_factor=capacity_factor)
    with torch.no_grad():  # skew the router so some experts overflow
        moe.router.proj.weight[0] += 0.5
    x = torch.randn(1, 20, D, dtype=torch.float64) + 0.3
    y = moe(x)
    r = moe.router(x.reshape(-1, D))
    cap = expert_capacity(capacity_factor, 20, 2, E)
    assert cap == math.ceil(capacity_factor * 20 * 2 / E)
    dropped = fcfs_dropped(r.experts, cap)
    assert dropped, "test setup should overflow some expert"
    assert float(moe.last_dropped_fraction) == pytest.approx(len(dropped) / 40)
    ref, _ = reference_moe(moe, x, dropped)
    torch.testing.assert_close(y, ref, atol=1e-10, rtol=0)
    # the dispatcher's kept rows are exactly the complement, and each expert holds at most `cap`
    d = LocalDispatcher().dispatch(x.reshape(-1, D), r.weights, r.experts, E, cap)
    kept = {(int(s) // 2, int(s) % 2) for s in d.slot}
    assert kept == {(t, j) for t in range(20) for j in range(2)} - dropped
    assert int(d.counts.max()) <= cap and int(d.counts.sum()) == len(kept)
    # a token with every assignment dropped gets exactly zero expert output
    full = [t for t in range(20) if (t, 0) in dropped and (t, 1) in dropped]
    for t in full:
        assert torch.all(y[0, t] == 0)


def test_aux_loss_hand_example():
    # T=4, E=2, k=1: experts [0, 0, 0, 1] -> f = [3/4, 1/4]; P = mean probs = [0.6, 0.4]
    probs = torch.tensor([[0.9, 0.1], [0.7, 0.3], [0.6, 0.4], [0.2, 0.8]])
    experts = torch.tensor([[0], [0], [0], [1]])
    expected = 2 * (0.75 * 0.6 + 0.25 * 0.4)
    assert float(load_balancing_loss(probs, experts, 2)) == pytest.approx(expected)
    logits = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    lse = [math.log(2.0), math.log(math.e + math.e**2)]
    assert float(z_loss(logits)) == pytest.approx((lse[0] ** 2 + lse[1] ** 2) / 2)
    # and MoE.aux_loss = weights * those formulas on its own router output
    moe = make_moe(aux_loss_weight=0.01, z_loss_weight=0.001)
    x = torch.randn(2, 5, D, dtype=torch.float64)
    moe(x)
    r = moe.router(x.reshape(-1, D))
    want = 0.01 * load_balancing_loss(r.probs, r.experts, E) + 0.001 * z_loss(r.logits)
    torch.testing.assert_close(moe.aux_loss, want)
    assert moe.aux_loss.requires_grad


def test_aux_free_bias_balances_skewed_router():
    moe = make_moe(score_fn="sigmoid", aux_free_bias_rate=0.05).float()
    with torch.no_grad():
        moe.router.proj.weight[:2] += 0.3  # experts 0 and 1 are favoured by every token
    x = torch.randn(4, 16, D) + 0.5
    moe.train()
    ratios = []
    for _ in range(12):
        moe(x)
        load = moe.load_since_update.clone()
        ratios.append(float(load.max() / load.mean()))
        moe.update_bias()
        assert moe.load_since_update.sum() == 0
    assert ratios[0] > 1.8
    assert ratios[-1] < ratios[0] - 0.5
    assert moe.router.expert_bias[:2].max() < 0 < moe.router.expert_bias[2:].max()


def test_attached_aux_loss_equals_adding_it_to_the_loss():
    """attach_aux_loss (what lets aux losses work in any pipeline stage) gives the gradients of
    loss + grad_scale * aux_loss, for the input and every parameter."""
    x = torch.randn(2, 6, D, dtype=torch.float64)
    c = torch.randn(2, 6, D, dtype=torch.float64)
    grads = []
    for attached in (True, False):
        moe = make_moe(n_shared_experts=1, aux_loss_weight=0.05, z_loss_weight=1e-2)
        moe.aux_grad_scale = 0.25 if attached else 0.0  # 0: the attached gradient vanishes
        xi = x.clone().requires_grad_()
        loss = (moe(xi) * c).sum()
        if not attached:
            loss = loss + 0.25 * moe.aux_loss
        loss.backward()
        grads.append([xi.grad] + [p.grad for p in moe.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert grads[0][1].abs().sum() > 0


def test_gradients_reach_router_experts_and_shared():
    moe = make_moe(n_shared_experts=1, aux_loss_weight=0.01, z_loss_weight=1e-3)
    x = torch.randn(2, 6, D, dtype=torch.float64, requires_grad=True)
    moe(x).square().sum().backward()  # the aux losses' gradient rides on the output
    for name, p in moe.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    assert torch.isfinite(x.grad).all()
    assert "router.expert_bias" in dict(moe.named_buffers()) and not any(
        n.endswith("expert_bias") for n, _ in moe.named_parameters())


def test_shared_experts_add_dense_path():
    moe = make_moe(n_shared_experts=2)
    assert moe.shared.up_proj.out_features == 2 * FF
    x = torch.randn(2, 5, D, dtype=torch.float64)
    y = moe(x)
    ref, _ = reference_moe(moe, x)
    torch.testing.assert_close(y, ref, atol=1e-10, rtol=0)
    routed = y - moe.shared(x.reshape(-1, D)).view(x.shape)
    with torch.no_grad():
        moe.shared.down_proj.weight.zero_()
    torch.testing.assert_close(moe(x), routed, atol=1e-12, rtol=0)


def test_init_std_and_empty_experts():
    torch.manual_seed(0)
    moe = MoE(64, 8, 2, 128, n_shared_experts=1, init_std=0.02, out_std=0.005)
    assert moe.experts.w_gate.std().item() == pytest.approx(0.02, rel=0.05)
    assert moe.experts.w_down.std().item() == pytest.approx(0.005, rel=0.05)
    assert moe.shared.down_proj.weight.std().item() == pytest.approx(0.005, rel=0.1)
    ex = GroupedExperts(3, 4, 5)
    ex.reset_parameters()
    out = ex(torch.randn(0, 4), torch.zeros(3, dtype=torch.long))
    assert out.shape == (0, 4)


def test_plugs_into_transformer_block():
    from megaloom.config import load_config
    from megaloom.models import Transformer, apply_recompute

    cfg = load_config(None, ["model.vocab_size=64", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
                             "model.max_seq_len=32", "train.seq_len=16"])
    torch.manual_seed(0)
    m = Transformer(cfg.model)
    m.layers[str(1)].mlp = MoE(32, 4, 2, 16, n_shared_experts=1, aux_loss_weight=0.01)
    apply_recompute(m, "selective")
    tokens = torch.randint(0, 64, (2, 8))
    loss = m(tokens, torch.randint(0, 64, (2, 8)))
    loss.backward()  # the language-model loss; the aux loss's gradient is attached to the MoE output
    assert m.layers[str(1)].mlp.experts.w_up.grad.abs().sum() > 0
    assert m.moe_layers == [m.layers[str(1)].mlp]


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="needs an sm90 GPU")
def test_grouped_mm_matches_fallback_on_gpu():
    torch.manual_seed(0)
    ex = GroupedExperts(4, 64, 128).cuda()
    ex.reset_parameters()
    counts = torch.tensor([5, 0, 17, 10], device="cuda")
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = ex(x, counts)
    ref = ex._looped(x.float(), counts)
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2e-2)
    y.float().sum().backward()
    assert torch.isfinite(ex.w_gate.grad).all() and torch.isfinite(x.grad).all()


def test_expert_counts_equal_bincount_without_a_data_dependent_shape() -> None:
    from megaloom.models.moe import expert_counts

    experts = torch.randint(0, 8, (37, 2))
    experts[0, 0] = 0  # expert 7 may be unused: the count keeps length E regardless of the largest index
    experts = experts.clamp(max=6)
    got = expert_counts(experts, 8)
    assert got.dtype == torch.long and got.shape == (8,)
    assert torch.equal(got, torch.bincount(experts.reshape(-1), minlength=8)) and got[7] == 0
