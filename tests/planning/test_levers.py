"""train.compile / train.fused_loss / train.attention / train.bf16_residual left at "auto": chosen per device
(megaloom/planning/levers.py);
CPU runs as before, the measured fast path on a GPU, explicit values untouched."""

from __future__ import annotations

import pytest
import yaml

from megaloom.config import ConfigError, load_config
from megaloom.planning.levers import choose_levers, describe_levers, resolve_levers


def chosen(overrides: list[str], device: str, capability=None) -> dict:
    return {c.key: c.value for c in choose_levers(load_config(None, overrides), device, capability)}


def test_cpu_keeps_the_plain_path():
    assert chosen([], "cpu") == {"train.compile": False, "train.fused_loss": False, "train.attention": "torch",
                                 "train.bf16_residual": False, "train.grad_accum_fusion": False,
                                 "train.embedding_grad_fusion": False, "train.bf16_params": False}


def test_hopper_takes_the_measured_fast_path(monkeypatch):
    monkeypatch.setattr("megaloom.planning.levers.fa4_importable", lambda: False)  # flash-attn-4: the test below
    assert chosen([], "cuda", (9, 0)) == {"train.compile": True, "train.fused_loss": True, "train.attention": "cudnn",
                                          "train.bf16_residual": True, "train.grad_accum_fusion": True,
                                          "train.embedding_grad_fusion": False, "train.bf16_params": False}
    assert chosen([], "cuda", (8, 0))["train.attention"] == "torch"  # cuDNN measured faster on Hopper only


@pytest.mark.parametrize("overrides,key,value", [
    (["model.preset=mixtral-tiny"], "train.compile", True),  # MoE too (measured: 1.42x on qwen3-moe-2.6b)
    # async_tp no longer turns compile off: compiled blocks overlap through Inductor (parallel/tp_overlap.py)
    (["parallel.tp=2", "parallel.sp=true", "parallel.async_tp=true"], "train.compile", True),
    (["parallel.tp=2"], "train.fused_loss", False),  # the vocab-parallel loss
    (["parallel.cp=2"], "train.fused_loss", False),
    (["model.preset=bert-tiny"], "train.fused_loss", False),  # the masked-LM head has a bias
    (["model.preset=t5-tiny"], "train.fused_loss", True),
    (["parallel.tp=2"], "train.compile", True),
    (["train.precision=fp8"], "train.bf16_residual", True),  # the fp8 linears run under bf16 autocast too
    (["train.precision=fp32"], "train.bf16_residual", False),  # no autocast: nothing to keep in bf16
    (["train.precision=fp16"], "train.bf16_residual", False),
    (["model.preset=gpt2-124m"], "train.bf16_residual", True),
    (["model.preset=mixtral-tiny"], "train.bf16_residual", False),  # MoE: not measured
    (["model.preset=bert-tiny"], "train.bf16_residual", False),
    (["model.preset=t5-tiny"], "train.bf16_residual", False),
    (["parallel.pp=2"], "train.bf16_residual", True),  # and the pipeline's messages halve
    # bf16 weights with fp32 master shards: measured faster (and -41% memory) on the 70B rank with ZeRO-1
    (["parallel.zero=1"], "train.bf16_params", True),
    (["parallel.zero=2"], "train.bf16_params", True),
    (["parallel.zero=0"], "train.bf16_params", False),  # every master kept: +2 bytes a weight, not measured
    (["parallel.zero=3"], "train.bf16_params", False),  # FSDP2's own bf16 policy
    (["parallel.zero=1", "model.preset=mixtral-tiny"], "train.bf16_params", False),  # MoE: not measured
    (["parallel.zero=1", "train.precision=fp8"], "train.bf16_params", False),
    (["parallel.zero=1", "train.optimizer_offload=true"], "train.bf16_params", False),
    (["parallel.zero=1", "parallel.param_gather=fp32"], "train.bf16_params", False),
    (["parallel.zero=1", "model.lora.rank=8"], "train.bf16_params", False),  # fine-tunes: not measured
])
def test_each_lever_where_it_applies(overrides, key, value):
    assert chosen(overrides, "cuda", (9, 0))[key] == value


def test_explicit_values_are_never_changed():
    cfg = load_config(None, ["train.compile=false", "train.fused_loss=true", "train.attention=flash",
                             "train.bf16_residual=false", "train.grad_accum_fusion=false",
                             "train.embedding_grad_fusion=false", "train.bf16_params=false"])
    resolved, choices = resolve_levers(cfg, "cuda", (9, 0))
    assert choices == [] and resolved is cfg


def test_resolution_is_a_copy_and_says_why():
    cfg = load_config(None, [])
    resolved, choices = resolve_levers(cfg, "cuda", (9, 0))
    assert cfg.train.compile == "auto" and resolved.train.compile is True and resolved.train.fused_loss is True
    line = describe_levers(choices)
    assert line.startswith("auto: compile on (CUDA)") and "attention cudnn (compute capability 9.0)" in line
    assert yaml.safe_load(resolved.to_yaml())["train"]["compile"] is True  # config.yaml holds the choice


def test_auto_values_parse_and_bad_ones_name_the_key():
    assert load_config(None, ["train.compile=auto"]).train.compile == "auto"
    assert load_config(None, ["train.compile=on"]).train.compile is True
    with pytest.raises(ConfigError, match="train.compile: expected true, false or auto"):
        load_config(None, ["train.compile=fast"])
    # async_tp: auto by default; true with compiled blocks is the compiled route (no longer refused); it needs sp
    assert load_config(None, []).parallel.async_tp == "auto"
    load_config(None, ["parallel.tp=2", "parallel.sp=true", "parallel.async_tp=true", "train.compile=true"])
    with pytest.raises(ConfigError, match="parallel.async_tp=true overlaps sequence parallelism"):
        load_config(None, ["parallel.tp=2", "parallel.async_tp=true"])
    with pytest.raises(ConfigError, match="parallel.async_tp: expected true, false or auto"):
        load_config(None, ["parallel.async_tp=ring"])


def test_attention_takes_fa4_where_it_is_installed(monkeypatch):
    import megaloom.planning.levers as levers

    monkeypatch.setattr(levers, "fa4_importable", lambda: True)
    assert chosen([], "cuda", (9, 0))["train.attention"] == "fa4"
    assert chosen([], "cuda", (12, 0))["train.attention"] == "cudnn"  # FA4's kernels: compute capability 9 and 10
    assert chosen([], "cpu")["train.attention"] == "torch"
    monkeypatch.setattr(levers, "fa4_importable", lambda: False)
    assert chosen([], "cuda", (9, 0))["train.attention"] == "cudnn"


def test_grad_accum_fusion_is_refused_where_no_buckets_keep_the_gradients() -> None:
    from megaloom.config import ConfigError, load_config

    for bad in (["parallel.zero=2"], ["parallel.zero=3"], ["parallel.pp=2", "parallel.schedule=zb"]):
        with pytest.raises(ConfigError, match="train.grad_accum_fusion=true adds weight gradients"):
            load_config(None, ["train.grad_accum_fusion=true", *bad])


def test_grad_accum_fusion_at_auto_is_on_where_it_was_measured_and_the_buckets_allow() -> None:
    from megaloom.config import load_config
    from megaloom.planning.levers import resolve_levers

    on, choices = resolve_levers(load_config(None, ["parallel.zero=1"]), "cuda", (9, 0))
    assert on.train.grad_accum_fusion is True
    assert any(c.key == "train.grad_accum_fusion" and "832 -> 747 ms" in c.why for c in choices)
    for device, over in (("cpu", ["parallel.zero=1"]), ("cuda", ["parallel.zero=2"]), ("cuda", ["parallel.zero=3"]),
                         ("cuda", ["parallel.pp=2", "parallel.schedule=zb"]),
                         ("cuda", ["parallel.tp=2", "parallel.sp=true", "parallel.async_tp=true",
                                   "train.compile=false"])):
        off, _ = resolve_levers(load_config(None, over), device, (9, 0))
        assert off.train.grad_accum_fusion is False, (device, over)
        load_config(None, [*over, f"train.grad_accum_fusion={off.train.grad_accum_fusion}"])  # accepted as resolved
