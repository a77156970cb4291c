"""LoRA (model.lora): adapters as PEFT computes them, a frozen base, exact resume, merged and PEFT exports.

Layout parity (tp=2 with and without sp, pp=2 x dp=2 with ZeRO-1, tp=4 with replicated KV heads) runs inside the
existing worlds: tests/parallel/test_world2.py, test_world4.py, pipeline/test_zero_pp_world.py.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from megaloom.config import ConfigError, LoraConfig, load_config
from megaloom.models.freeze import freeze_for_training
from megaloom.models.lora import is_adapter_name, merge_lora
from megaloom.models.registry import get_family
from megaloom.training.trainer import Trainer
from tests.conftest import tiny_overrides

ALL = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def tiny(*extra: str):
    return load_config(None, ["model.vocab_size=128", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
                              "model.n_kv_heads=2", "model.ffn_dim=96", "model.max_seq_len=32", "train.seq_len=32",
                              *extra])


def build(cfg, seed: int = 0):
    torch.manual_seed(seed)
    return get_family(cfg.model.arch).build(cfg.model)


def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_adapters_start_at_zero_and_merge_into_the_weights_exactly(arch: str) -> None:
    targets = ALL if arch == "llama" else "q_proj,k_proj,v_proj,o_proj,up_proj,down_proj"  # gpt2: no gate
    cfg = tiny(f"model.arch={arch}", "model.lora.rank=4", "model.lora.alpha=8", f"model.lora.targets={targets}")
    lora, base = build(cfg), build(tiny(f"model.arch={arch}"))
    x = tokens()
    with torch.no_grad():
        assert torch.equal(lora(x), base(x))  # B = 0: a fresh adapter changes nothing, and the base is the same
    q = lora.layers["0"].attn.q_proj
    bound = 1 / math.sqrt(64)  # PEFT's kaiming_uniform_(a=sqrt(5)) on A: U(-1/sqrt(in), 1/sqrt(in))
    assert q.lora_A.weight.shape == (4, 64) and q.lora_B.weight.shape == (64, 4) and q.lora_scale == 2.0
    assert q.lora_A.weight.abs().max() <= bound and q.lora_A.weight.std() > 0.8 * bound / math.sqrt(3)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if name.endswith("lora_B.weight"):
                p.normal_(0, 0.1)
        h = torch.randn(2, 5, 64)  # one adapted linear: W h + (alpha / r) B A h
        manual = h @ q.weight.T + 2.0 * (h @ q.lora_A.weight.T) @ q.lora_B.weight.T
        assert torch.allclose(q(h), manual, atol=1e-6)
        base.load_state_dict(merge_lora(lora.state_dict(), cfg.model.lora))
        assert (lora(x) - base(x)).abs().max() < 1e-5  # the merged model computes base + adapter
        assert not torch.allclose(lora(x), build(tiny(f"model.arch={arch}"))(x), atol=1e-3)  # the adapters matter


def test_bad_settings_are_refused_naming_the_setting_and_the_fix() -> None:
    from megaloom.preflight import preflight

    with pytest.raises(ConfigError, match=r"model.lora.rank must be >= 0 .*got -1"):
        tiny("model.lora.rank=-1")
    with pytest.raises(ConfigError, match=r"model.lora.targets: 'q' .*Did you mean 'q_proj'\?"):
        tiny("model.lora.rank=8", "model.lora.targets=q,v_proj")
    with pytest.raises(ConfigError, match=r"'gate_proj' .*not gated"):
        tiny("model.arch=gpt2", "model.lora.rank=8", "model.lora.targets=gate_proj")
    with pytest.raises(ConfigError, match=r"unknown config key 'model.lora.rnak'.*'model.lora.rank'"):
        tiny("model.lora.rnak=8")
    with pytest.raises(ConfigError, match="model.lora.alpha must be > 0"):
        tiny("model.lora.rank=8", "model.lora.alpha=0")
    with pytest.raises(ConfigError, match=r"parallel.async_tp=true .*set parallel.async_tp=false"):
        preflight(tiny("model.lora.rank=8", "parallel.tp=2", "parallel.sp=true", "parallel.async_tp=true",
                       "train.seq_len=32"), 2)
    nested = load_config(None, []).to_dict()
    nested["model"]["lora"] = {"rank": 4, "targets": ["v_proj"]}  # YAML's nested spelling reads back
    from megaloom.config import config_from_dict

    assert config_from_dict(nested).model.lora == LoraConfig(rank=4, targets=["v_proj"])


def test_memory_plan_gives_gradients_and_optimizer_state_to_the_adapters_only() -> None:
    from megaloom.planning.memory_params import analytic_params, count_model_params
    from megaloom.planning.memory_plan import plan_memory

    cfg = tiny("model.lora.rank=8", f"model.lora.targets={ALL}", "train.seq_len=32", "train.micro_batch_size=2",
               "train.global_batch_size=2")
    model = build(cfg)
    freeze_for_training(model, cfg.model)
    adapters = sum(p.numel() for n, p in model.named_parameters() if is_adapter_name(n))
    total = sum(p.numel() for p in model.parameters())  # the tied head once
    exact = count_model_params(model)
    assert (exact.local, exact.frozen) == (adapters, total - adapters)
    counted = analytic_params(cfg, [0, 1])  # from the config alone (`megaloom memory`, the auto micro-batch)
    assert (counted.local, counted.frozen, counted.largest) == (exact.local, exact.frozen, exact.largest)
    split = analytic_params(cfg, [0, 1], tp=2)  # A whole (column) / B whole (row) on each of 2 tp ranks
    assert adapters / 2 < split.local < adapters and split.frozen < exact.frozen
    plan = plan_memory(cfg, model, device="cpu")
    assert plan.gradients == 4 * adapters and plan.optimizer == 8 * adapters and plan.weights == 4 * total
    assert plan_memory(cfg, None, device="cpu").optimizer == plan.optimizer
    full = plan_memory(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=LoraConfig())),
                       device="cpu")
    assert full.optimizer == 8 * (total - adapters)  # without LoRA: the whole model's Adam moments
    # ZeRO-3 over 4 ranks shards the frozen base too: a quarter of everything on each
    z3 = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, zero=3),
                             train=dataclasses.replace(cfg.train, global_batch_size=8))
    sharded = plan_memory(z3, world_size=4, device="cpu")
    assert sharded.weights == 4 * (adapters // 4 + (total - adapters) // 4) and sharded.optimizer == 8 * (adapters // 4)


def test_training_moves_the_adapters_only_and_resumes_exactly(small_corpus, tmp_path) -> None:
    base = ["train.steps=4", "checkpoint.every=2", "train.eval_batches=1", "model.lora.rank=4",
            f"model.lora.targets={ALL}", "train.lr=1e-2", "model.lora.dropout=0.1"]
    ref = Trainer(load_config(None, tiny_overrides(small_corpus, tmp_path / "a", *base))).build()
    before = {n: p.detach().clone() for n, p in ref.model.named_parameters()}
    result = ref.fit()
    stateful = {id(p) for p in ref.optimizer.state}
    for n, p in ref.model.named_parameters():
        adapter = is_adapter_name(n)
        assert p.requires_grad == adapter and (p.grad is None or adapter), n
        assert torch.equal(p, before[n]) != adapter, n  # the base bit-identical, every adapter factor trained
        assert (id(p) in stateful) == adapter, n  # optimizer state for the adapters only
    # Resume: stopped after step 3 (newest checkpoint: step 2), then the same steps again, bit for bit.
    Trainer(load_config(None, tiny_overrides(small_corpus, tmp_path / "b", *base))).build().fit(stop_after=3)
    resumed = Trainer(load_config(None, tiny_overrides(small_corpus, tmp_path / "b", *base))).build()
    assert resumed.step == 2
    res = resumed.fit()
    assert all(res.losses[s] == result.losses[s] for s in range(3, 5)), (res.losses, result.losses)
    for (n, p), q in zip(resumed.model.named_parameters(), ref.model.parameters(), strict=True):
        assert torch.equal(p, q), n
    # Other adapters on these checkpoints are another model: refused, naming what to do.
    other = load_config(None, tiny_overrides(small_corpus, tmp_path / "b", *base[:3], "model.lora.rank=8"))
    with pytest.raises(Exception, match=r"model.lora: checkpoint rank 4.* vs config rank 8.*convert --to-hf"):
        Trainer(other).build()


def test_every_adapter_is_read_through_its_own_module_call() -> None:
    """ZeRO-1/2 wait for a parameter's all-gather in a forward pre-hook of the module that holds it (and the
    overlapped optimizer likewise): an adapter weight read without its module being called would race the gather
    (seen as a nondeterministic pp2 x dp2 ZeRO-1 mismatch before the factors were called as modules)."""
    cfg = tiny("model.lora.rank=4", f"model.lora.targets={ALL}")
    model = build(cfg)
    freeze_for_training(model, cfg.model)
    owners = {m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))}
    called: set[nn.Module] = set()
    for m in owners:
        m.register_forward_pre_hook(lambda mod, args: called.add(mod))
    model(tokens(), tokens())
    assert owners and called == owners, sorted(type(m).__name__ for m in owners - called)


def test_compiled_blocks_with_adapters_are_one_graph_each_and_equal() -> None:
    """train.compile (on by default on GPUs) compiles each block: the adapters trace without a graph break and
    the loss and adapter gradients equal eager's (AOTAutograd's eager backend: forward and backward traced)."""
    cfg = tiny("model.lora.rank=4", "model.lora.targets=q_proj,v_proj,down_proj")
    model = build(cfg)
    freeze_for_training(model, cfg.model)
    x = tokens()
    eager = model(x, x)
    eager.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for layer in model.layers.values():
        layer.compile(backend="aot_eager")
    compiled = model(x, x)
    compiled.backward()
    counters = torch._dynamo.utils.counters
    assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] <= 2
    assert torch.allclose(compiled, eager, atol=1e-6)
    assert grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    assert all(torch.allclose(p.grad, grads[n], atol=1e-6) for n, p in model.named_parameters() if n in grads)
    torch._dynamo.reset()


def test_zero3_shards_the_frozen_base_and_trains_like_one_process(small_corpus, tmp_path) -> None:
    """LoRA under ZeRO-3 (FSDP2), the way a 70B base is fine-tuned on GPUs that cannot each hold it: the frozen base
    sharded over dp like everything else, gradients and optimizer state for the adapters only. tp2 x dp2 under
    torchrun equals the single process step by step, its checkpoint resumes in one process, and the base stays
    bit-identical."""
    from tests.parallel.test_trainer_parallel import losses, torchrun

    base = ["train.steps=6", "checkpoint.every=3", "train.eval_batches=1", "model.lora.rank=4",
            f"model.lora.targets={ALL}", "train.lr=1e-2", "train.micro_batch_size=2", "train.grad_clip=0.5"]
    ref = Trainer(load_config(None, tiny_overrides(small_corpus, tmp_path / "ref", *base))).build()
    before = {n: p.detach().clone() for n, p in ref.model.named_parameters()}
    want = ref.fit().losses
    torchrun(4, tiny_overrides(small_corpus, tmp_path / "z3", *base, "parallel.zero=3", "parallel.tp=2"))
    got = losses(tmp_path / "z3")
    assert sorted(got) == list(range(1, 7))
    for step in range(1, 7):
        assert abs(got[step] - want[step]) <= 1e-5 * want[step], (step, got[step], want[step])
    ckpt = tmp_path / "z3" / "checkpoints" / "step_00000003"
    resumed = Trainer(load_config(None, tiny_overrides(small_corpus, tmp_path / "one", *base,
                                                       f"checkpoint.resume={ckpt}"))).build()
    assert resumed.step == 3
    res = resumed.fit()
    for step in range(4, 7):
        assert abs(res.losses[step] - want[step]) <= 1e-5 * want[step], step
    for n, p in resumed.model.named_parameters():
        if not is_adapter_name(n):
            assert torch.equal(p, before[n]), n  # the base came back from the sharded checkpoint unchanged
